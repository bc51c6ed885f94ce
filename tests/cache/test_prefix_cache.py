"""PrefixCache against its invariants and against a dict of page-aligned prefixes."""

from __future__ import annotations

import random

import pytest

from moeserve.cache.page_pool import PagePool
from moeserve.cache.prefix_cache import PrefixCache, TreeNode

PAGE = 4


class FakeClock:
    """Advances one tick per call, so LRU order is the order of operations."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def make_cache(num_pages: int = 64, page_size: int = PAGE) -> tuple[PrefixCache, PagePool]:
    pool = PagePool(num_pages, page_size)
    return PrefixCache(pool, clock=FakeClock()), pool


def cache_tokens(cache: PrefixCache, tokens: list[int]) -> tuple[TreeNode, list[int]]:
    """What the scheduler does after a prefill: allocate the whole pages, insert, free duplicates."""
    pages = cache.pool.alloc(len(tokens) // cache.page_size)
    node, tree_pages = cache.insert(tokens[:len(pages) * cache.page_size], pages)
    cache.pool.free([p for p in pages if p not in tree_pages])
    return node, tree_pages


def tree_prefixes(cache: PrefixCache) -> dict[tuple[int, ...], int]:
    """Every page-aligned prefix in the tree -> the page holding its last page of tokens."""
    ps, prefixes = cache.page_size, {}
    stack = [(cache.root, ())]
    while stack:
        node, above = stack.pop()
        for i, page in enumerate(node.pages):
            prefixes[above + node.key[:(i + 1) * ps]] = page
        stack.extend((child, above + node.key) for child in node.children.values())
    return prefixes


def path_pages(cache: PrefixCache, node: TreeNode) -> list[int]:
    pages = []
    while node is not cache.root:
        pages[:0] = node.pages
        node = node.parent
    return pages


def check_invariants(cache: PrefixCache, pool: PagePool) -> None:
    ps, owned, locked = cache.page_size, [], 0
    stack = [cache.root]
    while stack:
        node = stack.pop()
        owned += node.pages
        locked += len(node.pages) if node.lock_ref else 0
        if node is not cache.root:
            assert node.key and len(node.key) == len(node.pages) * ps
            assert node.parent.children[node.key[:ps]] is node
            assert node.lock_ref >= 0
            assert node.parent is cache.root or node.parent.lock_ref >= node.lock_ref
        for first, child in node.children.items():
            assert child.key[:ps] == first and child.parent is node
        stack.extend(node.children.values())
    assert len(owned) == len(set(owned)), "a page is owned twice"
    assert set(owned) <= pool._used and 0 not in owned
    assert cache.num_cached_pages == len(owned)
    assert cache.num_locked_pages == locked
    assert cache.num_evictable_pages + cache.num_locked_pages == cache.num_cached_pages


def test_match_returns_whole_pages_only() -> None:
    cache, pool = make_cache()
    tokens = list(range(12))
    _, pages = cache_tokens(cache, tokens)
    m = cache.match(tokens[:10])
    assert m.pages == pages[:2] and m.num_tokens == 8
    assert cache.match(tokens[:3]).pages == [] and cache.match(tokens[:3]).node is cache.root
    assert cache.match(tokens[:3]).num_tokens == 0
    check_invariants(cache, pool)


def test_match_on_empty_cache_returns_root() -> None:
    cache, _ = make_cache()
    m = cache.match(list(range(9)))
    assert m.pages == [] and m.node is cache.root and m.num_tokens == 0


def test_match_inside_a_node_splits_it_at_the_page_boundary() -> None:
    cache, pool = make_cache()
    tokens = list(range(12))
    leaf, pages = cache_tokens(cache, tokens)
    m = cache.match(tokens[:8] + [99, 99, 99, 99])
    assert m.pages == pages[:2] and m.node.key == tuple(tokens[:8]) and m.node.pages == pages[:2]
    assert m.node.children == {tuple(tokens[8:]): leaf}
    assert leaf.parent is m.node and leaf.key == tuple(tokens[8:]) and leaf.pages == pages[2:]
    assert cache.num_cached_pages == 3 and cache.num_evictable_pages == 3
    check_invariants(cache, pool)


def test_split_under_a_lock_keeps_lock_ref_and_counters() -> None:
    cache, pool = make_cache()
    tokens = list(range(12))
    leaf, pages = cache_tokens(cache, tokens)
    cache.lock(leaf)
    assert cache.num_locked_pages == 3 and cache.num_evictable_pages == 0
    upper = cache.match(tokens[:8]).node
    assert upper is leaf.parent and upper.lock_ref == 1
    check_invariants(cache, pool)
    cache.unlock(leaf)  # the handle taken before the split still unlocks the whole path
    assert upper.lock_ref == 0 and leaf.lock_ref == 0
    assert cache.num_locked_pages == 0 and cache.num_evictable_pages == 3
    check_invariants(cache, pool)


def test_insert_of_a_fully_cached_range_keeps_the_tree_pages() -> None:
    cache, pool = make_cache()
    tokens = list(range(8))
    node, pages = cache_tokens(cache, tokens)
    used = pool.num_used
    duplicates = pool.alloc(2)
    again, tree_pages = cache.insert(tokens, duplicates)
    assert again is node and tree_pages == pages and cache.num_cached_pages == 2
    assert pool.num_used == used + 2, "insert must not free the caller's duplicates"
    pool.free(duplicates)
    check_invariants(cache, pool)


def test_insert_of_a_partly_cached_range_takes_only_the_new_pages() -> None:
    cache, pool = make_cache()
    tokens = list(range(16))
    _, head = cache_tokens(cache, tokens[:8])
    caller = pool.alloc(4)
    node, tree_pages = cache.insert(tokens, caller)
    assert tree_pages == head + caller[2:]
    assert node.pages == caller[2:] and node.key == tuple(tokens[8:])
    assert cache.num_cached_pages == 4
    pool.free(caller[:2])
    check_invariants(cache, pool)


def test_insert_diverging_inside_a_node_splits_it() -> None:
    cache, pool = make_cache()
    a = list(range(12))
    b = a[:4] + [50, 51, 52, 53, 54, 55, 56, 57]
    _, pages_a = cache_tokens(cache, a)
    node_b, pages_b = cache_tokens(cache, b)
    assert pages_b[0] == pages_a[0] and pages_b[1:] != pages_a[1:]
    assert len(node_b.parent.children) == 2 and node_b.parent.pages == pages_a[:1]
    assert cache.num_cached_pages == 5
    check_invariants(cache, pool)


def test_insert_rejects_tokens_that_do_not_fill_the_pages() -> None:
    cache, pool = make_cache()
    with pytest.raises(ValueError):
        cache.insert(list(range(7)), pool.alloc(2))


def test_unlock_below_zero_raises() -> None:
    cache, _ = make_cache()
    node, _ = cache_tokens(cache, list(range(8)))
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(RuntimeError):
        cache.unlock(node)
    cache.lock(cache.root)  # the root is never locked, so these do nothing
    cache.unlock(cache.root)
    assert cache.root.lock_ref == 0


def test_evict_takes_least_recently_used_leaves_first() -> None:
    cache, pool = make_cache()
    old, old_pages = cache_tokens(cache, [1] * 8)
    new, new_pages = cache_tokens(cache, [2] * 8)
    cache.match([1] * 8)  # now [2]* is the least recently used
    free = pool.num_free
    assert cache.evict(1) == 2  # a whole leaf goes, more than asked
    assert pool.num_free == free + 2
    assert cache.match([2] * 8).pages == [] and cache.match([1] * 8).pages == old_pages
    check_invariants(cache, pool)


def test_evict_never_frees_locked_pages_and_cascades_to_parents() -> None:
    cache, pool = make_cache()
    shared = list(range(8))
    locked, locked_pages = cache_tokens(cache, shared + [10] * 4)
    cache_tokens(cache, [20] * 4 + [21] * 4)  # one node of two pages
    cache_tokens(cache, shared + [30] * 4)
    cache.lock(locked)
    free = pool.num_free
    assert cache.evict(100) == 3  # the [30] leaf, then [20, 21]; shared is an ancestor of a lock
    assert pool.num_free == free + 3
    assert tree_prefixes(cache).values() and set(tree_prefixes(cache).values()) == set(locked_pages)
    assert cache.num_evictable_pages == 0
    cache.unlock(locked)
    assert cache.evict(1) == 1  # the [10] leaf; its parent becomes a leaf but one page sufficed
    assert cache.evict(100) == 2
    assert cache.num_cached_pages == 0 and pool.num_used == 0
    check_invariants(cache, pool)


def test_reset_frees_everything_unless_locked() -> None:
    cache, pool = make_cache()
    node, _ = cache_tokens(cache, list(range(12)))
    cache_tokens(cache, list(range(4)) + [7] * 8)
    cache.lock(node)
    with pytest.raises(RuntimeError):
        cache.reset()
    cache.unlock(node)
    cache.reset()
    assert cache.num_cached_pages == 0 and pool.num_used == 0 and not cache.root.children
    with pytest.raises(RuntimeError):
        cache.lock(node)  # an evicted handle is stale
    check_invariants(cache, pool)


class Reference:
    """The cache as a dict: page-aligned prefix -> page of its last page, plus the held locks."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.prefixes: dict[tuple[int, ...], int] = {}
        self.held: list[tuple[TreeNode, tuple[int, ...]]] = []

    def match(self, tokens: list[int]) -> list[int]:
        pages = []
        for end in range(self.page_size, len(tokens) + 1, self.page_size):
            if tuple(tokens[:end]) not in self.prefixes:
                break
            pages.append(self.prefixes[tuple(tokens[:end])])
        return pages

    def pages_of(self, prefix: tuple[int, ...]) -> list[int]:
        return [self.prefixes[prefix[:end]] for end in range(self.page_size, len(prefix) + 1, self.page_size)]

    def locked_pages(self) -> set[int]:
        return {page for _, prefix in self.held for page in self.pages_of(prefix)}


