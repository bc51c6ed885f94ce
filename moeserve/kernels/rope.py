"""Rotary position embedding as DeepSeek applies it to the decoupled rope dimensions."""

from __future__ import annotations

import torch

from moeserve.kernels.backend import use_triton


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x [T, H, R]`` by ``cos, sin [T, R/2]`` (one angle per pair of dimensions).

    ``interleave=True`` pairs dimensions ``(0,1), (2,3), …`` as DeepSeek's checkpoints do and
    writes the result de-interleaved (``[evens | odds]``); queries and keys get the same layout,
    so their dot products are unchanged. ``interleave=False`` pairs ``(i, i + R/2)``. With
    ``out`` (x's shape and dtype; may be x itself, rotating in place) the result goes there.
    """
    if use_triton(x):
        from moeserve.kernels.triton import rope as triton_rope

        return triton_rope.apply_rope(x, cos, sin, interleave, out=out)
    result = apply_rope_ref(x, cos, sin, interleave)
    return result if out is None else out.copy_(result)


def apply_rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The torch version of ``apply_rope``."""
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    cos = cos.unsqueeze(-2).to(x.dtype)  # [T, 1, R/2]
    sin = sin.unsqueeze(-2).to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
