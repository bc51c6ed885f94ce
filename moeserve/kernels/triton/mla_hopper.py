"""MLA decode for Hopper in Gluon (Triton's explicit dialect): two warpgroups with different roles.

Used on Hopper for caches in pages of a multiple of 64 slots, heads in blocks of 64 per program
(DeepSeek's 128 heads in two; fewer heads, as under tensor parallelism, padded to 64 rows: the
MMA work grows but stays under the memory floor, and whole-page loads beat the Triton kernel's
row gather there too). Plain Triton runs every operation on all warps, so both
warpgroups of its 64-head tile re-read the whole query from shared memory for every score tile,
and loads, MMAs and softmax never overlap; it stays near 30% of the matmul rate there. Here:

- warpgroup 0 (the default partition) computes the scores ``S = Q K^T`` of a 64-key block
  alone (one 64 x 64 wgmma tile over the 576-wide rows), the online softmax, hands ``P`` and the
  rescale factor to warpgroup 1 through shared memory, and accumulates the left half of the
  output (latent columns 0..255);
- warpgroup 1 (a worker partition) loads the blocks with the copy engine (TMA, whole page
  blocks, two stages) and accumulates the right half (columns 256..511), so its MMAs run while
  warpgroup 0 scores the next block.

Shared memory: the query (72 KB), two stages of 64 cache rows (2 x 72 KB) and one ``P`` tile
(8 KB). Each program writes a normalised partial output and its log-sum-exp (base 2) per split,
as the Triton kernel does, and the Triton merge kernel combines the splits.
"""

from __future__ import annotations

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

from moeserve.kernels.triton.tma import copy_engine_can_read

BLOCK_H = gl.constexpr(64)  # heads per program: one wgmma row block
BLOCK_N = gl.constexpr(64)  # keys per block; pages must hold a multiple of it
LATENT = gl.constexpr(512)
ROPE = gl.constexpr(64)
HALF = gl.constexpr(256)  # each warpgroup's share of the output columns
# wgmma accumulators of one warpgroup: the 64 x 64 score tile and a 64 x 256 output half
S_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, BLOCK_N.value, 16]))
O_LAYOUT = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, HALF.value, 16]))


@gluon.jit
def _split_range(kv_indptr, seq, split, num_splits, BN: gl.constexpr):
    """``(first slot index, tokens, blocks)`` of this split: whole ``BN`` blocks of the sequence."""
    kv_start = gl.load(kv_indptr + seq).to(gl.int64)
    seq_len = (gl.load(kv_indptr + seq + 1) - kv_start).to(gl.int32)
    chunk = gl.cdiv(gl.cdiv(seq_len, num_splits), BN) * BN
    lo = split * chunk
    n_tokens = gl.maximum(gl.minimum(lo + chunk, seq_len) - lo, 0)
    return kv_start + lo, n_tokens, gl.cdiv(n_tokens, BN)


