"""Rotary frequencies, with DeepSeek's YaRN context extension."""

from __future__ import annotations

import math

import torch
from torch import nn

from moeserve.config import RopeConfig, yarn_mscale


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """``([dim/2] inverse frequencies, attention factor applied to cos/sin)``."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if rope.kind == "default":
        return 1.0 / pos_freqs, 1.0
    low, high = _yarn_correction_range(rope, dim)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    if rope.mscale and rope.mscale_all_dim:
        factor = yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    else:
        factor = yarn_mscale(rope.factor)
    return inv_freq, float(factor)


def _yarn_correction_range(rope: RopeConfig, dim: int) -> tuple[float, float]:
    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low = math.floor(correction_dim(rope.beta_fast))
    high = math.ceil(correction_dim(rope.beta_slow))
    return max(low, 0), min(high, dim - 1)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, dim: int) -> None:
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(rope, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [T]`` -> ``cos, sin [T, dim/2]`` in fp32."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor
