"""The MoE combine in Triton (reference in ``kernels/combine.py``).

The grid is (token, block of ``BLOCK_D`` columns): each program reads the token's ``k`` row
positions and weights, gathers the ``k`` row slices and writes their weighted sum, in fp32 and
rounded once. It replaces a gather that wrote ``[T, k, D]`` and a batched GEMM that read it back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONFIG_KEYS = ("BLOCK_D", "num_warps")


@triton.jit
def _topk_weighted_sum_kernel(rows_ptr, weights_ptr, position_ptr, out_ptr, dim, k, stride_row, stride_wt,
                              stride_out, HAS_POSITION: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < dim
    choices = tl.arange(0, BLOCK_K)
    choice_ok = choices < k
    # weights rounded to the rows' dtype first, as the reference's batched GEMM takes them
    w = tl.load(weights_ptr + token * stride_wt + choices, mask=choice_ok, other=0.0)
    w = w.to(rows_ptr.dtype.element_ty).to(tl.float32)
    if HAS_POSITION:
        src = tl.load(position_ptr + token * k + choices, mask=choice_ok, other=0)
    else:
        src = token * k + choices
    x = tl.load(rows_ptr + src.to(tl.int64)[:, None] * stride_row + cols[None, :],
                mask=choice_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_D]
    acc = tl.sum(x * w[:, None], 0)
    tl.store(out_ptr + token * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


def default_config(dim: int) -> dict:
    block = min(triton.next_power_of_2(max(dim, 16)), 1024)
    return {"BLOCK_D": block, "num_warps": max(1, min(8, block // 256))}


def topk_weighted_sum(rows: torch.Tensor, topk_weights: torch.Tensor, position: torch.Tensor | None = None,
                      *, config: dict | None = None) -> torch.Tensor:
    """See ``moeserve.kernels.combine.topk_weighted_sum`` (shapes checked there)."""
    if rows.shape[-1] > 1 and rows.stride(-1) != 1:
        raise ValueError(f"rows must be contiguous in their last dim, got strides {rows.stride()}")
    if topk_weights.shape[-1] > 1 and topk_weights.stride(-1) != 1:
        raise ValueError("topk_weights must be contiguous in their last dim")
    if position is not None and not position.is_contiguous():
        raise ValueError("position must be contiguous")
    num_tokens, k = topk_weights.shape
    dim = rows.shape[-1]
    out = torch.empty(num_tokens, dim, dtype=rows.dtype, device=rows.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = {**default_config(dim), **(config or {})}
    if set(cfg) - set(CONFIG_KEYS):
        raise ValueError(f"unknown topk_weighted_sum config keys {sorted(set(cfg) - set(CONFIG_KEYS))}")
    grid = (num_tokens, triton.cdiv(dim, cfg["BLOCK_D"]))
    _topk_weighted_sum_kernel[grid](
        rows, topk_weights, rows if position is None else position, out, dim, k,
        rows.stride(0), topk_weights.stride(0), out.stride(0),
        HAS_POSITION=position is not None, BLOCK_K=triton.next_power_of_2(k), BLOCK_D=cfg["BLOCK_D"],
        num_warps=cfg["num_warps"],
    )
    return out