@gluon.jit
def _query_to_smem(q_latent, q_rope, seq, head0, num_heads, stride_qlb, stride_qlh, stride_qrb, stride_qrh,
                   ROWS: gl.constexpr):
    """The query block ``[ROWS, L]`` and ``[ROWS, R]`` in shared memory (rows past num_heads zero)."""
    q_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    dtype: gl.constexpr = q_latent.dtype.element_ty
    heads = head0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, q_layout))
    cols = gl.arange(0, 64, layout=gl.SliceLayout(0, q_layout))
    head_ok = (heads < num_heads)[:, None]
    q_lat = gl.allocate_shared_memory(dtype, [ROWS, LATENT],
                                      gl.NVMMASharedLayout.get_default_for([ROWS, LATENT], dtype))
    q_rope_s = gl.allocate_shared_memory(dtype, [ROWS, ROPE], gl.NVMMASharedLayout.get_default_for([ROWS, ROPE], dtype))
    q_rows = q_latent + seq * stride_qlb + heads[:, None] * stride_qlh
    for c in gl.static_range(LATENT // 64):
        q_lat.slice(c * 64, 64, dim=1).store(gl.load(q_rows + c * 64 + cols[None, :], mask=head_ok, other=0.0))
    q_rope_s.store(gl.load(q_rope + seq * stride_qrb + heads[:, None] * stride_qrh + cols[None, :], mask=head_ok,
                           other=0.0))
    return q_lat, q_rope_s


@gluon.jit
def _load_block(desc_latent, desc_rope, kv_indices, block_start, j, stage, lat_a, lat_b, rope, ready,
                BN: gl.constexpr):
    """Block ``j`` of the split (``BN`` consecutive rows of one page) into ``stage`` by the copy
    engine, completing on ``ready[stage]``."""
    nbytes: gl.constexpr = 2 * desc_latent.block_type.nbytes + desc_rope.block_type.nbytes
    slot = gl.load(kv_indices + block_start + j * BN).to(gl.int32)
    bar = ready.index(stage)
    mbarrier.expect(bar, nbytes)
    tma.async_copy_global_to_shared(desc_latent, [slot, 0], bar, lat_a.index(stage))
    tma.async_copy_global_to_shared(desc_latent, [slot, HALF], bar, lat_b.index(stage))
    tma.async_copy_global_to_shared(desc_rope, [slot, LATENT], bar, rope.index(stage))


@gluon.jit
def _zero_tail(a, b, valid, BN: gl.constexpr):
    """Rows ``valid..BN`` of a partial block's latent halves to zero: they hold whatever their
    slots hold (NaN too), and P being 0 there does not make 0 * NaN zero."""
    zero_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    rows = gl.arange(0, BN, layout=gl.SliceLayout(1, zero_layout))
    for c in gl.static_range(HALF // 64):
        _zero_rows(a.slice(c * 64, 64, dim=1), rows, valid, zero_layout)
        _zero_rows(b.slice(c * 64, 64, dim=1), rows, valid, zero_layout)
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _issue_scores(q_lat, q_rope, lat_a, lat_b, rope, kv_ready, j, n_tokens):
    """Wait for block ``j`` (zeroing the rows of a partial block past the split's end) and start
    ``S = Q K^T`` on it, asynchronously."""
    stage = j % 2
    mbarrier.wait(kv_ready.index(stage), (j // 2) & 1)
    a = lat_a.index(stage)
    b = lat_b.index(stage)
    valid = n_tokens - j * BLOCK_N
    if valid < BLOCK_N:
        _zero_tail(a, b, valid, BLOCK_N)
    s = warpgroup_mma(q_lat.slice(0, HALF, dim=1), a.permute((1, 0)),
                      gl.zeros([BLOCK_H, BLOCK_N], gl.float32, S_LAYOUT), use_acc=False, is_async=True)
    s = warpgroup_mma(q_lat.slice(HALF, HALF, dim=1), b.permute((1, 0)), s, is_async=True)
    return warpgroup_mma(q_rope, rope.index(stage).permute((1, 0)), s, is_async=True)


@gluon.jit
def _softmax_and_left(s, j, o, m_i, l_i, lat_a, p_smem, alpha_smem, p_ready, p_free, n_tokens, qk_scale):
    """Online softmax of block ``j``'s scores, ``P`` and the rescale factor handed to warpgroup 1,
    and the left-half update started: returns the asynchronous ``o``."""
    keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
    s = gl.where((keys < n_tokens - j * BLOCK_N)[None, :], s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + gl.sum(p, axis=1)
    # hand P and alpha to warpgroup 1 once it is done with the previous ones
    mbarrier.wait(p_free, (j & 1) ^ 1)
    p_smem.store(p.to(p_smem.dtype))
    alpha_smem.store(alpha)
    fence_async_shared()
    mbarrier.arrive(p_ready)
    o = o * gl.convert_layout(alpha, gl.SliceLayout(1, O_LAYOUT))[:, None]
    o = warpgroup_mma(p_smem, lat_a.index(j % 2), o, is_async=True)
    return o, m_new, l_i


@gluon.jit
def _wg0_scores_and_left(q_lat, q_rope, lat_a, lat_b, rope, p_smem, alpha_smem, kv_ready, kv_free, p_ready, p_free,
                         n_blocks, n_tokens, qk_scale,
                         out, lse, stride_ob, stride_oh, stride_os, stride_lb, stride_lh, seq, split, head0,
                         num_heads, SINGLE_SPLIT: gl.constexpr):
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    l_i = gl.zeros([BLOCK_H], gl.float32, gl.SliceLayout(1, S_LAYOUT))
    o = gl.zeros([BLOCK_H, HALF], gl.float32, O_LAYOUT)
    for j in range(n_blocks):
        s = _issue_scores(q_lat, q_rope, lat_a, lat_b, rope, kv_ready, j, n_tokens)
        s = warpgroup_mma_wait(0, deps=(s, q_lat, q_rope, lat_a, lat_b, rope))[0]
        o, m_i, l_i = _softmax_and_left(s, j, o, m_i, l_i, lat_a, p_smem, alpha_smem, p_ready, p_free, n_tokens,
                                        qk_scale)
        o = warpgroup_mma_wait(0, deps=(o, p_smem, lat_a))[0]
        mbarrier.arrive(kv_free.index(j % 2))
    # last hand-off: the softmax mass, once warpgroup 1 has read the last alpha
    mbarrier.wait(p_free, (n_blocks & 1) ^ 1)
    alpha_smem.store(l_i)
    mbarrier.arrive(p_ready)
    _store_half(o, gl.convert_layout(l_i, gl.SliceLayout(1, O_LAYOUT)), out, seq, split, head0, num_heads,
                stride_ob, stride_oh, stride_os, 0)
    if not SINGLE_SPLIT:
        heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_LAYOUT))
        has_tokens = l_i > 0
        split_lse = gl.where(has_tokens, m_i + gl.log2(gl.where(has_tokens, l_i, 1.0)), float("-inf"))
        gl.store(lse + seq * stride_lb + heads * stride_lh + split, split_lse, mask=heads < num_heads)
    return (m_i,)  # a default partition must return a tuple; nothing reads it


@gluon.jit
def _zero_rows(part, rows, valid, layout: gl.constexpr):
    tile = part.load(layout)
    part.store(gl.where(rows[:, None] < valid, tile, gl.zeros_like(tile)))


@gluon.jit
def _store_half(o, l_o, out, seq, split, head0, num_heads, stride_ob, stride_oh, stride_os, col0):
    heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_LAYOUT))
    cols = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, O_LAYOUT))
    o = o / gl.where(l_o > 0, l_o, 1.0)[:, None]
    ptrs = out + seq * stride_ob + split * stride_os + heads[:, None] * stride_oh + cols[None, :]
    gl.store(ptrs, o.to(out.dtype.element_ty), mask=(heads < num_heads)[:, None])


