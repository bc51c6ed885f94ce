"""Linear layers. Weights are ``[out_features, in_features]`` as in checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def frozen(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialised inference-only parameter; the loader fills it."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = frozen(out_features, in_features)
        self.bias = frozen(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)
