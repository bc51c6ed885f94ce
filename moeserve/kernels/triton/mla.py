"""Triton MLA attention: absorbed decode over the paged latent cache, expanded varlen prefill.

Decode (``mla_decode``) splits each sequence's context into ``num_kv_splits`` chunks. Stage 1
runs one program per (head block, sequence, split): it gathers the chunk's cache rows through
``kv_indices``, scores them against the absorbed query (latent and rope parts as two dots) and
reuses the same latent tile as the values, with an online softmax in fp32 and base 2. Each
split writes a normalised partial output and its log-sum-exp; stage 2 merges the splits. The
chunk bounds are computed in the kernel from ``kv_indptr``, so a call never syncs with the host
and can be captured in a CUDA graph. When the caller gives the cache's page size, blocks of
tokens within one page are read whole by the copy engine (TMA) instead of row by row, and on
Hopper 64-head blocks go to the warp-specialised Gluon kernel in ``mla_hopper``.

An FP8 cache (float8_e4m3fn values with float32 scales, ``kernels/mla.py``) is read by the row
gather kernel, which dequantizes each block in registers: the latent's tiles of 128 columns
times their scales, the rope key times its own, in the query's dtype, before the same dots. Its
rows (596 bytes for DeepSeek-V3) are not the 16-byte multiples the copy engine reads, so the page
block kernel and the Gluon kernel of ``mla_hopper`` take the model dtype's cache only.

Verification (``mla_verify``) runs the same kernels with ``Q_PER_SEQ`` query rows per sequence:
program row ``r`` is query ``r % Q`` of sequence ``r // Q``, which reads the sequence's slots
from ``kv_indptr`` as decode does, less the ``Q - 1 - r % Q`` tokens after it (causal). No
per-row copy of ``kv_indices`` is made; ``Q_PER_SEQ = 1`` is decode itself. The Gluon kernel
takes one query per sequence only; verification with more runs the Triton kernels.

Prefill (``extend_attention``) is a flash-attention forward over sequences packed back to back,
causal with a cached prefix: new token ``i`` of a sequence sees keys ``0 .. prefix_len + i``.
Key blocks wholly below the diagonal run without masks; only the blocks on it are masked, and
blocks above it are never visited. A qk head dim that is not a power of two (DeepSeek's
192 = 128 nope + 64 rope) is loaded and multiplied as two power-of-two parts.

Head dims that are not powers of two (or are below the 16 that ``tl.dot`` needs) are padded to
one in the tiles and masked; DeepSeek's dims (512 + 64 latent, 128 + 64 qk, 128 v) need none.
Launch parameters come from small heuristics below; each wrapper takes a keyword-only
``config`` dict that overrides them (the tuning sweep in ``bench/kernel_cases/mla.py`` uses it).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moeserve.kernels.triton import mla_hopper
from moeserve.kernels.triton.tma import copy_engine_can_read

LOG2E = 1.4426950408889634
DECODE_CONFIG_KEYS = frozenset({"BLOCK_H", "BLOCK_N", "num_warps", "num_stages", "num_kv_splits", "LAZY_RESCALE",
                                "WS", "PAGED", "HOPPER_WS"})
EXTEND_CONFIG_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"})
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_GRID_YZ = 65535
_RESCALE_LOG2 = tl.constexpr(8.0)  # lazy rescale: tolerated growth of the running max, log2
_SCALE_TILE = 128  # columns of an FP8 cache's latent under one scale (kernels.fp8.FP8_BLOCK)


# --------------------------------------------------------------------------------------------
# decode


@triton.jit
def _decode_program(num_heads, BLOCK_H: tl.constexpr):
    """This decode program's query row, split, heads ``[BLOCK_H]`` and which of them exist. The
    head block is grid axis 0, the fastest, so the head blocks of one split read the same rows."""
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    return tl.program_id(1).to(tl.int64), tl.program_id(2), heads, heads < num_heads


@triton.jit
def _split_bounds(kv_indptr, kv_lens, row, split, num_splits, BLOCK_N: tl.constexpr, Q_PER_SEQ: tl.constexpr,
                  HAS_LENS: tl.constexpr = False):
    """``(kv_start, lo, hi)``: where the row's sequence's slots start in ``kv_indices`` and the
    token range ``[lo, hi)`` of this split, whole ``BLOCK_N`` blocks (``hi <= lo`` for an empty
    split). Row ``row`` is query ``row % Q_PER_SEQ`` of sequence ``row // Q_PER_SEQ``. With
    ``HAS_LENS`` a sequence has ``kv_lens[seq]`` slots from ``kv_indptr[seq]`` (the rest of its
    room unused) instead of all up to ``kv_indptr[seq + 1]``."""
    seq = row
    if Q_PER_SEQ > 1:
        seq = row // Q_PER_SEQ
    kv_start = tl.load(kv_indptr + seq).to(tl.int64)
    if HAS_LENS:
        seq_len = tl.load(kv_lens + seq).to(tl.int32)
    else:
        seq_len = (tl.load(kv_indptr + seq + 1) - kv_start).to(tl.int32)
    if Q_PER_SEQ > 1:  # the sequence's later queries are hidden from this one
        seq_len = tl.maximum(seq_len - (Q_PER_SEQ - 1 - row % Q_PER_SEQ).to(tl.int32), 0)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    return kv_start, lo, tl.minimum(lo + chunk, seq_len)


@triton.jit
def _softmax_step(qk, m_i, l_i, qk_scale, LAZY_RESCALE: tl.constexpr):
    """Online-softmax update for one block of scores (masked ones -inf, base 2):
    ``(p, alpha, m_i, l_i)``, ``alpha`` the factor the accumulator must be rescaled by.

    With ``LAZY_RESCALE`` the running max moves only when some row's max grew by more than
    2^_RESCALE_LOG2; until then p may reach that factor, harmless in fp32 and bf16, and
    ``alpha`` stays exactly 1, which ``_rescale`` skips."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # qk_scale > 0
    if LAZY_RESCALE:  # noqa: SIM102 - a compile-time branch around a run-time one
        if tl.max(m_new - m_i, 0) <= _RESCALE_LOG2:
            m_new = m_i
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk * qk_scale - m_new[:, None])  # one FMA per score
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _rescale(acc, alpha, LAZY_RESCALE: tl.constexpr):
    if LAZY_RESCALE:
        if tl.min(alpha, 0) < 1.0:
            acc = acc * alpha[:, None]
    else:
        acc = acc * alpha[:, None]
    return acc


