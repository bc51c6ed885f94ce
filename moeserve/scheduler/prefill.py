"""The prefill manager: admission and chunking of prompt work (and of re-prefills after retraction)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from moeserve.cache import PagePool
from moeserve.config import SchedulerConfig
from moeserve.core import ForwardMode, Req, ReqStatus, ScheduleBatch, ScheduledSeq
from moeserve.scheduler.requests import release_pages, reuse_prefix


class PrefillManager:
    """``waiting`` requests in order; ``chunked`` is the one whose prefill is split over steps.

    It only decides and reserves pages; the scheduler runs the batch and the role decides where a
    request goes once its prefill is done.
    """

    def __init__(self, config: SchedulerConfig, pages: PagePool, clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.pages, self.clock = config, pages, clock
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None
        # prompt tokens of requests that started their first prefill, and those the prefix cache held
        self.prompt_tokens = self.cached_tokens = 0
        self.lookahead = 0  # tokens past the prompt whose pages a completed prefill takes (draft tokens)

    def __len__(self) -> int:
        return len(self.waiting) + (self.chunked is not None)

    def add(self, req: Req, first: bool = False) -> None:
        req.status = ReqStatus.WAITING
        # a retracted request had been admitted once and its client may hold tokens of it: the
        # queue timeout is for requests never started, so only those are stamped
        req.queued_at = self.clock() if req.num_retractions == 0 else None
        if first:
            self.waiting.appendleft(req)
        elif self.config.enable_priority_scheduling:  # behind every request that comes first or ties
            rank = self._rank(req)
            at = next((i for i, r in enumerate(self.waiting) if self._rank(r) > rank and r.num_retractions == 0),
                      len(self.waiting))
            self.waiting.insert(at, req)
        else:
            self.waiting.append(req)

    def _rank(self, req: Req) -> int:
        """Smaller is admitted first."""
        return req.params.priority if self.config.schedule_low_priority_values_first else -req.params.priority

    def release(self, req: Req) -> bool:
        """Forget ``req`` if it is here (its pages stay with the caller); True if it was."""
        if req is self.chunked:
            self.chunked = None
            return True
        if req in self.waiting:
            self.waiting.remove(req)
            return True
        return False

    def overdue(self, timeout: float) -> list[int]:
        """1 for each ``waiting`` request (in order) that has waited more than ``timeout`` seconds
        without ever being scheduled, else 0."""
        now = self.clock()
        return [int(r.queued_at is not None and now - r.queued_at > timeout) for r in self.waiting]

    def next_batch(self, num_running: int) -> ScheduleBatch | None:
        """As much prompt work as the token budget, the running-request cap and the free pages
        (keeping ``decode_reserve_tokens`` of headroom per running request) allow."""
        budget, seqs = self._token_budget(), []
        reserve = num_running * self.pages.pages_for(self.config.decode_reserve_tokens)
        candidates = ([self.chunked] if self.chunked else []) + list(self.waiting)
        for req in candidates:
            if budget <= 0 or (req is not self.chunked
                               and num_running + len(seqs) >= self.config.max_running_requests):
                break
            seq = self._plan_chunk(req, budget, reserve)
            if seq is None:
                break
            seqs.append(seq)
            budget -= seq.end - seq.start
            if req is not self.chunked:
                self.waiting.remove(req)
                if req.num_retractions == 0:
                    self.prompt_tokens += len(req.prompt_ids)
                    self.cached_tokens += req.cached_tokens
            req.queued_at = None  # its prefill has started: never timed out from here
            self.chunked = None if seq.completes_fill else req
            if self.chunked is not None:
                break  # one partially prefilled request at a time
        return ScheduleBatch(ForwardMode.EXTEND, seqs) if seqs else None

    def _token_budget(self) -> int:
        cfg = self.config
        return cfg.chunked_prefill_size if cfg.chunked_prefill_size > 0 else cfg.max_prefill_tokens

    def _plan_chunk(self, req: Req, budget: int, reserve: int) -> ScheduledSeq | None:
        """Take as much of the request's unfilled tokens as the budget and free pages allow, past
        the prefix the cache holds for a prefill that starts here."""
        reuse_prefix(self.pages, req)
        seq = self._fit_chunk(req, budget, reserve)
        if seq is None and req.prefix_node is not None and req is not self.chunked:
            release_pages(self.pages, req)  # it waits on: its pins must not hold back eviction
        return seq

    def _fit_chunk(self, req: Req, budget: int, reserve: int) -> ScheduledSeq | None:
        start = req.kv_len
        end = start + min(req.seq_len - start, budget)
        if self.config.chunked_prefill_size <= 0:
            end = req.seq_len  # no chunking: the whole prompt or nothing
        free_for_req = self.pages.num_free - reserve
        needed = self.pages.pages_for(end + (self.lookahead if end == req.seq_len else 0)) - len(req.page_table)
        if needed > free_for_req:
            affordable = (len(req.page_table) + max(free_for_req, 0)) * self.pages.page_size
            if self.config.chunked_prefill_size <= 0 or affordable <= start:
                return None
            end = min(end, affordable)
            if end == req.seq_len and self.lookahead:  # completing takes the drafts' pages too: later
                end -= 1
            if end <= start:
                return None
            needed = self.pages.pages_for(end) - len(req.page_table)
        req.page_table += self.pages.alloc(max(needed, 0))
        req.status = ReqStatus.RUNNING
        return ScheduledSeq(req, start, end)
