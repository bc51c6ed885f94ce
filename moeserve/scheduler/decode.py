"""The decode manager: the running batch, one token per request per step, and retraction."""

from __future__ import annotations

from moeserve.cache import PagePool
from moeserve.core import ForwardMode, Req, ReqStatus, ScheduleBatch, ScheduledSeq
from moeserve.scheduler.prefill import PrefillManager
from moeserve.scheduler.requests import release_pages


class DecodeManager:
    """``running`` requests decode together; when pages run short the newest are retracted: their
    pages are given back and they wait, first in line, to be prefilled again (greedy output does
    not change, since the cache is recomputed from the same tokens)."""

    def __init__(self, pages: PagePool, prefill: PrefillManager) -> None:
        self.pages, self.prefill = pages, prefill
        self.running: list[Req] = []
        self.retracted = 0  # total retractions, for metrics and tests
        self.lookahead = 0  # tokens past each request's end whose pages a step takes (speculative drafts)

    def __len__(self) -> int:
        return len(self.running)

    def add(self, req: Req) -> None:
        req.status = ReqStatus.RUNNING
        self.running.append(req)

    def release(self, req: Req) -> bool:
        if req in self.running:
            self.running.remove(req)
            return True
        return False

    def next_batch(self) -> ScheduleBatch | None:
        """One token for every running request, retracting the newest ones while pages are short
        (the half-prefilled request first: it has produced nothing yet)."""
        if not self.running:
            return None
        while self._pages_needed() > self.pages.num_free:
            if self.prefill.chunked is not None:
                self.retract(self.prefill.chunked)
            elif len(self.running) > 1:
                self.retract(max(self.running, key=lambda r: r.arrival))
            else:
                raise RuntimeError("the KV cache cannot hold a single request; admission should have refused it")
        for req in self.running:
            req.page_table += self.pages.alloc(max(self._short(req), 0))
        return ScheduleBatch(ForwardMode.DECODE, [ScheduledSeq(r, r.seq_len - 1, r.seq_len) for r in self.running])

    def _pages_needed(self) -> int:
        return sum(max(self._short(r), 0) for r in self.running)

    def _short(self, req: Req) -> int:
        """Pages ``req`` lacks for this step."""
        return self.pages.pages_for(req.seq_len + self.lookahead) - len(req.page_table)

    def retract(self, req: Req) -> None:
        """Give a request's pages back and queue it first; it re-prefills later."""
        if not self.release(req):
            self.prefill.release(req)
        release_pages(self.pages, req)
        req.num_retractions += 1
        self.retracted += 1
        self.prefill.add(req, first=True)
