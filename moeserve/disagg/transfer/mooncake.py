"""The Mooncake Transfer Engine as a data path: RDMA when an IB device is given, TCP otherwise, with
peers found by Mooncake's P2P handshake (no etcd / metadata server).

Every merged piece is its own single-request batch: the Python binding has no non-blocking status
for a multi-request batch (``transfer_check_status`` reads only request 0, and
``get_batch_transfer_status`` blocks until all are done), and over TCP single-request batches were
also the faster of the two. At most ``_WINDOW`` pieces per peer are in flight, because the TCP
transport rejects the excess; ``check`` submits the rest as earlier pieces land, so poll every open
handle until it is done."""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from moeserve.disagg.transfer.base import KVPoll, Piece, TransferBackend, tensor_address, tensor_bytes

# Mooncake logs every connection at INFO; read when the library loads, so set before the import.
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
from mooncake.engine import TransferEngine

# Requests one peer may have queued in the TCP transport before it rejects more.
_WINDOW = int(os.environ.get("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "1024"))
logger = logging.getLogger(__name__)


@dataclass
class _Peer:
    session: str
    buffers: list[tuple[int, int]]  # (base address, bytes), by buffer index
    in_flight: int = 0


@dataclass
class _Transfer:
    """The handle ``write`` returns."""

    peer: _Peer
    todo: deque[tuple[int, int, int]]  # (local address, remote address, bytes) not yet submitted
    live: list[int] = field(default_factory=list)  # batch ids in flight
    failed: bool = False


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Runs contiguous on both sides become one piece: Mooncake's cost is per piece, not per byte."""
    out: list[Piece] = []
    for p in sorted(pieces, key=lambda p: (p.buffer, p.src)):
        last = out[-1] if out else None
        if last and last.buffer == p.buffer and last.src + last.length == p.src and last.dst + last.length == p.dst:
            out[-1] = Piece(p.buffer, last.src, last.dst, last.length + p.length)
        elif p.length:
            out.append(p)
    return out


def _submitted(batch_id: int) -> bool:
    # a refused submit returns 0, or -1 seen as an unsigned 64-bit int
    return 0 < batch_id < 1 << 63


class MooncakeBackend(TransferBackend):
    name = "mooncake"

    def __init__(self, buffers: Sequence[torch.Tensor], host: str, ib_device: str | None = None) -> None:
        super().__init__(buffers, host, ib_device)
        self.engine = TransferEngine()
        protocol = "rdma" if ib_device else "tcp"
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, ib_device or "") != 0:
            raise RuntimeError(f"Mooncake failed to start ({protocol} on {host}, device {ib_device!r})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._local = [(tensor_address(t), tensor_bytes(t)) for t in self.buffers]
        # connect()'s warm-up reads a byte of the peer's into this, so no real buffer is touched
        self._scratch = torch.zeros(1, dtype=torch.uint8)
        regions = [*self._local, (tensor_address(self._scratch), 1)]
        if self.engine.batch_register_memory([a for a, _ in regions], [n for _, n in regions]) != 0:
            raise RuntimeError("Mooncake could not register the transfer buffers")
        self._registered = [a for a, _ in regions]
        self._peers: dict[str, _Peer] = {}

    def descriptor(self) -> dict[str, Any]:
        return {"session": self.session, "buffers": [list(r) for r in self._local]}

    def connect(self, peer: str, descriptor: dict[str, Any]) -> None:
        remote = [(int(a), int(n)) for a, n in descriptor["buffers"]]
        if len(remote) != len(self.buffers):
            raise ValueError(f"peer {peer} has {len(remote)} buffers, this rank {len(self.buffers)}")
        # the first transfer to a session does the handshake and opens the TCP lanes / queue pairs
        if self.engine.transfer_sync_read(descriptor["session"], self._registered[-1], remote[0][0], 1) != 0:
            raise ConnectionError(f"Mooncake could not reach peer {peer} at {descriptor['session']}")
        self._peers[peer] = _Peer(descriptor["session"], remote)

    def write(self, peer: str, pieces: list[Piece]) -> object:
        target = self._peers.get(peer)
        if target is None:
            return KVPoll.Failed
        try:
            todo = deque(self._addresses(target, p) for p in _merge(pieces))
        except ValueError as exc:  # the page indices came from the peer: fail the room, not the thread
            logger.warning("refused a KV write to %s: %s", peer, exc)
            return KVPoll.Failed
        transfer = _Transfer(target, todo)
        self._submit(transfer)
        return transfer

    def check(self, handle: object) -> KVPoll:
        if not isinstance(handle, _Transfer):
            return handle  # type: ignore[return-value]  # write refused it: unknown peer or bad piece
        handle.live = [b for b in handle.live if not self._landed(handle.peer, b, handle)]
        if handle.failed:
            # nothing more starts, but the pieces already out may still land: Failed only once they
            # are over, so the decode side never reuses pages a late piece could still write
            handle.todo = deque()
            return KVPoll.Transferring if handle.live else KVPoll.Failed
        self._submit(handle)
        return KVPoll.Transferring if handle.todo or handle.live else KVPoll.Success

    def disconnect(self, peer: str) -> None:
        self._peers.pop(peer, None)

    def close(self) -> None:
        self._peers.clear()
        if self._registered:
            self.engine.batch_unregister_memory(self._registered)
            self._registered = []

    def _addresses(self, peer: _Peer, p: Piece) -> tuple[int, int, int]:
        """Absolute addresses of ``p``. A bad piece (its offsets come partly from the peer) fails
        here, named, rather than somewhere inside Mooncake."""
        if not 0 <= p.buffer < len(self._local) or min(p.src, p.dst, p.length) < 0:
            raise ValueError(f"{p} is not a piece of any of the {len(self._local)} buffers")
        (src_base, src_len), (dst_base, dst_len) = self._local[p.buffer], peer.buffers[p.buffer]
        if p.src + p.length > src_len or p.dst + p.length > dst_len:
            raise ValueError(f"{p} is outside buffer {p.buffer} ({src_len} bytes here, {dst_len} there)")
        return src_base + p.src, dst_base + p.dst, p.length

    def _submit(self, t: _Transfer) -> None:
        """Start pieces of ``t`` while the peer's queue has room."""
        while t.todo and t.peer.in_flight < _WINDOW:
            batch = self.engine.transfer_submit_write(t.peer.session, *t.todo.popleft())
            if not _submitted(batch):
                t.failed = True
                return
            t.peer.in_flight += 1
            t.live.append(batch)

    def _landed(self, peer: _Peer, batch: int, owner: _Transfer) -> bool:
        """Whether ``batch`` is over (Mooncake frees it then); marks ``owner`` failed if it failed."""
        status = self.engine.transfer_check_status(batch)
        if status == 0:
            return False
        # -2 (timed out): Mooncake keeps the batch, but it is given up on all the same
        peer.in_flight -= 1
        if status < 0:
            owner.failed = True
        return True
