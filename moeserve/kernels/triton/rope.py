"""Rotary position embedding in Triton (reference in ``kernels/rope.py``).

The grid is (token, block of ``BLOCK_H`` heads). A program loads whole contiguous head rows
(``x`` may be a strided view such as MLA's ``q_rope`` slice of ``q [T, H, 192]``), splits them into
the two halves of each rotation pair in registers, and writes ``[first rotated | second rotated]``.
The rotation is computed in fp32 from fp32 ``cos``/``sin`` (the reference rounds them to x's dtype
first, so the two differ by that rounding, ~2^-9 relative in bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONFIG_KEYS = ("BLOCK_H", "num_warps")


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    n_heads, x_stride_t, x_stride_h, cos_stride, sin_stride, out_stride_t, out_stride_h,
    HALF: tl.constexpr, INTERLEAVE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pair = tl.arange(0, BLOCK_HALF)
    head_ok = (heads < n_heads)[:, None]
    base = x_ptr + t * x_stride_t + heads[:, None].to(tl.int64) * x_stride_h
    if INTERLEAVE:
        # pairs (2i, 2i+1): load whole rows (coalesced) and split even/odd in registers
        dims = tl.arange(0, 2 * BLOCK_HALF)
        row = tl.load(base + dims[None, :], mask=head_ok & (dims < 2 * HALF)[None, :], other=0.0)
        x1, x2 = tl.split(tl.reshape(row.to(tl.float32), [BLOCK_H, BLOCK_HALF, 2]))
    else:
        # pairs (i, i + R/2)
        half_mask = head_ok & (pair < HALF)[None, :]
        x1 = tl.load(base + pair[None, :], mask=half_mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + pair[None, :], mask=half_mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * cos_stride + pair, mask=pair < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * sin_stride + pair, mask=pair < HALF, other=0.0).to(tl.float32)[None, :]
    # a whole row is loaded before any store, so out may be x itself
    out = out_ptr + t * out_stride_t + heads[:, None].to(tl.int64) * out_stride_h + pair[None, :]
    store_mask = head_ok & (pair < HALF)[None, :]
    tl.store(out, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=store_mask)
    tl.store(out + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=store_mask)


def default_config(n_heads: int, rope_dim: int) -> dict:
    """About 8192 elements per program: all 128 heads of DeepSeek's 64 rope dims, 4 warps (the
    H200 sweep's best at 8192 tokens)."""
    block_h = min(triton.next_power_of_2(n_heads), max(1, 8192 // triton.next_power_of_2(rope_dim)))
    return {"BLOCK_H": block_h, "num_warps": max(1, min(4, block_h * rope_dim // 1024))}


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, *, out: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Rotate ``x [T, H, R]`` (last dim contiguous, other strides free) by ``cos, sin [T, R/2]``
    (any float dtype, last dim contiguous). Returns ``[T, H, R]`` in x's dtype laid out as the
    reference's: ``interleave=True`` pairs ``(2i, 2i+1)`` and writes ``[evens | odds]`` rotated;
    ``interleave=False`` pairs ``(i, i + R/2)``. Written to ``out`` (x's shape and dtype, last dim
    contiguous; may be x itself) when given, else to a new contiguous tensor."""
    _check(x, cos, sin)
    n_tokens, n_heads, rope_dim = x.shape
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    elif (out.shape, out.dtype, out.device) != (x.shape, x.dtype, x.device) or (rope_dim > 1 and out.stride(-1) != 1):
        raise ValueError(f"out must be like x {tuple(x.shape)} {x.dtype} with a contiguous last dim, "
                         f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if out.numel() == 0:
        return out
    cfg = {**default_config(n_heads, rope_dim), **(config or {})}
    if set(cfg) - set(CONFIG_KEYS):
        raise ValueError(f"unknown apply_rope config keys {sorted(set(cfg) - set(CONFIG_KEYS))}")
    half = rope_dim // 2
    grid = (n_tokens, triton.cdiv(n_heads, cfg["BLOCK_H"]))
    _rope_kernel[grid](
        x, cos, sin, out, n_heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), out.stride(0), out.stride(1),
        HALF=half, INTERLEAVE=bool(interleave), BLOCK_H=cfg["BLOCK_H"],
        BLOCK_HALF=triton.next_power_of_2(half), num_warps=cfg["num_warps"],
    )
    return out


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [T, H, R] with R even, got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"x must be a floating tensor, got {x.dtype}")
    expected = (x.shape[0], x.shape[-1] // 2)
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != expected:
            raise ValueError(f"{name} must be [T, R/2] = {list(expected)}, got {tuple(t.shape)}")
