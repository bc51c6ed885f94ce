"""RMSNorm, optionally fused with the residual add."""

from __future__ import annotations

import torch

from moeserve.kernels.backend import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., D]``, ``weight [D]`` -> ``[..., D]`` in x's dtype; statistics in fp32."""
    if use_triton(x):
        from moeserve.kernels.triton import norm as triton_norm

        return triton_norm.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(rms_norm(x + residual), x + residual)``; the second is the new residual.
    Both are new tensors: ``x`` and ``residual`` are left untouched."""
    if use_triton(x):
        from moeserve.kernels.triton import norm as triton_norm

        return triton_norm.fused_add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch version of ``rms_norm``."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch version of ``fused_add_rms_norm``."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual
