"""The roles of disaggregated serving.

```
prefill server:  bootstrap (wait for the decode side's page indices) -> prefill manager (chunked
                 prefill; each finished chunk's pages pushed at the end of its step) -> in flight
                 (the last push carries the aux record) -> done: pages freed, the request ends
decode server:   pre-allocation (find the prefill rank, take pages for the prompt and an aux slot,
                 send their indices) -> transfer (poll) -> the running decode batch, first token
                 from the aux record, no prefill compute here
```

With speculative decoding both sides hold the MTP layer's KV (the pool's last layer, pushed with
the others). The prefill side runs the MTP module over each chunk within the chunk's step, which is
why pushes wait for the end of the step; once the prompt is done it drafts a chain, taking each
draft's argmax, and the chain rides in the aux record. The decode server's first step verifies it,
as drawn from a point mass for sampled requests, so the rejection rule still keeps the output
distribution. (The drafts, not the last hidden state: the prefill side must run the MTP module over
the whole prompt anyway, for the KV the decode side's later drafts attend to.)

The ranks of one attention-TP group move a request on only when every one of them sees it ready
(``sched.collectives.tp_min`` over the states), so they keep scheduling the same batches.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from moeserve.core import FinishReason, Req
from moeserve.disagg.transfer.base import KVPoll
from moeserve.disagg.transfer.decode import DecodeTransfer, KVReceiver
from moeserve.disagg.transfer.prefill import KVSender, MirrorSender, PrefillTransfer
from moeserve.disagg.transfer.protocol import read_aux, write_aux
from moeserve.scheduler.requests import release_pages
from moeserve.scheduler.roles import Role

if TYPE_CHECKING:
    from moeserve.scheduler.scheduler import Scheduler

DRAIN_TIMEOUT_S = 60.0  # an aborted room whose prefill side never confirms frees its pages after this


class SlotPool:
    """Free-list of aux record slots."""

    def __init__(self, n: int) -> None:
        self._free = list(range(n - 1, -1, -1))

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)


def _agreed(sched: Scheduler, reqs: list[Req],
            transfers: dict[str, KVSender | MirrorSender | KVReceiver]) -> list[tuple[Req, KVPoll]]:
    """Each request with its transfer's state as the whole attention-TP group sees it (the minimum)."""
    states = sched.collectives.tp_min([int(transfers[r.rid].poll()) for r in reqs])
    return [(r, KVPoll(s)) for r, s in zip(list(reqs), states)]


def _needs_bootstrap(req: Req, side: str) -> None:
    if req.bootstrap is None:
        raise ValueError(f"a {side} server needs bootstrap_host, bootstrap_port and bootstrap_room "
                         "(send requests through the PD router)")


