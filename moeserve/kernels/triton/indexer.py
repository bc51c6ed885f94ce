"""Triton version of DeepSeek-V3.2's lightning indexer: index scores over the paged cache, then
the top-k of each query row (``moeserve.kernels.indexer.select_topk`` is the contract).

One program scores ``BLOCKS`` blocks of ``BLOCK_S`` context positions of one query row: it loads
the row's index queries ``[H, D]`` once, gathers each block's keys through ``kv_indices``, takes
``ReLU(q · k)`` for every head with one ``tl.dot`` and sums the heads with their fp32 weights. FP8
keys are converted to the query's dtype for the dot and their sum is multiplied by the key's
scale after it (positive, so it factors out of the ReLU). A position after the row's own is
scored ``-inf``. The scores of a group of rows (at most
``SCORE_BUDGET`` of them exist at once) then go through ``torch.topk``, sorted, so a row's kept
slots come first and the ``-1`` of a short context last. Nothing is read back to the host: the
widest context is the caller's, from its host-side lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SCORE_BUDGET = 1 << 27  # fp32 scores held at once (512 MiB): a 128K prompt never builds 128K x 128K


@triton.jit
def _index_scores_kernel(
    q, weights, keys, key_scales, kv_indptr, kv_indices, seq_of_row, pos_of_row, out,
    row0, n_heads, width, stride_qt, stride_qh, stride_wt, stride_k, stride_ks, stride_ot,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, HAS_SCALES: tl.constexpr = False,
):
    t = tl.program_id(0)
    row = row0 + t
    seq = tl.load(seq_of_row + row)
    last = tl.load(pos_of_row + row)  # the row sees context positions 0 .. last
    kv_start = tl.load(kv_indptr + seq).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok, dim_ok = heads < n_heads, dims < D
    q_h = tl.load(q + row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                  mask=head_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_H, D]
    w_h = tl.load(weights + row.to(tl.int64) * stride_wt + heads, mask=head_ok, other=0.0).to(tl.float32)
    first = tl.program_id(1) * BLOCK_S * BLOCKS
    for b in tl.static_range(BLOCKS):
        pos = first + b * BLOCK_S + tl.arange(0, BLOCK_S)
        seen = pos <= last
        score = tl.full([BLOCK_S], float("-inf"), tl.float32)
        if first + b * BLOCK_S <= last:
            slots = tl.load(kv_indices + kv_start + pos, mask=seen, other=0).to(tl.int64)
            k = tl.load(keys + slots[:, None] * stride_k + dims[None, :], mask=seen[:, None] & dim_ok[None, :],
                        other=0.0)  # [BLOCK_S, D]
            dots = tl.dot(q_h, tl.trans(k.to(q_h.dtype)), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_S]
            summed = tl.sum(tl.maximum(dots, 0.0) * w_h[:, None], 0)  # [BLOCK_S]
            if HAS_SCALES:  # FP8 keys: each key's scale, factored out of its dots
                summed *= tl.load(key_scales + slots * stride_ks, mask=seen, other=0.0)
            score = tl.where(seen, summed, score)
        tl.store(out + t.to(tl.int64) * stride_ot + pos, score, mask=pos < width)


def index_scores(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, kv_indptr: torch.Tensor,
                 kv_indices: torch.Tensor, seq_of_row: torch.Tensor, pos_of_row: torch.Tensor, width: int,
                 rows: slice | None = None, index_scales: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[rows, width]`` index scores of the query rows ``rows`` (default all) over their
    contexts, ``-inf`` past each row's position; arguments as for ``select_topk``."""
    rows = rows or slice(0, q.shape[0])
    n_rows, (_, n_heads, dim) = rows.stop - rows.start, q.shape
    out = torch.empty(n_rows, width, dtype=torch.float32, device=q.device)
    if n_rows == 0 or width == 0:
        return out
    block_s, blocks = 64, 4 if width >= 1024 else 1
    grid = (n_rows, triton.cdiv(width, block_s * blocks))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _index_scores_kernel[grid](
        q, weights, index_cache, index_cache if index_scales is None else index_scales, kv_indptr, kv_indices,
        seq_of_row, pos_of_row, out,
        rows.start, n_heads, width, q.stride(0), q.stride(1), weights.stride(0), index_cache.stride(0),
        0 if index_scales is None else index_scales.stride(0), out.stride(0),
        D=dim, BLOCK_H=max(16, triton.next_power_of_2(n_heads)), BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BLOCK_S=block_s, BLOCKS=blocks, DOT_PRECISION=precision, HAS_SCALES=index_scales is not None, num_warps=4,
    )
    return out


def select_topk(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, kv_indptr: torch.Tensor,
                kv_indices: torch.Tensor, seq_of_row: torch.Tensor, pos_of_row: torch.Tensor, topk: int,
                width: int, index_scales: torch.Tensor | None = None) -> torch.Tensor:
    """``moeserve.kernels.indexer.select_topk`` on the GPU: the scores of as many rows at a time as
    ``SCORE_BUDGET`` allows, then their sorted top-k."""
    if q.stride(-1) != 1 or index_cache.stride(-1) != 1:
        raise ValueError("q and index_cache need a contiguous last dim")
    if (index_scales is None) != (index_cache.dtype != torch.float8_e4m3fn):
        raise ValueError(f"a float8_e4m3fn index_cache comes with index_scales, another without; got "
                         f"{index_cache.dtype} and {'no ' if index_scales is None else ''}scales")
    n_rows = q.shape[0]
    out = torch.full((n_rows, topk), -1, dtype=torch.int64, device=q.device)
    width = max(width, topk)  # a row of a short context gets -inf past it, so -1 here
    step = max(1, SCORE_BUDGET // width)
    for start in range(0, n_rows, step):
        rows = slice(start, min(start + step, n_rows))
        scores = index_scores(q, weights, index_cache, kv_indptr, kv_indices, seq_of_row, pos_of_row, width, rows,
                              index_scales)
        best, pos = scores.topk(topk, dim=-1, sorted=True)
        kept = best > float("-inf")
        slots = kv_indices[kv_indptr[seq_of_row[rows]].unsqueeze(1) + pos.masked_fill(~kept, 0)]
        out[rows] = torch.where(kept, slots, -1)
    return out
