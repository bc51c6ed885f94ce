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
from moeserve.kernels import fp8

# where one checkpoint tensor goes: (parameter, index into it, index into the checkpoint tensor)
Slot = tuple[torch.Tensor, tuple, tuple]


def frozen(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialised inference-only parameter; the loader fills it."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def frozen_fp8(*shape: int) -> tuple[nn.Parameter, nn.Parameter]:
    """An FP8 weight ``[..., N, K]`` and its 128x128 block scales ``[..., ceil(N/128),
    ceil(K/128)]``; the weight knows its scales (``weight.scale_inv``) so the loader fills both."""
    *lead, n, k = shape
    weight = frozen(*shape, dtype=fp8.FP8_DTYPE)
    weight.scale_inv = frozen(*lead, -(-n // fp8.FP8_BLOCK), -(-k // fp8.FP8_BLOCK), dtype=torch.float32)
    return weight, weight.scale_inv


def shard_range(total: int, group: Group) -> slice:
    """This rank's contiguous share of ``total`` (which must divide evenly)."""
    if total % group.size:
        raise ValueError(f"a dimension of {total} does not split over {group.size} ranks")
    size = total // group.size
    return slice(group.rank * size, (group.rank + 1) * size)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]`` times an FP8 ``weight [N, K]`` with 128x128 block scales ``scale_inv``;
    the activations are quantized per 1x128 group on the way in (DeepSeek-V3's w8a8 scheme).
    Returns ``[..., N]`` in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    x_fp8, x_scale = fp8.per_token_group_quant_fp8(rows, fp8.FP8_BLOCK)
    out = fp8.fp8_block_gemm(x_fp8, x_scale, weight, scale_inv, out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], out.shape[-1])


class Linear(nn.Module):
    """``y = x W^T + b``. With ``fp8=True`` (or after ``quantize_fp8_``) the weight is FP8 e4m3
    with a ``weight_scale_inv`` per 128x128 block, and the matmul runs in FP8."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, fp8: bool = False) -> None:
        super().__init__()
        self.weight_scale_inv: nn.Parameter | None = None
        if fp8:
            self.weight, self.weight_scale_inv = frozen_fp8(out_features, in_features)
        else:
            self.weight = frozen(out_features, in_features)
        self.bias = frozen(out_features) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is not None:
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.bias)
        return F.linear(x, self.weight, self.bias)

    def quantize_fp8_(self) -> None:
        """Replace the loaded weight by its FP8 block quantization (frees the original)."""
        w_fp8, scale_inv = fp8.block_quant_fp8(self.weight.data, (fp8.FP8_BLOCK, fp8.FP8_BLOCK))
        self.weight = nn.Parameter(w_fp8, requires_grad=False)
        self.weight_scale_inv = self.weight.scale_inv = nn.Parameter(scale_inv, requires_grad=False)


class ColumnParallelLinear(Linear):
    """Output features split over ``group``: each rank computes its slice of the outputs."""

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False,
                 fp8: bool = False) -> None:
        self.rows = shard_range(out_features, group)
        super().__init__(in_features, self.rows.stop - self.rows.start, bias, fp8)

    def checkpoint_slots(self) -> dict[str, list[Slot]]:
        slots = {"weight": [(self.weight, (), (self.rows,))]}
        if self.bias is not None:
            slots["bias"] = [(self.bias, (), (self.rows,))]
        return slots


class RowParallelLinear(Linear):
    """Input features split over ``group``: each rank returns a partial sum of the outputs.

    The bias is added on the group's first rank only, so the sum over ranks adds it once.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, bias: bool = False,
                 fp8: bool = False) -> None:
        self.cols = shard_range(in_features, group)
        super().__init__(self.cols.stop - self.cols.start, out_features, bias and group.first, fp8)
        self.has_checkpoint_bias = bias

    def checkpoint_slots(self) -> dict[str, list[Slot]]:
        slots = {"weight": [(self.weight, (), (slice(None), self.cols))]}
        if self.has_checkpoint_bias:
            slots["bias"] = [(self.bias, (), ())] if self.bias is not None else []
        return slots
