"""FP8 block-scaled GEMMs for Hopper in Gluon: the compute-bound cases of ``triton/gemm.py``.

DeepSeek-V3's FP8 scales every 128-wide step of K by its own factors (one per row of x, one per
128 x 128 block of w), so the product cannot stay in the tensor cores' accumulator: each step's
``wgmma`` result is taken into registers and added, rescaled, to an fp32 sum ("promotion", as
DeepGEMM calls it). Written in plain Triton the whole CTA waits for every step's MMA before it
rescales, and loads, MMAs and promotion never overlap; it stays near 60% of the FP8 matmul rate.
Here, per persistent CTA:

- a one-warp partition loads the tiles of x and w with the copy engine (TMA) into a ring of
  ``STAGES`` shared-memory buffers, running ahead across output tiles;
- two MMA warpgroups (the default partition and a worker, 64 rows of a 128-row tile each) issue
  the MMAs. With ``OVERLAP`` each takes the K-steps in pairs, into two register tiles: the second
  step's MMA runs while the first step's result is promoted, so the tensor cores do not wait for
  the CUDA cores (three 64 x ``BLOCK_N`` fp32 tiles per warpgroup: the sum and the pair). Without
  it each step's MMA is waited for, as DeepGEMM does, and the warpgroups overlap each other's
  promotion. Each warpgroup stores its rows with masked stores (a tile can end inside the next
  expert's rows, which the copy engine's stores would overwrite); warpgroup 0 then writes zeros
  over the rows the layout says are zero, as ``triton/gemm.py`` does.

The work list is the one of ``triton/gemm.py`` (live tiles expert by expert, ``GROUP_M`` m-tiles
walked down before moving right), built on the device from the layout's row counts, so a call
needs no host synchronisation and can be captured in a CUDA graph. Layouts: contiguous
(``seg_indptr``), masked (``masked_m``) and dense (one group: ``fp8_block_gemm``).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from moeserve.kernels.fp8 import FP8_BLOCK, FP8_DTYPE
from moeserve.kernels.triton.tma import copy_engine_can_read

BLOCK_K = gl.constexpr(FP8_BLOCK)  # one K-step per scale block
BLOCK_M = gl.constexpr(128)  # a tile's rows: two warpgroups of 64
HALF_M = gl.constexpr(64)
ZERO_M = gl.constexpr(64)
ZERO_N = gl.constexpr(128)
_CONTIGUOUS, _MASKED, _DENSE = 0, 1, 2

# Defaults from the H200 sweep at the reference's prefill shapes (``python3 tools/fp8_gemm_gpu.py --sweep``:
# 4 stages beat 5 and 6, the paired MMAs 10-15% over waiting for each, BLOCK_N 64 lost 35%).
DEFAULT_CONFIG = {"BLOCK_N": 128, "GROUP_M": 8, "STAGES": 4, "OVERLAP": 1, "MMA_REGS": 232, "LOADER_REGS": 40}
CONFIG_KEYS = tuple(DEFAULT_CONFIG)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- work list


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _pick(offs, i, values):
    """``values[i]`` of a register vector, as a scalar."""
    return gl.sum(gl.where(offs == i, values, 0), 0)


@gluon.jit
def _segments(seg_ptr, M, E, LAYOUT: gl.constexpr, E_POW2: gl.constexpr, layout: gl.constexpr):
    """The layout's rows as ``[E_POW2]`` int32 vectors (see ``triton/gemm.py``'s ``_segments``):
    live segment ``e`` is rows ``lo[e] : lo[e] + cnt[e]`` of batch ``e``, zero segment ``j`` rows
    ``zlo[j] : zlo[j] + zcnt[j]`` of batch ``j``."""
    offs = gl.arange(0, E_POW2, layout=layout)
    in_e = offs < E
    zero = gl.zeros([E_POW2], gl.int32, layout)
    if LAYOUT == 0:  # contiguous: seg_indptr [E + 1]
        lo = gl.load(seg_ptr + offs, mask=in_e, other=0).to(gl.int32)
        hi = gl.load(seg_ptr + offs + 1, mask=in_e, other=0).to(gl.int32)
        lo = gl.minimum(gl.maximum(lo, 0), M)
        cnt = gl.maximum(gl.minimum(hi, M) - lo, 0)
        first = gl.minimum(gl.maximum(gl.load(seg_ptr).to(gl.int32), 0), M)
        last = gl.minimum(gl.maximum(gl.load(seg_ptr + E).to(gl.int32), first), M)
        zlo = gl.where(offs == 0, last, zero)
        zcnt = gl.where(offs == 0, M - last, gl.where(offs == 1, first, zero))
    elif LAYOUT == 1:  # masked: masked_m [E], M = M_max
        cnt = gl.load(seg_ptr + offs, mask=in_e, other=0).to(gl.int32)
        cnt = gl.minimum(gl.maximum(cnt, 0), M)
        lo = zero
        zlo = cnt
        zcnt = gl.where(in_e, M - cnt, zero)
    else:  # dense: one group owning all M rows
        lo = zero
        cnt = gl.where(offs == 0, M, zero)
        zlo = zero
        zcnt = zero
    return offs, lo, cnt, zlo, zcnt


@gluon.jit
def _live_work(seg_ptr, M, N, E, LAYOUT: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, SPLIT_K: gl.constexpr, layout: gl.constexpr):
    """``(offs, lo, cnt, work, work_end)``: live items (tiles times K-splits) per segment and
    their running total."""
    offs, lo, cnt, zlo, zcnt = _segments(seg_ptr, M, E, LAYOUT, E_POW2, layout)
    work = gl.cdiv(cnt, BLOCK_M) * gl.cdiv(N, BLOCK_N) * SPLIT_K
    return offs, lo, cnt, work, gl.associative_scan(work, 0, _add)


@gluon.jit
def _tile(t, offs, lo, cnt, work, work_end, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
          GROUP_M: gl.constexpr, SPLIT_K: gl.constexpr):
    """Live item ``t`` -> ``(segment, first row, first column, rows left from the first, K-split,
    its first K-step, its K-steps)``."""
    e = gl.sum((work_end <= t).to(gl.int32), 0)
    local = t - _pick(offs, e, work_end - work)
    split = local % SPLIT_K
    local = local // SPLIT_K
    k_steps = gl.cdiv(K, BLOCK_K)
    per_split = gl.cdiv(k_steps, SPLIT_K)
    k_lo = gl.minimum(split * per_split, k_steps)
    rows = _pick(offs, e, cnt)
    num_m = gl.cdiv(rows, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (local // per_group) * GROUP_M
    group_m = gl.minimum(num_m - first_m, GROUP_M)
    r = local % per_group
    m_blk = first_m + r % group_m
    n_blk = r // group_m
    return (e, _pick(offs, e, lo) + m_blk * BLOCK_M, n_blk * BLOCK_N, rows - m_blk * BLOCK_M, split, k_lo,
            gl.minimum(k_lo + per_split, k_steps) - k_lo)


# ----------------------------------------------------------------------------- partitions


@gluon.jit
def _loader(args, LAYOUT: gl.constexpr, E_POW2: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr, OVERLAP: gl.constexpr, SPLIT_K: gl.constexpr, HALF: gl.constexpr):
    """One warp: the x and w tiles of every K-step of this CTA's tiles, into the ring (x as two
    64-row halves, one for each MMA warpgroup). Worker partitions share one signature, so this
    takes ``_mma_warpgroup``'s arguments and leaves the ones it does not need."""
    (a_desc, b_desc, a_bufs, b_bufs, ready, empty, out_ptr, xs_ptr, ws_ptr, seg_ptr, M, N, K, E, batch_rows,
     strides) = args
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    offs, lo, cnt, work, work_end = _live_work(seg_ptr, M, N, E, LAYOUT, E_POW2, BLOCK_M, BLOCK_N, SPLIT_K, vec)
    live = gl.sum(work, 0)
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    it = 0
    for t in range(gl.program_id(0), live, gl.num_programs(0)):
        e, row0, n0, rows_left, split, k_lo, k_steps = _tile(t, offs, lo, cnt, work, work_end, N, K, BLOCK_M,
                                                             BLOCK_N, GROUP_M, SPLIT_K)
        a_row = e * batch_rows + row0
        b_row = e * N + n0
        for kk in range(k_lo, k_lo + k_steps):
            s = it % STAGES
            mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            tma.async_copy_global_to_shared(a_desc, [a_row, kk * BLOCK_K], bar, a_bufs.index(2 * s))
            tma.async_copy_global_to_shared(a_desc, [a_row + HALF_M, kk * BLOCK_K], bar, a_bufs.index(2 * s + 1))
            tma.async_copy_global_to_shared(b_desc, [b_row, kk * BLOCK_K], bar, b_bufs.index(s))
            it += 1


