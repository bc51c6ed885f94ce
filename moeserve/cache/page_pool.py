"""Page allocator for the paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeserve.cache.prefix_cache import PrefixCache


class PagePool:
    """Hands out fixed-size pages of KV slots; slot ``s`` lies in page ``s // page_size``.

    Page 0 is never handed out: padded tokens (idle ranks, CUDA-graph padding) write there.

    With a prefix cache attached, the pages it holds that no request uses count as free: ``alloc``
    evicts them when the free list runs short, so admission and retraction see one number.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages, got {num_pages}")
        self.page_size = page_size
        self.capacity = num_pages - 1
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._used: set[int] = set()
        self.cache: PrefixCache | None = None

    def attach(self, cache: PrefixCache) -> None:
        self.cache = cache

    @property
    def num_free(self) -> int:
        """Pages ``alloc`` can hand out: free ones and cached ones no request uses."""
        return len(self._free) + (self.cache.num_evictable_pages if self.cache is not None else 0)

    @property
    def num_used(self) -> int:
        """Pages held by requests (cached pages that only the cache holds are not counted)."""
        return self.capacity - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages the prefix cache holds, in use by requests or not."""
        return self.cache.num_cached_pages if self.cache is not None else 0

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, num_pages: int) -> list[int] | None:
        """Take ``num_pages`` pages (evicting cached ones if need be), or None (taking nothing) when
        too few are free."""
        if num_pages > self.num_free:
            return None
        if num_pages > len(self._free):
            self.cache.evict(num_pages - len(self._free))
        pages = [self._free.pop() for _ in range(num_pages)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._used:
                raise RuntimeError(f"page {page} freed twice or never allocated")
            self._used.remove(page)
            self._free.append(page)