@gluon.jit
def _wg1_loads_and_right(desc_latent, desc_rope, kv_indices, block_start, lat_a, lat_b, rope, p_smem, alpha_smem,
                         kv_ready, kv_free, p_ready, p_free, n_blocks,
                         out, stride_ob, stride_oh, stride_os, seq, split, head0, num_heads):
    for j in gl.static_range(2):  # prologue: both stages
        if j < n_blocks:
            _load_block(desc_latent, desc_rope, kv_indices, block_start, j, j, lat_a, lat_b, rope, kv_ready, BLOCK_N)
    o = gl.zeros([BLOCK_H, HALF], gl.float32, O_LAYOUT)
    for j in range(n_blocks):
        stage = j % 2
        b = lat_b.index(stage)
        mbarrier.wait(p_ready, j & 1)
        alpha = alpha_smem.load(gl.SliceLayout(1, O_LAYOUT))
        o = o * alpha[:, None]
        o = warpgroup_mma(p_smem, b, o, is_async=True)
        o = warpgroup_mma_wait(0, deps=(o, p_smem, b))[0]
        mbarrier.arrive(p_free)
        mbarrier.arrive(kv_free.index(stage))
        if j + 2 < n_blocks:  # refill this stage once warpgroup 0 is done with it too
            mbarrier.wait(kv_free.index(stage), (j // 2) & 1)
            _load_block(desc_latent, desc_rope, kv_indices, block_start, j + 2, stage, lat_a, lat_b, rope, kv_ready,
                        BLOCK_N)
    mbarrier.wait(p_ready, n_blocks & 1)
    l_o = alpha_smem.load(gl.SliceLayout(1, O_LAYOUT))
    _store_half(o, l_o, out, seq, split, head0, num_heads, stride_ob, stride_oh, stride_os, HALF)


@gluon.jit
def _mla_decode_wide_kernel(
    q_latent, q_rope, desc_latent, desc_rope, kv_indptr, kv_indices, out, lse,
    num_heads, num_splits, qk_scale,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    SINGLE_SPLIT: gl.constexpr,
):
    """One (64-head block, sequence, split); 4 warps here plus a 4-warp worker partition."""
    head0 = gl.program_id(0) * BLOCK_H
    seq = gl.program_id(1).to(gl.int64)
    split = gl.program_id(2)
    block_start, n_tokens, n_blocks = _split_range(kv_indptr, seq, split, num_splits, BLOCK_N)
    q_lat, q_rope_s = _query_to_smem(q_latent, q_rope, seq, head0, num_heads, stride_qlb, stride_qlh, stride_qrb,
                                     stride_qrh, BLOCK_H)

    lat_a = gl.allocate_shared_memory(desc_latent.dtype, [2, BLOCK_N, HALF], desc_latent.layout)
    lat_b = gl.allocate_shared_memory(desc_latent.dtype, [2, BLOCK_N, HALF], desc_latent.layout)
    rope = gl.allocate_shared_memory(desc_rope.dtype, [2, BLOCK_N, ROPE], desc_rope.layout)
    p_smem = gl.allocate_shared_memory(desc_latent.dtype, [BLOCK_H, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], desc_latent.dtype))
    alpha_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    kv_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    p_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_free.index(i), count=2)  # both warpgroups release a stage
    mbarrier.init(p_ready, count=1)
    mbarrier.init(p_free, count=1)
    fence_async_shared()

    gl.warp_specialize([
        (_wg0_scores_and_left, (q_lat, q_rope_s, lat_a, lat_b, rope, p_smem, alpha_smem, kv_ready, kv_free, p_ready,
                                p_free, n_blocks, n_tokens, qk_scale, out, lse, stride_ob, stride_oh, stride_os,
                                stride_lb, stride_lh, seq, split, head0, num_heads, SINGLE_SPLIT)),
        (_wg1_loads_and_right, (desc_latent, desc_rope, kv_indices, block_start, lat_a, lat_b, rope, p_smem,
                                alpha_smem, kv_ready, kv_free, p_ready, p_free, n_blocks, out, stride_ob, stride_oh,
                                stride_os, seq, split, head0, num_heads)),
    ], [4], [232])