@gluon.jit
def _step(a_bufs, b_bufs, ready, it, dead, HALF: gl.constexpr, STAGES: gl.constexpr):
    """Wait for ring slot ``it`` and start this warpgroup's MMA on it into ``dead``'s registers
    (``use_acc=False``: their values are not read)."""
    s = it % STAGES
    mbarrier.wait(ready.index(s), (it // STAGES) & 1)
    return warpgroup_mma(a_bufs.index(2 * s + HALF), b_bufs.index(s).permute((1, 0)), dead, use_acc=False,
                         is_async=True)


@gluon.jit
def _promote(acc, token, pending: gl.constexpr, scale, empty, it, STAGES: gl.constexpr):
    """Wait until at most ``pending`` MMAs are in flight (``token``'s is done), free its ring slot
    ``it`` and add its result, rescaled, to ``acc``; returns ``(acc, the result's registers)``."""
    done = warpgroup_mma_wait(pending, deps=(token,))
    mbarrier.arrive(empty.index(it % STAGES), count=1)
    return acc + done * scale[:, None], done


@gluon.jit
def _scales(xs_rows, ws_tile, kk, stride_xsk, stride_wsk):
    """The factors of K-step ``kk``: x's per row times w's block scale."""
    return gl.load(xs_rows + kk * stride_xsk) * gl.load(ws_tile + kk * stride_wsk)


@gluon.jit
def _tile_product(a_bufs, b_bufs, ready, empty, it, k_steps, xs_rows, ws_tile, stride_xsk, stride_wsk,
                  acc_layout: gl.constexpr, BLOCK_N: gl.constexpr, HALF: gl.constexpr, STAGES: gl.constexpr,
                  OVERLAP: gl.constexpr):
    """``sum_k (x_k @ w_k^T) * scale_k`` over the item's ``k_steps`` K-steps (ring slots ``it`` on;
    ``xs_rows`` and ``ws_tile`` point at the first step's scales) for this
    warpgroup's 64 rows. With ``OVERLAP`` the steps go in pairs, each into its own register tile:
    the second's MMA runs while the first is promoted. (Keeping an MMA in flight across loop
    iterations would be deeper overlap, but ptxas then serialises every MMA: it cannot tell that
    the registers the loop carries are not those of the MMA in flight.)"""
    acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
    if OVERLAP:
        x_dead = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
        y_dead = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
        for kk in range(0, k_steps - 1, 2):  # steps kk (x) and kk + 1 (y): y's MMA runs while x is promoted
            sx = _scales(xs_rows, ws_tile, kk, stride_xsk, stride_wsk)
            sy = _scales(xs_rows, ws_tile, kk + 1, stride_xsk, stride_wsk)
            x = _step(a_bufs, b_bufs, ready, it + kk, x_dead, HALF, STAGES)
            y = _step(a_bufs, b_bufs, ready, it + kk + 1, y_dead, HALF, STAGES)
            acc, x_dead = _promote(acc, x, 1, sx, empty, it + kk, STAGES)
            acc, y_dead = _promote(acc, y, 0, sy, empty, it + kk + 1, STAGES)
        if k_steps % 2:
            sx = _scales(xs_rows, ws_tile, k_steps - 1, stride_xsk, stride_wsk)
            x = _step(a_bufs, b_bufs, ready, it + k_steps - 1, x_dead, HALF, STAGES)
            acc, x_dead = _promote(acc, x, 0, sx, empty, it + k_steps - 1, STAGES)
    else:
        dead = gl.zeros([HALF_M, BLOCK_N], gl.float32, acc_layout)
        for kk in range(k_steps):
            scale = _scales(xs_rows, ws_tile, kk, stride_xsk, stride_wsk)
            part = _step(a_bufs, b_bufs, ready, it + kk, dead, HALF, STAGES)
            acc, dead = _promote(acc, part, 0, scale, empty, it + kk, STAGES)
    return acc


@gluon.jit
def _zero_rows(seg_ptr, M, E, out_ptr, N, stride_oe, stride_om, LAYOUT: gl.constexpr, E_POW2: gl.constexpr,
               vec: gl.constexpr):
    """Zeros over this CTA's share of the zero segments (``ZERO_M`` rows an item)."""
    offs, lo, cnt, zlo, zcnt = _segments(seg_ptr, M, E, LAYOUT, E_POW2, vec)
    ztiles = gl.cdiv(zcnt, ZERO_M)
    zwork_end = gl.associative_scan(ztiles, 0, _add)
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    offs_m = gl.arange(0, ZERO_M, layout=gl.SliceLayout(1, layout))
    offs_n = gl.arange(0, ZERO_N, layout=gl.SliceLayout(0, layout))
    zeros = gl.zeros([ZERO_M, ZERO_N], out_ptr.dtype.element_ty, layout)
    for z in range(gl.program_id(0), gl.sum(ztiles, 0), gl.num_programs(0)):
        j = gl.sum((zwork_end <= z).to(gl.int32), 0)
        local = z - _pick(offs, j, zwork_end - ztiles)
        row0 = _pick(offs, j, zlo) + local * ZERO_M
        mask_m = offs_m < _pick(offs, j, zcnt) - local * ZERO_M
        base = out_ptr + j.to(gl.int64) * stride_oe + row0.to(gl.int64) * stride_om
        for n0 in range(0, N, ZERO_N):
            cols = n0 + offs_n
            gl.store(base + offs_m[:, None] * stride_om + cols[None, :], zeros,
                     mask=mask_m[:, None] & (cols < N)[None, :])


@gluon.jit
def _mma_warpgroup(args, LAYOUT: gl.constexpr, E_POW2: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                   STAGES: gl.constexpr, OVERLAP: gl.constexpr, SPLIT_K: gl.constexpr, HALF: gl.constexpr):
    """One MMA warpgroup (4 warps): rows ``64 * HALF`` on of each tile; MMAs, promotion and
    stores, then (warpgroup 0) this CTA's zeros."""
    (a_desc, b_desc, a_bufs, b_bufs, ready, empty, out_ptr, xs_ptr, ws_ptr, seg_ptr, M, N, K, E, batch_rows,
     strides) = args
    stride_os, stride_oe, stride_om, stride_xse, stride_xsm, stride_xsk, stride_wse, stride_wsn, stride_wsk = strides
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    vec: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs, lo, cnt, work, work_end = _live_work(seg_ptr, M, N, E, LAYOUT, E_POW2, BLOCK_M, BLOCK_N, SPLIT_K, vec)
    live = gl.sum(work, 0)
    rows_a = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, acc_layout))
    rows_s = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, store_layout))
    cols_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
    it = 0
    for t in range(gl.program_id(0), live, gl.num_programs(0)):
        e, row0, n0, rows_left, split, k_lo, k_steps = _tile(t, offs, lo, cnt, work, work_end, N, K, BLOCK_M,
                                                             BLOCK_N, GROUP_M, SPLIT_K)
        # rows past the segment read its last row's scale (a live tile has one: a warpgroup's half
        # may have none, and its first row may lie past the tensor); their results are dropped
        scale_rows = row0 + gl.minimum(HALF * HALF_M + rows_a, rows_left - 1)
        row0 += HALF * HALF_M
        rows_left -= HALF * HALF_M
        e64 = e.to(gl.int64)
        xs_rows = xs_ptr + e64 * stride_xse + scale_rows.to(gl.int64) * stride_xsm + k_lo * stride_xsk
        ws_tile = ws_ptr + e64 * stride_wse + (n0 // BLOCK_K) * stride_wsn + k_lo * stride_wsk
        acc = _tile_product(a_bufs, b_bufs, ready, empty, it, k_steps, xs_rows, ws_tile, stride_xsk, stride_wsk,
                            acc_layout, BLOCK_N, HALF, STAGES, OVERLAP)
        it += k_steps
        tile = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), store_layout)
        cols = n0 + cols_s
        mask = (rows_s < rows_left)[:, None] & (cols < N)[None, :]
        base = out_ptr + split.to(gl.int64) * stride_os + e64 * stride_oe
        ptrs = base + (row0 + rows_s).to(gl.int64)[:, None] * stride_om + cols[None, :]
        gl.store(ptrs, tile, mask=mask)
    if HALF == 0:
        _zero_rows(seg_ptr, M, E, out_ptr, N, stride_oe, stride_om, LAYOUT, E_POW2, vec)


