from __future__ import annotations

import torch
from torch import nn

from moeserve.kernels.activation import silu_and_mul
from moeserve.layers.linear import Linear


class MLP(nn.Module):
    """SwiGLU feed-forward: dense layers and shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        # gate_proj and up_proj stacked so one GEMM computes both
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.intermediate_size = intermediate_size

    def checkpoint_slots(self) -> dict[str, list[tuple[torch.Tensor, tuple]]]:
        inter, weight = self.intermediate_size, self.gate_up_proj.weight
        return {
            "gate_proj.weight": [(weight, (slice(0, inter),))],
            "up_proj.weight": [(weight, (slice(inter, 2 * inter),))],
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
