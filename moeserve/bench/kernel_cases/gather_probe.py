"""A read-only probe for the MLA decode sweep: the decode kernel's row gather without its math."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gather_read_kernel(cache, kv_indices, out, context, chunk, stride_kv,
                       LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Read split ``program_id(1)`` of sequence ``program_id(0)``'s cache rows as the decode
    kernel gathers them (latent and rope parts, power-of-two widths) and only add them up: the
    bandwidth the gather alone reaches. ``out`` gets one ``LATENT + ROPE`` row per program."""
    seq = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * chunk
    hi = tl.minimum(lo + chunk, context)
    offs_l = tl.arange(0, LATENT)
    offs_r = tl.arange(0, ROPE)
    acc_l = tl.zeros([LATENT], tl.float32)
    acc_r = tl.zeros([ROPE], tl.float32)
    for n in tl.range(lo, hi, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        ok = offs_n < hi
        rows = cache + tl.load(kv_indices + seq * context + offs_n, mask=ok, other=0).to(tl.int64)[:, None] * stride_kv
        acc_l += tl.sum(tl.load(rows + offs_l[None, :], mask=ok[:, None], other=0.0).to(tl.float32), 0)
        acc_r += tl.sum(tl.load(rows + LATENT + offs_r[None, :], mask=ok[:, None], other=0.0).to(tl.float32), 0)
    base = out + (seq * tl.num_programs(1) + tl.program_id(1)) * (LATENT + ROPE)
    tl.store(base + offs_l, acc_l)
    tl.store(base + LATENT + offs_r, acc_r)
