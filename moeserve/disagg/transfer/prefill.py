"""The prefill side of a rank's KV transfers. ``PrefillTransfer`` registers the rank's ROUTER at
its bootstrap server, answers decode ranks' handshakes, collects each room's page indices (one
``RoomRequest`` per decode TP rank), writes the room's chunks through the data path and tells
every decode rank when the room ended. ``KVSender`` is one room as the scheduler sees it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import httpx
import zmq

from moeserve.disagg.transfer.base import KVPoll, Piece
from moeserve.disagg.transfer.loop import KVArgs, KVTransfer, TransferRoom
from moeserve.disagg.transfer.protocol import (
    Hello,
    HelloReply,
    RankIdentity,
    RoomAbort,
    RoomDone,
    RoomRequest,
    SideMessage,
    bootstrap_token,
    bootstrap_url,
    decode,
    encode,
)
from moeserve.scheduler.channel import ServerSide

logger = logging.getLogger(__name__)
REGISTER_RETRY_S = 0.5
ENDED_ROOMS_KEPT = 1 << 16  # rooms a prefill rank remembers as ended, to answer a late decode side at once


@dataclass
class _PeerLink:
    decode_id: str
    kv_slots: int
    identity_frame: bytes


@dataclass
class _Target:
    link: _PeerLink
    page_indices: list[int]
    aux_index: int


@dataclass
class _InFlight:
    sender: KVSender
    handle: object
    started: float
    nbytes: int


class PrefillTransfer(KVTransfer):
    """A prefill rank's transfers. Only a peer that passed the handshake may name rooms; a room's
    indices that arrive before its request wait (``_early``), and a room that ended is remembered
    (``_ended``) so that late indices are answered at once."""

    def __init__(self, args: KVArgs) -> None:
        super().__init__(args, "kv-prefill")
        self._side = ServerSide(self.ctx, self.keys)
        self._router = self._side.bind(zmq.ROUTER, f"tcp://{args.host}:0")
        self.endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._peers: dict[str, _PeerLink] = {}  # decode_id -> its layout
        self._senders: dict[int, KVSender] = {}
        self._early: dict[int, list[tuple[RoomRequest, _PeerLink, float]]] = {}  # before the request itself
        self._ended: OrderedDict[int, str] = OrderedDict()  # rooms that ended here -> why (or "")
        self._writes: list[_InFlight] = []
        self._registered = args.bootstrap is None
        self._next_register = 0.0
        self._token = bootstrap_token(args.secret)
        self.loop.start()

    # ---- the scheduler's thread: commands for the loop -------------------------------------------
    def sender(self, room: int, aux_index: int) -> KVSender | MirrorSender:
        """The room's sender. Only the first rank of an attention-TP group sends (its latent copy
        serves every decode rank); the others follow along with a ``MirrorSender``."""
        if self.args.identity.tp_rank != 0:
            return MirrorSender(room)
        sender = KVSender(self, room, aux_index)
        self.loop.submit(lambda: self._add_sender(sender))
        return sender

    def send(self, sender: KVSender, first_page: int, pages: list[int], last: bool) -> None:
        """Queue the writes of one chunk of ``sender``'s room (``KVSender.send``)."""
        pages = list(pages)
        self.loop.submit(lambda: self._start_writes(sender, first_page, pages, last))

    def fail(self, sender: KVSender, message: str) -> None:
        """Queue the failure of ``sender``'s room; its writes in flight finish first."""
        self.loop.submit(lambda: sender.fail(message))

    def close(self) -> None:
        super().close()
        self._side.close()

    # ---- the loop's hooks ------------------------------------------------------------------------
    def sockets(self) -> list[zmq.Socket]:
        return [self._router]

    def receive(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        if len(frames) == 2 and (msg := decode(frames[1])) is not None:
            self._on_message(frames[0], msg)

    def step(self) -> None:
        self._register_once()
        self._check_writes()

    def expire(self, now: float) -> None:
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
                for _, link, _ in entries:
                    self._room_done(link, room, False, f"the prefill server never received request room {room}")

    # ---- the loop's thread: peers and rooms --------------------------------------------------------
    def _register_once(self) -> None:
        """Tell this server's bootstrap server where this rank listens (it may start after us)."""
        if self._registered or time.monotonic() < self._next_register:
            return
        host, port = self.args.bootstrap
        body = {"endpoint": self.endpoint, **dataclasses.asdict(self.args.identity)}
        try:
            r = httpx.put(f"{bootstrap_url(host, port)}/register", json=body, timeout=2,
                          headers={"Authorization": f"Bearer {self._token}"})
            self._registered = r.status_code == 200
        except httpx.HTTPError:
            pass
        self._next_register = time.monotonic() + REGISTER_RETRY_S

    def _on_message(self, identity: bytes, msg: SideMessage) -> None:
        """Only a peer that passed the handshake (``Hello``) may name rooms."""
        if isinstance(msg, Hello):
            self._router.send_multipart([identity, encode(self._hello(msg))])
            return
        link = self._peers.get(msg.decode_id) if isinstance(msg, (RoomRequest, RoomAbort)) else None
        if link is None:
            return
        link.identity_frame = identity
        if isinstance(msg, RoomAbort):
            self._on_abort(msg.room)
        elif (sender := self._senders.get(msg.room)) is not None:
            sender.add_target(msg, link)
        elif msg.room in self._ended:
            self._room_done(link, msg.room, False, f"room {msg.room} has already ended on the prefill side: "
                                                   f"{self._ended[msg.room] or 'done'}")
        else:
            self._early.setdefault(msg.room, []).append((msg, link, time.monotonic()))

    def _on_abort(self, room: int) -> None:
        why = f"the decode side aborted room {room}"
        if (sender := self._senders.get(room)) is not None:
            sender.fail(why)
            return
        self._remember_ended(room, why)  # before the request reached this rank: it fails on arrival
        for early, early_link, _ in self._early.pop(room, []):  # and the decode side hears so now
            self._room_done(early_link, early.room, False, why)

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

    def _room_done(self, link: _PeerLink, room: int, ok: bool, message: str) -> None:
        self._router.send_multipart([link.identity_frame, encode(RoomDone(room, ok, message))])

    def _remember_ended(self, room: int, message: str) -> None:
        self._ended[room] = message
        while len(self._ended) > ENDED_ROOMS_KEPT:
            self._ended.popitem(last=False)

    # ---- the loop's thread: writes ---------------------------------------------------------------
    def _start_writes(self, sender: KVSender, first_page: int, pages: list[int], last: bool) -> None:
        if sender.state is KVPoll.Failed:
            return
        sender.start_chunk(last)
        for target in sender.targets.values():
            pieces = self._pieces(sender, target, first_page, pages, last)
            handle = self.backend.write(target.link.decode_id, pieces)
            self._writes.append(_InFlight(sender, handle, time.monotonic(), sum(p.length for p in pieces)))

    def _pieces(self, sender: KVSender, target: _Target, first_page: int, pages: list[int],
                last: bool) -> list[Piece]:
        """Byte runs of every layer's pages, in this rank's buffers and the target's; with ``last``,
        the room's aux record too."""
        kv, aux = self.args.kv, self.args.aux
        layers, slots, dim = kv.shape  # [layers, slots, dim]
        elt = kv.element_size()
        page_bytes = self.args.identity.page_size * dim * elt
        src_layer, dst_layer = slots * dim * elt, target.link.kv_slots * dim * elt
        dst_pages = target.page_indices[first_page:first_page + len(pages)]
        pieces = [Piece(0, layer * src_layer + s * page_bytes, layer * dst_layer + d * page_bytes, n * page_bytes)
                  for layer in range(layers) for s, d, n in _runs(pages, dst_pages)]
        if last:
            record = aux[0].numel() * aux.element_size()
            pieces.append(Piece(1, sender.aux_index * record, target.aux_index * record, record))
        return pieces

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
        sender.finish()
        self.stats.transfers[sender.state.name.lower()] += 1
        self._senders.pop(sender.room, None)
        self._remember_ended(sender.room, sender.message)


class KVSender(TransferRoom):
    """The prefill side of one room. Its pages are sent chunk by chunk (``send``); the room is
    done when every decode TP rank has every piece. The scheduler's thread polls, sends and aborts,
    each only queued; the loop's thread alone writes ``state``, ``message``, ``targets`` and
    ``last_sent`` (through the methods below the scheduler's, which check it)."""

    _transfer: PrefillTransfer

    def __init__(self, transfer: PrefillTransfer, room: int, aux_index: int) -> None:
        super().__init__(transfer, room)
        self.aux_index = aux_index
        self.targets: dict[int, _Target] = {}  # decode TP rank -> where its copy goes
        self.last_sent = False

    # ---- the scheduler's thread ------------------------------------------------------------------
    def send(self, first_page: int, pages: list[int], last: bool) -> None:
        """Push prompt pages ``first_page ..`` (held in ``pages`` of this rank); with ``last``, the
        aux record too (write it into ``aux[aux_index]`` first). Non-blocking."""
        self._transfer.send(self, first_page, pages, last)

    def abort(self, message: str = "aborted on the prefill side") -> None:
        self._failing = True
        self._transfer.fail(self, message)

    # ---- the loop's thread -----------------------------------------------------------------------
    def add_target(self, msg: RoomRequest, link: _PeerLink) -> None:
        """A decode TP rank's page indices; with every rank's, the room waits for its KV."""
        self._transfer.loop.check_thread()
        if self.state is not KVPoll.Bootstrapping:
            return
        self.targets[msg.tp_rank] = _Target(link, msg.page_indices, msg.aux_index)
        if len(self.targets) == msg.tp_size:
            self.state = KVPoll.WaitingForInput

    def start_chunk(self, last: bool) -> None:
        self._transfer.loop.check_thread()
        self.state, self.last_sent = KVPoll.Transferring, self.last_sent or last

    def fail(self, message: str) -> None:
        """``Failed`` is sticky, and a room that succeeded stays so."""
        self._transfer.loop.check_thread()
        if self.state is not KVPoll.Success:
            self.state, self.message = KVPoll.Failed, message

    def finish(self) -> None:
        """Every write landed: ``Success``, unless the room failed."""
        self._transfer.loop.check_thread()
        if self.state is not KVPoll.Failed:
            self.state = KVPoll.Success


class MirrorSender:
    """A sender of a rank that sends nothing: ready at once, done once its last chunk is "sent".
    The group's states are agreed as minimums, so the first rank's state is the group's. No loop
    touches it: the scheduler's thread alone reads and writes it."""

    def __init__(self, room: int) -> None:
        self.room, self.state, self.message = room, KVPoll.WaitingForInput, ""

    def poll(self) -> KVPoll:
        return self.state

    def send(self, first_page: int, pages: list[int], last: bool) -> None:
        if last and self.state is not KVPoll.Failed:
            self.state = KVPoll.Success

    def abort(self) -> None:
        self.state = KVPoll.Failed


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(first src page, first dst page, pages)`` for the runs where both page lists go up by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
