"""The control half of KV transfer: one ``KVManager`` per rank, a thread that speaks a small
protocol over an authenticated ZMQ side channel and drives the data path (``TransferBackend``).

```
decode rank                                  prefill rank (ROUTER, registered at the bootstrap server)
  route lookup (bootstrap GET /route) ───────>
  Hello(descriptor, page size, dtype, layers, model)  ─>  check both sides match, backend.connect
                                           <─ HelloReply(ok | message naming both values)
  RoomRequest(room, page indices, aux slot)  ─>   the room's sender waits for one per decode TP rank
                                                  prefill runs; each chunk: backend.write(pieces)
                                           <─ RoomDone(room, ok) when every write of the room landed
  RoomAbort(room)                            ─>   the sender fails; writes in flight finish
```

The scheduler's thread never blocks on any of it: ``KVSender`` and ``KVReceiver`` only queue
commands for the manager's thread and read the states it writes. Every backend call happens on
the manager's thread (NIXL agents are not thread-safe).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import queue
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import torch
import zmq

from moeserve.disagg.transfer.base import KVPoll, Piece, TransferBackend, create_backend
from moeserve.scheduler.channel import ChannelKeys, ServerSide, connect, terminate

logger = logging.getLogger(__name__)
Address = tuple[str, int]  # a prefill server's bootstrap server (host, port)
POLL_MS = 2
REGISTER_RETRY_S = 0.5
LOOKUP_TIMEOUT_S = 5.0
HEARTBEAT_MIN_TIMEOUT_S = 2.0
ROUTE_RETRY_S = 0.1  # a prefill server not up yet, or whose ranks are still registering, is asked again
EXPIRY_CHECK_S = 0.05
ENDED_ROOMS_KEPT = 1 << 16  # rooms a prefill rank remembers as ended, to answer a late decode side at once
INJECTED = "injected failure (MOESERVE_TEST_DISAGG_FAILURE_PROB)"


# ---- identity and layout ---------------------------------------------------------------------
@dataclass(frozen=True)
class RankIdentity:
    """What both sides of a pair must agree on, and where a rank sits in its server's layout."""

    page_size: int
    kv_dtype: str
    num_layers: int  # of the KV cache (the model's, and the MTP module's with speculative decoding)
    model: str  # a fingerprint of the model (config and weight files)
    num_drafts: int = 0  # speculative decoding's draft tokens per step (0: off)
    dp_rank: int = 0
    tp_rank: int = 0
    attn_tp_size: int = 1
    attn_dp_size: int = 1

    def mismatches(self, other: RankIdentity) -> list[str]:
        names = ("page_size", "kv_dtype", "num_layers", "model", "num_drafts")
        return [f"{n}: prefill {getattr(self, n)!r} vs decode {getattr(other, n)!r}"
                for n in names if getattr(self, n) != getattr(other, n)]


# ---- messages ------------------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello"):
    decode_id: str
    identity: dict[str, Any]
    descriptor: dict[str, Any]
    kv_slots: int  # the decode rank's KV slots per layer (its layer stride)


class HelloReply(msgspec.Struct, tag="hello_reply"):
    ok: bool
    message: str = ""


class RoomRequest(msgspec.Struct, tag="room"):
    room: int
    decode_id: str
    tp_rank: int
    tp_size: int
    page_indices: list[int]
    aux_index: int


class RoomAbort(msgspec.Struct, tag="room_abort"):
    room: int
    decode_id: str


class RoomDone(msgspec.Struct, tag="room_done"):
    room: int
    ok: bool
    message: str = ""


SideMessage = Hello | HelloReply | RoomRequest | RoomAbort | RoomDone
_CODEC = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(SideMessage)


def _decode(data: bytes) -> SideMessage | None:
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def pd_keys(secret: bytes) -> ChannelKeys:
    """The side channel's CURVE keys: every PD server of a deployment derives the same from the
    secret the operator shares (one file, as for multi-node ranks)."""
    return ChannelKeys.from_secret(hmac.new(secret, b"moeserve-pd", hashlib.sha256).digest())


def bootstrap_token(secret: bytes) -> str:
    """The token prefill ranks present to register at their bootstrap server."""
    return hmac.new(secret, b"moeserve-bootstrap", hashlib.sha256).hexdigest()


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
    """What one rank's manager works with."""

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


