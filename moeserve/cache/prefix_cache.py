"""Prefix cache: a radix tree over token ids whose nodes own KV pages of a ``PagePool``.

The design follows SGLang's ``RadixCache`` with ``page_size > 1``. Every node's ``key`` is a run of
whole pages of token ids and the node owns the pages holding their KV. Only whole pages are shared
because the request owning a partly filled page still writes into it. Children are keyed by their
first page of tokens, so siblings never share a first page and a walk costs one dict look-up per node.

A match may end inside a node's key; that node is then split at the page boundary so the returned
node ends exactly at the match and can be locked on its own. The split keeps the original object as
the lower half, so handles that running requests hold keep naming the same tokens.

``lock_ref`` counts the running requests using a node. Locking a node locks its whole path, so
``lock_ref`` never grows from parent to child and an unlocked node has an unlocked subtree: eviction
frees least-recently-used unlocked leaves, and a parent whose last child went becomes a candidate.

The cache holds no policy: the scheduler decides when to match, insert, lock, unlock and evict.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from moeserve.cache.page_pool import PagePool


class TreeNode:
    """A radix-tree node: ``key`` tokens whose KV lies in ``pages`` (``len(key) // page_size`` of them).

    ``children`` are keyed by their first page of tokens. An evicted node has ``parent`` None.
    """

    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key: tuple[int, ...], pages: list[int], parent: TreeNode | None,
                 last_access: float, lock_ref: int = 0) -> None:
        self.key = key
        self.pages = pages
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = lock_ref
        self.last_access = last_access

    def __repr__(self) -> str:
        return f"TreeNode(pages={self.pages}, lock_ref={self.lock_ref}, children={len(self.children)})"


@dataclass(frozen=True)
class PrefixMatch:
    """The cached pages of the longest whole-page prefix and the node it ends in (root when empty)."""

    pages: list[int]
    node: TreeNode

    @property
    def num_tokens(self) -> int:
        if not self.pages:
            return 0
        # every non-root node holds page_size tokens per page, so the node itself tells the page size
        return len(self.pages) * (len(self.node.key) // len(self.node.pages))


class PrefixCache:
    """Shares the KV pages of common prompt prefixes between requests; see the module docstring."""

    def __init__(self, pool: PagePool, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self._clock = clock
        self.root = TreeNode((), [], None, clock())
        # kept as counters so the scheduler can ask every step in O(1)
        self._evictable_pages = 0
        self._locked_pages = 0

    @property
    def num_cached_pages(self) -> int:
        return self._evictable_pages + self._locked_pages

    @property
    def num_evictable_pages(self) -> int:
        return self._evictable_pages

    @property
    def num_locked_pages(self) -> int:
        return self._locked_pages

    def match(self, token_ids: Sequence[int]) -> PrefixMatch:
        """Longest cached prefix of whole pages; a trailing partial page never matches."""
        num_tokens = len(token_ids) // self.page_size * self.page_size
        node, pages = self._walk(tuple(token_ids[:num_tokens]), self._clock())
        return PrefixMatch(pages, node)

    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> tuple[TreeNode, list[int]]:
        """Cache ``pages`` holding ``token_ids``; return the node ending there and the tree's pages.

        Where the tree already holds a page it keeps its own; the caller frees its duplicates.
        Only the pages past the cached prefix pass to the tree.
        """
        if len(token_ids) != len(pages) * self.page_size:
            raise ValueError(f"{len(token_ids)} tokens do not fill {len(pages)} pages of {self.page_size}")
        tokens, now = tuple(token_ids), self._clock()
        node, tree_pages = self._walk(tokens, now)
        start = len(tree_pages)
        if start < len(pages):
            node = self._add_leaf(node, tokens[start * self.page_size:], list(pages[start:]), now)
            tree_pages.extend(node.pages)
        return node, tree_pages

    def lock(self, node: TreeNode) -> None:
        """Pin ``node`` and its ancestors for a running request; locking the root does nothing."""
        if node is not self.root and node.parent is None:
            raise RuntimeError(f"{node} was evicted; lock a match before evicting")
        while node is not self.root:
            if node.lock_ref == 0:
                self._move_pages(len(node.pages), to_locked=True)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one ``lock``; ancestors hold at least the node's count, so checking the node suffices."""
        if node is not self.root and node.lock_ref == 0:
            raise RuntimeError(f"{node} unlocked more often than locked")
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._move_pages(len(node.pages), to_locked=False)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages (whole leaves, so maybe more) or all evictable ones.

        Returns the number freed. Least recently used unlocked leaves go first.
        """
        tie = itertools.count()  # nodes do not compare; equal times fall back to tree order
        heap = [(leaf.last_access, next(tie), leaf) for leaf in self._nodes() if self._is_evictable_leaf(leaf)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            leaf = heapq.heappop(heap)[2]
            parent = leaf.parent
            freed += self._remove_leaf(leaf)
            if self._is_evictable_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        return freed

    def reset(self) -> None:
        """Free every cached page; a locked page means a request still runs, which is a bug here."""
        if self._locked_pages:
            raise RuntimeError(f"{self._locked_pages} pages are locked by running requests")
        self.evict(self._evictable_pages)

    def _walk(self, tokens: tuple[int, ...], now: float) -> tuple[TreeNode, list[int]]:
        """Follow ``tokens`` (whole pages) down the tree, splitting where the match ends inside a key."""
        node, pages = self.root, []
        while len(pages) * self.page_size < len(tokens):
            child = node.children.get(self._page_key(tokens, len(pages)))
            if child is None:
                break
            num_matched = self._num_matched_pages(child, tokens, len(pages))
            if num_matched < len(child.pages):
                child = self._split(child, num_matched)
            child.last_access = now
            pages.extend(child.pages)
            node = child
        return node, pages

    def _page_key(self, tokens: tuple[int, ...], page: int) -> tuple[int, ...]:
        return tokens[page * self.page_size:(page + 1) * self.page_size]

    def _num_matched_pages(self, node: TreeNode, tokens: tuple[int, ...], start_page: int) -> int:
        """Whole pages of ``node.key`` equal to ``tokens`` from ``start_page``; the first matched by look-up."""
        ps = self.page_size
        offset = start_page * ps
        num_pages = min(len(node.pages), len(tokens) // ps - start_page)
        for i in range(1, num_pages):
            if node.key[i * ps:(i + 1) * ps] != tokens[offset + i * ps:offset + (i + 1) * ps]:
                return i
        return num_pages

    def _split(self, node: TreeNode, num_pages: int) -> TreeNode:
        """Cut ``node`` after ``num_pages`` pages; return the new upper half.

        The upper half inherits ``lock_ref``: every lock on ``node`` also locked its ancestors.
        Pages keep their lock state, so the counters do not change.
        """
        cut, ps = num_pages * self.page_size, self.page_size
        upper = TreeNode(node.key[:cut], node.pages[:num_pages], node.parent, node.last_access, node.lock_ref)
        node.parent.children[upper.key[:ps]] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[num_pages:], upper
        upper.children[node.key[:ps]] = node
        return upper

    def _add_leaf(self, parent: TreeNode, key: tuple[int, ...], pages: list[int], now: float) -> TreeNode:
        leaf = TreeNode(key, pages, parent, now)
        parent.children[key[:self.page_size]] = leaf
        self._evictable_pages += len(pages)
        return leaf

    def _remove_leaf(self, leaf: TreeNode) -> int:
        self.pool.free(leaf.pages)
        del leaf.parent.children[leaf.key[:self.page_size]]
        leaf.parent = None  # lets lock() reject a stale handle
        self._evictable_pages -= len(leaf.pages)
        return len(leaf.pages)

    def _is_evictable_leaf(self, node: TreeNode) -> bool:
        return node is not self.root and not node.children and node.lock_ref == 0

    def _move_pages(self, num_pages: int, to_locked: bool) -> None:
        sign = 1 if to_locked else -1
        self._locked_pages += sign * num_pages
        self._evictable_pages -= sign * num_pages

    def _nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
