"""What the copy engine (TMA, Hopper and later) asks of a tensor whose tiles it loads."""

from __future__ import annotations

import torch


def copy_engine_can_read(*tensors: torch.Tensor) -> bool:
    """True where tensor descriptors can be made of every tensor's rows (rows along dim -2, the
    last dim contiguous): on a GPU with the copy engine (compute capability 9.0 or later; the
    interpreter takes CPU tensors too), with a 16-byte aligned base and row stride."""
    for t in tensors:
        if t.device.type == "cuda" and torch.cuda.get_device_capability(t.device) < (9, 0):
            return False
        if t.data_ptr() % 16 or (t.stride(-2) * t.element_size()) % 16:
            return False
    return True
