"""DeepSeek-V2/V3 for causal LM, composed from ``layers/``.

Each decoder layer exposes its forward as a list of operations over a ``LayerState``; plain
execution runs them in order, and two-batch overlap can interleave two micro-batches over the
same list. The model never sees the scheduler: everything per step arrives in a ``ForwardBatch``.

``DeepseekMTP`` is DeepSeek-V3's multi-token-prediction (MTP, "NextN") module, which speculative
decoding runs as its draft model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.core import YIELD, ForwardBatch, Yield
from moeserve.distributed.comm import all_gather_tokens
from moeserve.distributed.dispatcher import Dispatcher, DispatchOutput
from moeserve.distributed.groups import ParallelGroups
from moeserve.distributed.groups import single as single_groups
from moeserve.distributed.layout import TokenLayout
from moeserve.eplb.placement import ExpertPlacement
from moeserve.layers.disposable import DisposableTensor, dispose
from moeserve.layers.embedding import Embedding, LMHead
from moeserve.layers.linear import Linear, Slot
from moeserve.layers.mla import MLA, MLAInputs
from moeserve.layers.mlp import MLP
from moeserve.layers.moe import MoE, MoEOptions
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
    pending: object = None  # an issued dispatch or combine, until its wait half
    dispatcher: Dispatcher | None = None
    expert_out: torch.Tensor | None = None
    shared_out: torch.Tensor | None = None


Op = Callable[[LayerState, ForwardBatch], None]


class DecoderLayer(nn.Module):
    """Between ops the residual stream is in the scattered layout (``distributed/layout.py``).
    A model family whose attention differs names its own class here (``attention_cls``)."""

    attention_cls: type[MLA] = MLA

    def __init__(self, cfg: ModelConfig, layer_id: int, groups: ParallelGroups, moe: MoEOptions,
                 fp8: bool = False) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.layout = TokenLayout(groups)
        self.self_attn = self.attention_cls(cfg, layer_id, groups.attn_tp, fp8)
        self.is_moe = cfg.is_moe_layer(layer_id)
        if self.is_moe:
            self.mlp = MoE(cfg, layer_id, groups, moe, fp8)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, groups.dense_tp, fp8)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def ops(self, strategy: str = "plain") -> list[Op | Yield]:
        """The layer's operations; with a two-batch-overlap ``strategy`` ("prefill" or "decode"),
        ``YIELD`` markers where the other micro-batch may run (``executor/overlap.py``).

        prefill: around the dispatch and the combine, so that while one micro-batch's all-to-all
        is in flight the other's computation is queued (and its host-blocking dispatch starts only
        after that); decode: five stages a layer, which the executor runs two stages apart. In
        decode each all-to-all is in flight while the other micro-batch computes one stage: the
        dispatch (FP8) behind its input norm and attention projections, the combine (BF16, twice
        the bytes) behind its attention core, output projection and gate, and behind this micro-
        batch's shared experts, which therefore run after the combine is issued rather than after
        the dispatch (SGLang's order); ``bench rank`` measured the difference (docs/benchmarks.md)."""
        if not self.is_moe:
            return [self.op_input_norm, self.op_attn_prepare, self.op_attn_core, self.op_attn_output,
                    self.op_post_norm, self.op_dense_mlp]
        if strategy == "decode":
            return [self.op_input_norm, self.op_attn_prepare, YIELD,
                    self.op_attn_core, self.op_attn_output, self.op_post_norm, self.op_mlp_gate, YIELD,
                    self.op_moe_dispatch_a, YIELD,
                    self.op_moe_dispatch_b, self.op_moe_experts, self.op_moe_combine_a,
                    self.op_shared_experts, YIELD,
                    self.op_moe_combine_b, YIELD]
        ops = [self.op_input_norm, self.op_attn_prepare, self.op_attn_core, self.op_attn_output, self.op_post_norm,
               self.op_mlp_gate, YIELD, self.op_moe_dispatch_a, YIELD, self.op_moe_dispatch_b, self.op_shared_experts,
               self.op_moe_experts, self.op_moe_combine_a, YIELD, self.op_moe_combine_b]
        return ops if strategy == "prefill" else [op for op in ops if op is not YIELD]

    def forward(self, state: LayerState, batch: ForwardBatch) -> None:
        for op in self.ops():
            op(state, batch)

    def op_input_norm(self, s: LayerState, batch: ForwardBatch) -> None:
        if s.residual is None:
            s.residual, s.hidden = s.hidden, self.input_layernorm(s.hidden)
        else:
            s.hidden, s.residual = self.input_layernorm(s.hidden, s.residual)

    def op_attn_prepare(self, s: LayerState, batch: ForwardBatch) -> None:
        full = self.layout.gather_attn(s.hidden, batch.dp_info())  # [T_d, D], the DP group's batch
        s.attn = self.self_attn.prepare(full, s.cos, s.sin, batch)

    def op_attn_core(self, s: LayerState, batch: ForwardBatch) -> None:
        s.hidden, s.attn = self.self_attn.core(s.attn, batch), None

    def op_attn_output(self, s: LayerState, batch: ForwardBatch) -> None:
        s.hidden = self.layout.scatter_attn(self.self_attn.o_proj(s.hidden), batch.dp_info())

    def op_post_norm(self, s: LayerState, batch: ForwardBatch) -> None:
        s.hidden, s.residual = self.post_attention_layernorm(s.hidden, s.residual)

    def op_dense_mlp(self, s: LayerState, batch: ForwardBatch) -> None:
        dp = batch.dp_info()
        s.hidden = self.layout.scatter_dense(self.mlp(self.layout.gather_dense(s.hidden, dp)), dp)

    def op_mlp_gate(self, s: LayerState, batch: ForwardBatch) -> None:
        s.topk = self.mlp.route(s.hidden)

    def op_moe_dispatch_a(self, s: LayerState, batch: ForwardBatch) -> None:
        """Start sending the tokens to their experts (the all-to-all runs on while others compute)."""
        weights, ids = s.topk
        s.dispatcher = self.mlp.dispatcher(batch.dp_info().moe_mode)
        if s.dispatcher.disposable_buffers:  # then the MoE frees its input and the tokens received early
            s.hidden = DisposableTensor.wrap(s.hidden, f"layer {self.layer_id} MoE input")
        s.pending, s.topk = s.dispatcher.dispatch_a(s.hidden, ids, weights), None

    def op_moe_dispatch_b(self, s: LayerState, batch: ForwardBatch) -> None:
        s.recv, s.handle = s.dispatcher.dispatch_b(s.pending)
        s.pending = None
        if s.dispatcher.disposable_buffers:
            s.recv.hidden = DisposableTensor.wrap(s.recv.hidden, f"layer {self.layer_id} MoE dispatch output")

    def op_shared_experts(self, s: LayerState, batch: ForwardBatch) -> None:
        s.shared_out = self.mlp.shared(s.hidden)
        # dispatch has copied the tokens out and the residual is a tensor of its own: nothing reads
        # the input again (combine replaces it), so its [T, D] goes before the experts' peak
        dispose(s.hidden, keep=(s.residual, s.shared_out))

    def op_moe_experts(self, s: LayerState, batch: ForwardBatch) -> None:
        s.expert_out, s.recv = self.mlp.experts(s.recv), None  # the experts freed what they received

    def op_moe_combine_a(self, s: LayerState, batch: ForwardBatch) -> None:
        """Start sending the expert outputs back."""
        s.pending = s.dispatcher.combine_a(s.expert_out, s.handle)
        s.expert_out = s.handle = None

    def op_moe_combine_b(self, s: LayerState, batch: ForwardBatch) -> None:
        out = s.dispatcher.combine_b(s.pending)
        s.hidden = out if s.shared_out is None else out + s.shared_out
        s.pending = s.shared_out = s.dispatcher = None


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, moe: MoEOptions, fp8: bool = False,
                 layer_cls: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_cls(cfg, i, groups, moe, fp8) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)


