"""DeepSeek-V3.2's sparse attention (DSA): the lightning indexer and MLA over what it selects.

The indexer is small (64 heads of 128 over MLA's query latent, one 128-d key per token) and
replicated on every attention-TP rank, so every rank of a group selects the same tokens without
talking. Its keys live in the KV pool beside each token's latent (``MLAKVPool.index_keys``), so
whatever moves, caches or counts a token's slot carries them too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig
from moeserve.core import ForwardBatch, ForwardMode
from moeserve.distributed.groups import Group
from moeserve.kernels.indexer import select_topk
from moeserve.kernels.mla import sparse_mla
from moeserve.kernels.rope import apply_rope
from moeserve.layers.linear import Linear, frozen
from moeserve.layers.mla import MLA, MLAInputs


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` with checkpoint-loaded weight and bias, computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.bias, self.eps = frozen(dim), frozen(dim), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), x.shape[-1:], self.weight.float(), self.bias.float(), self.eps).to(x.dtype)


class Indexer(nn.Module):
    """Checkpoint names ``self_attn.indexer.{wq_b, wk, k_norm, weights_proj}``.

    ``q = wq_b(q_latent)`` per index head, ``k = LayerNorm(wk(x))``, both with rope on their first
    ``qk_rope_head_dim`` dims paired half with half (not interleaved like MLA's), and head weights
    ``weights_proj(x) · H^-0.5`` in fp32. The score of key ``s`` for query ``t`` is
    ``Σ_h w[t, h] · ReLU(q[t, h] · k[s]) · D^-0.5`` (``kernels/indexer.py``).
    """

    def __init__(self, cfg: ModelConfig, layer_id: int, fp8: bool = False) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.rope_dim = cfg.qk_rope_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, fp8=fp8)
        self.wk = Linear(cfg.hidden_size, self.head_dim, fp8=fp8)
        self.k_norm = LayerNorm(self.head_dim)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads)
        self.weights_proj.weight = frozen(self.n_heads, cfg.hidden_size, dtype=torch.float32)  # fp32, as released
        self.weight_scale = self.n_heads ** -0.5 * self.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor | None:
        """Write the new tokens' index keys; return the slots each new token attends to
        ``[T, index_topk]`` (``-1`` padded), or None when no token's context is longer than
        ``index_topk`` (then every token attends to its whole context, as V3)."""
        k = self.k_norm(self.wk(hidden))  # [T, D]
        k = self._rope(k.unsqueeze(1), cos, sin).squeeze(1)
        batch.kv_pool.write_index(self.layer_id, batch.out_cache_loc, k)
        width = batch.max_context  # under a CUDA graph, its context bucket
        if width <= self.topk:
            return None
        q = self._rope(self.wq_b(q_latent).view(-1, self.n_heads, self.head_dim), cos, sin)
        weights = F.linear(hidden.float(), self.weights_proj.weight.float()) * self.weight_scale  # [T, H]
        seq_of_row = torch.repeat_interleave(torch.arange(len(batch.extend_lens_cpu), device=hidden.device),
                                             batch.extend_lens, output_size=hidden.shape[0])
        pool = batch.kv_pool
        return select_topk(q, weights, pool.index_keys(self.layer_id), batch.kv_indptr, batch.kv_indices,
                           seq_of_row, batch.positions, self.topk, width, pool.index_scales(self.layer_id))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rope on the first ``rope_dim`` dims of ``x [T, H, D]``, half paired with half."""
        rotated = apply_rope(x[..., :self.rope_dim].contiguous(), cos, sin, interleave=False)
        return torch.cat([rotated, x[..., self.rope_dim:]], dim=-1)


class SparseMLA(MLA):
    """MLA with an indexer (DeepSeek-V3.2): a batch in which no token's context is longer than
    ``index_topk`` runs MLA's own paths; otherwise every new token attends, absorbed, to the slots
    the indexer selected for it (prefill, decode and verify alike)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: Group | None = None, fp8: bool = False) -> None:
        super().__init__(cfg, layer_id, tp, fp8)
        if cfg.q_lora_rank is None:
            raise ValueError("the indexer reads MLA's query latent: q_lora_rank must be set")
        self.indexer = Indexer(cfg, layer_id, fp8)

    def prepare(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> MLAInputs:
        inputs = super().prepare(hidden, cos, sin, batch)
        inputs.selected = self.indexer(hidden, inputs.q_compressed, cos, sin, batch)
        inputs.q_compressed = None
        return inputs

    def core(self, inputs: MLAInputs, batch: ForwardBatch) -> torch.Tensor:
        if inputs.selected is None:
            return super().core(inputs, batch)
        pool = batch.kv_pool
        launch_rows = None if batch.launch_batch_size is None else batch.launch_batch_size * batch.tokens_per_seq
        out_latent = sparse_mla(self._absorb(inputs), inputs.q_rope, pool.layer(self.layer_id), inputs.selected,
                                self.scale, kv_scales=pool.layer_scales(self.layer_id),
                                launch_rows=launch_rows if batch.mode is not ForwardMode.EXTEND else None)
        return self._unabsorb(out_latent).flatten(1)
