"""The request table: every live request of a scheduler by id, and what they do with their pages
(take a cached prefix, give pages to the prefix cache, give them back)."""

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


def reuse_prefix(pages: PagePool, req: Req) -> None:
    """At the start of a prefill (nothing cached for ``req`` yet): take the prefix cache's pages of
    the longest whole-page prefix of its tokens, pinned for it, and start its prefill past them. At
    least one token is left to compute: the step samples from its logits."""
    cache = pages.cache
    if cache is None or req.page_table or req.params.prompt_logprobs is not None:  # every logit is wanted
        return
    match = cache.match(req.fill_slice(0, req.seq_len - 1))
    if match.pages:
        cache.lock(match.node)
        req.prefix_node, req.shared_pages = match.node, len(match.pages)
        req.page_table, req.kv_len = list(match.pages), match.num_tokens
    if req.num_retractions == 0:
        req.cached_tokens = match.num_tokens


def cache_prefix(pages: PagePool, req: Req) -> None:
    """Give the prefix cache ``req``'s computed whole pages now, while it runs on: where the cache
    already held a page (a twin request computed it too), ``req`` takes the cache's and frees its
    own; it pins the longer prefix from here."""
    cache, n = pages.cache, req.kv_len // pages.page_size
    if cache is None or n <= req.shared_pages:
        return
    node, cached = cache.insert(req.fill_slice(0, n * pages.page_size), req.page_table[:n])
    cache.lock(node)
    if req.prefix_node is not None:
        cache.unlock(req.prefix_node)
    pages.free([mine for mine, theirs in zip(req.page_table[:n], cached) if mine != theirs])
    req.page_table[:n] = cached
    req.prefix_node, req.shared_pages = node, n


def release_pages(pages: PagePool, req: Req, cache: bool = False) -> None:
    """Give back every page ``req`` holds; its cache is empty afterwards. With ``cache`` (a finished
    request) its computed whole pages go to the prefix cache first; otherwise (aborted, retracted)
    only its pins on cached pages are dropped."""
    if cache:
        cache_prefix(pages, req)
    if req.prefix_node is not None:
        pages.cache.unlock(req.prefix_node)
    pages.free(req.page_table[req.shared_pages:])
    req.page_table, req.kv_len, req.prefix_node, req.shared_pages = [], 0, None, 0
