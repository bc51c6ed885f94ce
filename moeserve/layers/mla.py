"""Multi-head latent attention (DeepSeek-V2 §2.1), split into the steps the decoder layer runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.core import ForwardBatch, ForwardMode
from moeserve.distributed.groups import Group
from moeserve.distributed.groups import single as single_groups
from moeserve.kernels.mla import extend_attention, mla_decode, mla_verify
from moeserve.kernels.rope import apply_rope
from moeserve.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from moeserve.layers.norm import RMSNorm


@dataclass
class MLAInputs:
    """What ``prepare`` hands to ``core``: the query of the new tokens, its rope part rotated."""

    q: torch.Tensor  # [T, H, qk_nope_head_dim + qk_rope_head_dim]
    nope_dim: int
    q_compressed: torch.Tensor | None = None  # [T, q_lora_rank], the query's latent (None without q-LoRA)
    selected: torch.Tensor | None = None  # [T, K] cache slots each token attends to (V3.2; None: all)

    @property
    def q_nope(self) -> torch.Tensor:  # [T, H, qk_nope_head_dim], a view of q
        return self.q[..., :self.nope_dim]

    @property
    def q_rope(self) -> torch.Tensor:  # [T, H, qk_rope_head_dim], a view of q
        return self.q[..., self.nope_dim:]


class MLA(nn.Module):
    """Parameters named as in the checkpoints; the latent cache lives outside, in the KV pool."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: Group | None = None, fp8: bool = False) -> None:
        super().__init__()
        tp = tp or single_groups().world
        if cfg.num_heads % tp.size:
            raise ValueError(f"{cfg.num_heads} attention heads do not split over attention TP size {tp.size}")
        self.layer_id = layer_id
        self.num_heads = cfg.num_heads // tp.size  # heads on this rank
        heads = cfg.num_heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        self.interleave = cfg.rope.interleave
        bias = cfg.attention_bias
        # heads split over attention TP; the latent projections are small and replicated
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, heads * cfg.qk_head_dim, tp, fp8=fp8)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias, fp8=fp8)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * cfg.qk_head_dim, tp, fp8=fp8)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_cache_dim, bias=bias, fp8=fp8)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        # kept in the model dtype even with FP8 weights: absorbed MLA folds its halves into the
        # queries and outputs
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), tp)
        # a partial sum over the TP group: the decoder layer reduce-scatters it
        self.o_proj = RowParallelLinear(heads * cfg.v_head_dim, cfg.hidden_size, tp, bias=bias, fp8=fp8)

    def prepare(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> MLAInputs:
        """Project ``hidden [T, D]``; write the new tokens' latent and rope key to the cache."""
        n_tokens = hidden.shape[0]
        q_compressed = None
        if hasattr(self, "q_proj"):
            q = self.q_proj(hidden)
        else:
            q_compressed = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_compressed)
        q = q.view(n_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        inputs = MLAInputs(q, self.nope_dim, q_compressed)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope = inputs.q_rope
        apply_rope(q_rope, cos, sin, self.interleave, out=q_rope)  # in place: q is our own fresh projection
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin, self.interleave).squeeze(1)
        batch.kv_pool.write(self.layer_id, batch.out_cache_loc, latent, k_rope)
        return inputs

    def core(self, inputs: MLAInputs, batch: ForwardBatch) -> torch.Tensor:
        """Attention of the new tokens over this rank's heads; ``[T, H_local * v_head_dim]``."""
        if batch.mode.is_decode or batch.mode is ForwardMode.VERIFY:
            out = self._absorbed(inputs, batch)
        else:
            out = self._expanded(inputs, batch)
        return out.flatten(1)

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of ``kv_b_proj``: ``W_UK [H, nope, L]`` and ``W_UV [H, v, L]``."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope_dim], w[:, self.nope_dim:]

    def _absorb(self, inputs: MLAInputs) -> torch.Tensor:
        """The query's nope part through ``W_UK``: ``[T, H, L]``, in the latent's space."""
        return torch.einsum("thn,hnl->thl", inputs.q_nope, self._w_uk_uv()[0])

    def _unabsorb(self, out_latent: torch.Tensor) -> torch.Tensor:
        """Attention output in latent space ``[T, H, L]`` through ``W_UV``: ``[T, H, v]``."""
        return torch.einsum("thl,hvl->thv", out_latent, self._w_uk_uv()[1])

    def _absorbed(self, inputs: MLAInputs, batch: ForwardBatch) -> torch.Tensor:
        q_latent = self._absorb(inputs)  # [T, H, L]
        pool = batch.kv_pool
        cache, scales = pool.layer(self.layer_id), pool.layer_scales(self.layer_id)  # scales: FP8 only
        if batch.mode is ForwardMode.VERIFY:
            out_latent = mla_verify(q_latent, inputs.q_rope, cache, batch.kv_indptr, batch.kv_indices, self.scale,
                                    batch.tokens_per_seq, kv_scales=scales, page_size=batch.page_size,
                                    launch_batch=batch.launch_batch_size)
        else:
            out_latent = mla_decode(q_latent, inputs.q_rope, cache, batch.kv_indptr, batch.kv_indices, self.scale,
                                    kv_scales=scales, page_size=batch.page_size, launch_batch=batch.launch_batch_size)
        return self._unabsorb(out_latent)  # [T, H, v]

    def _expanded(self, inputs: MLAInputs, batch: ForwardBatch) -> torch.Tensor:
        # the new tokens too are read back from the cache: an FP8 cache's rounding then reaches them
        # exactly as it reaches a prefix from the prefix cache or a PD transfer
        cached = batch.kv_pool.read(self.layer_id, batch.kv_indices, inputs.q.dtype)  # [S, L + R]
        latent, k_rope = cached.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(latent).view(latent.shape[0], self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = kv.new_empty(latent.shape[0], self.num_heads, self.nope_dim + self.rope_dim)  # [S, H, Dqk]
        k[..., :self.nope_dim] = k_nope
        k[..., self.nope_dim:] = k_rope.unsqueeze(1)  # one rope key shared by every head
        return extend_attention(inputs.q, k, v, batch.extend_lens_cpu, batch.prefix_lens_cpu, self.scale)