class PrefillRole(Role):
    name = "prefill"

    def __init__(self, kv_transfer: PrefillTransfer, aux_slots: int) -> None:
        self.kv_transfer = kv_transfer
        self.aux = SlotPool(aux_slots)
        self.bootstrapping: list[Req] = []
        self.in_flight: list[Req] = []
        self.senders: dict[str, KVSender | MirrorSender] = {}
        self.aux_of: dict[str, int] = {}
        self.sent_pages: dict[str, int] = {}
        self.pushes: list[tuple[Req, int, bool]] = []  # this step's, sent at its end

    def bind(self, sched: Scheduler) -> None:
        super().bind(sched)
        if sched.spec is not None:
            sched.spec.greedy_drafts = True  # the decode side gets the chain, not its distributions

    def validate(self, req: Req) -> None:
        _needs_bootstrap(req, "prefill")
        if self.aux.num_free == 0:
            raise RuntimeError("too many disaggregated requests in flight (no aux record slot is free)")

    def admit(self, req: Req) -> None:
        slot = self.aux.alloc()
        self.aux_of[req.rid] = slot
        self.senders[req.rid] = self.kv_transfer.sender(req.bootstrap.room, slot)
        self.sent_pages[req.rid] = 0
        self.bootstrapping.append(req)

    def poll(self) -> list[Req]:
        changed = []
        for req, state in _agreed(self.sched, self.bootstrapping, self.senders):
            if state is KVPoll.Failed:
                changed.append(self._fail(req))
            elif state >= KVPoll.WaitingForInput:
                self.bootstrapping.remove(req)
                self.sched.prefill.add(req)
        for req, state in _agreed(self.sched, self.in_flight, self.senders):
            if state is KVPoll.Failed:
                changed.append(self._fail(req))
            elif state is KVPoll.Success:
                self.in_flight.remove(req)
                self._forget(req)
                self.sched.finish(req, FinishReason.LENGTH, self.sched.detokenize(req, req.output_ids))
                changed.append(req)
        return changed

    def after_chunk(self, req: Req, start: int, end: int) -> None:
        if end < req.seq_len:  # the last chunk goes with the aux record, after sampling
            self.pushes.append((req, end // self.sched.pages.page_size, False))

    def after_prefill(self, req: Req) -> bool:
        self.pushes.append((req, self.sched.pages.pages_for(len(req.prompt_ids)), True))
        self.in_flight.append(req)
        return False  # the decode server decides when it stops

    def end_step(self) -> None:
        """Push this step's chunks, now that every layer's KV of them is written (the MTP module's
        runs after the model's), the last with its aux record and drafts."""
        spec, pushes, self.pushes = self.sched.spec, self.pushes, []
        for req, upto, last in pushes:
            if req.rid not in self.senders:  # failed or aborted within the step
                continue
            if last:
                drafts = spec.drafts.pop(req.rid, []) if spec is not None else []
                write_aux(self.kv_transfer.args.aux, self.aux_of[req.rid], req, drafts)
            first = self.sent_pages[req.rid]
            if upto > first or last:
                self.senders[req.rid].send(first, req.page_table[first:upto], last)
                self.sent_pages[req.rid] = upto

    def _fail(self, req: Req) -> Req:
        message = self.senders[req.rid].message or "the KV transfer failed"
        self.sched.fail(req, f"disaggregated prefill: {message}")
        return req

    def stage(self, req: Req) -> str | None:
        if req in self.bootstrapping:
            return "bootstrap"
        return "inflight" if req in self.in_flight else None

    def release(self, req: Req) -> bool:
        """Prefill pages are only read by a transfer, so they can go at once: a write still reading
        them sends stale bytes to a room that is failing anyway."""
        for queue in (self.bootstrapping, self.in_flight):
            if req in queue:
                queue.remove(req)
        if req.rid in self.senders:
            self.senders[req.rid].abort()
            self._forget(req)
        return False

    def _forget(self, req: Req) -> None:
        self.senders.pop(req.rid, None)
        self.sent_pages.pop(req.rid, None)
        self.aux.free(self.aux_of.pop(req.rid))

    @property
    def num_pending(self) -> int:
        return len(self.bootstrapping) + len(self.in_flight)

    def stats(self) -> dict[str, int]:
        return {"bootstrap": len(self.bootstrapping), "inflight": len(self.in_flight)}

    def transfer_stats(self) -> object:
        return self.kv_transfer.stats

    def close(self) -> None:
        self.kv_transfer.close()


class DecodeRole(Role):
    name = "decode"
    caches_prefixes = False  # its KV arrives from the prefill side

    def __init__(self, kv_transfer: DecodeTransfer, aux_slots: int) -> None:
        self.kv_transfer = kv_transfer
        self.aux = SlotPool(aux_slots)
        self.prealloc: list[Req] = []
        self.transfer: list[Req] = []
        self.draining: list[tuple[Req, KVReceiver, float]] = []  # aborted, pages held until the room settles
        self.receivers: dict[str, KVReceiver] = {}
        self.aux_of: dict[str, int] = {}

    def validate(self, req: Req) -> None:
        _needs_bootstrap(req, "decode")

    def admit(self, req: Req) -> None:
        b = req.bootstrap
        self.receivers[req.rid] = self.kv_transfer.receiver(b.room, b.host, b.port, b.prefill_dp_rank)
        self.prealloc.append(req)

    def poll(self) -> list[Req]:
        changed = self._preallocate()
        for req, state in _agreed(self.sched, self.transfer, self.receivers):
            if state is KVPoll.Failed:
                changed.append(self._fail(req))
            elif state is KVPoll.Success:
                self.transfer.remove(req)
                changed.append(self._start_decoding(req))
        self._drain()
        return changed

    def _preallocate(self) -> list[Req]:
        """In arrival order, as long as pages for the prompt fit beside the running requests' growth."""
        changed, blocked = [], False
        for req, state in _agreed(self.sched, self.prealloc, self.receivers):
            if state is KVPoll.Failed:
                changed.append(self._fail(req))
            elif state >= KVPoll.WaitingForInput and not blocked:
                blocked = not self._allocate(req)
        return changed

    def _allocate(self, req: Req) -> bool:
        pages = self.sched.pages
        need = pages.pages_for(len(req.prompt_ids))
        reserve = (len(self.sched.decode) + len(self.transfer)) * pages.pages_for(
            self.sched.config.scheduler.decode_reserve_tokens)
        slot = self.aux.alloc() if pages.num_free - reserve >= need else None
        if slot is None:
            return False
        req.page_table = pages.alloc(need)
        self.aux_of[req.rid] = slot
        self.prealloc.remove(req)
        self.transfer.append(req)
        # only queued: a failure that landed since the poll stays (the loop never revives a failed room)
        self.receivers[req.rid].init(req.page_table, slot)
        return True

    def _start_decoding(self, req: Req) -> Req:
        token, logprob, drafts = read_aux(self.kv_transfer.args.aux, self.aux_of[req.rid],
                                          req.params.logprobs is not None)
        self._forget(req)
        spec = self.sched.spec
        if spec is not None and len(drafts) != spec.num_drafts:  # the handshake compares the counts
            self.sched.fail(req, f"disaggregated decode: the prefill side sent {len(drafts)} draft tokens, "
                                 f"this server verifies {spec.num_drafts}")
            return req
        req.output_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        req.kv_len = len(req.prompt_ids)
        self.sched.decode.add(req)
        self.sched.check_finished(req)
        if spec is not None and not req.finished:
            spec.drafts[req.rid] = drafts
        return req

    def _fail(self, req: Req) -> Req:
        message = self.receivers[req.rid].message or "the KV transfer failed"
        self.sched.fail(req, f"disaggregated decode: {message}")
        return req

    def stage(self, req: Req) -> str | None:
        if req in self.prealloc:
            return "prealloc"
        if req in self.transfer:
            return "transferred" if self.receivers[req.rid].state is KVPoll.Success else "transfer"
        return None

    def after_prefill(self, req: Req) -> bool:
        """A retracted request prefills again here, from its tokens, then decodes on."""
        self.sched.decode.add(req)
        return True

    def release(self, req: Req) -> bool:
        """An aborted request whose pages the prefill side may still be writing keeps them until its
        room settles (the prefill side confirms) or ``DRAIN_TIMEOUT_S`` passes."""
        if req in self.prealloc:
            self.prealloc.remove(req)
        receiver = self.receivers.get(req.rid)
        writing = req in self.transfer
        if writing:
            self.transfer.remove(req)
        if receiver is not None:
            receiver.abort()
        if writing:  # its pages and aux slot wait for the room to settle
            self.draining.append((req, receiver, time.monotonic() + DRAIN_TIMEOUT_S))
            return True
        self._forget(req)
        return False

    def _drain(self) -> None:
        """Free what aborted rooms held, once every rank of the group sees the room settled."""
        now = time.monotonic()
        ready = self.sched.collectives.tp_min([int(r.settled or now > deadline) for _, r, deadline in self.draining])
        for entry, done in zip(list(self.draining), ready):
            if done:
                self.draining.remove(entry)
                self._forget(entry[0])
                release_pages(self.sched.pages, entry[0])

    def _forget(self, req: Req) -> None:
        self.receivers.pop(req.rid, None)
        slot = self.aux_of.pop(req.rid, None)
        if slot is not None:
            self.aux.free(slot)

    @property
    def num_pending(self) -> int:
        return len(self.prealloc) + len(self.transfer) + len(self.draining)

    def stats(self) -> dict[str, int]:
        return {"prealloc": len(self.prealloc), "transfer": len(self.transfer), "draining": len(self.draining)}

    def transfer_stats(self) -> object:
        return self.kv_transfer.stats

    def close(self) -> None:
        self.kv_transfer.close()