def decode_supported(q_latent: torch.Tensor, kv_cache: torch.Tensor, page_size: int | None,
                     block_h: int = BLOCK_H.value, block_n: int = BLOCK_N.value, *, q_per_seq: int = 1) -> bool:
    """Whether ``decode_splits`` can take these inputs with these tiles (default: its own): one
    query per sequence (``q_per_seq``; verification with more runs the Triton kernels), a Hopper
    GPU, 16-bit DeepSeek dims, 64-head blocks over 64-row page blocks, pages of a multiple of 64
    slots, rows the copy engine can address. A cache in the query's dtype only: an FP8 cache's rows
    (596 bytes, not 16-byte multiples) go to the Triton row gather, which dequantizes them."""
    if q_per_seq != 1 or block_h != BLOCK_H.value or block_n != BLOCK_N.value:
        return False
    if page_size is None or page_size % block_n or kv_cache.device.type != "cuda":
        return False
    if torch.cuda.get_device_capability(kv_cache.device) != (9, 0):
        return False
    if q_latent.shape[-1] != LATENT.value or kv_cache.shape[1] != LATENT.value + ROPE.value:
        return False
    if q_latent.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dtype != q_latent.dtype:
        return False
    return copy_engine_can_read(kv_cache) and kv_cache.shape[0] < 2**31  # slots are int32 coordinates


def decode_splits(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                  kv_indices: torch.Tensor, qk_scale_log2: float, splits: int,
                  out: torch.Tensor, out_strides: tuple, lse: torch.Tensor, lse_strides: tuple) -> None:
    """Stage 1 of the split decode (see ``triton.mla._decode_splits``) on this kernel; the
    caller checked ``decode_supported``."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    batch, num_heads, _ = q_latent.shape
    dtype = gl.bfloat16 if kv_cache.dtype == torch.bfloat16 else gl.float16
    block_n, half, rope = BLOCK_N.value, HALF.value, ROPE.value
    desc_latent = TensorDescriptor.from_tensor(kv_cache, [block_n, half],
                                               gl.NVMMASharedLayout.get_default_for([block_n, half], dtype))
    desc_rope = TensorDescriptor.from_tensor(kv_cache, [block_n, rope],
                                             gl.NVMMASharedLayout.get_default_for([block_n, rope], dtype))
    args = (q_latent, q_rope, desc_latent, desc_rope, kv_indptr, kv_indices, out, lse, num_heads, splits,
            qk_scale_log2, q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            *out_strides, *lse_strides)
    grid = (triton.cdiv(num_heads, BLOCK_H.value), batch, splits)
    _mla_decode_wide_kernel[grid](*args, SINGLE_SPLIT=splits == 1, num_warps=4)
