"""Which requests run next: prefill admission with chunking, decode with retraction.

The policy only decides and reserves pages; running the model and handling its output belong to
the scheduler's step loop, so prefill-only and decode-only roles can swap policies.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moeserve.cache import PagePool
from moeserve.config import SchedulerConfig
from moeserve.core import ForwardMode, Req, ReqStatus, ScheduleBatch, ScheduledSeq


@dataclass
class Queues:
    """Requests by state. ``chunked`` is the one request whose prefill is split over steps."""

    waiting: deque[Req] = field(default_factory=deque)
    running: list[Req] = field(default_factory=list)
    chunked: Req | None = None

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running) + (self.chunked is not None)

    def all(self) -> list[Req]:
        return list(self.waiting) + self.running + ([self.chunked] if self.chunked else [])


class BatchPolicy:
    def __init__(self, config: SchedulerConfig, pages: PagePool) -> None:
        self.config = config
        self.pages = pages
        self.retracted = 0  # total retractions, for metrics and tests

    def next_batch(self, q: Queues) -> ScheduleBatch | None:
        """Prefill when there is prompt work that fits, else decode everything running."""
        batch = self._prefill(q)
        if batch is None and q.running:
            batch = self._decode(q)
        return batch

    def _token_budget(self) -> int:
        cfg = self.config
        return cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else cfg.max_prefill_tokens

    def _prefill(self, q: Queues) -> ScheduleBatch | None:
        budget, seqs = self._token_budget(), []
        reserve = len(q.running) * self.pages.pages_for(self.config.decode_reserve_tokens)
        candidates = ([q.chunked] if q.chunked else []) + list(q.waiting)
        for req in candidates:
            if budget <= 0 or (req is not q.chunked and len(q.running) + len(seqs) >= self.config.max_running_requests):
                break
            seq = self._plan_chunk(req, budget, reserve)
            if seq is None:
                break
            seqs.append(seq)
            budget -= seq.end - seq.start
            if req is not q.chunked:
                q.waiting.remove(req)
            q.chunked = None if seq.completes_fill else req
            if q.chunked is not None:
                break  # one partially prefilled request at a time
        return ScheduleBatch(ForwardMode.EXTEND, seqs) if seqs else None

    def _plan_chunk(self, req: Req, budget: int, reserve: int) -> ScheduledSeq | None:
        """Take as much of the request's unfilled tokens as the budget and free pages allow."""
        start = req.kv_len
        end = start + min(req.seq_len - start, budget)
        if self.config.chunked_prefill_size <= 0:
            end = req.seq_len  # no chunking: the whole prompt or nothing
        free_for_req = self.pages.num_free - reserve
        needed = self.pages.pages_for(end) - len(req.page_table)
        if needed > free_for_req:
            affordable = (len(req.page_table) + max(free_for_req, 0)) * self.pages.page_size
            if self.config.chunked_prefill_size <= 0 or affordable <= start:
                return None
            end = min(end, affordable)
            needed = self.pages.pages_for(end) - len(req.page_table)
        req.page_table += self.pages.alloc(needed)
        req.status = ReqStatus.RUNNING
        return ScheduledSeq(req, start, end)

    def _decode(self, q: Queues) -> ScheduleBatch:
        """One token for every running request, retracting the newest ones while pages are short."""
        while self._decode_pages_needed(q.running) > self.pages.num_free:
            if q.chunked is not None:
                self.retract(q, q.chunked)
            elif len(q.running) > 1:
                self.retract(q, max(q.running, key=lambda r: r.arrival))
            else:
                raise RuntimeError("the KV cache cannot hold a single request; admission should have refused it")
        for req in q.running:
            req.page_table += self.pages.alloc(self.pages.pages_for(req.seq_len) - len(req.page_table))
        return ScheduleBatch(ForwardMode.DECODE, [ScheduledSeq(r, r.seq_len - 1, r.seq_len) for r in q.running])

    def _decode_pages_needed(self, running: list[Req]) -> int:
        return sum(self.pages.pages_for(r.seq_len) - len(r.page_table) for r in running)

    def retract(self, q: Queues, req: Req) -> None:
        """Give a request's pages back and queue it first; it re-prefills later."""
        if req is q.chunked:
            q.chunked = None
        else:
            q.running.remove(req)
        self.release(req)
        req.status = ReqStatus.WAITING
        req.num_retractions += 1
        self.retracted += 1
        q.waiting.appendleft(req)

    def release(self, req: Req) -> None:
        self.pages.free(req.page_table)
        req.page_table = []
        req.kv_len = 0
