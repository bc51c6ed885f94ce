"""The MoE combine: each token's expert outputs, weighted by its routing weights and summed."""

from __future__ import annotations

import torch

from moeserve.kernels.backend import use_triton


def topk_weighted_sum(rows: torch.Tensor, topk_weights: torch.Tensor,
                      position: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * rows[position[t * k + j]]`` -> ``[T, D]`` in rows' dtype.

    ``rows [R, D]`` holds expert outputs in any order; ``position [T * k]`` (int64) says which
    row is choice ``j`` of token ``t`` (``None``: rows are already ``[T * k, D]`` in (token,
    choice) order). The weights are rounded to rows' dtype and the sum runs in fp32, rounded
    once: every dispatcher combines through here, so a token's output is the same whichever
    layout carried its rows. On CUDA one Triton kernel gathers and sums (no ``[T, k, D]`` copy).
    """
    num_tokens, k = topk_weights.shape
    if rows.dim() != 2:
        raise ValueError(f"rows must be [R, D], got shape {tuple(rows.shape)}")
    if position is None and rows.shape[0] != num_tokens * k:
        raise ValueError(f"without position, rows must be [T * k, D] = [{num_tokens * k}, D], got {tuple(rows.shape)}")
    if position is not None and position.shape != (num_tokens * k,):
        raise ValueError(f"position must be [T * k] = [{num_tokens * k}], got {tuple(position.shape)}")
    if use_triton(rows):
        from moeserve.kernels.triton import combine as triton_combine

        return triton_combine.topk_weighted_sum(rows, topk_weights, position)
    return topk_weighted_sum_ref(rows, topk_weights, position)


def topk_weighted_sum_ref(rows: torch.Tensor, topk_weights: torch.Tensor,
                          position: torch.Tensor | None = None) -> torch.Tensor:
    """The torch version of ``topk_weighted_sum``: a gather, then one batched GEMM."""
    num_tokens, k = topk_weights.shape
    picked = rows if position is None else rows.index_select(0, position)
    picked = picked.view(num_tokens, k, rows.shape[-1])
    return torch.bmm(topk_weights.to(rows.dtype).unsqueeze(1), picked).squeeze(1)