class SharedHead(nn.Module):
    """The MTP module's output head as the checkpoint names it; only its norm is its own: the
    checkpoint's ``shared_head.head`` repeats the model's LM head, which the module uses."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, eps)


class DeepseekMTP(nn.Module):
    """DeepSeek-V3's multi-token-prediction module (V3 report §2.2): from the model's final hidden
    state at position ``i`` and the token at ``i + 1``, a hidden state that predicts token ``i + 2``
    through the model's LM head.

    One decoder layer whose layer id is ``cfg.num_layers``: the KV-cache layer it reads and writes
    (the pool has ``num_layers + 1``) and, when it is a MoE layer, its row of the expert placement.
    The embedding and the LM head are the model's: passed at call time, never held here. The
    checkpoint keeps every tensor of it under ``model.layers.{num_layers}.``.
    """

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, moe: MoEOptions, fp8: bool = False,
                 layer_cls: type[DecoderLayer] = DecoderLayer) -> None:
        super().__init__()
        h, eps, self.layer_id = cfg.hidden_size, cfg.rms_norm_eps, cfg.num_layers
        if cfg.is_moe_layer(self.layer_id) and moe.placement.num_layers <= self.layer_id:
            raise ValueError(f"the MTP module's MoE is layer {self.layer_id}: the expert placement needs a row for "
                             f"it ({self.layer_id + 1} layers), it has {moe.placement.num_layers}")
        self.layout = TokenLayout(groups)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.qk_rope_head_dim)
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = Linear(2 * h, h, fp8=fp8)
        self.layer = layer_cls(cfg, self.layer_id, groups, moe, fp8)
        self.shared_head = SharedHead(h, eps)
        # the checkpoint names the decoder layer's tensors under the module's prefix too (the loader
        # reads ``checkpoint_prefix``)
        self.checkpoint_prefix = self.layer.checkpoint_prefix = f"model.layers.{self.layer_id}."
        if self.layer.is_moe:
            self.layer.mlp.recorder = None  # the drafts' routing is not the served load that EPLB balances

    def checkpoint_slots(self) -> dict[str, list[Slot]]:
        """The released checkpoint repeats the model's embedding and LM head here: known names,
        loaded once, as the model's."""
        return {"embed_tokens.weight": [], "shared_head.head.weight": []}

    def begin(self, batch: ForwardBatch, prev_hidden: torch.Tensor, embed: Embedding) -> LayerState:
        """``eh_proj([enorm(embed(next token)); hnorm(prev_hidden)])`` for this rank's scattered
        share of the batch; rope angles for the whole DP batch."""
        mine = self.layout.my_slice(batch.dp_info())
        tokens = self.enorm(embed(batch.input_ids[mine]))  # [t, D]
        hidden = self.eh_proj(torch.cat([tokens, self.hnorm(prev_hidden[mine])], dim=-1))  # [t, 2D] -> [t, D]
        cos, sin = self.rotary(batch.positions)
        return LayerState(hidden, cos, sin)

    def end(self, state: LayerState, batch: ForwardBatch) -> torch.Tensor:
        """The head's norm; returns the DP group's whole batch ``[T_d, D]``."""
        hidden = self.shared_head.norm(state.hidden, state.residual)[0]
        return self.layout.gather_attn(hidden, batch.dp_info())

    def operations(self, strategy: str = "plain") -> list[Op | Yield]:
        """The decoder layer's operations (``DecoderLayer.ops``), between ``begin`` and ``end``."""
        return self.layer.ops(strategy)

    def forward(self, batch: ForwardBatch, prev_hidden: torch.Tensor, embed: Embedding) -> torch.Tensor:
        """``prev_hidden [T_d, D]``: the model's final-norm hidden state at each of the batch's
        positions (the DP group's rows, as ``DeepseekForCausalLM.end`` returns them);
        ``batch.input_ids [T_d]``: the token after each position. Returns the MTP hidden state
        after ``shared_head.norm`` ``[T_d, D]`` (the DP group's rows, like ``end``)."""
        state = self.begin(batch, prev_hidden, embed)
        self.layer(state, batch)
        return self.end(state, batch)


