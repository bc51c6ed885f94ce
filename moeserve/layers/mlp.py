from __future__ import annotations

import torch
from torch import nn

from moeserve.distributed.groups import Group
from moeserve.distributed.groups import single as single_groups
from moeserve.kernels.activation import silu_and_mul
from moeserve.layers.linear import Linear, RowParallelLinear, Slot, shard_range


class MLP(nn.Module):
    """SwiGLU feed-forward (dense layers, shared experts), intermediate split over ``group``.

    With a group of several ranks the output is a partial sum: the caller reduces it.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, group: Group | None = None,
                 fp8: bool = False) -> None:
        super().__init__()
        group = group or single_groups().world
        self.shard = shard_range(intermediate_size, group)
        local = self.shard.stop - self.shard.start
        # gate_proj and up_proj stacked so one GEMM computes both
        self.gate_up_proj = Linear(hidden_size, 2 * local, fp8=fp8)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, group, fp8=fp8)

    def checkpoint_slots(self) -> dict[str, list[Slot]]:
        weight, local = self.gate_up_proj.weight, self.shard.stop - self.shard.start
        return {
            "gate_proj.weight": [(weight, (slice(0, local),), (self.shard,))],
            "up_proj.weight": [(weight, (slice(local, 2 * local),), (self.shard,))],
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
