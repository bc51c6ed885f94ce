"""The NIXL data path: each rank registers its buffers with one NIXL agent (UCX backend); a prefill
rank loads a decode rank's agent metadata and WRITEs byte runs straight into its buffers, one-sided,
so the decode rank spends no work on it. UCX picks the transport: RDMA or NVLink between GPUs,
cross-process copy between DRAM buffers on one host."""

from __future__ import annotations

import ipaddress
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moeserve.disagg.transfer.base import KVPoll, Piece, TransferBackend, tensor_address, tensor_bytes

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0


@dataclass
class _Write:
    """One posted transfer; ``xfer`` is dropped once NIXL has released it."""

    xfer: Any
    state: KVPoll


class NixlBackend(TransferBackend):
    name = "nixl"

    def __init__(self, buffers: Sequence[torch.Tensor], host: str, ib_device: str | None = None) -> None:
        super().__init__(buffers, host, ib_device)
        if not ib_device:
            # With ibverbs-providers installed, every process that made an agent crashed at exit
            # (SIGSEGV); with no IB device asked for, UCX needs no ib transports. UCX reads this
            # when the agent loads it, so it is set before the agent exists; setdefault leaves an
            # operator's own UCX_MODULES alone.
            os.environ.setdefault("UCX_MODULES", "^ib")
        if _is_loopback(host):
            # UCX listens on every network device it may use: on a loopback deployment only ``lo``,
            # so that no port of this server opens on another interface (as every listener of moeserve)
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        from nixl._api import nixl_agent, nixl_agent_config

        # Random suffix, not a counter: a restarted peer may reuse a pid while the prefill side
        # still holds the old agent under that name.
        self.agent_name = f"moeserve-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        # No progress thread: NIXL's busy-polls a core per agent (two agents idle took both cores of
        # a 2-core machine, and the engine crawled); ``progress`` advances the agent instead.
        self.agent = nixl_agent(self.agent_name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend("UCX", {"ucx_devices": ib_device} if ib_device else {})
        device = self.buffers[0].device if self.buffers else torch.device("cpu")
        self.mem_type = "VRAM" if device.type == "cuda" else "DRAM"
        # A byte peers READ to wire the connection up at connect time without touching real data.
        self._scratch = torch.zeros(1, dtype=torch.uint8, device=device)
        self._registered = self.agent.register_memory(self.buffers + [self._scratch])
        self._regions = [_region(b) for b in self.buffers]
        self._peers: dict[str, dict[str, Any]] = {}  # peer -> its descriptor
        self._posted: dict[int, _Write] = {}  # unfinished transfers, for close to cancel

    def progress(self) -> None:
        self.agent.get_new_notifs()  # drives the UCX worker: connection set-up, peers' one-sided writes

    def descriptor(self) -> dict[str, Any]:
        return {"agent": self.agent_name, "metadata": self.agent.get_agent_metadata(), "mem_type": self.mem_type,
                "regions": self._regions, "scratch": _region(self._scratch)}

    def connect(self, peer: str, descriptor: dict[str, Any]) -> None:
        self.disconnect(peer)
        if len(descriptor["regions"]) != len(self.buffers):  # a piece names the same buffer on both sides
            raise ConnectionError(f"{peer!r} has {len(descriptor['regions'])} buffers, this rank {len(self.buffers)}")
        try:
            self.agent.add_remote_agent(descriptor["metadata"])
            self._peers[peer] = descriptor
            self._warm_up(descriptor)
        except Exception as exc:
            self.disconnect(peer)
            raise ConnectionError(f"NIXL could not connect to {peer!r}: {exc}") from exc

    def _warm_up(self, remote: dict[str, Any]) -> None:
        """READ the peer's scratch byte and wait for it, so the endpoint is wired up now and not in
        the first write. Not make_connection: it only starts the wire-up, and the first write
        still paid for it."""
        read = self._post("READ", [_offset(_region(self._scratch), 0, 1)], [_offset(remote["scratch"], 0, 1)], remote)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while self.check(read) is KVPoll.Transferring:
            if time.monotonic() > deadline:
                self._finish(read, KVPoll.Failed)
                raise TimeoutError(f"the warm-up read took over {CONNECT_TIMEOUT_S:.0f} s")
            time.sleep(0.0005)
        if read.state is not KVPoll.Success:
            raise ConnectionError("the warm-up read failed")

    def write(self, peer: str, pieces: list[Piece]) -> object:
        remote = self._peers.get(peer)
        if remote is None:
            return _Write(None, KVPoll.Failed)
        runs = merge_runs(pieces)
        if not runs:
            return _Write(None, KVPoll.Success)
        local = [_offset(self._regions[p.buffer], p.src, p.length) for p in runs]
        far = [_offset(remote["regions"][p.buffer], p.dst, p.length) for p in runs]
        return self._post("WRITE", local, far, remote)

    def _post(self, op: str, local: list[tuple[int, int, int]], far: list[tuple[int, int, int]],
              remote: dict[str, Any]) -> _Write:
        try:
            xfer = self.agent.initialize_xfer(op, self.agent.get_xfer_descs(local, self.mem_type),
                                              self.agent.get_xfer_descs(far, remote["mem_type"]), remote["agent"])
        except Exception as exc:  # noqa: BLE001 -- NIXL raises on runs outside the registrations, a lost agent
            logger.warning("NIXL could not prepare a %s of %d runs to %s: %r", op, len(local), remote["agent"], exc)
            return _Write(None, KVPoll.Failed)
        handle = _Write(xfer, KVPoll.Transferring)
        self._posted[id(handle)] = handle
        self._advance(handle, lambda: self.agent.transfer(xfer))
        return handle

    def check(self, handle: object) -> KVPoll:
        assert isinstance(handle, _Write)
        if handle.state is KVPoll.Transferring:
            self._advance(handle, lambda: self.agent.check_xfer_state(handle.xfer))
        return handle.state

    def _advance(self, handle: _Write, poll: Callable[[], str]) -> None:
        try:
            state = poll()  # "DONE", "PROC" or "ERR"
        except Exception as exc:  # noqa: BLE001 -- NIXL raises instead for some errors (a lost peer)
            logger.warning("a NIXL transfer failed: %r", exc)
            state = "ERR"
        if state != "PROC":
            self._finish(handle, KVPoll.Success if state == "DONE" else KVPoll.Failed)

    def _finish(self, handle: _Write, state: KVPoll) -> None:
        handle.state = state
        self._posted.pop(id(handle), None)
        xfer, handle.xfer = handle.xfer, None
        self.agent.release_xfer_handle(xfer)  # cancels it if it still runs (or raises)

    def disconnect(self, peer: str) -> None:
        remote = self._peers.pop(peer, None)
        if remote is not None:
            self.agent.remove_remote_agent(remote["agent"])

    def close(self) -> None:
        for handle in list(self._posted.values()):
            try:
                self._finish(handle, KVPoll.Failed)
            except Exception:
                logger.warning("NIXL could not cancel a transfer at close", exc_info=True)
        for peer in list(self._peers):
            self.disconnect(peer)
        if self._registered is not None:
            self.agent.deregister_memory(self._registered)
            self._registered = None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return host == "localhost"


def _region(t: torch.Tensor) -> list[int]:
    """[address, bytes, device id] as NIXL describes memory (the device id of DRAM is 0)."""
    return [tensor_address(t), tensor_bytes(t), max(t.get_device(), 0)]


def _offset(region: list[int], start: int, length: int) -> tuple[int, int, int]:
    return region[0] + start, length, region[2]


def merge_runs(pieces: list[Piece]) -> list[Piece]:
    """The pieces with each one that continues the previous in the same buffer on both sides folded
    into it: consecutive pages become one descriptor, and NIXL posts one operation per descriptor."""
    runs: list[Piece] = []
    for p in pieces:
        last = runs[-1] if runs else None
        if last and last.buffer == p.buffer and last.src + last.length == p.src and last.dst + last.length == p.dst:
            runs[-1] = Piece(p.buffer, last.src, last.dst, last.length + p.length)
        elif p.length > 0:
            runs.append(p)
    return runs
