"""Grouped GEMMs for the routed experts: one call for all local experts of a layer.

Two layouts, as DeepEP hands tokens to DeepGEMM:
- contiguous: rows of all experts in one ``[M, K]`` matrix, expert ``e`` owning rows
  ``seg_indptr[e]:seg_indptr[e+1]`` (rows past ``seg_indptr[-1]`` are padding);
- masked: ``[E, M_max, K]``, expert ``e`` using only its first ``masked_m[e]`` rows; the shape is
  fixed, so the call needs no host synchronisation and can be captured in a CUDA graph.

Operands are either one float dtype (bf16, fp16, fp32) or DeepSeek-V3's FP8: ``x`` in
float8_e4m3fn with ``x_scale`` (fp32, one per 1x128 group of a row, as ``per_token_group_quant_fp8``
makes) and ``w`` in float8_e4m3fn with ``w_scale`` (fp32, one per 128x128 block of each expert,
as ``block_quant_fp8`` makes). The functions here are the torch references; CUDA inputs go to the
Triton kernels in ``kernels/triton/gemm.py``.
"""

from __future__ import annotations

import torch

from moeserve.kernels.activation import silu_and_mul
from moeserve.kernels.backend import use_triton
from moeserve.kernels.fp8 import FP8_BLOCK, FP8_DTYPE, block_dequant_fp8, per_token_group_dequant_fp8


def grouped_gemm_contiguous(
    x: torch.Tensor,
    w: torch.Tensor,
    seg_indptr: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    tail_rows: bool = True,
    fuse_silu_and_mul: bool = False,
) -> torch.Tensor:
    """``out[s:t] = x[s:t] @ w[e].T`` for each expert ``e`` with ``s, t = seg_indptr[e], seg_indptr[e+1]``.

    ``x [M, K]`` (bf16/fp16/fp32, or float8_e4m3fn with ``x_scale [M, ceil(K/128)]`` fp32),
    ``w [E, N, K]`` (the same float dtype, or float8_e4m3fn with ``w_scale [E, ceil(N/128),
    ceil(K/128)]`` fp32), ``seg_indptr [E + 1]`` int64 on the device, non-decreasing from 0
    -> ``[M, N]`` in ``out_dtype`` (default: ``x.dtype``; bf16 for fp8). Rows outside every
    segment (padding past ``seg_indptr[E]``) are zero; segments need no alignment.
    ``tail_rows=False`` promises that ``seg_indptr[E] == M`` (no padding), which spares a pass.
    ``fuse_silu_and_mul``: ``w`` holds ``[gate | up]`` rows and the result is ``silu_and_mul`` of
    the product, ``[M, N / 2]``. In this layout it runs as a pass of its own: the Triton kernel
    can fuse it (two half-width accumulators per tile), but on the H200 that ran 1% slower than
    the plain tiles plus the pass at 65536 bf16 rows, 15% slower in FP8, and tied at decode sizes
    (docs/benchmarks.md).
    """
    if use_triton(x):
        if _cublas_wins(x, w, x_scale, out_dtype):
            return _gated(_cublas_grouped(x, w, seg_indptr, tail_rows), fuse_silu_and_mul)
        from moeserve.kernels.triton import gemm as triton_gemm

        out = triton_gemm.grouped_gemm_contiguous(x, w, seg_indptr, x_scale, w_scale, out_dtype)
        return _gated(out, fuse_silu_and_mul)
    return _gated(grouped_gemm_contiguous_ref(x, w, seg_indptr, x_scale, w_scale, out_dtype), fuse_silu_and_mul)


def _gated(out: torch.Tensor, fuse_silu_and_mul: bool) -> torch.Tensor:
    """The unfused form of ``fuse_silu_and_mul``: the activation as a pass of its own."""
    return silu_and_mul(out) if fuse_silu_and_mul else out


# From this many rows per expert on, bf16 grouped GEMMs are compute-bound. There cuBLAS's grouped
# GEMM (torch._grouped_mm) ran ~1.1x faster than our Triton kernel with pointer loads on the
# H200; with its tiles loaded by TMA (Hopper on) ours ran as fast or faster (docs/benchmarks.md),
# so cuBLAS takes only GPUs without TMA. Below this the Triton kernel streams the weights at copy
# bandwidth, which cuBLAS does not.
CUBLAS_MIN_ROWS_PER_EXPERT = 128


def _cublas_wins(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor | None,
                 out_dtype: torch.dtype | None) -> bool:
    if torch.cuda.get_device_capability(x.device) >= (9, 0):
        return False
    return (hasattr(torch, "_grouped_mm") and x_scale is None and x.dtype == torch.bfloat16
            and w.dtype == torch.bfloat16 and out_dtype in (None, torch.bfloat16) and x.is_contiguous()
            and x.shape[0] >= CUBLAS_MIN_ROWS_PER_EXPERT * w.shape[0] and x.shape[-1] % 8 == 0)


