"""The controller's approximate prefix tree against brute force, and the cache-aware policy's rule."""

from __future__ import annotations

import random

import pytest

from moeserve.server.prefix_routing import CacheAwareRouter, PrefixTree, _Node


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _check_structure(tree: PrefixTree) -> None:
    """A group holding a node holds its parent; ``sizes`` are the tokens of the nodes each group holds."""
    sizes = [0] * len(tree.sizes)
    stack: list[_Node] = list(tree.root.children.values())
    while stack:
        node = stack.pop()
        assert node.key and node.groups and node.parent.children[node.key[0]] is node
        assert node.parent is tree.root or set(node.groups) <= set(node.parent.groups)
        for group in node.groups:
            sizes[group] += len(node.key)
        stack.extend(node.children.values())
    assert sizes == tree.sizes


def _prompts(rng: random.Random, count: int) -> list[list[int]]:
    """Prompts sharing prefixes at random depths: each extends a cut of an earlier one."""
    prompts = [[rng.randrange(4) for _ in range(rng.randrange(1, 12))]]
    for _ in range(count - 1):
        base = rng.choice(prompts)
        prompts.append(base[:rng.randrange(len(base) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(12))])
    return [p for p in prompts if p]


def test_match_and_sizes_equal_brute_force():
    rng = random.Random(0)
    tree, held = PrefixTree(3), [[], [], []]
    for prompt in _prompts(rng, 300):
        group = rng.randrange(3)
        tree.insert(prompt, group)
        held[group].append(prompt)
        query = rng.choice(_prompts(rng, 5) + [prompt])
        assert tree.match(query) == [max((_common(p, query) for p in ps), default=0) for ps in held]
    _check_structure(tree)
    distinct_prefixes = [len({tuple(p[:i]) for p in ps for i in range(1, len(p) + 1)}) for ps in held]
    assert tree.sizes == distinct_prefixes


def test_match_stops_inside_an_edge_and_insert_splits_it():
    tree = PrefixTree(2)
    tree.insert([1, 2, 3, 4, 5], 0)
    assert tree.match([1, 2, 3, 9]) == [3, 0]
    tree.insert([1, 2, 3, 9], 1)
    assert tree.match([1, 2, 3, 4, 5, 6]) == [5, 3]
    assert tree.match([1, 2, 3, 9, 9]) == [3, 4]
    assert tree.match([7]) == [0, 0] and tree.match([]) == [0, 0]
    assert tree.sizes == [5, 4]
    _check_structure(tree)


def test_lru_leaves_are_evicted_per_group():
    tree = PrefixTree(2, max_tokens=25)  # past 25 tokens a group is cut to 25 - 25 // 8 = 22
    a, b, c = [1] * 10, [2] * 10, [3] * 10
    tree.insert(a, 0)
    tree.insert(b, 0)
    tree.insert(a, 0)  # a is now more recent than b
    tree.insert(a, 1)
    tree.insert(c, 0)
    assert [tree.match(p)[0] for p in (a, b, c)] == [10, 0, 10]
    assert tree.match(a)[1] == 10  # group 1's copy of a is its own
    assert tree.sizes == [20, 10]
    _check_structure(tree)


def test_eviction_drops_a_leaf_and_keeps_the_shared_prefix():
    tree = PrefixTree(1, max_tokens=24)  # cut to 21
    shared = [5] * 8
    tree.insert(shared + [1] * 6, 0)
    tree.insert(shared + [2] * 6, 0)
    tree.insert(shared + [3] * 6, 0)  # 26 tokens: the oldest suffix goes
    assert tree.match(shared + [1] * 6) == [8]
    assert tree.match(shared + [2] * 6) == [14] and tree.match(shared + [3] * 6) == [14]
    assert tree.sizes == [20]
    _check_structure(tree)


def test_random_inserts_stay_in_budget_and_keep_the_latest_prompt():
    rng = random.Random(1)
    tree = PrefixTree(2, max_tokens=40)
    for prompt in _prompts(rng, 400):
        prompt, group = prompt[:20], rng.randrange(2)
        tree.insert(prompt, group)
        assert max(tree.sizes) <= 40
        assert tree.match(prompt)[group] == len(prompt)  # shorter than the budget: never its own victim
    _check_structure(tree)


def test_a_prompt_longer_than_the_budget_is_bounded():
    tree = PrefixTree(1, max_tokens=8)
    tree.insert(list(range(100)), 0)
    assert tree.sizes[0] <= 8
    _check_structure(tree)


SYSTEM = list(range(100, 164))  # a 64-token system prompt


def test_a_shared_prefix_sticks_to_one_group():
    router = CacheAwareRouter(4)
    load = [0, 0, 0, 0]
    first = router.pick(SYSTEM + [1, 2], load)
    load[first] += 500  # still balanced: under the absolute threshold
    for question in range(10):
        group = router.pick(SYSTEM + [question] * 4, load)
        assert group == first
        load[group] += 500


def test_distinct_prefixes_spread_over_groups():
    router = CacheAwareRouter(4)
    idle = [router.pick([p] * 32, [0, 0, 0, 0]) for p in range(4)]  # idle: the group holding least
    assert sorted(idle) == [0, 1, 2, 3]
    busy = CacheAwareRouter(4)
    load = [0, 0, 0, 0]
    for p in range(4):
        group = busy.pick([p] * 32, load)
        load[group] += 100
    assert load == [100] * 4


def test_imbalance_falls_back_to_the_least_loaded_group():
    router = CacheAwareRouter(2, balance_abs_threshold=1000)
    assert router.pick(SYSTEM, [0, 0]) == 0
    assert router.pick(SYSTEM + [1], [1000, 0]) == 0  # a difference of exactly the threshold is balanced
    assert router.pick(SYSTEM + [2], [1001, 0]) == 1
    assert router.tree.match(SYSTEM + [2]) == [len(SYSTEM), len(SYSTEM) + 1]  # recorded where it went


def test_relative_threshold():
    router = CacheAwareRouter(2, balance_abs_threshold=10, balance_rel_threshold=2.0)
    router.pick(SYSTEM, [0, 0])
    assert router.pick(SYSTEM, [150, 100]) == 0  # 50 apart but under twice the least
    assert router.pick(SYSTEM + [1], [250, 100]) == 1


def test_a_short_match_goes_to_the_least_loaded_group():
    router = CacheAwareRouter(3)
    assert router.pick(SYSTEM[:10], [0, 0, 0]) == 0
    assert router.pick(SYSTEM[:9] + [0] * 20, [5, 0, 7]) == 1  # 9 of 29 tokens matched: under 0.5


def test_equal_matches_go_to_the_less_loaded_group():
    router = CacheAwareRouter(3, balance_abs_threshold=100)
    assert router.pick(SYSTEM, [0, 0, 0]) == 0
    assert router.pick(SYSTEM, [200, 0, 200]) == 1  # imbalanced: SYSTEM now in groups 0 and 1
    assert router.pick(SYSTEM + [1], [10, 30, 20]) == 0
    assert router.pick(SYSTEM + [2], [40, 30, 20]) == 1


@pytest.mark.parametrize("groups,tokens", [(0, 8), (2, 0)])
def test_tree_rejects_empty_budgets(groups, tokens):
    with pytest.raises(ValueError):
        PrefixTree(groups, tokens)