def random_tokens(rng: random.Random, page_size: int) -> list[int]:
    # a tiny vocabulary and short prompts give many shared prefixes, splits and partial pages
    return [rng.randrange(3) for _ in range(rng.randrange(0, 6 * page_size))]


def step_insert(rng: random.Random, cache: PrefixCache, ref: Reference) -> None:
    tokens = random_tokens(rng, cache.page_size)
    num_pages = len(tokens) // cache.page_size
    tokens = tokens[:num_pages * cache.page_size]
    m = cache.match(tokens) if rng.random() < 0.7 else None  # else insert blind: all duplicates
    if m is not None:
        cache.lock(m.node)
    known = m.pages if m is not None else []
    fresh = cache.pool.alloc(num_pages - len(known))
    if fresh is None:
        evict_and_check(cache, ref, num_pages - len(known) - cache.pool.num_free)
        fresh = cache.pool.alloc(num_pages - len(known))
    if fresh is not None:
        node, tree_pages = cache.insert(tokens, known + fresh)
        assert tree_pages[:len(known)] == known
        for end, page in zip(range(cache.page_size, len(tokens) + 1, cache.page_size), tree_pages):
            assert ref.prefixes.setdefault(tuple(tokens[:end]), page) == page
        cache.pool.free([p for p in fresh if p not in tree_pages])
        cache.lock(node)
        ref.held.append((node, tuple(tokens)))
    if m is not None:
        cache.unlock(m.node)