class KVManager:
    """One rank's transfers; ``role`` is "prefill" or "decode"."""

    def __init__(self, role: str, args: KVArgs) -> None:
        self.role, self.args = role, args
        self.keys = pd_keys(args.secret)
        self.backend: TransferBackend = create_backend(args.backend, [args.kv, args.aux], args.host, args.ib_device)
        self.ctx = zmq.Context()
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._later: list[tuple[float, Callable[[], None]]] = []  # commands to run again at a time
        self._stop = threading.Event()
        self.stats = TransferStats()
        self._chaos = random.Random()
        self._next_expiry = 0.0
        self._init_role()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kv-{role}")
        self._thread.start()
        if role == "decode":
            self._heartbeat = Heartbeat(self)

    def _init_role(self) -> None:
        if self.role == "prefill":
            self._side = ServerSide(self.ctx, self.keys)
            self._router = self._side.bind(zmq.ROUTER, f"tcp://{self.args.host}:0")
            self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._peers: dict[str, _PeerLink] = {}  # decode_id -> its layout
            self._senders: dict[int, KVSender] = {}
            self._early: dict[int, list[tuple[RoomRequest, _PeerLink, float]]] = {}  # before the request itself
            self._ended: OrderedDict[int, str] = OrderedDict()  # rooms that ended here -> why (or "")
            self._writes: list[_InFlight] = []
            self._registered = self.args.bootstrap is None
            self._next_register = 0.0
            self._token = bootstrap_token(self.args.secret)
        else:
            self.decode_id = f"{self.args.host}:{os.getpid()}:{self.args.identity.dp_rank}.{self.args.identity.tp_rank}"
            self._layouts: dict[Address, dict] = {}  # bootstrap server -> its /route answer
            self._dealers: dict[str, _Dealer] = {}  # prefill endpoint -> link
            self._receivers: dict[int, KVReceiver] = {}

    # ---- the scheduler's side ------------------------------------------------------------------
    def sender(self, room: int, aux_index: int) -> KVSender | MirrorSender:
        """The room's sender. Only the first rank of an attention-TP group sends (its latent copy
        serves every decode rank); the others follow along with a ``MirrorSender``."""
        if self.args.identity.tp_rank != 0:
            return MirrorSender(room)
        sender = KVSender(self, room, aux_index)
        self._commands.put(lambda: self._add_sender(sender))
        return sender

    def receiver(self, room: int, bootstrap_host: str, bootstrap_port: int, prefill_dp: int | None) -> KVReceiver:
        receiver = KVReceiver(self, room, (bootstrap_host, bootstrap_port))
        self._commands.put(lambda: self._start_receiver(receiver, prefill_dp))
        return receiver

    def inject_failure(self, transfer: KVSender | KVReceiver) -> bool:
        """Tests (``failure_prob``): True when this poll of ``transfer`` is to fail. One draw per state a
        transfer is polled in (bootstrapping, waiting, transferring), so that how often a loop polls
        does not change how many transfers fail."""
        p, state = self.args.failure_prob, transfer.state
        if p <= 0 or state in (KVPoll.Success, KVPoll.Failed) or state in transfer.drawn:
            return False
        transfer.drawn.add(state)
        return self._chaos.random() < p

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self.role == "decode":
            self._heartbeat.join()
        self.backend.close()
        if self.role == "prefill":
            self._side.close()
        else:
            terminate(self.ctx)

    # ---- the manager's thread ------------------------------------------------------------------
    def _run(self) -> None:
        sockets, poller = self._poller()
        while not self._stop.is_set():
            try:
                self.backend.progress()
                self._run_commands()
                self._expire()
                if self.role == "prefill":
                    self._register_once()
                    self._check_writes()
                if self._sockets() != sockets:  # a decode rank's prefill peers came or went
                    sockets, poller = self._poller()
                if sockets:
                    for sock, _ in poller.poll(POLL_MS):
                        self._receive(sock)
                else:  # a decode rank before its first peer: Poller.poll would not wait
                    self._stop.wait(POLL_MS / 1000)
            except Exception:  # one bad room or message must not end every transfer of the rank
                logger.exception("the KV transfer thread hit an error; it goes on")

    def _poller(self) -> tuple[list[zmq.Socket], zmq.Poller]:
        sockets, poller = self._sockets(), zmq.Poller()
        for sock in sockets:
            poller.register(sock, zmq.POLLIN)
        return sockets, poller

    def _sockets(self) -> list[zmq.Socket]:
        return [self._router] if self.role == "prefill" else [d.sock for d in self._dealers.values()]

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

    def _receive(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart()
        if self.role == "prefill":
            if len(frames) != 2 or (msg := _decode(frames[1])) is None:
                return
            self._on_prefill_message(frames[0], msg)
        elif len(frames) == 1 and (msg := _decode(frames[0])) is not None:
            self._on_decode_message(sock, msg)

    def _expire(self) -> None:
        """Fail what waited past its deadline (checked every ``EXPIRY_CHECK_S``)."""
        now = time.monotonic()
        if now < self._next_expiry:
            return
        self._next_expiry = now + EXPIRY_CHECK_S
        if self.role == "prefill":
            self._expire_prefill(now)
        else:
            self._expire_decode(now)

    # ---- prefill: peers, rooms, writes -----------------------------------------------------------
    def _expire_prefill(self, now: float) -> None:
        limits = self.args.deadlines
        for sender in list(self._senders.values()):
            if sender.state is KVPoll.Bootstrapping and now - sender.created > limits.bootstrap:
                sender.fail(f"no decode rank sent page indices for room {sender.room} within "
                            f"{limits.bootstrap:g} s (--disaggregation-bootstrap-timeout)")
        late = [w for w in self._writes if now - w.started > limits.transfer]
        for write in late:  # given up on: the room fails, whatever the backend still does with it
            write.sender.fail(f"a KV write of room {write.sender.room} to the decode rank took longer than "
                              f"{limits.transfer:g} s (--disaggregation-transfer-timeout)")
        self._writes = [w for w in self._writes if w not in late]
        for room, entries in list(self._early.items()):  # indices for a request that never came here
            if now - entries[0][2] > limits.bootstrap:
                del self._early[room]
                for msg, link, _ in entries:
                    self._room_done(link, room, False, f"the prefill server never received request room {room}")

    def _register_once(self) -> None:
        """Tell this server's bootstrap server where this rank listens (it may start after us)."""
        if self._registered or time.monotonic() < self._next_register:
            return
        host, port = self.args.bootstrap
        body = {"endpoint": self.endpoint, **dataclasses.asdict(self.args.identity)}
        try:
            r = httpx.put(f"{_http(host, port)}/register", json=body, timeout=2,
                          headers={"Authorization": f"Bearer {self._token}"})
            self._registered = r.status_code == 200
        except httpx.HTTPError:
            pass
        self._next_register = time.monotonic() + REGISTER_RETRY_S

    def _on_prefill_message(self, identity: bytes, msg: SideMessage) -> None:
        """Only a peer that passed the handshake (``Hello``) may name rooms."""
        if isinstance(msg, Hello):
            reply = self._hello(msg)
            self._router.send_multipart([identity, _CODEC.encode(reply)])
            return
        link = self._peers.get(msg.decode_id) if isinstance(msg, (RoomRequest, RoomAbort)) else None
        if link is None:
            return
        link.identity_frame = identity
        sender = self._senders.get(msg.room)
        if isinstance(msg, RoomAbort):
            why = f"the decode side aborted room {msg.room}"
            if sender is not None:
                sender.fail(why)
                return
            self._remember_ended(msg.room, why)  # before the request reached this rank: it fails on arrival
            for early, early_link, _ in self._early.pop(msg.room, []):  # and the decode side hears so now
                self._room_done(early_link, early.room, False, why)
        elif sender is not None:
            sender.add_target(msg, link)
        elif msg.room in self._ended:
            self._room_done(link, msg.room, False, f"room {msg.room} has already ended on the prefill side: "
                                                   f"{self._ended[msg.room] or 'done'}")
        else:
            self._early.setdefault(msg.room, []).append((msg, link, time.monotonic()))

    def _hello(self, msg: Hello) -> HelloReply:
        theirs = RankIdentity(**msg.identity)
        problems = self.args.identity.mismatches(theirs)
        if problems:
            logger.warning("refused decode rank %s: %s", msg.decode_id, "; ".join(problems))
            return HelloReply(False, "the prefill and decode servers do not match: " + "; ".join(problems))
        try:
            self.backend.connect(msg.decode_id, msg.descriptor)
        except Exception as exc:
            return HelloReply(False, f"the prefill rank could not reach the decode rank's memory: {exc}")
        self._peers[msg.decode_id] = _PeerLink(msg.decode_id, msg.kv_slots, b"")
        return HelloReply(True)

    def _add_sender(self, sender: KVSender) -> None:
        self._senders[sender.room] = sender
        if sender.room in self._ended:  # the decode side gave up on it already
            sender.fail(self._ended[sender.room])
        for msg, link, _ in self._early.pop(sender.room, []):
            sender.add_target(msg, link)

    def _start_writes(self, sender: KVSender, first_page: int, pages: list[int], last: bool) -> None:
        if sender.state is KVPoll.Failed:
            return
        sender.state, sender.last_sent = KVPoll.Transferring, sender.last_sent or last
        for target in sender.targets.values():
            pieces = sender.pieces(target, first_page, pages, last)
            handle = self.backend.write(target.link.decode_id, pieces)
            self._writes.append(_InFlight(sender, handle, time.monotonic(), sum(p.length for p in pieces)))

    def _check_writes(self) -> None:
        pending = []
        for write in self._writes:
            state = self.backend.check(write.handle)
            if state is KVPoll.Transferring:
                pending.append(write)
            elif state is KVPoll.Failed:
                write.sender.fail("a KV write to the decode rank failed")
            else:
                self.stats.add(write.nbytes, time.monotonic() - write.started)
        self._writes = pending
        busy = {id(w.sender) for w in pending}
        for sender in list(self._senders.values()):
            if id(sender) not in busy and (sender.last_sent or sender.state is KVPoll.Failed):
                self._finish_room(sender)

    def _finish_room(self, sender: KVSender) -> None:
        """Every write of the room has landed (or the room failed): tell each decode rank."""
        ok = sender.state is not KVPoll.Failed
        for target in sender.targets.values():
            self._room_done(target.link, sender.room, ok, sender.message)
        sender.state = KVPoll.Success if ok else KVPoll.Failed
        self.stats.transfers[sender.state.name.lower()] += 1
        self._senders.pop(sender.room, None)
        self._remember_ended(sender.room, sender.message)

    def _room_done(self, link: _PeerLink, room: int, ok: bool, message: str) -> None:
        self._router.send_multipart([link.identity_frame, _CODEC.encode(RoomDone(room, ok, message))])

    def _remember_ended(self, room: int, message: str) -> None:
        self._ended[room] = message
        while len(self._ended) > ENDED_ROOMS_KEPT:
            self._ended.popitem(last=False)

    # ---- decode: routes, handshakes, rooms -------------------------------------------------------
    def _start_receiver(self, receiver: KVReceiver, prefill_dp: int | None) -> None:
        if receiver.state is KVPoll.Failed:  # aborted, timed out, or its prefill server died meanwhile
            receiver.settled = True
            self._receivers.pop(receiver.room, None)
            return
        self._receivers[receiver.room] = receiver
        try:
            endpoint = self._route(receiver.bootstrap, receiver.room, prefill_dp)
        except (httpx.TransportError, LookupError):  # not up yet, or its ranks still registering
            self._later.append((time.monotonic() + ROUTE_RETRY_S, lambda: self._start_receiver(receiver, prefill_dp)))
            return
        except (httpx.HTTPError, ValueError) as exc:
            self._end_receiver(receiver, f"the prefill server at {_addr(receiver.bootstrap)} could not be used: {exc}")
            return
        dealer = self._dealers.get(endpoint)
        if dealer is None:
            dealer = self._dealers[endpoint] = _Dealer(connect(self.ctx, zmq.DEALER, endpoint, self.keys))
            hello = Hello(self.decode_id, dataclasses.asdict(self.args.identity), self.backend.descriptor(),
                          int(self.args.kv.shape[1]))
            dealer.sock.send(_CODEC.encode(hello))
        receiver.dealer = dealer
        dealer.waiting.append(receiver)
        if dealer.ready is not None:
            self._settle(dealer)

    def _route(self, bootstrap: Address, room: int, prefill_dp: int | None) -> str:
        layout = self._layouts.get(bootstrap)
        if layout is None:
            r = httpx.get(f"{_http(*bootstrap)}/route", timeout=LOOKUP_TIMEOUT_S)
            if r.status_code != 200:
                raise LookupError(f"bootstrap answered {r.status_code}: {r.text}")
            layout = self._layouts[bootstrap] = r.json()
        dp = room % layout["attn_dp_size"] if prefill_dp is None else prefill_dp
        if not 0 <= dp < layout["attn_dp_size"]:
            raise ValueError(f"prefill_dp_rank {dp} is not in [0, {layout['attn_dp_size']})")
        return layout["endpoints"][dp]

    def _on_decode_message(self, sock: zmq.Socket, msg: SideMessage) -> None:
        if isinstance(msg, HelloReply):
            dealer = next(d for d in self._dealers.values() if d.sock is sock)
            dealer.ready, dealer.message = msg.ok, msg.message
            self._settle(dealer)
        elif isinstance(msg, RoomDone):
            receiver = self._receivers.pop(msg.room, None)
            if receiver is not None:
                receiver.done(msg.ok, msg.message)
                receiver.settled = True
                self.stats.transfers["success" if msg.ok else "failed"] += 1

    def _settle(self, dealer: _Dealer) -> None:
        """The handshake with a prefill rank ended: its rooms may go on, or fail."""
        for receiver in dealer.waiting:
            if dealer.ready:
                receiver.advance(KVPoll.WaitingForInput)
            else:
                receiver.fail(dealer.message)
                receiver.settled = True
        dealer.waiting.clear()

    def _send_room(self, receiver: KVReceiver, page_indices: list[int], aux_index: int) -> None:
        if receiver.state is KVPoll.Failed:  # aborted before the indices left
            return
        ident = self.args.identity
        receiver.dealer.sock.send(_CODEC.encode(RoomRequest(
            receiver.room, self.decode_id, ident.tp_rank, ident.attn_tp_size, page_indices, aux_index)))
        receiver.requested, receiver.requested_at = True, time.monotonic()

    def _abort_room(self, receiver: KVReceiver) -> None:
        """Tell the prefill rank (so that it stops at once); the room settles when it confirms (its
        writes in flight landed), or at once when the indices never left."""
        if receiver.dealer is not None and receiver.dealer.ready and receiver.dealer in self._dealers.values():
            receiver.dealer.sock.send(_CODEC.encode(RoomAbort(receiver.room, self.decode_id)))
        if not receiver.requested:
            self._receivers.pop(receiver.room, None)
            receiver.settled = True

    def _end_receiver(self, receiver: KVReceiver, message: str) -> None:
        """Fail a room nothing will write into any more (no indices sent, or its prefill server is gone)."""
        receiver.fail(message)
        receiver.settled = True
        self._receivers.pop(receiver.room, None)

    def _expire_decode(self, now: float) -> None:
        limits = self.args.deadlines
        for receiver in list(self._receivers.values()):
            if receiver.state is KVPoll.Bootstrapping and now - receiver.created > limits.bootstrap:
                self._end_receiver(receiver, f"the prefill server at {_addr(receiver.bootstrap)} did not answer the "
                                             f"route lookup and handshake within {limits.bootstrap:g} s "
                                             "(--disaggregation-bootstrap-timeout)")
            elif receiver.requested and now - receiver.requested_at > limits.waiting:
                # the role's abort tells the prefill side; the pages wait until it confirms
                receiver.fail(f"the KV cache of room {receiver.room} did not arrive within {limits.waiting:g} s "
                              "(--disaggregation-waiting-timeout)")

    def watched(self) -> set[Address]:
        """The prefill servers (bootstrap addresses) this rank has rooms with; any thread may ask."""
        return {r.bootstrap for r in tuple(self._receivers.values()) if not r.settled}

    def layout_instance(self, bootstrap: Address) -> str | None:
        """The instance id of the prefill server whose layout this rank uses; any thread may ask."""
        layout = self._layouts.get(bootstrap)
        return None if layout is None else layout.get("instance")

    def prefill_gone(self, bootstrap: Address, why: str) -> None:
        """The prefill server at ``bootstrap`` died or restarted (the heartbeat says): fail exactly its
        rooms (nothing of it can write into their pages any more), drop its connections and its
        layout, so that a request naming it later looks it up and shakes hands anew."""
        message = f"the prefill server at {_addr(bootstrap)} {why}"
        for receiver in list(self._receivers.values()):
            if receiver.bootstrap == bootstrap:
                self._end_receiver(receiver, message)
        layout = self._layouts.pop(bootstrap, None)
        for endpoint in layout["endpoints"] if layout else []:
            dealer = self._dealers.pop(endpoint, None)
            if dealer is not None:
                for receiver in dealer.waiting:
                    self._end_receiver(receiver, message)
                dealer.sock.close(linger=0)
        self.stats.peers_lost += 1
        logger.warning("%s: its requests failed, its connections dropped", message)


@dataclass
class _PeerLink:
    decode_id: str
    kv_slots: int
    identity_frame: bytes


@dataclass
class _Dealer:
    sock: zmq.Socket
    ready: bool | None = None
    message: str = ""
    waiting: list[KVReceiver] = field(default_factory=list)


@dataclass
class _InFlight:
    sender: KVSender
    handle: object
    started: float
    nbytes: int


@dataclass
class _Target:
    link: _PeerLink
    page_indices: list[int]
    aux_index: int


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


class KVSender:
    """The prefill side of one room. Its pages are sent chunk by chunk (``send``); the room is
    done when every decode TP rank has every piece. Only the manager's thread changes ``state``."""

    def __init__(self, manager: KVManager, room: int, aux_index: int) -> None:
        self.manager, self.room, self.aux_index = manager, room, aux_index
        self.state = KVPoll.Bootstrapping
        self.message = ""
        self.targets: dict[int, _Target] = {}  # decode TP rank -> where its copy goes
        self.last_sent = False
        self.created = time.monotonic()
        self.drawn: set[KVPoll] = set()  # states a failure was drawn for (``inject_failure``)

    def poll(self) -> KVPoll:
        if self.manager.inject_failure(self):
            self.fail(INJECTED)
        return self.state

    def add_target(self, msg: RoomRequest, link: _PeerLink) -> None:
        if self.state is not KVPoll.Bootstrapping:
            return
        self.targets[msg.tp_rank] = _Target(link, msg.page_indices, msg.aux_index)
        if len(self.targets) == msg.tp_size:
            self.state = KVPoll.WaitingForInput

    def send(self, first_page: int, pages: list[int], last: bool) -> None:
        """Push prompt pages ``first_page ..`` (held in ``pages`` of this rank); with ``last``, the
        aux record too (write it into ``aux[aux_index]`` first). Non-blocking."""
        pages = list(pages)
        self.manager._commands.put(lambda: self.manager._start_writes(self, first_page, pages, last))

    def pieces(self, target: _Target, first_page: int, pages: list[int], last: bool) -> list[Piece]:
        """Byte runs of every layer's pages, in this rank's buffers and the target's."""
        kv, aux = self.manager.args.kv, self.manager.args.aux
        layers, slots, dim = kv.shape
        elt = kv.element_size()
        page_bytes = self.manager.args.identity.page_size * dim * elt
        src_layer, dst_layer = slots * dim * elt, target.link.kv_slots * dim * elt
        dst_pages = target.page_indices[first_page:first_page + len(pages)]
        pieces = [Piece(0, layer * src_layer + s * page_bytes, layer * dst_layer + d * page_bytes, n * page_bytes)
                  for layer in range(layers) for s, d, n in _runs(pages, dst_pages)]
        if last:
            record = aux[0].numel() * aux.element_size()
            pieces.append(Piece(1, self.aux_index * record, target.aux_index * record, record))
        return pieces

    def fail(self, message: str) -> None:
        if self.state is not KVPoll.Success:
            self.state, self.message = KVPoll.Failed, message

    def abort(self, message: str = "aborted on the prefill side") -> None:
        self.manager._commands.put(lambda: self.fail(message))


class MirrorSender:
    """A sender of a rank that sends nothing: ready at once, done once its last chunk is "sent".
    The group's states are agreed as minimums, so the first rank's state is the group's."""

    def __init__(self, room: int) -> None:
        self.room, self.state, self.message = room, KVPoll.WaitingForInput, ""

    def poll(self) -> KVPoll:
        return self.state

    def send(self, first_page: int, pages: list[int], last: bool) -> None:
        if last and self.state is not KVPoll.Failed:
            self.state = KVPoll.Success

    def abort(self) -> None:
        self.state = KVPoll.Failed


class KVReceiver:
    """The decode side of one room."""

    def __init__(self, manager: KVManager, room: int, bootstrap: Address) -> None:
        self.manager, self.room, self.bootstrap = manager, room, bootstrap
        self.state = KVPoll.Bootstrapping
        self.message = ""
        self.dealer: _Dealer | None = None
        self.created = time.monotonic()
        self.requested = False  # the prefill rank has this room's page indices
        self.requested_at = 0.0
        self.settled = False  # nothing of the prefill side will write into this room's pages any more
        self.drawn: set[KVPoll] = set()  # states a failure was drawn for (``inject_failure``)

    def poll(self) -> KVPoll:
        if self.manager.inject_failure(self):
            self.abort(INJECTED)
        return self.state

    def init(self, page_indices: list[int], aux_index: int) -> None:
        """Tell the prefill rank where this room's KV and aux record go."""
        self.state = KVPoll.Transferring
        self.manager._commands.put(lambda: self.manager._send_room(self, list(page_indices), aux_index))

    def advance(self, state: KVPoll) -> None:
        if self.state is not KVPoll.Failed and state > self.state:
            self.state = state

    def done(self, ok: bool, message: str) -> None:
        if ok:
            self.advance(KVPoll.Success)
        else:
            self.fail(message or "the prefill side failed the transfer")

    def fail(self, message: str) -> None:
        if self.state is not KVPoll.Success:
            self.state, self.message = KVPoll.Failed, message

    def abort(self, message: str = "aborted") -> None:
        self.fail(message)
        self.manager._commands.put(lambda: self.manager._abort_room(self))


def _http(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _addr(bootstrap: Address) -> str:
    return _http(*bootstrap).removeprefix("http://")


class Heartbeat:
    """A decode rank's watch over the prefill servers it has rooms with: ``GET /health`` of each one's
    bootstrap server every ``heartbeat_interval``. A server that misses ``heartbeat_max_failures``
    checks in a row, or answers with another instance id than the one this rank shook hands with (it
    restarted), is gone: the manager fails exactly its rooms. Its own thread, so that a server that
    does not answer never delays a transfer."""

    def __init__(self, manager: KVManager) -> None:
        self.manager = manager
        self.misses: dict[Address, int] = {}
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-heartbeat")
        self._thread.start()

    def _run(self) -> None:
        limits = self.manager.args.deadlines
        # a slow answer is not a missed one: a loaded prefill server gets seconds, however often it is asked
        timeout = min(max(limits.heartbeat_interval, HEARTBEAT_MIN_TIMEOUT_S), LOOKUP_TIMEOUT_S)
        with httpx.Client(timeout=timeout, trust_env=False) as http:
            while not self.manager._stop.wait(limits.heartbeat_interval):
                watched = self.manager.watched()
                self.misses = {a: n for a, n in self.misses.items() if a in watched}
                for bootstrap in watched:
                    why = self._check(http, bootstrap, limits.heartbeat_max_failures)
                    if why is not None:
                        self.misses.pop(bootstrap, None)
                        self.manager._commands.put(lambda b=bootstrap, w=why: self.manager.prefill_gone(b, w))

    def _check(self, http: httpx.Client, bootstrap: Address, max_failures: int) -> str | None:
        """Why the server at ``bootstrap`` counts as gone, or None while it is fine."""
        try:
            r = http.get(f"{_http(*bootstrap)}/health")
            instance = r.json().get("instance") if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            instance = None
        if instance is None:
            self.misses[bootstrap] = self.misses.get(bootstrap, 0) + 1
            if self.misses[bootstrap] >= max_failures:
                return f"missed {max_failures} health checks in a row"
            return None
        self.misses.pop(bootstrap, None)
        known = self.manager.layout_instance(bootstrap)
        return "restarted" if known is not None and known != instance else None

    def join(self) -> None:
        self._thread.join(timeout=5)


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(first src page, first dst page, pages)`` for the runs where both page lists go up by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