class DeepseekForCausalLM(nn.Module):
    """``fp8=True``: every projection and routed expert holds FP8 weights with 128x128 block
    scales (embeddings, LM head, router, norms and ``kv_b_proj`` keep the model dtype).

    ``mtp=True``: also the checkpoint's first MTP module, as ``self.mtp`` (``DeepseekMTP``); its
    MoE layer needs a placement of ``num_layers + 1`` layers (the default ``moe`` has one).

    A model family that differs only inside its decoder layers subclasses this with its own
    ``decoder_layer`` (``models/deepseek_v32.py``)."""

    decoder_layer: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups | None = None, moe: MoEOptions | None = None,
                 fp8: bool = False, mtp: bool = False) -> None:
        super().__init__()
        if mtp and cfg.num_mtp_layers < 1:
            raise ValueError("mtp: the checkpoint has no MTP module (config.json's num_nextn_predict_layers is 0)")
        self.cfg = cfg
        self.groups = groups = groups or single_groups()
        self.layout = TokenLayout(groups)
        moe = moe or MoEOptions(ExpertPlacement.trivial(cfg.num_layers + int(mtp), max(cfg.n_routed_experts, 1), 1))
        self.model = DeepseekModel(cfg, groups, moe, fp8, self.decoder_layer)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, groups.lm_head)
        if cfg.tie_word_embeddings:
            if groups.lm_head.size > 1:
                raise ValueError("tied word embeddings with a vocab-parallel LM head are not supported")
            self.lm_head.weight = self.model.embed_tokens.weight
        # built after the model's layers, so that they are built (and dummy-filled) as without it
        self.mtp = DeepseekMTP(cfg, groups, moe, fp8, self.decoder_layer) if mtp else None

    def begin(self, batch: ForwardBatch) -> LayerState:
        """Embed this rank's scattered share of the batch; rope angles for the whole DP batch."""
        cos, sin = self.model.rotary(batch.positions)
        mine = self.layout.my_slice(batch.dp_info())
        return LayerState(self.model.embed_tokens(batch.input_ids[mine]), cos, sin)

    def end(self, state: LayerState, batch: ForwardBatch) -> torch.Tensor:
        """Final norm; returns the DP group's whole batch ``[T_d, D]``."""
        if state.residual is None:
            hidden = self.model.norm(state.hidden)
        else:
            hidden = self.model.norm(state.hidden, state.residual)[0]
        return self.layout.gather_attn(hidden, batch.dp_info())

    def operations(self, strategy: str = "plain") -> list[Op | Yield]:
        """Every layer's operations in order, one flat list (``DecoderLayer.ops``), for an executor
        that runs it for one micro-batch or interleaves two."""
        return [op for layer in self.model.layers for op in layer.ops(strategy)]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states ``[T, D]`` of every new token of this DP group after the final norm."""
        state = self.begin(batch)
        for layer in self.model.layers:
            layer(state, batch)
        return self.end(state, batch)

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """``hidden [N, D]`` (rows of this DP group) -> fp32 logits ``[N, V]``.

        A vocab-parallel head over the whole world needs every DP group's rows on every rank:
        they are gathered over the ranks with the same attention-TP rank, and ours picked back.
        """
        head_group, dp_group = self.groups.lm_head, self.groups.attn_dp
        if head_group.size == self.groups.attn_tp.size or dp_group.size == 1:
            return self.lm_head(hidden)
        counts = batch.dp_info().seq_counts
        rows = all_gather_tokens(hidden, dp_group, counts)
        start = sum(counts[:self.groups.dp_rank])
        return self.lm_head(rows)[start:start + hidden.shape[0]]

    def mtp_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The MTP module's hidden states ``[N, D]`` (rows of this DP group) -> fp32 logits
        ``[N, V]`` through the model's LM head (``compute_logits``): the module has none of its own."""
        return self.compute_logits(hidden, batch)
