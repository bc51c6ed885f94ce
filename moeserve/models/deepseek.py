"""DeepSeek-V2/V3 for causal LM, composed from ``layers/``.

Each decoder layer exposes its forward as a list of operations over a ``LayerState``; plain
execution runs them in order, and two-batch overlap can interleave two micro-batches over the
same list. The model never sees the scheduler: everything per step arrives in a ``ForwardBatch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.core import ForwardBatch
from moeserve.distributed.dispatcher import DispatchOutput
from moeserve.layers.embedding import Embedding, LMHead
from moeserve.layers.mla import MLA, MLAInputs
from moeserve.layers.mlp import MLP
from moeserve.layers.moe import MoE
from moeserve.layers.norm import RMSNorm
from moeserve.layers.rotary import RotaryEmbedding


@dataclass
class LayerState:
    """One micro-batch flowing through the layers; ops read and replace its fields."""

    hidden: torch.Tensor  # [T, D]
    cos: torch.Tensor  # [T, R/2]
    sin: torch.Tensor
    residual: torch.Tensor | None = None
    attn: MLAInputs | None = None
    topk: tuple[torch.Tensor, torch.Tensor] | None = None
    recv: DispatchOutput | None = None
    handle: object = None
    expert_out: torch.Tensor | None = None
    shared_out: torch.Tensor | None = None


Op = Callable[[LayerState, ForwardBatch], None]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = MLA(cfg, layer_id)
        self.is_moe = cfg.is_moe_layer(layer_id)
        self.mlp = MoE(cfg) if self.is_moe else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def ops(self) -> list[Op]:
        attn = [self.op_input_norm, self.op_attn_prepare, self.op_attn_core, self.op_attn_output,
                self.op_post_norm]
        if not self.is_moe:
            return attn + [self.op_dense_mlp]
        return attn + [self.op_mlp_gate, self.op_moe_dispatch, self.op_shared_experts,
                       self.op_moe_experts, self.op_moe_combine]

    def forward(self, state: LayerState, batch: ForwardBatch) -> None:
        for op in self.ops():
            op(state, batch)

    def op_input_norm(self, s: LayerState, batch: ForwardBatch) -> None:
        if s.residual is None:
            s.residual, s.hidden = s.hidden, self.input_layernorm(s.hidden)
        else:
            s.hidden, s.residual = self.input_layernorm(s.hidden, s.residual)

    def op_attn_prepare(self, s: LayerState, batch: ForwardBatch) -> None:
        s.attn = self.self_attn.prepare(s.hidden, s.cos, s.sin, batch)

    def op_attn_core(self, s: LayerState, batch: ForwardBatch) -> None:
        s.hidden, s.attn = self.self_attn.core(s.attn, batch), None

    def op_attn_output(self, s: LayerState, batch: ForwardBatch) -> None:
        s.hidden = self.self_attn.o_proj(s.hidden)

    def op_post_norm(self, s: LayerState, batch: ForwardBatch) -> None:
        s.hidden, s.residual = self.post_attention_layernorm(s.hidden, s.residual)

    def op_dense_mlp(self, s: LayerState, batch: ForwardBatch) -> None:
        s.hidden = self.mlp(s.hidden)

    def op_mlp_gate(self, s: LayerState, batch: ForwardBatch) -> None:
        s.topk = self.mlp.gate(s.hidden)

    def op_moe_dispatch(self, s: LayerState, batch: ForwardBatch) -> None:
        weights, ids = s.topk
        s.recv, s.handle = self.mlp.dispatcher.dispatch(s.hidden, ids, weights)
        s.topk = None

    def op_shared_experts(self, s: LayerState, batch: ForwardBatch) -> None:
        s.shared_out = self.mlp.shared(s.hidden)

    def op_moe_experts(self, s: LayerState, batch: ForwardBatch) -> None:
        s.expert_out, s.recv = self.mlp.experts(s.recv), None

    def op_moe_combine(self, s: LayerState, batch: ForwardBatch) -> None:
        out = self.mlp.dispatcher.combine(s.expert_out, s.handle)
        s.hidden = out if s.shared_out is None else out + s.shared_out
        s.expert_out = s.handle = s.shared_out = None


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DeepseekModel(cfg)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def begin(self, batch: ForwardBatch) -> LayerState:
        cos, sin = self.model.rotary(batch.positions)
        return LayerState(self.model.embed_tokens(batch.input_ids), cos, sin)

    def end(self, state: LayerState) -> torch.Tensor:
        """Final norm; returns ``[T, D]``."""
        if state.residual is None:
            return self.model.norm(state.hidden)
        return self.model.norm(state.hidden, state.residual)[0]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[T, D]`` of every new token after the final norm."""
        state = self.begin(batch)
        for layer in self.model.layers:
            layer(state, batch)
        return self.end(state)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, D]`` -> fp32 logits ``[N, V]``."""
        return self.lm_head(hidden)
