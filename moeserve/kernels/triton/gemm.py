"""Triton GEMMs for the routed experts (grouped, contiguous and masked) and the FP8 block-scaled linear.

One kernel serves the three layouts. Its work list is built on the device from the layout's row
counts, inside the kernel (a cumulative sum over the experts), so no call synchronises with the
host and every call can be captured in a CUDA graph:

- live tiles: ``BLOCK_M x BLOCK_N`` output tiles of each expert's rows (times ``SPLIT_K`` for the
  dense layout), expert by expert, grouped ``GROUP_M`` m-tiles at a time for L2 reuse;
- zero tiles: ``ZERO_M`` rows x all columns of the rows the layout says are zero (contiguous
  padding, masked rows at or past ``masked_m[e]``), so the output needs no separate memset.

With ``GLU`` the weights are a gated pair ``[gate | up]`` (``w [E, 2N, K]``) and each tile of the N
output columns holds ``silu(x @ gate.T) * (x @ up.T)``: the K loop feeds two accumulators from one A
tile, and the gate-up product never goes to memory (SiLU-and-mul fused into the epilogue).

The grid is a static upper bound on that list (each program then takes one item, and programs past
the end return at once) or, with ``ctas_per_sm``, a persistent grid striding over it.

FP8 operands follow DeepSeek-V3: activations ``float8_e4m3fn`` with one fp32 scale per 1x128 group
of a row, weights ``float8_e4m3fn`` with one fp32 scale per 128x128 block; each 128-wide step of K
is a fp8 dot rescaled into the fp32 accumulator (``acc += dot(a, b) * a_scale * b_scale``).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8 import FP8_BLOCK, FP8_DTYPE
from moeserve.kernels.triton.tma import copy_engine_can_read

SCALE_BLOCK = FP8_BLOCK  # the kernel's K-step rescale assumes DeepSeek-V3's 128
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_SCALE = tl.constexpr(SCALE_BLOCK)
_CONTIGUOUS, _MASKED, _DENSE = 0, 1, 2
# Zero tiles are ZERO_M rows, stored ZERO_N columns at a time: large enough that a long padding
# tail costs few work items, small enough that the zero block stays a few registers per thread.
ZERO_M, ZERO_N = 64, 128

# Launch configs. Keys of a config dict (all optional in an override): BLOCK_M, BLOCK_N, BLOCK_K,
# GROUP_M, num_warps, num_stages, ctas_per_sm (0: one program per work item; n: a persistent grid
# of n programs per SM), SPLIT_K (dense layout only), TMA (1: operand tiles through tensor
# descriptors, Hopper's copy engine; falls back to pointer loads where the operands do not allow
# it), WS (1, with TMA and 8 warps: ask Triton to warp-specialise the K loop) and HOPPER (1: FP8
# operands go to the Gluon kernel of ``gemm_hopper.py`` where it applies, a Hopper GPU and no fused
# activation; the other keys then do not apply). Starting points for Hopper; re-tune with
# ``moeserve.bench.kernel_cases.gemm.sweep()``.
_LARGE = {  # many rows per expert: compute bound (TMA and WS apply from Hopper on; the H200 sweep's best)
    "fp8": {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4,
            "TMA": 1, "WS": 1, "HOPPER": 1},
    "16bit": {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3,
              "TMA": 1},
    "fp32": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
}
_SMALL = {  # a few rows per expert: bound by reading the weights once; BLOCK_M follows the rows
    "fp8": {"BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 5},
    "16bit": {"BLOCK_N": 128, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
    "fp32": {"BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
}
_LARGE_ROWS = 128  # mean rows per expert from which the compute-bound config wins
_MASKED_CTAS_PER_SM = 2
_GLUON_MASKED_ROWS = 256
_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "ctas_per_sm", "SPLIT_K",
                "TMA", "WS", "HOPPER")


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _segments(seg_ptr, M, E, LAYOUT: tl.constexpr, E_POW2: tl.constexpr):
    """The layout's rows as vectors over the (padded) expert axis, all ``[E_POW2]`` int32.

    Live segment ``e``: rows ``lo[e] : lo[e] + cnt[e]`` of batch ``e``. Zero segment ``j``: rows
    ``zlo[j] : zlo[j] + zcnt[j]`` of batch ``j``. (A batch is an expert of the masked layout; the
    other layouts have one batch, reached with a batch stride of 0.)
    """
    offs = tl.arange(0, E_POW2)
    in_e = offs < E
    zero = tl.zeros((E_POW2,), dtype=tl.int32)
    if LAYOUT == 0:  # contiguous: seg_indptr [E + 1]
        lo = tl.load(seg_ptr + offs, mask=in_e, other=0).to(tl.int32)
        hi = tl.load(seg_ptr + offs + 1, mask=in_e, other=0).to(tl.int32)
        lo = tl.minimum(tl.maximum(lo, 0), M)
        cnt = tl.maximum(tl.minimum(hi, M) - lo, 0)
        first = tl.minimum(tl.maximum(tl.load(seg_ptr).to(tl.int32), 0), M)
        last = tl.minimum(tl.maximum(tl.load(seg_ptr + E).to(tl.int32), first), M)
        # rows past seg_indptr[E] (padding) and, should seg_indptr[0] > 0, the rows before it
        zlo = tl.where(offs == 0, last, zero)
        zcnt = tl.where(offs == 0, M - last, tl.where(offs == 1, first, zero))
    elif LAYOUT == 1:  # masked: masked_m [E], M = M_max
        cnt = tl.load(seg_ptr + offs, mask=in_e, other=0).to(tl.int32)
        cnt = tl.minimum(tl.maximum(cnt, 0), M)
        lo = zero
        zlo = cnt
        zcnt = tl.where(in_e, M - cnt, zero)
    else:  # dense: one expert owning all M rows
        lo = zero
        cnt = tl.where(offs == 0, M, zero)
        zlo = zero
        zcnt = zero
    return lo, cnt, zlo, zcnt


@triton.jit
def _pick(offs, i, values):
    """``values[i]`` of a register vector, as a scalar."""
    return tl.sum(tl.where(offs == i, values, 0), 0)


@triton.jit
def _swizzle(local, num_m, num_n, GROUP_M: tl.constexpr):
    """Item ``local`` of a ``num_m x num_n`` tile grid -> ``(m, n)``, walking ``GROUP_M`` m-tiles
    down before moving right, so the programs in flight share A rows and B columns in L2."""
    per_group = GROUP_M * num_n
    first_m = (local // per_group) * GROUP_M
    group_m = tl.minimum(num_m - first_m, GROUP_M)
    r = local % per_group
    return first_m + r % group_m, r // group_m


@triton.jit
def _accumulate(acc, a, b, as_ptrs, bs_ptrs, kk, stride_xsk, stride_wsk,
                FP8: tl.constexpr, IEEE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc + a @ b`` for K-step ``kk``; FP8 steps are rescaled by their activation and weight scales."""
    if FP8:
        kb = (kk * BLOCK_K) // _SCALE
        a_s = tl.load(as_ptrs + kb * stride_xsk)  # [BLOCK_M]
        b_s = tl.load(bs_ptrs + kb * stride_wsk)  # scalar, or [BLOCK_N] past 128 columns
        if BLOCK_N <= _SCALE:
            acc += tl.dot(a, b) * (a_s * b_s)[:, None]
        else:
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _mma_loop(a_ptrs, b_ptrs, up_offset, as_ptrs, bs_ptrs, bs_up_ptrs, k_lo, k_hi, K, stride_xsk, stride_wsk,
              FP8: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr):
    """``sum_k A[:, k] @ B[k, :]`` over K-steps ``k_lo:k_hi`` -> two ``[BLOCK_M, BLOCK_N]`` fp32
    accumulators: the gate's (or the only one) and, with ``GLU``, the up half's, whose weights
    lie ``up_offset`` elements past the gate's (``bs_up_ptrs``: their FP8 scales).

    ``a_ptrs [BLOCK_M, BLOCK_K]`` / ``b_ptrs [BLOCK_K, BLOCK_N]`` point at step ``k_lo`` and only
    at valid rows and columns (the caller clamps them), so the full steps load without masks,
    which would cost a predicate per copy; only a partial last step masks K.
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_full = tl.minimum(k_hi, K // BLOCK_K)
    for kk in range(k_lo, k_full):
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
        acc = _accumulate(acc, a, b, as_ptrs, bs_ptrs, kk, stride_xsk, stride_wsk, FP8, IEEE, BLOCK_N, BLOCK_K)
        if GLU:
            b_up = tl.load(b_ptrs + up_offset)
            acc_up = _accumulate(acc_up, a, b_up, as_ptrs, bs_up_ptrs, kk, stride_xsk, stride_wsk, FP8, IEEE,
                                 BLOCK_N, BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not EVEN_K:
        offs_k = tl.arange(0, BLOCK_K)
        for kk in range(tl.maximum(k_full, k_lo), k_hi):  # at most one step: zeros add nothing
            k_ok = offs_k < K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            acc = _accumulate(acc, a, b, as_ptrs, bs_ptrs, kk, stride_xsk, stride_wsk, FP8, IEEE, BLOCK_N, BLOCK_K)
            if GLU:
                b_up = tl.load(b_ptrs + up_offset, mask=k_ok[:, None], other=0.0)
                acc_up = _accumulate(acc_up, a, b_up, as_ptrs, bs_up_ptrs, kk, stride_xsk, stride_wsk, FP8, IEEE,
                                     BLOCK_N, BLOCK_K)
    return acc, acc_up


@triton.jit
def _mma_loop_tma(a_desc, b_desc, a_row, b_row, up_row, as_ptrs, bs_ptrs, bs_up_ptrs, k_lo, k_hi, stride_xsk,
                  stride_wsk, FP8: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, WS: tl.constexpr, GLU: tl.constexpr):
    """``_mma_loop`` with tiles copied by the tensor-memory accelerator: ``a_desc`` over x as
    ``[rows, K]``, ``b_desc`` over w as ``[E * N_w, K]``; the tile at row ``a_row`` / ``b_row``
    (``up_row``: the up half's) of step ``kk``. The copy engine fills what lies past the tensors'
    ends (K's tail included) with zeros, so no step needs a mask; rows that run into the next
    expert's are dropped by the store. ``WS`` asks Triton to warp-specialise the loop (loads and
    MMAs in different warps)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in tl.range(k_lo, k_hi, warp_specialize=WS):
        a = a_desc.load([a_row, kk * BLOCK_K])
        b = b_desc.load([b_row, kk * BLOCK_K])
        acc = _accumulate(acc, a, b.T, as_ptrs, bs_ptrs, kk, stride_xsk, stride_wsk, FP8, IEEE, BLOCK_N, BLOCK_K)
        if GLU:
            b_up = b_desc.load([up_row, kk * BLOCK_K])
            acc_up = _accumulate(acc_up, a, b_up.T, as_ptrs, bs_up_ptrs, kk, stride_xsk, stride_wsk, FP8, IEEE,
                                 BLOCK_N, BLOCK_K)
    return acc, acc_up


@triton.jit
def _scale_ptrs(ws_ptr, e64, stride_wse, stride_wsn, col0, n_in, BLOCK_N: tl.constexpr):
    """FP8 weight scales of the tile whose columns start at weight row ``col0``: one scalar when
    the tile lies inside one 128-row scale block, else one per column."""
    if BLOCK_N <= _SCALE:
        ptrs = ws_ptr + e64 * stride_wse + (col0 // _SCALE) * stride_wsn
    else:
        ptrs = ws_ptr + e64 * stride_wse + ((col0 + n_in) // _SCALE) * stride_wsn
    return ptrs


@triton.jit
def _silu_mul(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` rounded as ``silu_and_mul`` rounds the unfused GEMM's output: both
    operands, then the activation, to ``dtype`` (identity for fp32)."""
    gate = gate.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return act * up.to(dtype).to(tl.float32)


@triton.jit
def _live_tile(t, offs_e, work_end, work, lo, cnt, num_n,
               x_ptr, w_ptr, out_ptr, xs_ptr, ws_ptr, a_desc, b_desc, batch_rows, N, K,
               stride_xe, stride_xm, stride_we, stride_wn, stride_oe, stride_om, stride_os,
               stride_xse, stride_xsm, stride_xsk, stride_wse, stride_wsn, stride_wsk,
               FP8: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
               TMA: tl.constexpr, WS: tl.constexpr, GLU: tl.constexpr):
    """Compute and store output tile ``t`` of the live work list (``batch_rows``: rows per batch
    of x seen as one 2-D tensor, for the TMA path; ``N``: output columns, half of w's rows
    with ``GLU``)."""
    e = tl.sum((work_end <= t).to(tl.int32), 0)  # the expert whose items hold t
    local = t - _pick(offs_e, e, work_end - work)
    rows = _pick(offs_e, e, cnt)
    row_lo = _pick(offs_e, e, lo)
    split = local % SPLIT_K
    m_blk, n_blk = _swizzle(local // SPLIT_K, tl.cdiv(rows, BLOCK_M), num_n, GROUP_M)

    row0 = row_lo + m_blk * BLOCK_M
    n0 = n_blk * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # rows past the expert's last and columns past N re-read the last valid ones; the store drops them
    m_in = tl.minimum(offs_m, rows - m_blk * BLOCK_M - 1)
    n_in = tl.minimum(offs_n, N - 1 - n0)
    k_steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    k_lo = split * per_split
    k_hi = tl.minimum(k_lo + per_split, k_steps)

    # 64-bit bases (experts x rows x K can pass 2^31), 32-bit offsets inside the tile
    e64 = e.to(tl.int64)
    a_base = x_ptr + e64 * stride_xe + row0.to(tl.int64) * stride_xm + k_lo * BLOCK_K
    b_base = w_ptr + e64 * stride_we + n0.to(tl.int64) * stride_wn + k_lo * BLOCK_K
    a_ptrs = a_base + m_in[:, None] * stride_xm + offs_k[None, :]
    b_ptrs = b_base + offs_k[:, None] + n_in[None, :] * stride_wn
    as_ptrs = xs_ptr + e64 * stride_xse + row0.to(tl.int64) * stride_xsm + m_in * stride_xsm
    bs_ptrs = _scale_ptrs(ws_ptr, e64, stride_wse, stride_wsn, n0, n_in, BLOCK_N)
    bs_up_ptrs = _scale_ptrs(ws_ptr, e64, stride_wse, stride_wsn, N + n0, n_in, BLOCK_N)  # used with GLU
    if TMA:
        w_rows = 2 * N if GLU else N  # rows of one expert's weight
        a_row = (e64 * batch_rows + row0).to(tl.int32)
        b_row = (e64 * w_rows + n0).to(tl.int32)
        acc, acc_up = _mma_loop_tma(a_desc, b_desc, a_row, b_row, b_row + N, as_ptrs, bs_ptrs, bs_up_ptrs, k_lo,
                                    k_hi, stride_xsk, stride_wsk, FP8, IEEE, BLOCK_M, BLOCK_N, BLOCK_K, WS, GLU)
    else:
        acc, acc_up = _mma_loop(a_ptrs, b_ptrs, N * stride_wn, as_ptrs, bs_ptrs, bs_up_ptrs, k_lo, k_hi, K,
                                stride_xsk, stride_wsk, FP8, IEEE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, GLU)
    if GLU:
        acc = _silu_mul(acc, acc_up, out_ptr.dtype.element_ty)

    mask = (offs_m < rows - m_blk * BLOCK_M)[:, None] & (offs_n < N - n0)[None, :]
    c_base = out_ptr + split.to(tl.int64) * stride_os + e64 * stride_oe + row0.to(tl.int64) * stride_om
    tl.store(c_base + offs_m[:, None] * stride_om + (n0 + offs_n)[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _zero_tile(z, offs_e, zwork_end, ztiles, zlo, zcnt, out_ptr, N, stride_oe, stride_om,
               ZERO_M: tl.constexpr, ZERO_N: tl.constexpr):
    """Store zeros over item ``z`` of the zero work list: ``ZERO_M`` rows, every column."""
    j = tl.sum((zwork_end <= z).to(tl.int32), 0)
    local = z - _pick(offs_e, j, zwork_end - ztiles)
    row0 = _pick(offs_e, j, zlo) + local * ZERO_M
    offs_m = tl.arange(0, ZERO_M)
    offs_n = tl.arange(0, ZERO_N)
    mask_m = offs_m < _pick(offs_e, j, zcnt) - local * ZERO_M
    base = out_ptr + j.to(tl.int64) * stride_oe + row0.to(tl.int64) * stride_om + offs_m[:, None] * stride_om
    zeros = tl.zeros((ZERO_M, ZERO_N), dtype=out_ptr.dtype.element_ty)
    for n0 in range(0, N, ZERO_N):
        cols = n0 + offs_n
        tl.store(base + cols[None, :], zeros, mask=mask_m[:, None] & (cols < N)[None, :])


@triton.jit(do_not_specialize=["M", "E", "batch_rows"])
def _grouped_gemm_kernel(
    x_ptr, w_ptr, out_ptr, xs_ptr, ws_ptr, seg_ptr, a_desc, b_desc,
    M, N, K, E, batch_rows,
    stride_xe, stride_xm, stride_we, stride_wn, stride_oe, stride_om, stride_os,
    stride_xse, stride_xsm, stride_xsk, stride_wse, stride_wsn, stride_wsk,
    LAYOUT: tl.constexpr, FP8: tl.constexpr, IEEE: tl.constexpr, EVEN_K: tl.constexpr,
    E_POW2: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, ZERO_M: tl.constexpr, ZERO_N: tl.constexpr,
    TMA: tl.constexpr, WS: tl.constexpr, GLU: tl.constexpr,
):
    """``out[rows of e] = x[rows of e] @ w[e].T`` for every expert ``e``, zeros elsewhere; with
    ``GLU``, ``silu(x @ w[e, :N].T) * (x @ w[e, N:].T)``.

    ``x [B, M, K]`` (batch stride ``stride_xe``), ``w [E, N, K]`` (``[E, 2N, K]`` with ``GLU``),
    ``out [SPLIT_K, B, M, N]``; the last dims are contiguous. ``seg_ptr``: seg_indptr [E + 1]
    (contiguous) or masked_m [E] (masked).
    """
    offs_e = tl.arange(0, E_POW2)
    lo, cnt, zlo, zcnt = _segments(seg_ptr, M, E, LAYOUT, E_POW2)
    num_n = tl.cdiv(N, BLOCK_N)
    work = tl.cdiv(cnt, BLOCK_M) * (num_n * SPLIT_K)  # [E_POW2] live items per expert
    work_end = tl.cumsum(work, 0)
    ztiles = tl.cdiv(zcnt, ZERO_M)  # [E_POW2] zero items per segment
    zwork_end = tl.cumsum(ztiles, 0)
    live = tl.sum(work, 0)
    total = live + tl.sum(ztiles, 0)
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    # Items pid, pid + nprog, ... of the list [live items | zero items], as two loops so that
    # the pipelined K-loop sits in a plain loop rather than under a branch.
    for t in range(pid, live, nprog):
        _live_tile(t, offs_e, work_end, work, lo, cnt, num_n,
                   x_ptr, w_ptr, out_ptr, xs_ptr, ws_ptr, a_desc, b_desc, batch_rows, N, K,
                   stride_xe, stride_xm, stride_we, stride_wn, stride_oe, stride_om, stride_os,
                   stride_xse, stride_xsm, stride_xsk, stride_wse, stride_wsn, stride_wsk,
                   FP8, IEEE, EVEN_K, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, TMA, WS, GLU)
    first_zero = live + (pid + nprog - live % nprog) % nprog  # the first item >= live that is ours
    for t in range(first_zero, total, nprog):
        _zero_tile(t - live, offs_e, zwork_end, ztiles, zlo, zcnt, out_ptr, N, stride_oe, stride_om,
                   ZERO_M, ZERO_N)


# ----------------------------------------------------------------------------- configs


def _kind(dtype: torch.dtype) -> str:
    return "fp8" if dtype == FP8_DTYPE else "fp32" if dtype == torch.float32 else "16bit"


def _block_m_for(rows: float) -> int:
    """Smallest tile (16, the least ``tl.dot`` takes, up to 64) that holds ``rows`` rows."""
    return max(16, min(64, triton.next_power_of_2(max(1, math.ceil(rows)))))


def _by_rows(dtype: torch.dtype, rows: float) -> dict:
    kind = _kind(dtype)
    if rows >= _LARGE_ROWS:
        return dict({"TMA": 0, "WS": 0, "HOPPER": 0}, **_LARGE[kind], ctas_per_sm=0, SPLIT_K=1)
    return dict(_SMALL[kind], BLOCK_M=_block_m_for(rows), ctas_per_sm=0, SPLIT_K=1, TMA=0, WS=0, HOPPER=0)


def contiguous_config(m: int, num_experts: int, n: int, k: int, dtype: torch.dtype) -> dict:
    """Default launch config of the contiguous layout, chosen from the mean rows per expert
    (``m / E``, known from the shapes alone, so choosing needs no sync)."""
    return _by_rows(dtype, m / max(num_experts, 1))


def masked_config(m_max: int, num_experts: int, n: int, k: int, dtype: torch.dtype,
                  expected_m: int | None = None) -> dict:
    """Default launch config of the masked layout. It serves low-latency decode, where
    ``masked_m`` is mostly far below ``M_max``; a persistent grid skips the empty row blocks
    without launching a program for each. FP8 calls whose experts are expected to hold at least
    ``_GLUON_MASKED_ROWS`` rows go to the Gluon kernel on Hopper (HOPPER): on the H200, at 4
    experts x 512 rows (the decode rank of a 72-way EP layout) it ran in half the Triton
    kernel's time, but at 32 experts x ~32 rows of a 1024-row M_max it took 1.36x as long
    (docs/benchmarks.md), hence the expected rows and not M_max decide."""
    hopper = int(dtype == FP8_DTYPE and expected_m is not None and expected_m >= _GLUON_MASKED_ROWS)
    return dict(_by_rows(dtype, min(m_max, 64)), ctas_per_sm=_MASKED_CTAS_PER_SM, HOPPER=hopper)


def masked_fuses_silu_and_mul(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None,
                              expected_m: int | None = None) -> bool:
    """Whether ``grouped_gemm_masked`` fuses SiLU-and-mul into these operands' call: the Triton
    kernel does where the weights allow; the Gluon kernel, which takes wide FP8 batches on
    Hopper, does not (the activation is then a pass of its own)."""
    if not can_fuse_silu_and_mul(w):
        return False
    cfg = masked_config(x.shape[1], w.shape[0], w.shape[1], w.shape[2], x.dtype, expected_m)
    return not (cfg["HOPPER"] and _gluon_takes(x, w, _out_dtype(x, out_dtype), False))


def dense_config(m: int, n: int, k: int, dtype: torch.dtype, num_sms: int = 132) -> dict:
    """Default launch config of ``fp8_block_gemm``; few rows and few column tiles split K so
    that every SM streams part of the weight. From 128 rows on (128-row tiles) K is not split:
    on the H200 the partial sums cost more than the idle SMs at 128 and 256 rows."""
    cfg = _by_rows(dtype, m)
    tiles = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
    k_steps = triton.cdiv(k, cfg["BLOCK_K"])
    if m < _LARGE_ROWS and tiles < num_sms:
        cfg["SPLIT_K"] = max(1, min(num_sms // tiles, k_steps // 4, 16))
    return cfg


def _resolve(default: dict, override: dict | None, fp8: bool, layout: int) -> dict:
    cfg = dict(default, **(override or {}))
    unknown = set(cfg) - set(_CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {_CONFIG_KEYS}")
    for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = cfg[key]
        if v < 16 or v & (v - 1):
            raise ValueError(f"{key} must be a power of two >= 16 (tl.dot's least tile), got {v}")
    if fp8 and SCALE_BLOCK % cfg["BLOCK_K"]:
        raise ValueError(f"fp8 needs BLOCK_K dividing {SCALE_BLOCK} (one scale per K-step), got {cfg['BLOCK_K']}")
    if cfg["SPLIT_K"] != 1 and layout != _DENSE:
        raise ValueError("SPLIT_K applies to fp8_block_gemm only")
    if cfg["WS"] and not cfg["TMA"]:
        raise ValueError("WS (warp specialisation) needs TMA")
    if cfg["num_warps"] < 8:  # Triton 3.6's warp specialiser failed to compile 4-warp tiles on Hopper
        cfg["WS"] = 0
    return cfg


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a token persistent grid
    return torch.cuda.get_device_properties(device).multi_processor_count


# ----------------------------------------------------------------------------- checks


def _check_operands(x: torch.Tensor, w: torch.Tensor, x_scale: torch.Tensor | None,
                    w_scale: torch.Tensor | None, x_dims: int, w_dims: int) -> bool:
    """Validate ``x [..., K]`` and ``w [..., N, K]`` (and the FP8 scales); True for FP8 operands."""
    if x.dim() != x_dims or w.dim() != w_dims:
        raise ValueError(f"x must be {x_dims}-D and w {w_dims}-D, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(f"x has K = {x.shape[-1]} but w has K = {w.shape[-1]}")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device} but w on {w.device}")
    if (x.shape[-1] > 1 and x.stride(-1) != 1) or (w.shape[-1] > 1 and w.stride(-1) != 1):
        raise ValueError("x and w need a contiguous last (K) dim")
    fp8 = x.dtype == FP8_DTYPE
    if fp8 != (w.dtype == FP8_DTYPE) or (not fp8 and x.dtype != w.dtype) or (not fp8 and x.dtype not in FLOAT_DTYPES):
        raise ValueError(f"x and w must both be float8_e4m3fn or both one of {FLOAT_DTYPES}; got {x.dtype}, {w.dtype}")
    if fp8 != (x_scale is not None) or fp8 != (w_scale is not None):
        raise ValueError("fp8 operands need x_scale and w_scale; float operands take neither")
    if fp8:
        kb = triton.cdiv(x.shape[-1], SCALE_BLOCK)
        _check_scale(x_scale, "x_scale", (*x.shape[:-1], kb), x.device)
        _check_scale(w_scale, "w_scale", (*w.shape[:-2], triton.cdiv(w.shape[-2], SCALE_BLOCK), kb), x.device)
    return fp8


def _check_scale(s: torch.Tensor, name: str, shape: tuple, device: torch.device) -> None:
    if tuple(s.shape) != tuple(shape) or s.dtype != torch.float32 or s.device != device:
        raise ValueError(f"{name} must be float32 {list(shape)} on {device}, got {s.dtype} {list(s.shape)} on {s.device}")


def _check_index(t: torch.Tensor, name: str, length: int, device: torch.device) -> None:
    if t.dim() != 1 or t.shape[0] != length or t.dtype not in (torch.int32, torch.int64) or t.device != device:
        raise ValueError(f"{name} must be int32/int64 [{length}] on {device}, got {t.dtype} {list(t.shape)} on {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _out_dtype(x: torch.Tensor, out_dtype: torch.dtype | None) -> torch.dtype:
    return out_dtype if out_dtype is not None else torch.bfloat16 if x.dtype == FP8_DTYPE else x.dtype


# ----------------------------------------------------------------------------- launch


def _launch(layout: int, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, x_scale: torch.Tensor | None,
            w_scale: torch.Tensor | None, index: torch.Tensor, rows: int, cfg: dict, bound: int,
            glu: bool = False) -> None:
    """Launch over ``x [B, rows, K]``, ``w [E, N, K]`` (``[E, 2N, K]`` with ``glu``), ``out [S, B,
    rows, N]`` (``x_scale [B, rows, Kb]``, ``w_scale [E, Nb, Kb]``); ``bound`` is an upper bound on
    the work items."""
    fp8 = x_scale is not None
    if fp8 and cfg["HOPPER"] and _gluon_takes(x, w, out.dtype, glu):
        from moeserve.kernels.triton import gemm_hopper

        gemm_hopper.launch(layout, x, w, out, x_scale, w_scale, index, rows)
        return
    num_e, n, k = w.shape
    n = n // 2 if glu else n
    batched = layout == _MASKED  # else the one batch is reached with stride 0
    if fp8:
        xs, ws = x_scale, w_scale
        xs_strides = (x_scale.stride(0) if batched else 0, x_scale.stride(1), x_scale.stride(2))
        ws_strides = w_scale.stride()
    else:  # unused pointers; any tensor of the call will do
        xs, ws = x, w
        xs_strides = ws_strides = (0, 0, 0)
    descs = _tma_descriptors(x, w, cfg) if cfg["TMA"] else None
    cap = _sm_count(x.device) * cfg["ctas_per_sm"] if cfg["ctas_per_sm"] > 0 else bound
    grid = (max(1, min(bound, cap)),)
    if rows >= 2**31 or n >= 2**31:
        raise ValueError("row and column counts must fit in int32")
    _grouped_gemm_kernel[grid](
        x, w, out, xs, ws, index, *(descs or (x, w)),
        rows, n, k, num_e, rows if batched else 0,
        x.stride(0) if batched else 0, x.stride(1), w.stride(0), w.stride(1),
        out.stride(1) if batched else 0, out.stride(2), out.stride(0),
        *xs_strides, *ws_strides,
        LAYOUT=layout, FP8=fp8, IEEE=x.dtype == torch.float32, EVEN_K=k % cfg["BLOCK_K"] == 0,
        E_POW2=max(16, triton.next_power_of_2(num_e)), SPLIT_K=cfg["SPLIT_K"],
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        ZERO_M=ZERO_M, ZERO_N=ZERO_N, TMA=descs is not None, WS=bool(cfg["WS"]) and descs is not None, GLU=glu,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _gluon_takes(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, glu: bool) -> bool:
    """Whether ``gemm_hopper``'s Gluon kernel takes these FP8 operands (imported only on a GPU
    where it may run). ``MOESERVE_FP8_GEMM=triton`` in the environment keeps every call on the
    Triton kernel, for side-by-side benchmarks."""
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device) != (9, 0):
        return False
    if os.environ.get("MOESERVE_FP8_GEMM") == "triton":
        return False
    from moeserve.kernels.triton import gemm_hopper

    return gemm_hopper.supported(x, w, out_dtype, glu)


def _tma_descriptors(x: torch.Tensor, w: torch.Tensor, cfg: dict) -> tuple | None:
    """Tensor descriptors of ``x [B, rows, K]`` as ``[B * rows, K]`` and ``w [E, N, K]`` as
    ``[E * N, K]``, or None where the copy engine cannot take them: not a Hopper-or-later GPU
    (the interpreter takes them too), rows not 16-byte aligned, batches not back to back."""
    if x.numel() == 0 or w.numel() == 0 or not copy_engine_can_read(x, w):
        return None
    b, rows, k = x.shape
    e, n, _ = w.shape
    packed = (b == 1 or x.stride(0) == rows * x.stride(1)) and (e == 1 or w.stride(0) == n * w.stride(1))
    if not (packed and cfg["BLOCK_K"] * x.element_size() >= 16 and max(cfg["BLOCK_M"], cfg["BLOCK_N"]) <= 256):
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    a2d = x.as_strided((b * rows, k), (x.stride(1), 1))
    b2d = w.as_strided((e * n, k), (w.stride(1), 1))
    return (TensorDescriptor.from_tensor(a2d, [cfg["BLOCK_M"], cfg["BLOCK_K"]]),
            TensorDescriptor.from_tensor(b2d, [cfg["BLOCK_N"], cfg["BLOCK_K"]]))


def grouped_gemm_contiguous(x: torch.Tensor, w: torch.Tensor, seg_indptr: torch.Tensor,
                            x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                            out_dtype: torch.dtype | None = None, *, fuse_silu_and_mul: bool = False,
                            config: dict | None = None) -> torch.Tensor:
    """``x [M, K]``, ``w [E, N, K]``, ``seg_indptr [E + 1]`` -> ``[M, N]`` (``[M, N / 2]`` with
    ``fuse_silu_and_mul``); see ``kernels.grouped_gemm.grouped_gemm_contiguous`` for the contract.
    ``config`` overrides the launch config (tuning only; with the fused activation its BLOCK_N
    is per half)."""
    fp8 = _check_operands(x, w, x_scale, w_scale, x_dims=2, w_dims=3)
    num_e, n, k = w.shape
    n_out = _glu_columns(w) if fuse_silu_and_mul else n
    _check_index(seg_indptr, "seg_indptr", num_e + 1, x.device)
    m = x.shape[0]
    out = torch.empty(m, n_out, dtype=_out_dtype(x, out_dtype), device=x.device)
    if out.numel() == 0:
        return out
    if k == 0 or num_e == 0:  # silu(0) * 0 = 0 as well
        return out.zero_()
    cfg = _resolve(_halve_n(contiguous_config(m, num_e, n, k, x.dtype), fuse_silu_and_mul), config, fp8, _CONTIGUOUS)
    # sum over E live and 2 zero segments of cdiv(rows, BLOCK_M) <= cdiv(M, BLOCK_M) + E + 1
    bound = (triton.cdiv(m, cfg["BLOCK_M"]) + num_e + 1) * triton.cdiv(n_out, cfg["BLOCK_N"])
    bound += triton.cdiv(m, ZERO_M) + 2
    _launch(_CONTIGUOUS, x[None], w, out[None, None], x_scale[None] if fp8 else None, w_scale,
            seg_indptr, m, cfg, bound, fuse_silu_and_mul)
    return out


def can_fuse_silu_and_mul(w: torch.Tensor) -> bool:
    """Whether ``fuse_silu_and_mul`` takes these ``[gate | up]`` weights ``w [E, N, K]``: N even
    and, for FP8, gate and up each in whole 128-row scale blocks."""
    n = w.shape[-2]
    return n % 2 == 0 and (w.dtype != FP8_DTYPE or (n // 2) % SCALE_BLOCK == 0)


def _glu_columns(w: torch.Tensor) -> int:
    """Output columns of a fused SiLU-and-mul over ``[gate | up]`` weights ``w [E, N, K]``."""
    n = w.shape[-2]
    if not can_fuse_silu_and_mul(w):
        need = f"a multiple of {2 * SCALE_BLOCK} (fp8: gate and up in whole scale blocks)" if n % 2 == 0 else "even"
        raise ValueError(f"fuse_silu_and_mul needs w's N (gate + up rows) {need}, got {n}")
    return n // 2


def _halve_n(cfg: dict, glu: bool) -> dict:
    """With the fused activation each tile holds a gate and an up half: ``BLOCK_N`` per half is
    half the plain config's, so a tile does the same MMA work with the same registers."""
    return dict(cfg, BLOCK_N=max(16, cfg["BLOCK_N"] // 2)) if glu else cfg


def grouped_gemm_masked(x: torch.Tensor, w: torch.Tensor, masked_m: torch.Tensor,
                        x_scale: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                        out_dtype: torch.dtype | None = None, *, fuse_silu_and_mul: bool = False,
                        expected_m: int | None = None, config: dict | None = None) -> torch.Tensor:
    """``x [E, M_max, K]``, ``w [E, N, K]``, ``masked_m [E]`` -> ``[E, M_max, N]`` (``N / 2``
    columns with ``fuse_silu_and_mul``); see ``kernels.grouped_gemm.grouped_gemm_masked`` for the
    contract."""
    fp8 = _check_operands(x, w, x_scale, w_scale, x_dims=3, w_dims=3)
    num_e, n, k = w.shape
    n_out = _glu_columns(w) if fuse_silu_and_mul else n
    if x.shape[0] != num_e:
        raise ValueError(f"x has {x.shape[0]} experts but w has {num_e}")
    _check_index(masked_m, "masked_m", num_e, x.device)
    m_max = x.shape[1]
    out = torch.empty(num_e, m_max, n_out, dtype=_out_dtype(x, out_dtype), device=x.device)
    if out.numel() == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = _resolve(_halve_n(masked_config(m_max, num_e, n, k, x.dtype, expected_m), fuse_silu_and_mul), config, fp8,
                   _MASKED)
    bound = num_e * (triton.cdiv(m_max, cfg["BLOCK_M"]) * triton.cdiv(n_out, cfg["BLOCK_N"])
                     + triton.cdiv(m_max, ZERO_M))
    _launch(_MASKED, x, w, out[None], x_scale, w_scale, masked_m, m_max, cfg, bound, fuse_silu_and_mul)
    return out


def fp8_block_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                   out_dtype: torch.dtype = torch.bfloat16, *, config: dict | None = None) -> torch.Tensor:
    """``x_fp8 [M, K]``, ``x_scale [M, ceil(K/128)]``, ``w_fp8 [N, K]``, ``w_scale [ceil(N/128),
    ceil(K/128)]`` -> ``[M, N]``; see ``kernels.fp8.fp8_block_gemm``."""
    if x_fp8.dtype != FP8_DTYPE:
        raise ValueError(f"x_fp8 must be float8_e4m3fn, got {x_fp8.dtype}")
    _check_operands(x_fp8, w_fp8, x_scale, w_scale, x_dims=2, w_dims=2)
    (m, k), n = x_fp8.shape, w_fp8.shape[0]
    if m == 0 or n == 0:
        return torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    if k == 0:
        return torch.zeros(m, n, dtype=out_dtype, device=x_fp8.device)
    cfg = _resolve(dense_config(m, n, k, x_fp8.dtype, _sm_count(x_fp8.device)), config, True, _DENSE)
    split = cfg["SPLIT_K"]
    # split K: each slice writes its fp32 partial sum; one reduction adds them
    out = torch.empty(split, 1, m, n, dtype=torch.float32 if split > 1 else out_dtype, device=x_fp8.device)
    bound = triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]) * split
    _launch(_DENSE, x_fp8[None], w_fp8[None], out, x_scale[None], w_scale[None], x_fp8, m, cfg, bound)
    return out[0, 0] if split == 1 else out.sum(0)[0].to(out_dtype)
