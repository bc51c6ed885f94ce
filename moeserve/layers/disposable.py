"""Activations freed at a chosen point, whatever else still refers to them.

The reference deployment cuts the MoE's peak activation memory by freeing large buffers (the
MoE input once dispatch and the shared experts have read it, the dispatched tokens once the
experts have) as soon as the op that owns them is done, instead of when the last Python
reference goes. ``DisposableTensor.dispose`` resizes the tensor's storage to 0 bytes, which
hands the memory back to the allocator at once (on CUDA in stream order, as any free: a tensor
that another stream still reads must have been recorded on it, as NCCL and DeepEP do).

Contract:

- ``DisposableTensor.wrap(t, label)`` takes ``t`` over: the caller keeps only the wrapper. It
  refuses (returns ``t`` unchanged, so ``dispose`` leaves it alone) a tensor that is a window onto
  a larger storage or whose storage cannot be resized: freeing that would free bytes that others use.
- Ops on a ``DisposableTensor`` return plain tensors, so the subclass does not spread through
  the model, and only ops on the wrapper itself pay its ``__torch_function__`` (a flag check and
  a storage comparison, a few microseconds). The one exception is a result that shares its
  storage (a view, ``reshape`` without a copy, ``split``...): that comes back as a
  ``DisposableTensor`` sharing the wrapper's fate.
- ``dispose`` frees the storage, so it ends the wrapper and every view of it at once, whichever
  of them it is called on. After it any op, method, indexing or printing of any of them raises
  ``RuntimeError`` naming the label; metadata (shape, dtype, device, ...) stays readable.
  A plain alias made before ``wrap`` (or by code that reads the data pointer directly, such as a
  C++ extension that kept the tensor) is not guarded: it reads freed memory.
- ``dispose`` does nothing while a CUDA stream capture is in progress (freeing inside a captured
  graph would let later captured kernels reuse bytes the replay still needs), for plain tensors,
  and inside ``disposal_enabled(False)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

_enabled = True  # flipped only by ``disposal_enabled``


@contextlib.contextmanager
def disposal_enabled(enabled: bool) -> Iterator[None]:
    """Run a block with ``dispose`` freeing (True, the default) or doing nothing (False), as a
    reference run; restores the previous setting after."""
    global _enabled
    old, _enabled = _enabled, enabled
    try:
        yield
    finally:
        _enabled = old


@dataclass
class _Fate:
    """Shared by a ``DisposableTensor`` and its views: one storage, disposed once for all."""

    label: str
    storage_ptr: int  # 0 for an empty storage: then no result counts as a view
    disposed: bool = False


# what may still be read of a disposed tensor: metadata, never the bytes
_METADATA = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.size, torch.Tensor.dim,
    torch.Tensor.numel, torch.Tensor.element_size, torch.Tensor.untyped_storage,
})


class DisposableTensor(torch.Tensor):
    """A tensor whose ``dispose()`` frees its storage now, even while other references exist;
    any later use raises. See the module docstring for the contract."""

    _fate: _Fate

    @staticmethod
    def wrap(t: torch.Tensor, label: str) -> torch.Tensor:
        """``t`` as a ``DisposableTensor`` named ``label`` (in errors); ``t`` itself when it is one
        already, or when it does not own its whole resizable storage (then it stays plain)."""
        if isinstance(t, DisposableTensor):
            return t
        storage = t.untyped_storage()
        if t.storage_offset() != 0 or t.numel() * t.element_size() != storage.nbytes() or not storage.resizable():
            return t
        return _adopt(t, _Fate(label, storage.data_ptr()))

    @property
    def label(self) -> str:
        return self._fate.label

    @property
    def is_disposed(self) -> bool:
        return self._fate.disposed

    def dispose(self) -> None:
        """Free the storage (of this tensor and all its views) now; see ``dispose`` for when not."""
        fate = self._fate
        if fate.disposed or not _enabled:
            return
        with torch._C.DisableTorchFunctionSubclass():
            if self.is_cuda and torch.cuda.is_current_stream_capturing():
                return
            self.untyped_storage().resize_(0)
        fate.disposed = True

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not all(issubclass(cls, t) for t in types):
            return NotImplemented
        fates = _fates(args, kwargs)
        for fate in fates:
            if fate.disposed and func not in _METADATA:
                raise RuntimeError(f"tensor {fate.label!r} was disposed (its memory freed) and must not be "
                                   f"used any more; called {getattr(func, '__name__', func)!s} on it")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
            return _track_views(out, fates)


def dispose(t: torch.Tensor | None, keep: Iterable[torch.Tensor | None] = ()) -> bool:
    """Free ``t`` now if it is a ``DisposableTensor`` and shares no storage with any tensor in
    ``keep`` (what the caller still needs); plain tensors and ``None`` are left alone.
    Returns whether ``t`` is disposed afterwards."""
    if not isinstance(t, DisposableTensor):
        return False
    if any(k is not None and _storage_ptr(k) == t._fate.storage_ptr != 0 for k in keep):
        return t.is_disposed
    t.dispose()
    return t.is_disposed


def is_disposed(t: torch.Tensor | None) -> bool:
    """True for a ``DisposableTensor`` (or view of one) whose storage was freed."""
    return isinstance(t, DisposableTensor) and t.is_disposed


def _adopt(t: torch.Tensor, fate: _Fate) -> DisposableTensor:
    out = t.as_subclass(DisposableTensor)
    out._fate = fate
    return out


def _storage_ptr(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return t.untyped_storage().data_ptr()


def _fates(args: tuple, kwargs: dict) -> list[_Fate]:
    """The fates of the ``DisposableTensor`` arguments (also inside a list, as ``torch.cat`` takes)."""
    fates = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, DisposableTensor):
            fates.append(a._fate)
        elif isinstance(a, (list, tuple)):
            fates.extend(b._fate for b in a if isinstance(b, DisposableTensor))
    return fates


def _track_views(out: object, fates: list[_Fate]) -> object:
    """``out`` with each plain tensor that shares a storage of ``fates`` made a ``DisposableTensor``."""
    if type(out) is torch.Tensor:
        ptr = out.untyped_storage().data_ptr()
        for fate in fates:
            if ptr == fate.storage_ptr != 0:
                return _adopt(out, fate)
        return out
    if isinstance(out, (list, tuple)) and out and type(out[0]) is torch.Tensor:
        return type(out)(_track_views(o, fates) for o in out)  # list, tuple or torch.return_types
    return out

