"""An in-process data path for unit tests of the queues: "peers" are buffers registered in this
process, and a write is a synchronous copy. It moves real bytes, but never between processes."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import Any

import torch

from moeserve.disagg.transfer.base import KVPoll, Piece, TransferBackend

_REGISTRY: dict[int, list[torch.Tensor]] = {}
_IDS = itertools.count(1)
_LOCK = threading.Lock()


class _HeldWrite:
    def __init__(self, peer: str, pieces: list[Piece]) -> None:
        self.peer, self.pieces = peer, pieces


class FakeBackend(TransferBackend):
    name = "fake"

    def __init__(self, buffers: Sequence[torch.Tensor], host: str, ib_device: str | None = None) -> None:
        super().__init__(buffers, host, ib_device)
        with _LOCK:
            self.id = next(_IDS)
            _REGISTRY[self.id] = self.buffers
        self._peers: dict[str, list[torch.Tensor]] = {}
        self.fail_writes = False  # tests flip this to inject a failed transfer
        self.hold_writes = False  # ... or to keep writes in flight until they flip it back

    def descriptor(self) -> dict[str, Any]:
        return {"fake_id": self.id}

    def connect(self, peer: str, descriptor: dict[str, Any]) -> None:
        with _LOCK:
            if descriptor.get("fake_id") not in _REGISTRY:
                raise ConnectionError(f"no fake peer {descriptor!r} in this process")
            self._peers[peer] = _REGISTRY[descriptor["fake_id"]]

    def write(self, peer: str, pieces: list[Piece]) -> object:
        if self.fail_writes or peer not in self._peers:
            return KVPoll.Failed
        return _HeldWrite(peer, pieces) if self.hold_writes else self._copy(peer, pieces)

    def _copy(self, peer: str, pieces: list[Piece]) -> KVPoll:
        for p in pieces:
            src = self.buffers[p.buffer].view(-1).view(torch.uint8)
            dst = self._peers[peer][p.buffer].view(-1).view(torch.uint8)
            dst[p.dst:p.dst + p.length].copy_(src[p.src:p.src + p.length])
        return KVPoll.Success

    def check(self, handle: object) -> KVPoll:
        if isinstance(handle, _HeldWrite):
            if self.hold_writes:
                return KVPoll.Transferring
            return self._copy(handle.peer, handle.pieces) if handle.peer in self._peers else KVPoll.Failed
        return handle  # type: ignore[return-value]

    def disconnect(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def close(self) -> None:
        with _LOCK:
            _REGISTRY.pop(self.id, None)