def evict_and_check(cache: PrefixCache, ref: Reference, asked: int) -> None:
    """Evict, check what went against the held locks, and drop it from the reference."""
    evictable, free = cache.num_evictable_pages, cache.pool.num_free
    freed = cache.evict(asked)
    assert min(asked, evictable) <= freed <= evictable
    assert cache.pool.num_free == free + freed
    gone = {prefix for prefix, page in ref.prefixes.items() if page not in cache.pool._used}
    assert len(gone) == freed and not {ref.prefixes[p] for p in gone} & ref.locked_pages()
    for prefix in gone:
        del ref.prefixes[prefix]


def step_evict(rng: random.Random, cache: PrefixCache, ref: Reference) -> None:
    evict_and_check(cache, ref, rng.randrange(1, 12))


def step_match(rng: random.Random, cache: PrefixCache, ref: Reference) -> None:
    tokens = random_tokens(rng, cache.page_size)
    m = cache.match(tokens)
    assert m.pages == ref.match(tokens)
    assert m.num_tokens == len(m.pages) * cache.page_size
    assert path_pages(cache, m.node) == m.pages
    if rng.random() < 0.5:
        cache.lock(m.node)
        ref.held.append((m.node, tuple(tokens[:m.num_tokens])))


def step_unlock(rng: random.Random, cache: PrefixCache, ref: Reference) -> None:
    if ref.held:
        node, _ = ref.held.pop(rng.randrange(len(ref.held)))
        cache.unlock(node)


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_match_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    cache, pool = make_cache(num_pages=40, page_size=2)
    ref = Reference(cache.page_size)
    steps = [step_insert, step_insert, step_match, step_unlock, step_unlock, step_evict]
    for _ in range(1500):
        rng.choice(steps)(rng, cache, ref)
        check_invariants(cache, pool)
        assert tree_prefixes(cache) == ref.prefixes
        assert pool._used == set(ref.prefixes.values())
        assert cache.num_locked_pages == len(ref.locked_pages())
        for node, prefix in ref.held:  # handles survive splits and name the same tokens
            assert path_pages(cache, node) == ref.pages_of(prefix)
    while ref.held:
        step_unlock(rng, cache, ref)
    cache.reset()
    assert pool.num_used == 0 and cache.num_cached_pages == 0
