"""What the Triton kernel tests compare by: relative error against an fp64 reference, its bound
per output dtype, and NaN left in the GPU allocator so that an unwritten output shows."""

from __future__ import annotations

import torch

# relative error bound vs an fp64 reference, by output dtype (a few roundings of the dtype)
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||``; a non-finite output (an unwritten element?) fails outright."""
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output (an unwritten element?)"
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poison_allocator(device: str) -> None:
    """Fill cached allocator blocks with NaN bytes, so outputs the kernel fails to write show up."""
    if device != "cuda":
        return
    for n in (1 << 20, 1 << 26, 1 << 28):
        torch.full((n,), 0xFF, dtype=torch.uint8, device=device)  # 0xFF.. is NaN in every float dtype
