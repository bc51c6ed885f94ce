from __future__ import annotations

import torch
from torch import nn

from moeserve.kernels.norm import fused_add_rms_norm, rms_norm
from moeserve.layers.linear import frozen


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = frozen(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without ``residual``: the normalised ``x``. With it: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
