"""The one thread a rank's KV transfers run on, and what its prefill and decode sides share.

```
scheduler's thread                          the loop's thread (one per rank)
  KVSender / KVReceiver .poll()  <── reads ── state, message, settled  <── written only here
  send / init / abort  ── queue a command ──> commands, delayed commands ─┐
                                             socket poller ──────────────┤  the side's hooks
                                             expiry timer ───────────────┤  (PrefillTransfer,
                                             backend.progress(), step() ─┘   DecodeTransfer)
```

The scheduler's thread never blocks on a transfer and never writes one: it reads the states the
loop writes and queues commands for it. The writers of a transfer's state check that they run on
the loop's thread (``TransferLoop.check_thread``), so a second writer is an error, not a race.
Every backend call happens on the loop's thread too (NIXL agents are not thread-safe).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import zmq

from moeserve.disagg.transfer.base import KVPoll, TransferBackend, create_backend
from moeserve.disagg.transfer.protocol import RankIdentity, pd_keys

logger = logging.getLogger(__name__)
POLL_MS = 2
EXPIRY_CHECK_S = 0.05
INJECTED = "injected failure (MOESERVE_TEST_DISAGG_FAILURE_PROB)"
Command = Callable[[], None]


@dataclass(frozen=True)
class Deadlines:
    """How long each side waits for the other (``DisaggConfig``'s timeouts and heartbeat), seconds."""

    bootstrap: float = 300.0  # prefill: for the decode side's indices; decode: for the route and handshake
    waiting: float = 300.0  # decode: from the indices sent to the whole KV arrived
    transfer: float = 60.0  # prefill: one write
    heartbeat_interval: float = 2.0
    heartbeat_max_failures: int = 3


@dataclass
class KVArgs:
    """What one rank's transfers work with."""

    backend: str
    kv: torch.Tensor  # [layers, slots, dim], the latent cache
    aux: torch.Tensor  # [aux slots, AUX_WIDTH] float64, first-token records
    identity: RankIdentity
    host: str  # where the side channel and the data path listen
    secret: bytes
    ib_device: str | None = None
    bootstrap: tuple[str, int] | None = None  # prefill: its own bootstrap server
    deadlines: Deadlines = field(default_factory=Deadlines)
    failure_prob: float = 0.0  # tests: each poll of a transfer fails with this probability


@dataclass
class TransferStats:
    """Finished transfers by result, bytes moved and time spent, for metrics."""

    transfers: dict[str, int] = field(default_factory=lambda: {"success": 0, "failed": 0})
    bytes: int = 0
    seconds: float = 0.0
    writes: int = 0
    peers_lost: int = 0  # decode: prefill servers found dead or restarted by the heartbeat

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.seconds += seconds
        self.writes += 1


class TransferLoop:
    """The thread of one rank's transfers. Each turn: the backend progresses, queued commands run
    (and delayed ones that came due), what waited past its deadline fails (every
    ``EXPIRY_CHECK_S``), the side does its per-turn work, and what arrived on its sockets within
    ``POLL_MS`` goes to it."""

    def __init__(self, backend: TransferBackend, side: KVTransfer, name: str) -> None:
        self.backend, self.side = backend, side
        self._commands: queue.Queue[Command] = queue.Queue()
        self._later: list[tuple[float, Command]] = []  # (when, command); the loop's thread only
        self._stop = threading.Event()
        self._next_expiry = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True, name=name)

    def start(self) -> None:
        self._thread.start()

    def submit(self, command: Command) -> None:
        """Run ``command`` on the loop's thread, after every command queued before it. Any thread."""
        self._commands.put(command)

    def submit_after(self, delay_s: float, command: Command) -> None:
        """Queue ``command`` once ``delay_s`` has passed (a retry). The loop's thread only."""
        self.check_thread()
        self._later.append((time.monotonic() + delay_s, command))

    def check_thread(self) -> None:
        """The guard of the one-writer rule: transfers' states are written on this thread only."""
        if threading.current_thread() is not self._thread:
            raise RuntimeError(f"a KV transfer's state is written only on the {self._thread.name} thread, "
                               f"not on {threading.current_thread().name}")

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stopped(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s; True once the loop is stopping (helper threads pace on this)."""
        return self._stop.wait(timeout)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        sockets, poller = self._poller()
        while not self._stop.is_set():
            try:
                self.backend.progress()
                self._run_commands()
                self._expire()
                self.side.step()
                if self.side.sockets() != sockets:  # a decode rank's prefill peers came or went
                    sockets, poller = self._poller()
                self._receive(sockets, poller)
            except Exception:  # one bad room or message must not end every transfer of the rank
                logger.exception("the KV transfer thread hit an error; it goes on")

    def _poller(self) -> tuple[list[zmq.Socket], zmq.Poller]:
        sockets, poller = self.side.sockets(), zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        return sockets, poller

    def _receive(self, sockets: list[zmq.Socket], poller: zmq.Poller) -> None:
        if not sockets:  # a decode rank before its first peer: Poller.poll would not wait
            self._stop.wait(POLL_MS / 1000)
            return
        for sock, _ in poller.poll(POLL_MS):
            self.side.receive(sock, sock.recv_multipart())

    def _run_commands(self) -> None:
        now = time.monotonic()
        due = [c for t, c in self._later if t <= now]
        self._later = [(t, c) for t, c in self._later if t > now]
        for command in due:
            self._commands.put(command)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # a command concerns one room: it must not end the thread
                logger.exception("a KV transfer command failed")

    def _expire(self) -> None:
        now = time.monotonic()
        if now >= self._next_expiry:
            self._next_expiry = now + EXPIRY_CHECK_S
            self.side.expire(now)


class KVTransfer(ABC):
    """One rank's side of PD KV transfer (``PrefillTransfer`` or ``DecodeTransfer``): its data path,
    side-channel context and keys, stats, and the loop that drives them. A side supplies the loop's
    hooks (its sockets, what to do with a message, what expired, its per-turn work); its methods the
    scheduler's thread calls only queue commands for the loop."""

    def __init__(self, args: KVArgs, name: str) -> None:
        self.args = args
        self.keys = pd_keys(args.secret)
        self.backend: TransferBackend = create_backend(args.backend, [args.kv, args.aux], args.host, args.ib_device)
        self.ctx = zmq.Context()
        self.stats = TransferStats()
        self.loop = TransferLoop(self.backend, self, name)  # the side starts it once its sockets exist
        self._chaos = random.Random()

    # ---- the loop's hooks ------------------------------------------------------------------------
    @abstractmethod
    def sockets(self) -> list[zmq.Socket]:
        """The sockets the loop polls; the list may change from one turn to the next."""

    @abstractmethod
    def receive(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        """One multipart message that arrived on ``sock``."""

    @abstractmethod
    def expire(self, now: float) -> None:
        """Fail what waited past its deadline."""

    def step(self) -> None:
        """Work of every turn besides commands, messages and deadlines."""

    # ---- the scheduler's thread ------------------------------------------------------------------
    def inject_failure(self, state: KVPoll, drawn: set[KVPoll]) -> bool:
        """Tests (``failure_prob``): True when a transfer polled in ``state`` is to fail; ``drawn``,
        the transfer's own, holds the states it had a draw for. One draw per state a transfer is
        polled in (bootstrapping, waiting, transferring), so that how often a loop polls does not
        change how many transfers fail. The caller queues the failure: the loop applies it."""
        p = self.args.failure_prob
        if p <= 0 or state in (KVPoll.Success, KVPoll.Failed) or state in drawn:
            return False
        drawn.add(state)
        return self._chaos.random() < p

    def close(self) -> None:
        self.loop.close()
        self.backend.close()


class TransferRoom:
    """What the two sides' rooms share: a state and its message that the loop's thread alone
    writes, and a poll that, in tests, draws an injected failure once per state it sees."""

    def __init__(self, transfer: KVTransfer, room: int) -> None:
        self.room = room
        self.state = KVPoll.Bootstrapping
        self.message = ""
        self.created = time.monotonic()
        self._transfer = transfer
        self._drawn: set[KVPoll] = set()  # states a failure was drawn for (``inject_failure``)
        self._failing = False  # a failure is queued: no more draws

    def poll(self) -> KVPoll:
        """The room's state (the scheduler's thread)."""
        state = self.state
        if not self._failing and self._transfer.inject_failure(state, self._drawn):
            self.abort(INJECTED)
        return state

    def abort(self, message: str) -> None:
        raise NotImplementedError

