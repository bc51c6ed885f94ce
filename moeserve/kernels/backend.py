"""Which implementation a kernel call runs: the Triton one for CUDA tensors, else the torch one.

Every public function in ``kernels/`` is a torch reference that hands CUDA inputs to its Triton
twin in ``kernels/triton/`` (imported only then, so CPU installs never need Triton).
``set_kernel_backend("torch")`` forces the references everywhere, for comparisons and benchmarks.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch

BACKENDS = ("auto", "torch")
_backend = "auto"


def set_kernel_backend(name: str) -> None:
    """``"auto"``: Triton on CUDA tensors where it is installed; ``"torch"``: references only."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


@contextlib.contextmanager
def kernel_backend(name: str):
    """Run a block with ``set_kernel_backend(name)``, restoring the previous choice after."""
    old = _backend
    set_kernel_backend(name)
    try:
        yield
    finally:
        set_kernel_backend(old)


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    """True when a call on ``t`` should run the Triton implementation."""
    return _backend == "auto" and t.is_cuda and triton_available()
