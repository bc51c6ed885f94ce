"""Cache-aware DP routing: send a prompt to the DP group whose prefix cache most likely holds it.

The controller cannot see the schedulers' radix caches, so it keeps an approximate one
(``PrefixTree``): the prompts it routed to each group, bounded per group and evicted least
recently used first, as the schedulers evict theirs. ``CacheAwareRouter`` is SGLang's
sgl-router ``cache_aware`` policy over it, with load counted in outstanding tokens.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class _Node:
    """One radix-tree edge: ``key`` is the run of token ids from the parent to this node;
    ``groups`` maps each DP group that holds it to its last access (a tick of the tree's clock).
    A group that holds a node holds all its ancestors."""

    key: list[int]
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)  # first token of the child's key -> child
    groups: dict[int, int] = field(default_factory=dict)


def _common_prefix_len(key: list[int], ids: list[int], start: int) -> int:
    """How many leading tokens of ``key`` equal ``ids[start:]``."""
    n = min(len(key), len(ids) - start)
    if key[:n] == ids[start:start + n]:  # the usual case, compared in C
        return n
    i = 0
    while key[i] == ids[start + i]:
        i += 1
    return i


class PrefixTree:
    """A radix tree over token ids shared by ``num_groups`` DP groups: each node records which
    groups hold it. ``match`` and ``insert`` take O(prompt length + groups x path nodes).

    Each group holds at most ``max_tokens`` tokens; past that, its least recently used leaves are
    dropped until it is back under ``max_tokens - max_tokens // 8``, so the O(tree) walk that
    finds the leaves is paid once per eighth of the budget inserted, not on every insert.
    """

    def __init__(self, num_groups: int, max_tokens: int = 2**20) -> None:
        if num_groups < 1 or max_tokens < 1:
            raise ValueError(f"num_groups ({num_groups}) and max_tokens ({max_tokens}) must be >= 1")
        self.root = _Node([], None)
        self.max_tokens = max_tokens
        self.sizes = [0] * num_groups  # tokens each group holds
        self._clock = itertools.count(1)

    def match(self, ids: list[int]) -> list[int]:
        """For each group, how many leading tokens of ``ids`` it holds."""
        lengths = [0] * len(self.sizes)
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                break
            matched = _common_prefix_len(child.key, ids, pos)
            pos += matched
            for group in child.groups:
                lengths[group] = pos
            if matched < len(child.key):
                break
            node = child
        return lengths

    def insert(self, ids: list[int], group: int) -> None:
        """Record that ``group`` now holds ``ids``, most recently used; then keep it under budget."""
        tick = next(self._clock)
        node, pos = self.root, 0
        while pos < len(ids):
            child = node.children.get(ids[pos])
            if child is None:
                child = node.children[ids[pos]] = _Node(ids[pos:], node)
            else:
                matched = _common_prefix_len(child.key, ids, pos)
                if matched < len(child.key):
                    child = self._split(child, matched)
            self._touch(child, group, tick)
            pos += len(child.key)
            node = child
        if self.sizes[group] > self.max_tokens:
            self._evict(group, self.max_tokens - self.max_tokens // 8)

    def _touch(self, node: _Node, group: int, tick: int) -> None:
        if group not in node.groups:
            self.sizes[group] += len(node.key)
        node.groups[group] = tick

    @staticmethod
    def _split(node: _Node, at: int) -> _Node:
        """Cut ``node``'s key after ``at`` tokens; the new upper node, holding the same groups, is returned."""
        upper = _Node(node.key[:at], node.parent, {node.key[at]: node}, dict(node.groups))
        node.parent.children[upper.key[0]] = upper
        node.key, node.parent = node.key[at:], upper
        return upper

    def _evict(self, group: int, target: int) -> None:
        """Drop ``group``'s least recently used leaves until it holds at most ``target`` tokens."""
        seq = itertools.count()  # ties never compare nodes
        heap = [(node.groups[group], next(seq), node) for node in self._leaves(group)]
        heapq.heapify(heap)
        while heap and self.sizes[group] > target:
            _, _, node = heapq.heappop(heap)
            del node.groups[group]
            self.sizes[group] -= len(node.key)
            parent = node.parent
            if not node.groups:
                del parent.children[node.key[0]]
            if parent is not self.root and not any(group in c.groups for c in parent.children.values()):
                heapq.heappush(heap, (parent.groups[group], next(seq), parent))

    def _leaves(self, group: int) -> list[_Node]:
        """Nodes ``group`` holds none of whose children it holds."""
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            held = [c for c in node.children.values() if group in c.groups]
            if held:
                stack.extend(held)
            elif node is not self.root:
                leaves.append(node)
        return leaves


class CacheAwareRouter:
    """SGLang's sgl-router ``cache_aware`` policy over DP groups, deterministic.

    ``load[d]`` is group ``d``'s outstanding tokens (prompt + tokens still to generate of its
    requests in flight), as ``shortest_queue`` counts them. The load is imbalanced when
    ``max - min > balance_abs_threshold`` and ``max > balance_rel_threshold * min``; then the least
    loaded group gets the request whatever its cache holds. Otherwise the group holding the
    longest prefix of the prompt gets it if that prefix is at least ``cache_threshold`` of the
    prompt (ties: the less loaded), else the least loaded group. Least loaded ties go to the group
    holding the fewest tokens (the most cache to spare), so an idle engine still spreads distinct
    prompts. The prompt is then recorded in the chosen group's tree.

    SGLang's router thresholds are 32 requests and 1.0001; the load here is tokens, so the absolute
    threshold defaults to 32 requests of 1,024 tokens.
    """

    def __init__(self, num_groups: int, cache_threshold: float = 0.5, balance_abs_threshold: int = 32 * 1024,
                 balance_rel_threshold: float = 1.0001, max_tokens_per_group: int = 2**20) -> None:
        self.tree = PrefixTree(num_groups, max_tokens_per_group)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def pick(self, ids: list[int], load: Sequence[int]) -> int:
        """The DP group for a prompt ``ids`` given each group's ``load``; records the choice."""
        group = self._choose(ids, load)
        self.tree.insert(ids, group)
        return group

    def _choose(self, ids: list[int], load: Sequence[int]) -> int:
        if self._imbalanced(load) or not ids:
            return self._least_loaded(load)
        lengths = self.tree.match(ids)
        best = min(range(len(load)), key=lambda d: (-lengths[d], load[d], d))
        if lengths[best] / len(ids) >= self.cache_threshold:
            return best
        return self._least_loaded(load)

    def _imbalanced(self, load: Sequence[int]) -> bool:
        high, low = max(load), min(load)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def _least_loaded(self, load: Sequence[int]) -> int:
        return min(range(len(load)), key=lambda d: (load[d], self.tree.sizes[d], d))
