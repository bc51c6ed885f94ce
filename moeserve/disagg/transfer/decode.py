"""The decode side of a rank's KV transfers. ``DecodeTransfer`` looks up each room's prefill rank
(the prefill server's bootstrap ``/route``), shakes hands with it over a DEALER socket (``Hello``),
sends the room's page indices (``RoomRequest``) and hears when the room ended (``RoomDone``);
its ``Heartbeat`` watches the prefill servers it has rooms with. ``KVReceiver`` is one room as
the scheduler sees it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field

import httpx
import zmq

from moeserve.disagg.transfer.base import KVPoll
from moeserve.disagg.transfer.heartbeat import Heartbeat
from moeserve.disagg.transfer.loop import KVArgs, KVTransfer, TransferRoom
from moeserve.disagg.transfer.protocol import (
    LOOKUP_TIMEOUT_S,
    Address,
    Hello,
    HelloReply,
    RoomAbort,
    RoomDone,
    RoomRequest,
    SideMessage,
    address_text,
    bootstrap_url,
    decode,
    encode,
)
from moeserve.scheduler.channel import connect, terminate

logger = logging.getLogger(__name__)
ROUTE_RETRY_S = 0.1  # a prefill server not up yet, or whose ranks are still registering, is asked again


@dataclass
class _Dealer:
    """The link to one prefill rank; ``ready`` is None until its ``HelloReply``."""

    sock: zmq.Socket
    ready: bool | None = None
    message: str = ""
    waiting: list[KVReceiver] = field(default_factory=list)  # rooms waiting for the handshake


class DecodeTransfer(KVTransfer):
    """A decode rank's transfers. A room whose prefill server dies (the heartbeat says) fails and
    settles at once; an aborted room whose indices left settles when the prefill rank confirms."""

    def __init__(self, args: KVArgs) -> None:
        super().__init__(args, "kv-decode")
        self.decode_id = f"{args.host}:{os.getpid()}:{args.identity.dp_rank}.{args.identity.tp_rank}"
        self._layouts: dict[Address, dict] = {}  # bootstrap server -> its /route answer
        self._dealers: dict[str, _Dealer] = {}  # prefill endpoint -> link
        self._receivers: dict[int, KVReceiver] = {}
        self.loop.start()
        self._heartbeat = Heartbeat(self)

    # ---- the scheduler's thread: commands for the loop -------------------------------------------
    def receiver(self, room: int, bootstrap_host: str, bootstrap_port: int, prefill_dp: int | None) -> KVReceiver:
        receiver = KVReceiver(self, room, (bootstrap_host, bootstrap_port))
        self.loop.submit(lambda: self._start_receiver(receiver, prefill_dp))
        return receiver

    def request_room(self, receiver: KVReceiver, page_indices: list[int], aux_index: int) -> None:
        """Queue the room's page indices for its prefill rank (``KVReceiver.init``)."""
        page_indices = list(page_indices)
        self.loop.submit(lambda: self._send_room(receiver, page_indices, aux_index))

    def abort(self, receiver: KVReceiver, message: str) -> None:
        """Queue the failure of ``receiver``'s room and the prefill rank's notice."""
        self.loop.submit(lambda: self._abort_room(receiver, message))

    # ---- any thread --------------------------------------------------------------------------------
    def watched(self) -> set[Address]:
        """The prefill servers (bootstrap addresses) this rank has rooms with."""
        return {r.bootstrap for r in tuple(self._receivers.values()) if not r.settled}

    def layout_instance(self, bootstrap: Address) -> str | None:
        """The instance id of the prefill server whose layout this rank uses."""
        layout = self._layouts.get(bootstrap)
        return None if layout is None else layout.get("instance")

    def prefill_gone(self, bootstrap: Address, why: str) -> None:
        """The prefill server at ``bootstrap`` died or restarted (the heartbeat says): queue the end
        of exactly its rooms and connections."""
        self.loop.submit(lambda: self._drop_prefill(bootstrap, why))

    def close(self) -> None:
        super().close()
        self._heartbeat.join()
        terminate(self.ctx)

    # ---- the loop's hooks ------------------------------------------------------------------------
    def sockets(self) -> list[zmq.Socket]:
        return [d.sock for d in self._dealers.values()]

    def receive(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        if len(frames) == 1 and (msg := decode(frames[0])) is not None:
            self._on_message(sock, msg)

    def expire(self, now: float) -> None:
        limits = self.args.deadlines
        for receiver in list(self._receivers.values()):
            if receiver.state is KVPoll.Bootstrapping and now - receiver.created > limits.bootstrap:
                self._end_receiver(receiver, f"the prefill server at {address_text(receiver.bootstrap)} did not "
                                             f"answer the route lookup and handshake within {limits.bootstrap:g} s "
                                             "(--disaggregation-bootstrap-timeout)")
            elif receiver.requested and now - receiver.requested_at > limits.waiting:
                # the role's abort tells the prefill side; the pages wait until it confirms
                receiver.fail(f"the KV cache of room {receiver.room} did not arrive within {limits.waiting:g} s "
                              "(--disaggregation-waiting-timeout)")

    # ---- the loop's thread: routes and handshakes ------------------------------------------------
    def _start_receiver(self, receiver: KVReceiver, prefill_dp: int | None) -> None:
        if receiver.state is KVPoll.Failed:  # aborted, timed out, or its prefill server died meanwhile
            receiver.settle()
            self._receivers.pop(receiver.room, None)
            return
        self._receivers[receiver.room] = receiver
        try:
            endpoint = self._route(receiver.bootstrap, receiver.room, prefill_dp)
        except (httpx.TransportError, LookupError):  # not up yet, or its ranks still registering
            self.loop.submit_after(ROUTE_RETRY_S, lambda: self._start_receiver(receiver, prefill_dp))
            return
        except (httpx.HTTPError, ValueError) as exc:
            self._end_receiver(receiver, f"the prefill server at {address_text(receiver.bootstrap)} could not be "
                                         f"used: {exc}")
            return
        dealer = self._dealers.get(endpoint) or self._shake_hands(endpoint)
        receiver.attach(dealer)
        dealer.waiting.append(receiver)
        if dealer.ready is not None:
            self._handshake_done(dealer)

    def _route(self, bootstrap: Address, room: int, prefill_dp: int | None) -> str:
        layout = self._layouts.get(bootstrap)
        if layout is None:
            r = httpx.get(f"{bootstrap_url(*bootstrap)}/route", timeout=LOOKUP_TIMEOUT_S)
            if r.status_code != 200:
                raise LookupError(f"bootstrap answered {r.status_code}: {r.text}")
            layout = self._layouts[bootstrap] = r.json()
        dp = room % layout["attn_dp_size"] if prefill_dp is None else prefill_dp
        if not 0 <= dp < layout["attn_dp_size"]:
            raise ValueError(f"prefill_dp_rank {dp} is not in [0, {layout['attn_dp_size']})")
        return layout["endpoints"][dp]

    def _shake_hands(self, endpoint: str) -> _Dealer:
        dealer = self._dealers[endpoint] = _Dealer(connect(self.ctx, zmq.DEALER, endpoint, self.keys))
        hello = Hello(self.decode_id, dataclasses.asdict(self.args.identity), self.backend.descriptor(),
                      int(self.args.kv.shape[1]))
        dealer.sock.send(encode(hello))
        return dealer

    def _on_message(self, sock: zmq.Socket, msg: SideMessage) -> None:
        if isinstance(msg, HelloReply):
            dealer = next(d for d in self._dealers.values() if d.sock is sock)
            dealer.ready, dealer.message = msg.ok, msg.message
            self._handshake_done(dealer)
        elif isinstance(msg, RoomDone):
            receiver = self._receivers.pop(msg.room, None)
            if receiver is not None:
                receiver.done(msg.ok, msg.message)
                receiver.settle()
                self.stats.transfers["success" if msg.ok else "failed"] += 1

    def _handshake_done(self, dealer: _Dealer) -> None:
        """The handshake with a prefill rank ended: its rooms may go on, or fail."""
        for receiver in dealer.waiting:
            if dealer.ready:
                receiver.advance(KVPoll.WaitingForInput)
            else:
                receiver.fail(dealer.message)
                receiver.settle()
        dealer.waiting.clear()

    # ---- the loop's thread: rooms ------------------------------------------------------------------
    def _send_room(self, receiver: KVReceiver, page_indices: list[int], aux_index: int) -> None:
        """The room's indices to its prefill rank, unless the room failed since the scheduler saw it
        ready (its prefill server died, or it was aborted): ``Failed`` stays."""
        if receiver.state is KVPoll.Failed:
            return
        receiver.mark_requested()
        ident = self.args.identity
        receiver.dealer.sock.send(encode(RoomRequest(
            receiver.room, self.decode_id, ident.tp_rank, ident.attn_tp_size, page_indices, aux_index)))

    def _abort_room(self, receiver: KVReceiver, message: str) -> None:
        """Fail the room and tell the prefill rank (so that it stops at once); the room settles when
        it confirms (its writes in flight landed), or at once when the indices never left."""
        receiver.fail(message)
        dealer = receiver.dealer
        if dealer is not None and dealer.ready and dealer in self._dealers.values():
            dealer.sock.send(encode(RoomAbort(receiver.room, self.decode_id)))
        if not receiver.requested:
            self._receivers.pop(receiver.room, None)
            receiver.settle()

    def _end_receiver(self, receiver: KVReceiver, message: str) -> None:
        """Fail a room nothing will write into any more (no indices sent, or its prefill server is gone)."""
        receiver.fail(message)
        receiver.settle()
        self._receivers.pop(receiver.room, None)

    def _drop_prefill(self, bootstrap: Address, why: str) -> None:
        """Fail exactly the rooms of the prefill server at ``bootstrap`` (nothing of it can write into
        their pages any more), drop its connections and its layout, so that a request naming it
        later looks it up and shakes hands anew."""
        message = f"the prefill server at {address_text(bootstrap)} {why}"
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


class KVReceiver(TransferRoom):
    """The decode side of one room. The scheduler's thread polls it, sends its page indices
    (``init``) and aborts it, each only queued; the loop's thread alone writes ``state``,
    ``message``, ``settled`` and where the room stands with its prefill rank (``dealer``,
    ``requested``), through the methods below the scheduler's, which check it. ``Failed`` is
    sticky: a failure that lands after a poll saw the room ready stays failed."""

    _transfer: DecodeTransfer

    def __init__(self, transfer: DecodeTransfer, room: int, bootstrap: Address) -> None:
        super().__init__(transfer, room)
        self.bootstrap = bootstrap
        self.dealer: _Dealer | None = None
        self.requested = False  # the prefill rank has this room's page indices
        self.requested_at = 0.0
        self.settled = False  # nothing of the prefill side will write into this room's pages any more

    # ---- the scheduler's thread ------------------------------------------------------------------
    def init(self, page_indices: list[int], aux_index: int) -> None:
        """Tell the prefill rank where this room's KV and aux record go; the room is
        ``Transferring`` once the loop sent them."""
        self._transfer.request_room(self, page_indices, aux_index)

    def abort(self, message: str = "aborted") -> None:
        self._failing = True
        self._transfer.abort(self, message)

    # ---- the loop's thread -----------------------------------------------------------------------
    def attach(self, dealer: _Dealer) -> None:
        self._transfer.loop.check_thread()
        self.dealer = dealer

    def advance(self, state: KVPoll) -> None:
        """Forward only, and never out of ``Failed``."""
        self._transfer.loop.check_thread()
        if self.state is not KVPoll.Failed and state > self.state:
            self.state = state

    def mark_requested(self) -> None:
        self.advance(KVPoll.Transferring)
        self.requested, self.requested_at = True, time.monotonic()

    def done(self, ok: bool, message: str) -> None:
        if ok:
            self.advance(KVPoll.Success)
        else:
            self.fail(message or "the prefill side failed the transfer")

    def fail(self, message: str) -> None:
        """``Failed`` is sticky, and a room that succeeded stays so."""
        self._transfer.loop.check_thread()
        if self.state is not KVPoll.Success:
            self.state, self.message = KVPoll.Failed, message

    def settle(self) -> None:
        self._transfer.loop.check_thread()
        self.settled = True
