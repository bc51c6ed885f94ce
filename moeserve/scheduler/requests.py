"""The request table: every live request of a scheduler by id, and the page release they share."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from moeserve.cache import PagePool
from moeserve.core import Req


class RequestTable:
    """Live requests by id; ``add`` stamps each with its arrival order (retraction picks the newest)."""

    def __init__(self) -> None:
        self._reqs: dict[str, Req] = {}
        self._arrivals = itertools.count()

    def add(self, req: Req) -> Req:
        if req.rid in self._reqs:
            raise ValueError(f"request id {req.rid!r} is already in use")
        req.arrival = next(self._arrivals)
        self._reqs[req.rid] = req
        return req

    def pop(self, rid: str) -> Req | None:
        return self._reqs.pop(rid, None)

    def get(self, rid: str) -> Req | None:
        return self._reqs.get(rid)

    def __contains__(self, rid: object) -> bool:
        return rid in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Req]:
        return iter(list(self._reqs.values()))


def release_pages(pages: PagePool, req: Req) -> None:
    """Give back every page ``req`` holds; its cache is empty afterwards."""
    pages.free(req.page_table)
    req.page_table = []
    req.kv_len = 0
