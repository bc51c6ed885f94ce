"""Linear layers. Weights are ``[out_features, in_features]`` as in checkpoints.

The tensor-parallel ones hold a shard and say, through ``checkpoint_slots``, which rows or
columns of the checkpoint tensor they take; they never communicate themselves: the layer that
owns them decides whether the partial result is all-reduced or reduce-scattered.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.distributed.groups import Group

# where one checkpoint tensor goes: (parameter, index into it, index into the checkpoint tensor)
Slot = tuple[torch.Tensor, tuple, tuple]


def frozen(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialised inference-only parameter; the loader fills it."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def shard_range(total: int, group: Group) -> slice:
    """This rank's contiguous share of ``total`` (which must divide evenly)."""
    if total % group.size:
        raise ValueError(f"a dimension of {total} does not split over {group.size} ranks")
    size = total // group.size
    return slice(group.rank * size, (group.rank + 1) * size)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = frozen(out_features, in_features)
        self.bias = frozen(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """Output features split over ``group``: each rank computes its slice of the outputs."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False) -> None:
        self.rows = shard_range(out_features, group)
        super().__init__(in_features, self.rows.stop - self.rows.start, bias)

    def checkpoint_slots(self) -> dict[str, list[Slot]]:
        slots = {"weight": [(self.weight, (), (self.rows,))]}
        if self.bias is not None:
            slots["bias"] = [(self.bias, (), (self.rows,))]
        return slots


class RowParallelLinear(Linear):
    """Input features split over ``group``: each rank returns a partial sum of the outputs.

    The bias is added on the group's first rank only, so the sum over ranks adds it once.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False) -> None:
        self.cols = shard_range(in_features, group)
        super().__init__(self.cols.stop - self.cols.start, out_features, bias and group.first)
        self.has_checkpoint_bias = bias

    def checkpoint_slots(self) -> dict[str, list[Slot]]:
        slots = {"weight": [(self.weight, (), (slice(None), self.cols))]}
        if self.has_checkpoint_bias:
            slots["bias"] = [(self.bias, (), ())] if self.bias is not None else []
        return slots
