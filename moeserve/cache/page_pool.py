"""Page allocator for the paged KV cache."""

from __future__ import annotations


class PagePool:
    """Hands out fixed-size pages of KV slots; slot ``s`` lies in page ``s // page_size``.

    Page 0 is never handed out: padded tokens (idle ranks, CUDA-graph padding) write there.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages, got {num_pages}")
        self.page_size = page_size
        self.capacity = num_pages - 1
        self._free = list(range(num_pages - 1, 0, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, num_pages: int) -> list[int] | None:
        """Take ``num_pages`` pages, or None (taking nothing) when too few are free."""
        if num_pages > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(num_pages)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            if page not in self._used:
                raise RuntimeError(f"page {page} freed twice or never allocated")
            self._used.remove(page)
            self._free.append(page)