@gluon.jit
def _default(args, LAYOUT: gl.constexpr, E_POW2: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
             STAGES: gl.constexpr, OVERLAP: gl.constexpr, SPLIT_K: gl.constexpr):
    _mma_warpgroup(args, LAYOUT, E_POW2, BLOCK_N, GROUP_M, STAGES, OVERLAP, SPLIT_K, 0)
    return (0,)


@gluon.jit(do_not_specialize=["M", "E", "batch_rows"])
def _fp8_gemm_kernel(a_desc, b_desc, out_ptr, xs_ptr, ws_ptr, seg_ptr, M, N, K, E, batch_rows,
                     stride_os, stride_oe, stride_om, stride_xse, stride_xsm, stride_xsk, stride_wse, stride_wsn,
                     stride_wsk,
                     LAYOUT: gl.constexpr, E_POW2: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                     STAGES: gl.constexpr, OVERLAP: gl.constexpr, SPLIT_K: gl.constexpr, MMA_REGS: gl.constexpr,
                     LOADER_REGS: gl.constexpr):
    """``out[rows of e] = (x * xs)[rows of e] @ (w[e] * ws[e]).T`` for every segment ``e``, zeros
    elsewhere. ``a_desc`` over x as ``[B * batch_rows, K]`` (``batch_rows`` 0: one batch) in
    64-row boxes, ``b_desc`` over w as ``[E * N, K]``; ``out [SPLIT_K, B, M, N]``, contiguous last
    dim (each K-split writes its partial sum to its own slice; only the dense layout splits).
    Partitions: MMA warpgroup 0 (the default, 4 warps), MMA warpgroup 1, the loader (1 warp)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, HALF_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both MMA warpgroups free a slot
    fence_async_shared()
    strides = (stride_os, stride_oe, stride_om, stride_xse, stride_xsm, stride_xsk, stride_wse, stride_wsn, stride_wsk)
    args = (a_desc, b_desc, a_bufs, b_bufs, ready, empty, out_ptr, xs_ptr, ws_ptr, seg_ptr, M, N, K, E, batch_rows,
            strides)
    gl.warp_specialize([
        (_default, (args, LAYOUT, E_POW2, BLOCK_N, GROUP_M, STAGES, OVERLAP, SPLIT_K)),
        (_mma_warpgroup, (args, LAYOUT, E_POW2, BLOCK_N, GROUP_M, STAGES, OVERLAP, SPLIT_K, 1)),
        (_loader, (args, LAYOUT, E_POW2, BLOCK_N, GROUP_M, STAGES, OVERLAP, SPLIT_K, 1)),
    ], [4, 1], [MMA_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------- host side


def supported(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, glu: bool = False) -> bool:
    """Whether ``launch`` takes ``x [B, rows, K]`` and ``w [E, N, K]``: FP8 on a Hopper GPU
    (compute capability 9.0), rows the copy engine can address (K a multiple of 16), batches
    back to back, no fused activation."""
    if glu or x.dtype != FP8_DTYPE or w.dtype != FP8_DTYPE or x.device.type != "cuda" or x.dim() != 3:
        return False
    if torch.cuda.get_device_capability(x.device) != (9, 0) or out_dtype not in _OUT_DTYPES:
        return False
    (b, rows, k), (e, n, _) = x.shape, w.shape
    packed = (b == 1 or x.stride(0) == rows * x.stride(1)) and (e == 1 or w.stride(0) == n * w.stride(1))
    return k % 16 == 0 and packed and copy_engine_can_read(x, w) and b * rows < 2**31 and e * n < 2**31


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def resolve(config: dict | None) -> dict:
    cfg = dict(DEFAULT_CONFIG, **(config or {}))
    unknown = set(cfg) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; known: {CONFIG_KEYS}")
    if cfg["BLOCK_N"] not in (32, 64, 128):
        raise ValueError(f"BLOCK_N must be 32, 64 or 128 (one weight scale a tile), got {cfg['BLOCK_N']}")
    return cfg


def launch(layout: int, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, x_scale: torch.Tensor,
           w_scale: torch.Tensor, index: torch.Tensor, rows: int, config: dict | None = None) -> None:
    """``x [B, rows, K]``, ``w [E, N, K]``, ``out [S, B, rows, N]`` with ``S`` K-splits (dense
    layout only; each slice gets a partial sum) (``x_scale [B, rows, Kb]``, ``w_scale [E, Nb,
    Kb]``); ``index``: seg_indptr or masked_m (any tensor for the dense layout). The caller
    checked the operands and ``supported``."""
    cfg = resolve(dict(narrow_tiles(layout, x, w), **(config or {})))
    split = out.shape[0]
    if split > 1 and layout != _DENSE:
        raise ValueError("K-splits apply to the dense layout only")
    num_e, n, k = w.shape
    b = x.shape[0]
    a_desc, b_desc = descriptors(x.as_strided((b * rows, k), (x.stride(1), 1)),
                                 w.as_strided((num_e * n, k), (w.stride(1), 1)), cfg["BLOCK_N"])
    batched = layout == _MASKED
    bound = (triton.cdiv(b * rows, BLOCK_M.value) + num_e) * triton.cdiv(n, cfg["BLOCK_N"]) * split
    grid = (max(1, min(_sm_count(x.device), bound + triton.cdiv(b * rows, ZERO_M.value))),)
    _fp8_gemm_kernel[grid](
        a_desc, b_desc, out, x_scale, w_scale, index, rows, n, k, num_e, rows if batched else 0,
        out.stride(0), out.stride(1) if batched else 0, out.stride(2),
        x_scale.stride(0) if batched else 0, x_scale.stride(1), x_scale.stride(2), *w_scale.stride(),
        **kernel_constants(layout, num_e, cfg, split), num_warps=4,
    )


def narrow_tiles(layout: int, x: torch.Tensor, w: torch.Tensor) -> dict:
    """``{"BLOCK_N": 64}`` for a dense product whose 128-wide tiles would leave over half the SMs
    idle (decode-sized batches of the attention projections and shared experts), else nothing.
    On the H200 (docs/benchmarks.md) the narrow tiles ran 1.2-1.25x faster there (256 rows x
    2112 and 4096 columns, 128 rows x 2112, 4096 and 7168) and 0.65-0.8x where the wide tiles
    already fill the SMs."""
    tiles = triton.cdiv(x.shape[0] * x.shape[1], BLOCK_M.value) * triton.cdiv(w.shape[1], 128)
    return {"BLOCK_N": 64} if layout == _DENSE and 2 * tiles <= _sm_count(x.device) else {}


def kernel_constants(layout: int, num_e: int, cfg: dict, split: int = 1) -> dict:
    return dict(LAYOUT=layout, E_POW2=max(32, triton.next_power_of_2(num_e)), BLOCK_N=cfg["BLOCK_N"],
                GROUP_M=cfg["GROUP_M"], STAGES=cfg["STAGES"], OVERLAP=bool(cfg["OVERLAP"]), SPLIT_K=split,
                MMA_REGS=cfg["MMA_REGS"], LOADER_REGS=cfg["LOADER_REGS"])



def descriptors(a2d: torch.Tensor, b2d: torch.Tensor, block_n: int) -> tuple:
    """Tensor descriptors of x as ``[rows, K]`` in 64-row boxes and w as ``[E * N, K]``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bk = BLOCK_K.value
    a_layout = gl.NVMMASharedLayout.get_default_for([HALF_M.value, bk], gl.float8e4nv)
    b_layout = gl.NVMMASharedLayout.get_default_for([block_n, bk], gl.float8e4nv)
    return (TensorDescriptor.from_tensor(a2d, [HALF_M.value, bk], a_layout),
            TensorDescriptor.from_tensor(b2d, [block_n, bk], b_layout))
