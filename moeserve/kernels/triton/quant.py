"""Per-token-group FP8 quantization in Triton (reference in ``kernels/fp8.py``).

The grid is (row, block of ``BLOCK_G`` groups); a program holds ``[BLOCK_G, group_size]`` values,
takes each group's amax and writes the e4m3 values and the fp32 scales. The arithmetic is the
reference's with correctly rounded divisions, so results match it bit for bit on CPU; on CUDA torch
divides by the 448 scalar as a multiply by its reciprocal, so a scale may differ there by an ulp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moeserve.kernels.fp8 import FP8_DTYPE, FP8_MAX, SCALE_EPS

CONFIG_KEYS = ("BLOCK_G", "num_warps", "DIV_RN")


@triton.jit
def _per_token_group_quant_kernel(
    x_ptr, q_ptr, s_ptr, k, n_groups, x_stride, scale_eps, fp8_max,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_G: tl.constexpr, DIV_RN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * stride can pass 2^31 in long prefills
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    lane = tl.arange(0, GROUP_P)
    cols = groups[:, None] * GROUP + lane[None, :]  # [BLOCK_G, GROUP_P]
    mask = (groups < n_groups)[:, None] & (lane < GROUP)[None, :] & (cols < k)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    # div_rn: Triton's plain fp32 division is approximate, the reference's is not (div_rn does
    # not broadcast, hence the explicit shapes)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), scale_eps)  # [BLOCK_G]
    scale = tl.math.div_rn(amax, tl.full([BLOCK_G], fp8_max, tl.float32))
    if DIV_RN:
        q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], [BLOCK_G, GROUP_P]))
    else:  # fewer instructions; an ulp off at times, which may flip a rounding tie
        q = x * (1.0 / scale)[:, None]
    q = tl.clamp(q, -fp8_max, fp8_max)
    tl.store(q_ptr + row * k + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * n_groups + groups, scale, mask=groups < n_groups)


def default_config(k: int, group_size: int) -> dict:
    """8 groups of 128 per program: 1024 values, 16-byte loads for 4 warps in bf16; exact division."""
    n_groups = triton.cdiv(k, group_size)
    block_g = min(triton.next_power_of_2(n_groups), max(1, 1024 // triton.next_power_of_2(group_size)))
    size = block_g * triton.next_power_of_2(group_size)
    return {"BLOCK_G": block_g, "num_warps": max(1, min(4, size // 256)), "DIV_RN": True}


def per_token_group_quant_fp8(
    x: torch.Tensor, group_size: int = 128, *, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` (last dim contiguous; rows may be strided) -> ``(x_fp8 [..., K]
    float8_e4m3fn, scales [..., ceil(K/g)] float32)``, both contiguous, with
    ``x ≈ x_fp8.float() * scales`` repeated over each group; the last group may be partial."""
    _check(x, group_size)
    k = x.shape[-1]
    n_groups = triton.cdiv(k, group_size)
    q = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(*x.shape[:-1], n_groups, dtype=torch.float32, device=x.device)
    if q.numel() == 0:
        return q, scales
    rows = x.reshape(-1, k)  # a view unless the leading dims cannot merge
    cfg = {**default_config(k, group_size), **(config or {})}
    if set(cfg) - set(CONFIG_KEYS):
        raise ValueError(f"unknown quant config keys {sorted(set(cfg) - set(CONFIG_KEYS))}")
    grid = (rows.shape[0], triton.cdiv(n_groups, cfg["BLOCK_G"]))
    _per_token_group_quant_kernel[grid](
        rows, q, scales, k, n_groups, rows.stride(0), SCALE_EPS, FP8_MAX,
        GROUP=group_size, GROUP_P=triton.next_power_of_2(group_size), BLOCK_G=cfg["BLOCK_G"],
        DIV_RN=bool(cfg["DIV_RN"]), num_warps=cfg["num_warps"],
    )
    return q, scales


def _check(x: torch.Tensor, group_size: int) -> None:
    if x.dim() == 0:
        raise ValueError("x must be [..., K], got a scalar")
    if not x.dtype.is_floating_point or x.dtype == FP8_DTYPE:
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous in its last dim, got strides {x.stride()}")
