"""RMSNorm, optionally fused with the residual add, in Triton (references in ``kernels/norm.py``).

One program normalises ``BLOCK_R`` whole rows held in registers (statistics in fp32), so a row is
read once and written once. Rows may be strided views (MLA's ``q_a``/latent splits): only the
last dimension must be contiguous. Outputs are fresh contiguous tensors, as the reference's are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CONFIG_KEYS = ("BLOCK_R", "num_warps")


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    n_rows, dim, x_stride, res_stride, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows < n_rows)[:, None] & (cols < dim)[None, :]
    rows = rows.to(tl.int64)  # rows * stride can pass 2^31 in long prefills
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
        # the reference rounds the sum to the residual dtype and takes statistics of that
        x = (x.to(tl.float32) + r.to(tl.float32)).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + rows[:, None] * dim + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / dim + eps)  # [BLOCK_R]
    # as in the reference: normalise, round to the activation dtype, then scale by the weight
    y = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * dim + cols[None, :], (y * w[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def default_config(dim: int) -> dict:
    """Whole rows per program; short rows are batched so a program moves at least ~4 KB."""
    block_d = triton.next_power_of_2(dim)
    block_r = max(1, min(16, 2048 // block_d))
    return {"BLOCK_R": block_r, "num_warps": max(1, min(8, block_r * block_d // 512))}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, config: dict | None = None) -> torch.Tensor:
    """``x [..., D]`` (last dim contiguous), ``weight [D]`` -> ``[..., D]`` contiguous, in the
    promoted dtype of x and weight (x's dtype when they match); statistics in fp32."""
    rows = _as_rows(x, "x")
    _check_weight(weight, x)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch(rows, None, weight, out, None, eps, config)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, config: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x, residual [..., D]`` -> ``(rms_norm(x + residual), x + residual)``, both fresh tensors;
    the inputs are left untouched. The sum is rounded to the promoted dtype of x and residual."""
    if residual.shape != x.shape:
        raise ValueError(f"residual has shape {tuple(residual.shape)}, x has {tuple(x.shape)}")
    if residual.device != x.device:
        raise ValueError(f"residual is on {residual.device}, x on {x.device}")
    rows, res_rows = _as_rows(x, "x"), _as_rows(residual, "residual")
    _check_weight(weight, x)
    res_dtype = torch.promote_types(x.dtype, residual.dtype)
    new_res = torch.empty(x.shape, dtype=res_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(res_dtype, weight.dtype), device=x.device)
    _launch(rows, res_rows, weight, out, new_res, eps, config)
    return out, new_res


def _launch(
    rows: torch.Tensor, res_rows: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
    new_res: torch.Tensor | None, eps: float, config: dict | None,
) -> None:
    n_rows, dim = rows.shape
    if n_rows == 0 or dim == 0:
        return
    cfg = _config(dim, config)
    has_res = res_rows is not None
    grid = (triton.cdiv(n_rows, cfg["BLOCK_R"]),)
    _rms_norm_kernel[grid](
        rows, res_rows if has_res else rows, weight, out, new_res if has_res else out,
        n_rows, dim, rows.stride(0), res_rows.stride(0) if has_res else 0, float(eps),
        HAS_RESIDUAL=has_res, BLOCK_R=cfg["BLOCK_R"], BLOCK_D=triton.next_power_of_2(dim),
        num_warps=cfg["num_warps"],
    )


def _config(dim: int, override: dict | None) -> dict:
    cfg = {**default_config(dim), **(override or {})}
    unknown = set(cfg) - set(CONFIG_KEYS)
    if unknown:
        raise ValueError(f"unknown rms_norm config keys {sorted(unknown)}; known: {CONFIG_KEYS}")
    return cfg


def _as_rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """``x [..., D]`` as ``[rows, D]`` with one row stride: a view for row-strided inputs (a copy
    only when the leading dims cannot merge)."""
    if x.dim() == 0:
        raise ValueError(f"{name} must have a feature dimension, got a scalar")
    if not x.dtype.is_floating_point:
        raise ValueError(f"{name} must be a floating tensor, got {x.dtype}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {x.stride()}")
    return x.reshape(-1, x.shape[-1])


def _check_weight(weight: torch.Tensor, x: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if weight.stride(0) != 1 and weight.shape[0] > 1:
        raise ValueError("weight must be contiguous")