@triton.jit
def _store_split(acc, l_i, m_i, out_ptrs, lse_ptrs, head_ok, col_ok,
                 SINGLE_SPLIT: tl.constexpr, STORE_LSE: tl.constexpr):
    """Normalise ``acc`` by the split's softmax mass and store it (and, once per split, its lse)."""
    has_tokens = l_i > 0  # false only for an empty split
    l_safe = tl.where(has_tokens, l_i, 1.0)
    tl.store(out_ptrs, (acc / l_safe[:, None]).to(out_ptrs.dtype.element_ty), mask=head_ok[:, None] & col_ok[None, :])
    if STORE_LSE and not SINGLE_SPLIT:
        split_lse = tl.where(has_tokens, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptrs, split_lse, mask=head_ok)


@triton.jit
def _dequantize_block(latent, rope, kv_scales, slots, tok_ok, stride_ks, dtype: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_L: tl.constexpr, SCALE_TILES: tl.constexpr, SCALE_W: tl.constexpr):
    """FP8 rows ``latent [BLOCK_N, BLOCK_L]`` and ``rope [BLOCK_N, BLOCK_R]`` in ``dtype``: each
    ``SCALE_W`` columns of the latent (128, or the whole of a narrower one) times their tile's
    scale, the rope key times the token's, from ``kv_scales [slots, SCALE_TILES + 1]``."""
    scale_rows = kv_scales + slots * stride_ks  # [BLOCK_N]
    tiles = tl.arange(0, BLOCK_L // SCALE_W)
    tile_scale = tl.load(scale_rows[:, None] + tiles[None, :], mask=tok_ok[:, None] & (tiles < SCALE_TILES)[None, :],
                         other=0.0)  # [BLOCK_N, tiles]
    tiled = tl.reshape(latent.to(tl.float32), (BLOCK_N, BLOCK_L // SCALE_W, SCALE_W)) * tile_scale[:, :, None]
    rope_scale = tl.load(scale_rows + SCALE_TILES, mask=tok_ok, other=0.0)  # [BLOCK_N]
    return (tl.reshape(tiled, (BLOCK_N, BLOCK_L)).to(dtype),
            (rope.to(tl.float32) * rope_scale[:, None]).to(dtype))


@triton.jit
def _mla_decode_split_kernel(
    q_latent, q_rope, kv_cache, kv_scales, kv_indptr, kv_indices, kv_lens, out, lse,
    num_heads, num_splits, qk_scale,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_kv, stride_ks,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, LAZY_RESCALE: tl.constexpr, DOT_PRECISION: tl.constexpr, WS: tl.constexpr,
    Q_PER_SEQ: tl.constexpr = 1, HAS_LENS: tl.constexpr = False, SCALE_TILES: tl.constexpr = 0,
    SCALE_W: tl.constexpr = 1,
):
    """One (head block, query row, split): softmax-weighted latent over the split's tokens, each
    cache row gathered through ``kv_indices``. A row is a sequence, or with ``Q_PER_SEQ > 1`` one
    of its queries; ``kv_lens`` (with ``HAS_LENS``) as in ``_split_bounds``. ``SCALE_TILES > 0``:
    the cache is FP8 with ``kv_scales`` (``_dequantize_block``); 0: the query's dtype, no scales.

    ``out`` is ``[rows, H, splits, L]`` fp32 with ``lse [rows, H, splits]`` (log2 domain), or,
    with ``SINGLE_SPLIT``, the final ``[rows, H, L]`` output (``lse`` unused).
    """
    row, split, heads, head_ok = _decode_program(num_heads, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    l_ok = offs_l < LATENT  # all true unless the latent dim is padded
    r_ok = offs_r < ROPE
    q_l = tl.load(q_latent + row * stride_qlb + heads[:, None] * stride_qlh + offs_l[None, :],
                  mask=head_ok[:, None] & l_ok[None, :], other=0.0)  # [BLOCK_H, L]
    q_r = tl.load(q_rope + row * stride_qrb + heads[:, None] * stride_qrh + offs_r[None, :],
                  mask=head_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_H, R]
    kv_start, lo, hi = _split_bounds(kv_indptr, kv_lens, row, split, num_splits, BLOCK_N, Q_PER_SEQ, HAS_LENS)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for n in tl.range(lo, hi, BLOCK_N, warp_specialize=WS):  # WS: Triton's warp specialisation
        offs_n = n + tl.arange(0, BLOCK_N)
        tok_ok = offs_n < hi
        slots = tl.load(kv_indices + kv_start + offs_n, mask=tok_ok, other=0).to(tl.int64)
        rows = kv_cache + slots[:, None] * stride_kv
        # [BLOCK_N, L] latent rows, the keys' first part and the values both
        latent = tl.load(rows + offs_l[None, :], mask=tok_ok[:, None] & l_ok[None, :], other=0.0)
        rope = tl.load(rows + LATENT + offs_r[None, :], mask=tok_ok[:, None] & r_ok[None, :], other=0.0)
        if SCALE_TILES > 0:
            latent, rope = _dequantize_block(latent, rope, kv_scales, slots, tok_ok, stride_ks, q_l.dtype, BLOCK_N,
                                             BLOCK_L, SCALE_TILES, SCALE_W)
        qk = tl.dot(q_l, tl.trans(latent), input_precision=DOT_PRECISION)
        qk = tl.dot(q_r, tl.trans(rope), qk, input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        qk = tl.where(tok_ok[None, :], qk, float("-inf"))
        p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, qk_scale, LAZY_RESCALE)
        acc = tl.dot(p.to(latent.dtype), latent, _rescale(acc, alpha, LAZY_RESCALE), input_precision=DOT_PRECISION)

    o_ptrs = out + row * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_l[None, :]
    _store_split(acc, l_i, m_i, o_ptrs, lse + row * stride_lb + heads * stride_lh + split,
                 head_ok, l_ok, SINGLE_SPLIT, True)


@triton.jit
def _paged_block(acc_a, acc_b, m_i, l_i, q_a, q_b, q_r, desc_latent, desc_rope, kv_indices, kv_start, n, hi,
                 qk_scale, HALF: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                 LAZY_RESCALE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Tokens ``[n, n + BLOCK_N)``, which lie on one page: rows ``slot .. slot + BLOCK_N`` of the
    cache, read by the copy engine as latent halves and the rope part. ``MASKED``: the last block,
    where rows from ``hi`` on belong to no token of this split."""
    slot = tl.load(kv_indices + kv_start + n).to(tl.int32)
    lat_a = desc_latent.load([slot, 0])  # [BLOCK_N, HALF]
    lat_b = desc_latent.load([slot, HALF])
    rope = desc_rope.load([slot, 2 * HALF])  # [BLOCK_N, R]
    if MASKED:  # rows past the end hold whatever their slots hold (NaN too): zero the values
        tok_ok = (n + tl.arange(0, BLOCK_N)) < hi
        lat_a = tl.where(tok_ok[:, None], lat_a, 0.0)
        lat_b = tl.where(tok_ok[:, None], lat_b, 0.0)
    qk = tl.dot(q_a, tl.trans(lat_a), input_precision=DOT_PRECISION)
    qk = tl.dot(q_b, tl.trans(lat_b), qk, input_precision=DOT_PRECISION)
    qk = tl.dot(q_r, tl.trans(rope), qk, input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
    if MASKED:
        qk = tl.where(tok_ok[None, :], qk, float("-inf"))
    p, alpha, m_i, l_i = _softmax_step(qk, m_i, l_i, qk_scale, LAZY_RESCALE)
    p = p.to(lat_a.dtype)
    acc_a = tl.dot(p, lat_a, _rescale(acc_a, alpha, LAZY_RESCALE), input_precision=DOT_PRECISION)
    acc_b = tl.dot(p, lat_b, _rescale(acc_b, alpha, LAZY_RESCALE), input_precision=DOT_PRECISION)
    return acc_a, acc_b, m_i, l_i


@triton.jit
def _mla_decode_paged_kernel(
    q_latent, q_rope, desc_latent, desc_rope, kv_indptr, kv_indices, out, lse,
    num_heads, num_splits, qk_scale,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    HALF: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, LAZY_RESCALE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    Q_PER_SEQ: tl.constexpr = 1,
):
    """``_mla_decode_split_kernel`` for caches laid out in pages of a multiple of ``BLOCK_N``
    slots: a block of tokens is ``BLOCK_N`` consecutive rows, loaded whole by the copy engine
    (TMA) instead of row by row. The latent (``2 * HALF`` wide) is handled as two halves, since
    a copy-engine box is at most 256 elements wide."""
    row, split, heads, head_ok = _decode_program(num_heads, BLOCK_H)
    offs_h = tl.arange(0, HALF)
    offs_r = tl.arange(0, ROPE)
    q_row = q_latent + row * stride_qlb + heads[:, None] * stride_qlh
    q_a = tl.load(q_row + offs_h[None, :], mask=head_ok[:, None], other=0.0)  # [BLOCK_H, HALF]
    q_b = tl.load(q_row + HALF + offs_h[None, :], mask=head_ok[:, None], other=0.0)
    q_r = tl.load(q_rope + row * stride_qrb + heads[:, None] * stride_qrh + offs_r[None, :],
                  mask=head_ok[:, None], other=0.0)  # [BLOCK_H, R]
    kv_start, lo, hi = _split_bounds(kv_indptr, kv_indptr, row, split, num_splits, BLOCK_N, Q_PER_SEQ)
    hi = tl.maximum(hi, lo)
    full_end = lo + (hi - lo) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_a = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc_b = tl.zeros([BLOCK_H, HALF], tl.float32)
    for n in tl.range(lo, full_end, BLOCK_N):
        acc_a, acc_b, m_i, l_i = _paged_block(acc_a, acc_b, m_i, l_i, q_a, q_b, q_r, desc_latent, desc_rope,
                                              kv_indices, kv_start, n, hi, qk_scale,
                                              HALF, BLOCK_N, False, LAZY_RESCALE, DOT_PRECISION)
    if full_end < hi:
        acc_a, acc_b, m_i, l_i = _paged_block(acc_a, acc_b, m_i, l_i, q_a, q_b, q_r, desc_latent, desc_rope,
                                              kv_indices, kv_start, full_end, hi, qk_scale,
                                              HALF, BLOCK_N, True, LAZY_RESCALE, DOT_PRECISION)

    o_ptrs = out + row * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_h[None, :]
    lse_ptrs = lse + row * stride_lb + heads * stride_lh + split
    col_ok = offs_h < HALF  # all true
    _store_split(acc_a, l_i, m_i, o_ptrs, lse_ptrs, head_ok, col_ok, SINGLE_SPLIT, True)
    _store_split(acc_b, l_i, m_i, o_ptrs + HALF, lse_ptrs, head_ok, col_ok, SINGLE_SPLIT, False)


@triton.jit
def _mla_decode_merge_kernel(
    partial, lse, out, num_splits,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    LATENT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One (head, query row): weight each split's output by its share of the softmax mass."""
    head = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_l = tl.arange(0, BLOCK_L)
    l_ok = offs_l < LATENT
    lse_row = lse + row * stride_lb + head * stride_lh
    split_lse = tl.load(lse_row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    top = tl.max(split_lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: all weights 0, output 0
    total = tl.sum(tl.exp2(split_lse - top), 0)
    acc = tl.zeros([BLOCK_L], tl.float32)
    part_row = partial + row * stride_pb + head * stride_ph
    for s in range(num_splits):
        weight = tl.exp2(tl.load(lse_row + s) - top)
        acc += weight * tl.load(part_row + s * stride_ps + offs_l, mask=l_ok, other=0.0)
    acc = acc / tl.where(total > 0, total, 1.0)
    tl.store(out + row * stride_ob + head * stride_oh + offs_l, acc.to(out.dtype.element_ty), mask=l_ok)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter on CPU: any positive count
    return torch.cuda.get_device_properties(device).multi_processor_count


def _dot_block(dim: int) -> int:
    """Tile width for a head dim: the next power of two, at least the 16 ``tl.dot`` needs."""
    return max(16, triton.next_power_of_2(dim))


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs (tests, debugging) get fp32 products, as torch matmuls do, rather than tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_config(batch: int, num_heads: int, row_bytes: int, device: torch.device,
                  page_size: int | None = None, hopper_kernel: bool = False) -> dict:
    """Default launch parameters from static facts only (no context lengths: graph-safe);
    ``batch`` is the launch's query rows (its sequences, in decode), ``row_bytes`` the size of one
    cache row ((L + R) * element size; 1152 for DeepSeek bf16), ``page_size`` the cache's pages,
    if the caller gives them; ``hopper_kernel``: the Gluon kernel of ``mla_hopper`` takes these
    inputs (``mla_hopper.decode_supported``).

    The Gluon kernel is the default wherever it applies, for any head count: on the H200 it ran
    128 sequences x 4096, 128 heads in 0.28 ms against 0.51 ms for the Triton kernel over page
    blocks, and 64 x 8192 with 16 heads (padded to its 64-row tiles, still under the memory
    floor) in 0.160 ms against 0.217 ms for the Triton row gather (device times, 2026-11-29;
    `tools/mla_decode_timing.py`).
    Elsewhere, wide head blocks (>= 64 heads, so Hopper's 64-row wgmma applies) are compute-bound
    and hold a [64, L] fp32 accumulator, one program per SM: aim for ~1 wave; they read whole
    blocks of a page through the copy engine where the pages allow. Narrow ones are
    bandwidth-bound and several fit on an SM: aim for ~2 waves. Wider rows (fp32, larger latents)
    get smaller tiles to fit registers and shared memory.
    """
    if hopper_kernel:
        cfg = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}
        waves = 1  # one program per SM (230 KB of shared memory); 16 heads x 64: 2 splits beat 4 and 8
    elif row_bytes > 1152:
        cfg = {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}
        waves = 4
    elif num_heads >= 64:
        cfg = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
        waves = 1
    else:  # 64 x 8192, 16 heads: 4 splits (2 waves), 3 stages, lazy rescale was the sweep's best
        cfg = {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "LAZY_RESCALE": True}
        waves = 2
    cfg.setdefault("LAZY_RESCALE", False)
    cfg["WS"] = False
    cfg["PAGED"] = cfg["BLOCK_H"] >= 64
    cfg["HOPPER_WS"] = hopper_kernel
    if cfg["PAGED"] and page_size is not None and page_size % cfg["BLOCK_N"] == 0:
        cfg["num_stages"] = 2
    programs = triton.cdiv(num_heads, cfg["BLOCK_H"]) * max(batch, 1)
    cfg["num_kv_splits"] = min(32, max(1, round(waves * _num_sms(device) / programs)))
    return cfg


def _merge_config(default: dict, config: dict | None, allowed: frozenset) -> dict:
    if config is None:
        return default
    unknown = set(config) - allowed
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    return {**default, **config}


def _check_scale(scale: float) -> None:
    # the kernels take the running max of unscaled scores, which needs a positive scale
    if not scale > 0:
        raise ValueError(f"softmax scale must be positive, got {scale}")


def _check_decode_inputs(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, q_per_seq: int = 1,
                         kv_scales: torch.Tensor | None = None) -> None:
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_rope.shape[:2] != q_latent.shape[:2]:
        raise ValueError(f"q_latent [B*Q, H, L] and q_rope [B*Q, H, R] expected, got {tuple(q_latent.shape)} "
                         f"and {tuple(q_rope.shape)}")
    if q_per_seq < 1 or q_latent.shape[0] % q_per_seq:
        raise ValueError(f"{q_latent.shape[0]} query rows are not sequences of q_per_seq = {q_per_seq}")
    latent_dim, rope_dim = q_latent.shape[-1], q_rope.shape[-1]
    if kv_cache.dim() != 2 or kv_cache.shape[1] != latent_dim + rope_dim or latent_dim == 0:
        raise ValueError(f"kv_cache [slots, L + R] = [slots, {latent_dim + rope_dim}] with L > 0 expected, "
                         f"got {tuple(kv_cache.shape)}")
    cache_dtype = q_latent.dtype if kv_scales is None else torch.float8_e4m3fn
    if not (q_latent.dtype == q_rope.dtype and kv_cache.dtype == cache_dtype) or q_latent.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q_latent, q_rope, kv_cache must share one of {_FLOAT_DTYPES} (kv_cache float8_e4m3fn "
                         f"with kv_scales), got {q_latent.dtype}, {q_rope.dtype}, {kv_cache.dtype}")
    if kv_scales is not None:
        _check_scales(kv_scales, kv_cache, latent_dim)
    if q_latent.stride(-1) != 1 or q_rope.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("q_latent, q_rope and kv_cache need a contiguous last dim")
    if kv_indptr.shape != (q_latent.shape[0] // q_per_seq + 1,) or kv_indices.dim() != 1:
        raise ValueError(f"kv_indptr [B + 1] and kv_indices [total] expected, got {tuple(kv_indptr.shape)} "
                         f"and {tuple(kv_indices.shape)}")
    if kv_indptr.dtype not in _INDEX_DTYPES or kv_indices.dtype not in _INDEX_DTYPES:
        raise ValueError(f"kv_indptr/kv_indices must be int32 or int64, got {kv_indptr.dtype}, {kv_indices.dtype}")
    if not (kv_indptr.is_contiguous() and kv_indices.is_contiguous()):
        raise ValueError("kv_indptr and kv_indices must be contiguous")
    if q_latent.shape[0] > _MAX_GRID_YZ:
        raise ValueError(f"at most {_MAX_GRID_YZ} query rows per call, got {q_latent.shape[0]}")
    devices = {t.device for t in (q_latent, q_rope, kv_cache, kv_indptr, kv_indices)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")


def _check_scales(kv_scales: torch.Tensor, kv_cache: torch.Tensor, latent_dim: int) -> None:
    tiles = -(-latent_dim // _SCALE_TILE)
    if kv_scales.dtype != torch.float32 or kv_scales.shape != (kv_cache.shape[0], tiles + 1):
        raise ValueError(f"kv_scales [slots, ceil(L/128) + 1] = [{kv_cache.shape[0]}, {tiles + 1}] float32 expected, "
                         f"got {tuple(kv_scales.shape)} {kv_scales.dtype}")
    if kv_scales.stride(-1) != 1 or kv_scales.device != kv_cache.device:
        raise ValueError("kv_scales needs a contiguous last dim, on the cache's device")


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    *,
    kv_scales: torch.Tensor | None = None,
    page_size: int | None = None,
    config: dict | None = None,
    launch_batch: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode; the contract of ``moeserve.kernels.mla.mla_decode``.

    ``q_latent [B, H, L]``, ``q_rope [B, H, R]`` (any strides, last dim contiguous),
    ``kv_cache [slots, L + R]``, ``kv_indptr [B + 1]`` and ``kv_indices [total]`` (int32/int64,
    on the device) -> ``[B, H, L]`` in q's dtype. ``page_size``: the cache is paged, token ``t``
    of a sequence at slot ``page * page_size + t % page_size``; blocks of tokens are then read
    whole by the copy engine where the tiles allow (``PAGED`` in the config turns that off), and
    on Hopper, with pages of a multiple of 64 slots, the warp-specialised Gluon kernel of
    ``mla_hopper`` runs (heads in blocks of 64, padded; ``HOPPER_WS=False`` turns that off and
    takes the Triton kernels' defaults). ``config`` overrides ``decode_config``; ``launch_batch``
    (default B) is the batch ``decode_config`` sizes the splits for. With ``kv_scales`` the cache
    is FP8 (float8_e4m3fn, ``[slots, ceil(L/128) + 1]`` float32 scales) and its rows are gathered
    and dequantized by the row kernel whatever the page size.
    """
    return mla_verify(q_latent, q_rope, kv_cache, kv_indptr, kv_indices, scale, 1, kv_scales=kv_scales,
                      page_size=page_size, config=config, launch_batch=launch_batch)


def mla_verify(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    q_per_seq: int,
    *,
    kv_scales: torch.Tensor | None = None,
    page_size: int | None = None,
    config: dict | None = None,
    launch_batch: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA with ``Q = q_per_seq`` causal queries per sequence, each sequence's last
    tokens; the contract of ``moeserve.kernels.mla.mla_verify``, ``mla_decode`` at ``Q = 1``.

    ``q_latent [B*Q, H, L]``, ``q_rope [B*Q, H, R]``, ``kv_indptr [B + 1]``; the rest, ``kv_scales``,
    ``page_size`` and ``config`` as for ``mla_decode``. Each query row is a row of the decode grid. The Gluon
    kernel takes ``Q = 1`` only; with more queries the Triton kernels run. ``launch_batch``
    (default B) counts sequences, as for ``mla_decode``: ``decode_config`` sizes the splits for
    ``launch_batch * Q`` rows, the programs such a launch has, so whole sequences of a verify
    batch (with their batch's size) get bitwise the whole's rows, and ``Q = 1`` launches as
    decode does.
    """
    _check_decode_inputs(q_latent, q_rope, kv_cache, kv_indptr, kv_indices, q_per_seq, kv_scales)
    _check_scale(scale)
    if page_size is not None and page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    rows, num_heads, latent_dim = q_latent.shape
    row_bytes = kv_cache.shape[1] * kv_cache.element_size()
    wants_hopper = (config or {}).get("HOPPER_WS", True) and kv_scales is None
    hopper_kernel = wants_hopper and mla_hopper.decode_supported(q_latent, kv_cache, page_size, q_per_seq=q_per_seq)
    launch_rows = (launch_batch or rows // q_per_seq) * q_per_seq
    default = decode_config(launch_rows, num_heads, row_bytes, q_latent.device, page_size, hopper_kernel)
    cfg = _merge_config(default, config, DECODE_CONFIG_KEYS)
    stage_1 = _stage_1(q_latent, q_rope, kv_cache, kv_scales, kv_indptr, kv_indices, scale, q_per_seq, page_size,
                       cfg, hopper_kernel)
    return _split_and_merge(q_latent, cfg["num_kv_splits"], stage_1)


def sparse_mla(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, selected: torch.Tensor,
               scale: float, *, kv_scales: torch.Tensor | None = None, launch_rows: int | None = None,
               config: dict | None = None) -> torch.Tensor:
    """``moeserve.kernels.mla.sparse_mla`` on the GPU: each query row is a sequence of its own
    whose slots are its row of ``selected [T, K]`` (the kept ones first, then ``-1``), read up to
    its count of kept ones; no host sync. ``launch_rows`` (default T) sizes the splits as
    ``launch_batch`` does for ``mla_decode``; ``kv_scales`` as there."""
    rows, top = selected.shape
    indptr = torch.arange(0, (rows + 1) * top, top, dtype=torch.int64, device=selected.device)
    indices = selected.contiguous().view(-1)
    _check_decode_inputs(q_latent, q_rope, kv_cache, indptr, indices, kv_scales=kv_scales)
    _check_scale(scale)
    row_bytes = kv_cache.shape[1] * kv_cache.element_size()
    default = decode_config(launch_rows or rows, q_latent.shape[1], row_bytes, q_latent.device)
    cfg = _merge_config(default, config, DECODE_CONFIG_KEYS)
    lens = (selected >= 0).sum(dim=1, dtype=torch.int32)
    stage_1 = functools.partial(_decode_splits, q_latent, q_rope, kv_cache, indptr, indices, scale, cfg, None, 1,
                                kv_lens=lens, kv_scales=kv_scales)
    return _split_and_merge(q_latent, cfg["num_kv_splits"], stage_1)


def _split_and_merge(q_latent: torch.Tensor, splits: int, stage_1: functools.partial) -> torch.Tensor:
    """Run stage 1 into the output (one split) or into fp32 partials that stage 2 merges."""
    rows, num_heads, latent_dim = q_latent.shape
    out = q_latent.new_empty(rows, num_heads, latent_dim)
    if rows == 0 or num_heads == 0:
        return out
    if splits == 1:  # stage 1 writes the final output; nothing to merge
        stage_1(out, (*out.stride()[:2], 0), out, (0, 0))
        return out
    partial = torch.empty(rows, num_heads, splits, latent_dim, dtype=torch.float32, device=out.device)
    lse = torch.empty(rows, num_heads, splits, dtype=torch.float32, device=out.device)
    stage_1(partial, partial.stride()[:3], lse, lse.stride()[:2])
    _mla_decode_merge_kernel[(num_heads, rows)](
        partial, lse, out, splits,
        *partial.stride()[:3], *lse.stride()[:2], out.stride(0), out.stride(1),
        LATENT=latent_dim, BLOCK_L=_dot_block(latent_dim), BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
    )
    return out


def _stage_1(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, kv_scales: torch.Tensor | None,
             kv_indptr: torch.Tensor, kv_indices: torch.Tensor, scale: float, q_per_seq: int, page_size: int | None,
             cfg: dict, hopper_kernel: bool) -> functools.partial:
    """The split kernel for these inputs and config, waiting for ``(out, out_strides, lse, lse_strides)``:
    the Gluon kernel where it applies and the config has its tiles, else the Triton one."""
    hopper_tiles = (cfg["BLOCK_H"], cfg["BLOCK_N"]) == (mla_hopper.BLOCK_H.value, mla_hopper.BLOCK_N.value)
    if hopper_kernel and cfg["PAGED"] and hopper_tiles:
        return functools.partial(mla_hopper.decode_splits, q_latent, q_rope, kv_cache, kv_indptr, kv_indices,
                                 scale * LOG2E, cfg["num_kv_splits"])
    descriptors = None if kv_scales is not None else _page_descriptors(kv_cache, q_latent.shape[-1], page_size, cfg)
    return functools.partial(_decode_splits, q_latent, q_rope, kv_cache, kv_indptr, kv_indices, scale, cfg,
                             descriptors, q_per_seq, kv_scales=kv_scales)


def _page_descriptors(kv_cache: torch.Tensor, latent_dim: int, page_size: int | None, cfg: dict) -> tuple | None:
    """Copy-engine descriptors of the cache (latent half tiles, rope tiles, ``BLOCK_N`` rows
    each), or None where blocks must be gathered row by row: no page size, pages not a multiple
    of ``BLOCK_N``, head dims the halves cannot take, rows not 16-byte aligned, a GPU before
    Hopper (the interpreter takes them). An FP8 cache never gets here: its rows are gathered."""
    if page_size is None or not cfg["PAGED"] or page_size % cfg["BLOCK_N"]:
        return None
    half, rope_dim = latent_dim // 2, kv_cache.shape[1] - latent_dim

    def fits(dim: int) -> bool:  # a power of two tl.dot takes, within one copy-engine box
        return 16 <= dim <= 256 and triton.next_power_of_2(dim) == dim

    if latent_dim != 2 * half or not (fits(half) and fits(rope_dim)):
        return None
    if not copy_engine_can_read(kv_cache) or kv_cache.shape[0] >= 2**31:  # slots are int32 coordinates
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return (TensorDescriptor.from_tensor(kv_cache, [cfg["BLOCK_N"], half]),
            TensorDescriptor.from_tensor(kv_cache, [cfg["BLOCK_N"], rope_dim]))


def _decode_splits(q_latent: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                   kv_indices: torch.Tensor, scale: float, cfg: dict, descriptors: tuple | None, q_per_seq: int,
                   out: torch.Tensor, out_strides: tuple, lse: torch.Tensor, lse_strides: tuple,
                   kv_lens: torch.Tensor | None = None, kv_scales: torch.Tensor | None = None) -> None:
    """Stage 1 into ``out`` (``[rows, H, splits, L]`` by ``out_strides``) and ``lse``
    (``[rows, H, splits]``), ``q_per_seq`` query rows a sequence, through the copy engine when
    ``descriptors`` are given, by row gathers otherwise (``kv_lens`` and an FP8 cache's
    ``kv_scales``: row gathers only)."""
    rows, num_heads, latent_dim = q_latent.shape
    rope_dim = q_rope.shape[-1]
    splits = cfg["num_kv_splits"]
    grid = (triton.cdiv(num_heads, cfg["BLOCK_H"]), rows, splits)
    common = {"BLOCK_H": cfg["BLOCK_H"], "BLOCK_N": cfg["BLOCK_N"], "SINGLE_SPLIT": splits == 1,
              "Q_PER_SEQ": q_per_seq,
              "LAZY_RESCALE": cfg["LAZY_RESCALE"], "DOT_PRECISION": _dot_precision(q_latent.dtype),
              "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    q_strides = (q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1))
    if descriptors is not None:
        _mla_decode_paged_kernel[grid](
            q_latent, q_rope, *descriptors, kv_indptr, kv_indices, out, lse,
            num_heads, splits, scale * LOG2E, *q_strides, *out_strides, *lse_strides,
            HALF=latent_dim // 2, ROPE=rope_dim, **common,
        )
        return
    block_l = _dot_block(latent_dim)
    fp8 = {}  # the model dtype's cache: SCALE_TILES 0, kv_scales never read
    if kv_scales is not None:
        fp8 = {"SCALE_TILES": kv_scales.shape[1] - 1, "SCALE_W": min(_SCALE_TILE, block_l)}
    _mla_decode_split_kernel[grid](
        q_latent, q_rope, kv_cache, kv_cache if kv_scales is None else kv_scales, kv_indptr, kv_indices,
        kv_indptr if kv_lens is None else kv_lens, out, lse,
        num_heads, splits, scale * LOG2E, *q_strides, kv_cache.stride(0),
        0 if kv_scales is None else kv_scales.stride(0), *out_strides, *lse_strides,
        LATENT=latent_dim, ROPE=rope_dim, BLOCK_L=block_l, BLOCK_R=_dot_block(rope_dim),
        WS=bool(cfg["WS"]), HAS_LENS=kv_lens is not None, **fp8, **common,
    )


# --------------------------------------------------------------------------------------------
# prefill


@triton.jit
def _attend_kv_blocks(
    acc, l_i, m_i, q_1, q_2, k_head, v_head, stride_kt, stride_vt,
    start, end, query_pos, qk_scale,
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online-softmax update over keys ``[start, end)``; ``MASKED`` applies the causal mask
    (key <= query position) and the bound ``key < end`` (``end`` is then the context length
    or the diagonal's end, whichever comes first)."""
    offs_1 = tl.arange(0, D1)
    offs_2 = D1 + tl.arange(0, D2)
    offs_v = tl.arange(0, DV)
    ok_1 = offs_1 < QK_DIM  # all true unless the head dims are padded
    ok_2 = offs_2 < QK_DIM
    ok_v = offs_v < V_DIM
    for n in tl.range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        k_rows = k_head + offs_n.to(tl.int64)[:, None] * stride_kt
        v_rows = v_head + offs_n.to(tl.int64)[:, None] * stride_vt
        key_ok = offs_n < end
        if not MASKED:  # whole block below the diagonal and inside the context
            key_ok = tl.full([BLOCK_N], True, tl.int1)
        k_1 = tl.load(k_rows + offs_1[None, :], mask=key_ok[:, None] & ok_1[None, :], other=0.0)
        k_2 = tl.load(k_rows + offs_2[None, :], mask=key_ok[:, None] & ok_2[None, :], other=0.0)
        v = tl.load(v_rows + offs_v[None, :], mask=key_ok[:, None] & ok_v[None, :], other=0.0)
        qk = tl.dot(q_1, tl.trans(k_1), input_precision=DOT_PRECISION)
        qk = tl.dot(q_2, tl.trans(k_2), qk, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = (offs_n[None, :] <= query_pos[:, None]) & key_ok[None, :]
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)  # log2 domain; qk_scale > 0
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk * qk_scale - m_new[:, None])  # one FMA per score
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _extend_attention_kernel(
    q, k, v, out, seq_info, num_seqs, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    QK_DIM: tl.constexpr, V_DIM: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (query block, head, sequence). ``seq_info [4, B]`` int64 rows: first query token,
    first key token, prefix length, number of new tokens. The qk head dim is tiled as columns
    ``[0, D1)`` and ``[D1, D1 + D2)``, the v head dim as ``[0, DV)``."""
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)  # longest (last) blocks first
    head = tl.program_id(1)
    seq = tl.program_id(2)
    n_new = tl.load(seq_info + 3 * num_seqs + seq).to(tl.int32)
    m0 = m_block * BLOCK_M
    if m0 >= n_new:
        return
    q_start = tl.load(seq_info + seq)
    kv_start = tl.load(seq_info + num_seqs + seq)
    n_prefix = tl.load(seq_info + 2 * num_seqs + seq).to(tl.int32)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_new
    offs_1 = tl.arange(0, D1)
    offs_2 = D1 + tl.arange(0, D2)
    q_rows = q + (q_start + offs_m.to(tl.int64))[:, None] * stride_qt + head * stride_qh
    q_1 = tl.load(q_rows + offs_1[None, :], mask=row_ok[:, None] & (offs_1 < QK_DIM)[None, :], other=0.0)
    q_2 = tl.load(q_rows + offs_2[None, :], mask=row_ok[:, None] & (offs_2 < QK_DIM)[None, :], other=0.0)
    query_pos = n_prefix + offs_m  # absolute positions; a query sees keys <= its position

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV], tl.float32)
    k_head = k + kv_start * stride_kt + head * stride_kh
    v_head = v + kv_start * stride_vt + head * stride_vh
    # keys < n_prefix + m0 + 1 are visible to every row of the block: no mask for whole blocks there
    full_end = (n_prefix + m0 + 1) // BLOCK_N * BLOCK_N
    diag_end = tl.minimum(n_prefix + n_new, n_prefix + m0 + BLOCK_M)
    acc, l_i, m_i = _attend_kv_blocks(acc, l_i, m_i, q_1, q_2, k_head, v_head, stride_kt, stride_vt,
                                      0, full_end, query_pos, qk_scale,
                                      QK_DIM, V_DIM, D1, D2, DV, BLOCK_N, False, DOT_PRECISION)
    acc, l_i, m_i = _attend_kv_blocks(acc, l_i, m_i, q_1, q_2, k_head, v_head, stride_kt, stride_vt,
                                      full_end, diag_end, query_pos, qk_scale,
                                      QK_DIM, V_DIM, D1, D2, DV, BLOCK_N, True, DOT_PRECISION)
    o = acc / l_i[:, None]  # l_i >= 1 for every row: key 0 is always visible
    offs_v = tl.arange(0, DV)
    o_rows = out + (q_start + offs_m.to(tl.int64))[:, None] * stride_ot + head * stride_oh
    tl.store(o_rows + offs_v[None, :], o.to(out.dtype.element_ty), mask=row_ok[:, None] & (offs_v < V_DIM)[None, :])


def split_head_dim(dim: int) -> tuple[int, int]:
    """Tile widths ``(D1, D2)`` of the two dots a qk head dim is multiplied as, both powers of two
    >= 16 with ``D1 + D2 >= dim``: 192 -> (128, 64), 576 -> (512, 64); a power of two is halved,
    128 -> (64, 64); other dims are padded, 40 -> (32, 16)."""
    if triton.next_power_of_2(dim) == dim and dim >= 32:
        return dim // 2, dim // 2
    d1 = max(16, triton.next_power_of_2(dim + 1) // 2)  # the largest power of two <= dim
    return d1, _dot_block(max(dim - d1, 1))


def extend_config(head_dim_qk: int, head_dim_v: int, element_size: int) -> dict:
    """Default launch parameters: Hopper flash-attention forward tiles for 16-bit head dims
    up to qk + v = 384 (DeepSeek's 192 + 128); smaller tiles beyond, and for fp32."""
    if (head_dim_qk + head_dim_v) * element_size <= 768:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    if element_size == 4:  # fp32 products on CUDA cores (no tensor cores): keep the key tiles thin
        return {"BLOCK_M": 64, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def _check_extend_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extend_lens: list[int],
                         prefix_lens: list[int]) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q [T, H, Dqk], k [S, H, Dqk], v [S, H, Dv] expected, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:2] != v.shape[:2] or q.shape[1:] != k.shape[1:] or q.shape[-1] == 0 or v.shape[-1] == 0:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q, k, v must share one of {_FLOAT_DTYPES}, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous last dim")
    if len(extend_lens) != len(prefix_lens) or len(extend_lens) > _MAX_GRID_YZ:
        raise ValueError(f"one extend and prefix length per sequence (at most {_MAX_GRID_YZ}), got "
                         f"{len(extend_lens)} and {len(prefix_lens)}")
    if min(extend_lens, default=0) < 0 or min(prefix_lens, default=0) < 0:
        raise ValueError("lengths must be non-negative")
    if sum(extend_lens) != q.shape[0] or sum(extend_lens) + sum(prefix_lens) != k.shape[0]:
        raise ValueError(f"q holds {q.shape[0]} tokens and k {k.shape[0]}, but the lengths sum to "
                         f"{sum(extend_lens)} new and {sum(extend_lens) + sum(prefix_lens)} in all")
    if q.shape[1] > _MAX_GRID_YZ:
        raise ValueError(f"at most {_MAX_GRID_YZ} heads, got {q.shape[1]}")


def _seq_info(extend_lens: list[int], prefix_lens: list[int], device: torch.device) -> torch.Tensor:
    """``[4, B]`` int64: first query token, first key token, prefix length, new tokens."""
    q_starts, kv_starts, q_at, kv_at = [], [], 0, 0
    for n_new, n_prefix in zip(extend_lens, prefix_lens):
        q_starts.append(q_at)
        kv_starts.append(kv_at)
        q_at += n_new
        kv_at += n_prefix + n_new
    return torch.tensor([q_starts, kv_starts, list(prefix_lens), list(extend_lens)], dtype=torch.int64,
                        device=device)


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extend_lens: list[int],
    prefix_lens: list[int],
    scale: float,
    *,
    config: dict | None = None,
) -> torch.Tensor:
    """Varlen causal prefill with a cached prefix; the contract of
    ``moeserve.kernels.mla.extend_attention``.

    ``q [T, H, Dqk]``, ``k [S, H, Dqk]``, ``v [S, H, Dv]`` (any token/head strides, last dim
    contiguous), host lists of per-sequence lengths -> ``[T, H, Dv]`` in q's dtype.
    ``config`` overrides ``extend_config``.
    """
    _check_extend_inputs(q, k, v, extend_lens, prefix_lens)
    _check_scale(scale)
    num_heads, qk_dim, v_dim = q.shape[1], q.shape[-1], v.shape[-1]
    out = q.new_empty(q.shape[0], num_heads, v_dim)
    max_new = max(extend_lens, default=0)
    if max_new == 0 or num_heads == 0:
        return out
    d1, d2 = split_head_dim(qk_dim)
    cfg = _merge_config(extend_config(qk_dim, v_dim, q.element_size()), config, EXTEND_CONFIG_KEYS)
    seq_info = _seq_info(extend_lens, prefix_lens, q.device)
    grid = (triton.cdiv(max_new, cfg["BLOCK_M"]), num_heads, len(extend_lens))
    _extend_attention_kernel[grid](
        q, k, v, out, seq_info, len(extend_lens), scale * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        QK_DIM=qk_dim, V_DIM=v_dim, D1=d1, D2=d2, DV=_dot_block(v_dim), BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"], DOT_PRECISION=_dot_precision(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out
