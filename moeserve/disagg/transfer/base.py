"""What every KV transfer backend is: a data path that copies byte runs of this rank's registered
buffers into a peer rank's, and the registry that builds one by name (importing its optional
library only then)."""

from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch


class KVPoll(enum.IntEnum):
    """Where a transfer stands. A state only moves forward; ``Failed`` is sticky. Ordered so that
    the minimum over the ranks of a group is the group's state."""

    Failed = 0
    Bootstrapping = 1  # the peer is being looked up / the handshake runs
    WaitingForInput = 2  # handshake done; the prefill side waits for the decode side's page indices
    Transferring = 3
    Success = 4


@dataclass(frozen=True)
class Piece:
    """A contiguous run of ``length`` bytes: from this rank's buffer ``buffer`` at byte ``src`` to the
    peer's buffer of the same index at byte ``dst``."""

    buffer: int
    src: int
    dst: int
    length: int


class TransferBackend(ABC):
    """The data path of one rank. ``buffers`` (contiguous tensors on the CPU or one GPU: the KV
    cache, then the aux records) are registered once, when the backend is made; a prefill rank
    ``connect``s to each decode peer once, then ``write``s pieces without blocking."""

    name: ClassVar[str]

    def __init__(self, buffers: Sequence[torch.Tensor], host: str, ib_device: str | None = None) -> None:
        for b in buffers:
            if not b.is_contiguous():
                raise ValueError("transfer buffers must be contiguous")
        self.buffers, self.host, self.ib_device = list(buffers), host, ib_device

    @abstractmethod
    def descriptor(self) -> dict[str, Any]:
        """Plain data (str, int, bytes, lists, dicts) a peer needs to write into this rank's
        buffers; the decode side sends it to the prefill side in the handshake."""

    @abstractmethod
    def connect(self, peer: str, descriptor: dict[str, Any]) -> None:
        """Prefill side: get ready to write into the buffers ``descriptor`` describes, known from
        now on as ``peer``. Connection set-up happens here, not in the first ``write``. Raises
        on failure."""

    @abstractmethod
    def write(self, peer: str, pieces: list[Piece]) -> object:
        """Start copying ``pieces`` into ``peer``'s buffers; returns a handle at once."""

    @abstractmethod
    def check(self, handle: object) -> KVPoll:
        """``Transferring`` while the copy runs, then ``Success`` (every byte is in the peer's
        memory) or ``Failed`` -- only once no byte of this write can land any more, so that the
        decode side may reuse the pages when it hears of the failure."""

    def progress(self) -> None:
        """Called every few milliseconds by the transfer loop's thread, on both sides: a backend with no
        progress thread of its own advances its transfers and connection set-ups here."""

    def disconnect(self, peer: str) -> None:
        """Forget ``peer`` (it died or left)."""

    def close(self) -> None:
        """Release the registrations and connections."""


_BACKENDS = {
    "fake": "moeserve.disagg.transfer.fake:FakeBackend",
    "torch": "moeserve.disagg.transfer.torch_p2p:TorchBackend",
    "nixl": "moeserve.disagg.transfer.nixl:NixlBackend",
    "mooncake": "moeserve.disagg.transfer.mooncake:MooncakeBackend",
}


def create_backend(name: str, buffers: Sequence[torch.Tensor], host: str,
                   ib_device: str | None = None) -> TransferBackend:
    """The backend ``name``; its library is imported only here."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown transfer backend {name!r}; known: {', '.join(_BACKENDS)}")
    module, cls = _BACKENDS[name].split(":")
    try:
        backend_cls = getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        extra = {"nixl": "nixl", "mooncake": "mooncake"}.get(name)
        hint = f" (pip install 'moeserve[{extra}]')" if extra else ""
        raise ImportError(f"the {name} transfer backend needs a library that is not installed{hint}: {exc}") from exc
    return backend_cls(buffers, host, ib_device)


def tensor_address(t: torch.Tensor) -> int:
    return t.data_ptr()


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
