"""Grouped GEMMs for the routed experts: one call for all local experts of a layer.

Two layouts, as DeepEP hands tokens to DeepGEMM:
- contiguous: rows of all experts in one ``[M, K]`` matrix, expert ``e`` owning rows
  ``seg_indptr[e]:seg_indptr[e+1]`` (rows past ``seg_indptr[-1]`` are padding);
- masked: ``[E, M_max, K]``, expert ``e`` using only its first ``masked_m[e]`` rows; the shape is
  fixed, so the call needs no host synchronisation and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch


def grouped_gemm_contiguous(x: torch.Tensor, w: torch.Tensor, seg_indptr: torch.Tensor) -> torch.Tensor:
    """``x [M, K]``, ``w [E, N, K]``, ``seg_indptr [E + 1]`` -> ``[M, N]`` with ``out = x @ w[e].T``
    per segment; padding rows are zero."""
    out = x.new_zeros(x.shape[0], w.shape[1])
    bounds = seg_indptr.tolist()
    for e in range(w.shape[0]):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            out[start:end] = x[start:end] @ w[e].t()
    return out


def grouped_gemm_masked(x: torch.Tensor, w: torch.Tensor, masked_m: torch.Tensor) -> torch.Tensor:
    """``x [E, M, K]``, ``w [E, N, K]``, ``masked_m [E]`` -> ``[E, M, N]``; rows at or past
    ``masked_m[e]`` are zero."""
    out = torch.bmm(x, w.transpose(1, 2))
    rows = torch.arange(x.shape[1], device=x.device)
    return out * (rows[None, :] < masked_m[:, None]).unsqueeze(-1).to(out.dtype)
