"""KV transfer with torch alone, for machines where neither NIXL nor Mooncake is installed.

Between GPUs of one machine the decode rank shares its buffers by CUDA IPC and the prefill rank
copies device to device into them, on a stream of its own, done when its event is. Otherwise each
(prefill rank, decode rank) pair gets a gloo process group of its own, outside any server's world,
rendezvousing through a store the decode rank hosts: a write sends a header (how many pieces, where
each goes) and the pieces' bytes packed into one message; a thread of the decode rank receives it,
scatters the bytes into its buffers and acknowledges, and the write counts as done only on that
acknowledgement, so a finished write means the bytes are in the decode rank's memory (tensors on a
GPU are staged through host memory on this path).
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moeserve.disagg.transfer.base import KVPoll, Piece, TransferBackend

logger = logging.getLogger(__name__)
GROUP_TIMEOUT_S = 120  # a peer that stops answering fails its transfers after this long
# A decode rank's wait for a prefill peer's next write: quiet hours are normal, and a peer that dies
# closes the connection (the wait ends at once); a timeout here would end a healthy pair
IDLE_TIMEOUT_S = 7 * 24 * 3600
DIAL_TIMEOUT_S = 10  # a decode rank's store that does not answer a new pair's dial within this is gone
ACCEPT_POLL_S = 0.01
_TAG = 7


def _byte_views(buffers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [b.view(-1).view(torch.uint8) for b in buffers]


class _Write:
    """One write's state, set by the peer's sender thread."""

    def __init__(self, pieces: list[Piece]) -> None:
        self.pieces, self.state = pieces, KVPoll.Transferring


class _Peer:
    """A prefill rank's link to one decode rank: the pair's group and a thread that sends the
    queued writes in order (gloo completes a send only inside ``wait``, so someone must wait).

    A send that fails fails its write and those queued behind it; the thread then dials the pair
    anew (``dial``), so that a connection lost once does not fail every later room of the pair.
    Writes queued meanwhile wait for it (the transfer timeout bounds them); when the dial fails
    too, the decode rank is gone and the link is dead: later writes fail at once. Nothing here
    blocks the caller of ``write``."""

    def __init__(self, dial: Callable[[], dist.ProcessGroup], byte_views: list[torch.Tensor]) -> None:
        self.dial, self.group, self.bytes = dial, dial(), byte_views
        self.dialling = False
        self.queue: queue.Queue[_Write | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="kv-torch-send")
        self.thread.start()

    def _run(self) -> None:
        while (write := self.queue.get()) is not None:
            try:
                self._send(write.pieces)
                write.state = KVPoll.Success
            except RuntimeError as exc:
                logger.warning("a transfer failed: %s", exc)
                write.state = KVPoll.Failed
                self._fail_queued()
                if not self._redial():
                    self._fail_queued()
                    return

    def _redial(self) -> bool:
        self.dialling = True
        try:
            self.group = self.dial()
        except RuntimeError as exc:  # the decode rank is gone: the heartbeat and timeouts deal with it
            logger.warning("could not reconnect to a decode rank: %s", exc)
            return False
        finally:
            self.dialling = False
        logger.info("reconnected to a decode rank whose pair had broken")
        return True

    def _send(self, pieces: list[Piece]) -> None:
        meta = torch.tensor([[p.buffer, p.dst, p.length] for p in pieces], dtype=torch.int64).view(-1)
        payload = torch.cat([self.bytes[p.buffer][p.src:p.src + p.length].cpu() for p in pieces])
        for t in (torch.tensor([len(pieces)]), meta, payload):
            self.group.send([t], 1, _TAG).wait()
        self.group.recv([torch.empty(1, dtype=torch.int64)], 1, _TAG).wait()  # the decode rank has them

    def _fail_queued(self) -> None:
        while True:
            try:
                write = self.queue.get_nowait()
            except queue.Empty:
                return
            if write is not None:
                write.state = KVPoll.Failed

    def stop(self) -> None:
        self.queue.put(None)


class TorchBackend(TransferBackend):
    name = "torch"

    def __init__(self, buffers: Sequence[torch.Tensor], host: str, ib_device: str | None = None) -> None:
        super().__init__(buffers, host, ib_device)
        self._bytes = _byte_views(self.buffers)
        self._peers: dict[str, _Peer] = {}
        self._store: dist.TCPStore | None = None
        self._threads: list[threading.Thread] = []
        self._inbound: list[dist.ProcessGroup] = []  # decode side: a group per prefill peer
        self._ipc: dict[str, _IpcPeer] = {}  # prefill side: peers whose buffers this process maps
        self._closed = threading.Event()

    # ---- decode side -------------------------------------------------------------------------
    def descriptor(self) -> dict[str, Any]:
        """Start hosting the rendezvous (once) and accepting prefill peers in a thread."""
        if self._store is None:
            listener = socket.create_server((self.host, 0))  # bound to the chosen host only
            port = listener.getsockname()[1]
            self._store = dist.TCPStore(self.host, port, None, True, timedelta(seconds=GROUP_TIMEOUT_S),
                                        wait_for_workers=False, master_listen_fd=listener.detach())
            self._spawn(self._accept_peers)
        out: dict[str, Any] = {"store_host": self.host, "store_port": self._store.port}
        if all(b.is_cuda for b in self.buffers):
            out["cuda_ipc"] = {"machine": _machine_id(), "buffers": [_ipc_handle(b) for b in self.buffers]}
        return out

    def _spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True, name=f"kv-{target.__name__}")
        thread.start()
        self._threads.append(thread)

    def _accept_peers(self) -> None:
        """A prefill peer announces itself by taking the next number from ``peers``."""
        for k in itertools.count():
            while self._store.add("peers", 0) <= k:
                if self._closed.wait(ACCEPT_POLL_S):
                    return
            self._spawn(self._receive_from, k)

    def _receive_from(self, k: int) -> None:
        """Join pair ``k``'s group (in this peer's own thread: a peer that died before joining blocks
        no other), then header, packed bytes, scatter, acknowledge; until the peer goes away."""
        try:
            group = _pair_group(self._store, k, rank=1, timeout_s=IDLE_TIMEOUT_S)
        except RuntimeError as exc:
            logger.info("a prefill peer never joined its transfer group: %s", exc)
            return
        self._inbound.append(group)
        while not self._closed.is_set():
            try:
                count = torch.empty(1, dtype=torch.int64)
                group.recv([count], 0, _TAG).wait()
                meta = torch.empty(int(count) * 3, dtype=torch.int64)
                group.recv([meta], 0, _TAG).wait()
                rows = meta.view(-1, 3).tolist()
                payload = torch.empty(sum(r[2] for r in rows), dtype=torch.uint8)
                group.recv([payload], 0, _TAG).wait()
                self._scatter(rows, payload)
                group.send([torch.ones(1, dtype=torch.int64)], 0, _TAG).wait()
            except RuntimeError as exc:
                if not self._closed.is_set():
                    logger.info("a prefill peer's transfer group ended: %s", exc)
                return

    def _scatter(self, rows: list[list[int]], payload: torch.Tensor) -> None:
        offset = 0
        for buffer, dst, length in rows:
            target = self._bytes[buffer][dst:dst + length]
            target.copy_(payload[offset:offset + length].to(target.device))
            offset += length

    # ---- prefill side ------------------------------------------------------------------------
    def connect(self, peer: str, descriptor: dict[str, Any]) -> None:
        ipc = descriptor.get("cuda_ipc")
        if ipc and ipc["machine"] == _machine_id() and all(b.is_cuda for b in self.buffers):
            self._ipc[peer] = _IpcPeer([_open_ipc(h) for h in ipc["buffers"]], self.buffers[0].device)
            return
        def dial() -> dist.ProcessGroup:  # a new pair with the decode rank: it accepts any number
            store = dist.TCPStore(descriptor["store_host"], int(descriptor["store_port"]), None, False,
                                  timedelta(seconds=DIAL_TIMEOUT_S))
            k = store.add("peers", 1) - 1
            return _pair_group(store, k, rank=0, timeout_s=GROUP_TIMEOUT_S)

        self._peers[peer] = _Peer(dial, self._bytes)

    def write(self, peer: str, pieces: list[Piece]) -> object:
        if peer in self._ipc:
            return self._ipc[peer].write(self._bytes, _merged(pieces))
        write = _Write(_merged(pieces))
        link = self._peers.get(peer)
        if link is None or not link.thread.is_alive():
            write.state = KVPoll.Failed
        else:
            link.queue.put(write)
        return write

    def check(self, handle: object) -> KVPoll:
        if isinstance(handle, torch.cuda.Event):
            return KVPoll.Success if handle.query() else KVPoll.Transferring
        assert isinstance(handle, _Write)
        return handle.state

    def disconnect(self, peer: str) -> None:
        self._ipc.pop(peer, None)
        link = self._peers.pop(peer, None)
        if link is not None:
            link.stop()
            _abort(link.group)
            if not link.dialling:  # a dial cannot be cut short; its thread ends when the dial does
                link.thread.join(timeout=5)

    def close(self) -> None:
        """Stop every thread: a gloo call still blocked when the process exits would abort it."""
        self._closed.set()
        for peer in list(self._peers):
            self.disconnect(peer)
        for group in self._inbound:
            _abort(group)
        for thread in self._threads:
            thread.join(timeout=5)


class _IpcPeer:
    """A decode rank's buffers mapped into this process; writes are device copies on a side stream."""

    def __init__(self, buffers: list[torch.Tensor], device: torch.device) -> None:
        self.buffers, self.stream = buffers, torch.cuda.Stream(device)

    def write(self, src: list[torch.Tensor], pieces: list[Piece]) -> torch.cuda.Event:
        # after whatever was queued on the default stream so far (the prefill that wrote these pages)
        self.stream.wait_stream(torch.cuda.default_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            for p in pieces:
                self.buffers[p.buffer][p.dst:p.dst + p.length].copy_(src[p.buffer][p.src:p.src + p.length],
                                                                      non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done


def _machine_id() -> str:
    """The same for every process of this boot of this machine (CUDA IPC works only within one)."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f"{socket.gethostname()}:{f.read().strip()}"


def _ipc_handle(t: torch.Tensor) -> list[Any]:
    """Plain data another process opens ``t`` (contiguous, on a GPU) from, as bytes."""
    shared = t.untyped_storage()._share_cuda_()
    return [*shared, t.storage_offset() * t.element_size(), t.numel() * t.element_size()]


def _open_ipc(handle: list[Any]) -> torch.Tensor:
    """The bytes of another process's tensor, from ``_ipc_handle``."""
    *shared, offset, nbytes = handle
    storage = torch.UntypedStorage._new_shared_cuda(*shared)
    whole = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", int(shared[0]))).set_(storage)
    return whole[offset:offset + nbytes]


def _abort(group: dist.ProcessGroup) -> None:
    """Make the group's blocked calls return (older torch has no ``abort`` on gloo groups)."""
    abort = getattr(group, "abort", None)
    if abort is not None:
        abort()


def _pair_group(store: dist.Store, k: int, rank: int, timeout_s: float) -> dist.ProcessGroup:
    """The two-rank gloo group of pair ``k`` (prefill rank 0, decode rank 1), outside any world;
    each side's operations give up after its own ``timeout_s``."""
    prefixed = dist.PrefixStore(f"pair/{k}", store)
    return dist.ProcessGroupGloo(prefixed, rank, 2, timedelta(seconds=timeout_s))


def _merged(pieces: list[Piece]) -> list[Piece]:
    """Adjacent pieces of one buffer that are contiguous on both sides, as one."""
    out: list[Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if last and last.buffer == p.buffer and last.src + last.length == p.src and last.dst + last.length == p.dst:
            out[-1] = Piece(p.buffer, last.src, last.dst, last.length + p.length)
        else:
            out.append(p)
    return out
