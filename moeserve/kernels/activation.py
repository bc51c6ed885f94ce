"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moeserve.kernels.backend import use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``x [..., 2I]`` holding ``[gate | up]`` -> ``silu(gate) * up`` of shape ``[..., I]``."""
    if use_triton(x):
        from moeserve.kernels.triton import activation as triton_activation

        return triton_activation.silu_and_mul(x)
    return silu_and_mul_ref(x)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The torch version of ``silu_and_mul``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