def _cublas_grouped(x: torch.Tensor, w: torch.Tensor, seg_indptr: torch.Tensor, tail_rows: bool) -> torch.Tensor:
    """``grouped_gemm_contiguous`` through cuBLAS; rows past the last segment are zeroed
    without a host sync (they are computed with the last expert, then masked)."""
    offs = seg_indptr[1:].to(torch.int32)
    offs[-1] = x.shape[0]  # the padding rides with the last expert
    out = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)  # [M, N]
    if not tail_rows:
        return out
    padding = torch.arange(x.shape[0], device=x.device) >= seg_indptr[-1]
    return out.masked_fill_(padding.unsqueeze(1), 0)


def grouped_gemm_masked(
    x: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    *,
    fuse_silu_and_mul: bool = False,
    expected_m: int | None = None,
) -> torch.Tensor:
    """``out[e, :masked_m[e]] = x[e, :masked_m[e]] @ w[e].T``; rows at or past ``masked_m[e]`` are zero.

    ``x [E, M_max, K]`` (FP8: ``x_scale [E, M_max, ceil(K/128)]``), ``w [E, N, K]`` (FP8:
    ``w_scale [E, ceil(N/128), ceil(K/128)]``), ``masked_m [E]`` int32/int64 on the device
    -> ``[E, M_max, N]`` in ``out_dtype`` (default as for ``grouped_gemm_contiguous``);
    ``fuse_silu_and_mul`` as there (``[E, M_max, N / 2]``). Here the Triton kernel applies it in
    its epilogue, where the weights allow: a separate pass would read and write every row of the
    ``M_max``-padded buffer, mostly padding in low-latency decode (0.60 -> 0.47 ms for 32 experts
    x 1024 rows on the H200). Wide FP8 batches on Hopper run the Gluon kernel, which does not
    fuse it (``triton_gemm.masked_fuses_silu_and_mul``). ``expected_m``: the rows an expert is
    expected to hold (a host-side estimate from the shapes, as DeepGEMM's masked GEMM takes it),
    which picks the kernel's tiles; None keeps the tiles made for rows far below ``M_max``.
    """
    if use_triton(x):
        from moeserve.kernels.triton import gemm as triton_gemm

        fuse = fuse_silu_and_mul and triton_gemm.masked_fuses_silu_and_mul(x, w, out_dtype, expected_m)
        out = triton_gemm.grouped_gemm_masked(x, w, masked_m, x_scale, w_scale, out_dtype, fuse_silu_and_mul=fuse,
                                              expected_m=expected_m)
        return _gated(out, fuse_silu_and_mul and not fuse)
    return _gated(grouped_gemm_masked_ref(x, w, masked_m, x_scale, w_scale, out_dtype), fuse_silu_and_mul)


def grouped_gemm_contiguous_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    seg_indptr: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Torch version of ``grouped_gemm_contiguous``: one matmul per expert (FP8 operands
    dequantized to fp32 first; float operands multiplied in their own dtype)."""
    fp8 = _check_fp8_operands(x, w, x_scale, w_scale)
    dtype = _default_out_dtype(x, out_dtype)
    xf = per_token_group_dequant_fp8(x, x_scale, FP8_BLOCK) if fp8 else x
    out = torch.zeros(x.shape[0], w.shape[1], dtype=dtype, device=x.device)
    bounds = seg_indptr.tolist()  # reference only: the host loop needs the bounds
    for e in range(w.shape[0]):
        start, end = bounds[e], bounds[e + 1]
        if end > start:
            out[start:end] = (xf[start:end] @ _expert_weight(w, w_scale, e).t()).to(dtype)
    return out


def grouped_gemm_masked_ref(
    x: torch.Tensor,
    w: torch.Tensor,
    masked_m: torch.Tensor,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Torch version of ``grouped_gemm_masked``: one batched matmul over all ``M_max`` rows."""
    fp8 = _check_fp8_operands(x, w, x_scale, w_scale)
    dtype = _default_out_dtype(x, out_dtype)
    xf = per_token_group_dequant_fp8(x, x_scale, FP8_BLOCK) if fp8 else x
    wf = torch.stack([_expert_weight(w, w_scale, e) for e in range(w.shape[0])]) if fp8 else w
    out = torch.bmm(xf, wf.transpose(1, 2))  # [E, M_max, N]
    rows = torch.arange(x.shape[1], device=x.device)
    keep = (rows[None, :] < masked_m[:, None]).unsqueeze(-1)  # [E, M_max, 1]
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device)).to(dtype)


def _expert_weight(w: torch.Tensor, w_scale: torch.Tensor | None, e: int) -> torch.Tensor:
    """``w[e]`` as ``[N, K]``: fp32 for FP8 weights, else as stored."""
    if w_scale is None:
        return w[e]
    return block_dequant_fp8(w[e], w_scale[e], (FP8_BLOCK, FP8_BLOCK))


def _check_fp8_operands(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor | None,
                        w_scale: torch.Tensor | None) -> bool:
    """True for FP8 operands (both fp8, both scales given); float operands take no scales."""
    fp8 = x.dtype == FP8_DTYPE
    if fp8 != (w.dtype == FP8_DTYPE) or fp8 != (x_scale is not None) or fp8 != (w_scale is not None):
        raise ValueError("fp8 operands need x and w in float8_e4m3fn with x_scale and w_scale; "
                         f"float operands take no scales (got x {x.dtype}, w {w.dtype})")
    return fp8


def _default_out_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype
