"""DeepSeek's expert-parallel load balancer (EPLB) as pure functions over CPU tensors.

From the load of each logical expert (tokens routed to it, per MoE layer) decide how many replicas
each expert gets and on which GPU each replica lives, so that the GPUs of one layer get even loads.

Sizes and abbreviations, defined once for the module:
- ``L`` layers, ``E`` logical experts, ``P`` physical slots (``P = E + redundant``), ``N`` GPUs
  (EP ranks), ``K`` nodes, ``G`` expert groups (``E / G`` consecutive experts each: the groups of
  DeepSeek-V3's group-limited routing);
- ``X = P - E + 1``: the most replicas one expert can have, the fixed width of ``log2phy``;
- ``phy2log [L, P]`` int64: the logical expert each physical slot holds; slot ``p`` lives on GPU
  ``p // (P / N)``, and GPU ``g`` on node ``g // (N / K)``;
- ``log2phy [L, E, X]`` int64: the slots holding each logical expert, in slot order, padded with -1;
- ``logcnt [L, E]`` int64: how many replicas each logical expert has.
The maps are those of ``placement.py`` (``ExpertPlacement.from_phy2log`` builds the same
``log2phy`` and ``logcnt`` from a ``phy2log``).

The policy. Hierarchical, when ``G % K == 0``: (1) pack the ``G`` groups onto the ``K`` nodes,
``G / K`` each, evening the nodes' loads (a group stays on one node, so group-limited routing keeps
traffic inside few nodes); (2) inside each node, replicate its ``E / K`` experts to ``P / K`` slots,
each extra replica going to the expert with the most load per replica; (3) pack the node's slots
onto its ``N / K`` GPUs, evening their loads and keeping an expert's replicas on different GPUs
where that is possible. Global otherwise: the same steps with one node and one group.

Everything is deterministic (ties go to the lower index), so every rank computes the same placement
from the same load.
"""

from __future__ import annotations

from collections import Counter, deque

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int,
                     labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items each,
    keeping the heaviest pack light: heaviest item first, each into the lightest pack with room.

    ``weight [R, n]``: ``R`` independent rows (layers, or layers x nodes) of item weights.
    ``labels [R, n]`` int64, optional: items of one label (replicas of one expert) spread over the
    packs, at most ``ceil(count / num_packs)`` of a label in a pack, so on different packs when the
    label has at most ``num_packs`` items (the greedy choice skips packs with their share of the
    label; when that leaves no pack with room, a chain of moves between packs makes room).
    Returns ``pack_index [R, n]`` and ``rank_in_pack [R, n]`` int64: item ``i`` takes place
    ``rank_in_pack[i]`` (``0 … n / num_packs - 1``) of pack ``pack_index[i]``.
    """
    rows, n = weight.shape
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"num_packs: {n} items do not split evenly into {num_packs} packs")
    per_pack = n // num_packs
    if per_pack == 1 or num_packs == 1:  # nothing to choose: keep the items' order
        place = torch.arange(n, dtype=torch.int64).expand(rows, n)
        zero = torch.zeros(rows, n, dtype=torch.int64)
        return (place.clone(), zero) if per_pack == 1 else (zero, place.clone())
    weights = weight.to(torch.float64).cpu()
    order = weights.sort(dim=-1, descending=True, stable=True).indices.tolist()
    label_rows = labels.tolist() if labels is not None else [[0] * n] * rows
    pack_index, rank_in_pack = [[0] * n for _ in range(rows)], [[0] * n for _ in range(rows)]
    for r in range(rows):
        packs = _Packs(num_packs, per_pack, weights[r].tolist(), label_rows[r], labels is not None)
        for item in order[r]:
            packs.add(item)
        for pack, items in enumerate(packs.members):
            for rank, item in enumerate(items):
                pack_index[r][item], rank_in_pack[r][item] = pack, rank
    return torch.tensor(pack_index, dtype=torch.int64), torch.tensor(rank_in_pack, dtype=torch.int64)


class _Packs:
    """One row of ``balanced_packing``: the packs' items, loads and labels as they fill."""

    def __init__(self, num_packs: int, per_pack: int, weight: list[float], labels: list[int],
                 constrained: bool) -> None:
        self.per_pack, self.weight, self.labels = per_pack, weight, labels
        self.members: list[list[int]] = [[] for _ in range(num_packs)]
        self.load = [0.0] * num_packs
        self.held: list[Counter[int]] = [Counter() for _ in range(num_packs)]
        # the most items of one label a pack may take: its even share, rounded up
        counts = Counter(labels)
        self.share = {lab: -(-count // num_packs) if constrained else per_pack for lab, count in counts.items()}

    def fits(self, pack: int, label: int) -> bool:
        return self.held[pack][label] < self.share[label]

    def lightest(self, packs: list[int]) -> int:
        return min(packs, key=lambda p: (self.load[p], p))

    def add(self, item: int) -> None:
        label = self.labels[item]
        open_packs = [p for p in range(len(self.members)) if len(self.members[p]) < self.per_pack]
        allowed = [p for p in open_packs if self.fits(p, label)]
        if allowed:
            self._put(self.lightest(allowed), item)
        elif not self._make_room(item):  # cannot happen (a spread assignment always exists); kept for safety
            self._put(self.lightest(open_packs), item)

    def _make_room(self, item: int) -> bool:
        """Place ``item`` when every pack with room has its share of the label: ``item`` into a full
        pack ``b1`` below its share of that label, one of ``b1``'s items into a pack ``b2`` below its
        share of that one's label, and so on, the last into a pack with room. This is an augmenting
        path of the assignment of items to packs (found breadth first, lighter packs first); one
        exists whenever a spread assignment of the items placed so far plus ``item`` does, and one
        always does: deal the items, grouped by label, round-robin over the packs."""
        by_load = sorted(range(len(self.members)), key=lambda p: (self.load[p], p))
        came_from: dict[int, tuple[int | None, int]] = {}  # pack -> (pack the item leaves, item)
        queue: deque[int] = deque()
        for pack in by_load:
            if self.fits(pack, self.labels[item]):
                came_from[pack] = (None, item)
                queue.append(pack)
        while queue:
            pack = queue.popleft()
            if len(self.members[pack]) < self.per_pack:
                self._shift(pack, came_from)
                return True
            for moved in self.members[pack]:
                for to in by_load:
                    if to not in came_from and self.fits(to, self.labels[moved]):
                        came_from[to] = (pack, moved)
                        queue.append(to)
        return False

    def _shift(self, end: int, came_from: dict[int, tuple[int | None, int]]) -> None:
        pack: int | None = end
        while pack is not None:
            source, moved = came_from[pack]
            self._put(pack, moved)
            if source is not None:
                self.members[source].remove(moved)
                self.load[source] -= self.weight[moved]
                self.held[source][self.labels[moved]] -= 1
            pack = source

    def _put(self, pack: int, item: int) -> None:
        self.members[pack].append(item)
        self.load[pack] += self.weight[item]
        self.held[pack][self.labels[item]] += 1


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Give ``n_logical`` experts ``num_phy`` slots: one each, then one more at a time to the expert
    with the most load per replica (``weight / logcnt``; ties go to the expert with fewer replicas,
    then to the lower index, so a layer without load gets its replicas spread as in the trivial
    placement).

    ``weight [R, n_logical]``: ``R`` independent rows of expert loads.
    Returns ``phy2log [R, num_phy]`` (the experts in order, then the extra replicas as they were
    given), ``rank [R, num_phy]`` (which replica of its expert each slot is, 0 for the first) and
    ``logcnt [R, n_logical]``, all int64.
    """
    rows, num_log = weight.shape
    if num_phy < num_log:
        raise ValueError(f"num_phy: {num_phy} slots are fewer than the {num_log} logical experts")
    load = weight.to(torch.float64).cpu()
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(rows, 1)
    rank = torch.zeros(rows, num_phy, dtype=torch.int64)
    logcnt = torch.ones(rows, num_log, dtype=torch.int64)
    row = torch.arange(rows)
    for slot in range(num_log, num_phy):
        per_replica = load / logcnt  # [R, n_logical]
        tied = per_replica == per_replica.max(dim=-1, keepdim=True).values
        hottest = logcnt.masked_fill(~tied, num_phy + 1).argmin(dim=-1)  # [R]; argmin: the first of equal minima
        phy2log[:, slot] = hottest
        rank[:, slot] = logcnt[row, hottest]
        logcnt[row, hottest] += 1
    return phy2log, rank, logcnt


def rebalance_experts(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int,
                      num_gpus: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A balanced placement of ``E`` logical experts in ``P = num_replicas`` slots over ``N =
    num_gpus`` GPUs on ``K = num_nodes`` nodes: hierarchical when the ``G = num_groups`` groups
    divide over the nodes, global otherwise (see the module docstring).

    ``weight [L, E]``: the load of each logical expert (tokens routed to it), int or float, >= 0.
    Returns ``phy2log [L, P]``, ``log2phy [L, E, X]`` (``X = P - E + 1``) and ``logcnt [L, E]``.
    Raises ValueError, naming the argument, for sizes that do not fit together.
    """
    _check_sizes(weight, num_replicas, num_groups, num_nodes, num_gpus)
    load = weight.to(torch.float64).cpu()
    if num_groups % num_nodes == 0:
        phy2log = _place(load, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log = _place(load, num_replicas, 1, 1, num_gpus)
    num_logical = weight.shape[1]
    logcnt = replica_counts(phy2log, num_logical)
    return phy2log, replica_slots(phy2log, logcnt, num_replicas - num_logical + 1), logcnt


def _check_sizes(weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int) -> None:
    if weight.dim() != 2:
        raise ValueError(f"weight: expected [layers, logical experts], got shape {tuple(weight.shape)}")
    num_logical = weight.shape[1]
    for name, value in [("num_replicas", num_replicas), ("num_groups", num_groups), ("num_nodes", num_nodes),
                        ("num_gpus", num_gpus)]:
        if value < 1:
            raise ValueError(f"{name}: must be >= 1, got {value}")
    if num_logical % num_groups:
        raise ValueError(f"num_groups: {num_logical} logical experts do not split into {num_groups} groups")
    if num_replicas < num_logical:
        raise ValueError(f"num_replicas: {num_replicas} physical slots are fewer than the {num_logical} logical "
                         f"experts")
    if num_gpus % num_nodes:
        raise ValueError(f"num_nodes: {num_gpus} GPUs do not divide over {num_nodes} nodes")
    if num_replicas % num_gpus:
        raise ValueError(f"num_gpus: {num_replicas} physical slots do not divide over {num_gpus} GPUs")
    if weight.numel() and not (torch.isfinite(weight).all() and (weight >= 0).all()):
        raise ValueError("weight: loads must be finite and >= 0")


def _place(weight: torch.Tensor, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int) -> torch.Tensor:
    """``phy2log [L, P]`` by the three hierarchical steps. ``nlog`` numbers the logical experts node by
    node (node ``k`` holds ``nlog`` ``k·E/K … (k+1)·E/K - 1``), the order steps 2 and 3 work in."""
    layers, num_log = weight.shape
    group_size, log_per_node, phy_per_node = num_log // num_groups, num_log // num_nodes, num_phy // num_nodes
    # 1. groups onto nodes
    group_load = weight.reshape(layers, num_groups, group_size).sum(-1)  # [L, G]
    node, rank_in_node = balanced_packing(group_load, num_nodes)  # [L, G]
    group_start = (node * (num_groups // num_nodes) + rank_in_node) * group_size  # [L, G] first nlog of the group
    log2nlog = (group_start.unsqueeze(-1) + torch.arange(group_size)).flatten(1)  # [L, E]
    nlog2log = _inverse(log2nlog)  # [L, E]
    # 2. replicas inside each node; rows are (layer, node)
    node_load = weight.gather(-1, nlog2log).view(layers * num_nodes, log_per_node)
    phy2nlog, _, nlogcnt = replicate_experts(node_load, phy_per_node)  # [L*K, P/K], node-local nlog
    # 3. each node's slots onto its GPUs
    replica_load = (node_load / nlogcnt).gather(-1, phy2nlog)  # [L*K, P/K]
    gpu, rank_in_gpu = balanced_packing(replica_load, num_gpus // num_nodes, labels=phy2nlog)
    slot = gpu * (num_phy // num_gpus) + rank_in_gpu  # [L*K, P/K] node-local slot of each replica
    slot2nlog = torch.empty_like(phy2nlog).scatter_(-1, slot, phy2nlog)  # [L*K, P/K]
    node_first = (torch.arange(num_nodes) * log_per_node).view(1, num_nodes, 1)
    nlog = (slot2nlog.view(layers, num_nodes, phy_per_node) + node_first).view(layers, num_phy)  # [L, P]
    return nlog2log.gather(-1, nlog)


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    """The inverse of each row's permutation ``perm [R, n]``."""
    return torch.empty_like(perm).scatter_(-1, perm, torch.arange(perm.shape[-1]).expand_as(perm))


def replica_counts(phy2log: torch.Tensor, num_logical: int) -> torch.Tensor:
    """``logcnt [L, E]`` of ``phy2log [L, P]``."""
    logcnt = torch.zeros(phy2log.shape[0], num_logical, dtype=torch.int64)
    return logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))


def replica_slots(phy2log: torch.Tensor, logcnt: torch.Tensor, width: int) -> torch.Tensor:
    """``log2phy [L, E, width]`` of ``phy2log [L, P]`` and its ``logcnt [L, E]``: slots in slot order."""
    layers, num_phy = phy2log.shape
    order = phy2log.sort(dim=-1, stable=True).indices  # [L, P] slots grouped by expert, in slot order
    log_of = phy2log.gather(-1, order)  # [L, P]
    first = logcnt.cumsum(-1) - logcnt  # [L, E] where each expert's run starts in ``order``
    replica = torch.arange(num_phy) - first.gather(-1, log_of)  # [L, P]
    log2phy = torch.full((layers, logcnt.shape[1], width), -1, dtype=torch.int64)
    log2phy.view(layers, -1).scatter_(-1, log_of * width + replica, order)
    return log2phy


def gpu_loads(phy2log: torch.Tensor, weight: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """The tokens each GPU gets, ``[L, N]`` float64, when each logical expert's load ``weight [L, E]``
    is split evenly over its replicas in ``phy2log [L, P]``."""
    layers, num_phy = phy2log.shape
    num_logical = weight.shape[1]
    if weight.shape[0] != layers:
        raise ValueError(f"weight: {weight.shape[0]} layers, phy2log has {layers}")
    if num_gpus < 1 or num_phy % num_gpus:
        raise ValueError(f"num_gpus: {num_phy} physical slots do not divide over {num_gpus} GPUs")
    if phy2log.numel() and (phy2log.min() < 0 or phy2log.max() >= num_logical):
        raise ValueError(f"phy2log: names experts outside [0, {num_logical})")
    load = weight.to(torch.float64).cpu()
    logcnt = replica_counts(phy2log, num_logical)
    if ((logcnt == 0) & (load > 0)).any():
        raise ValueError("phy2log: an expert with load has no physical slot")
    per_slot = (load / logcnt.clamp(min=1)).gather(-1, phy2log)  # [L, P]
    return per_slot.view(layers, num_gpus, num_phy // num_gpus).sum(-1)


def layer_balancedness(phy2log: torch.Tensor, weight: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """``[L]`` float64: mean over max of each layer's GPU loads (1.0 is perfect; 1.0 for a layer with
    no load)."""
    loads = gpu_loads(phy2log, weight, num_gpus)  # [L, N]
    peak = loads.max(-1).values
    return torch.where(peak > 0, loads.mean(-1) / peak.clamp(min=torch.finfo(torch.float64).tiny), 1.0)


def balancedness(phy2log: torch.Tensor, weight: torch.Tensor, num_gpus: int) -> float:
    """Mean of ``layer_balancedness`` over the layers with any load (1.0 when none has)."""
    return balancedness_of(gpu_loads(phy2log, weight, num_gpus))


def balancedness_of(loads: torch.Tensor) -> float:
    """Mean over the layers with any load of mean / max of the GPU loads ``[L, N]`` (1.0 when none
    has): what ``balancedness`` gives for a placement's estimate, and the recorder for measured loads."""
    loads = loads.to(torch.float64)
    peak = loads.max(-1).values  # [L]
    loaded = peak > 0
    if not loaded.any():
        return 1.0
    return float((loads.mean(-1)[loaded] / peak[loaded]).mean())


def trivial_phy2log(num_layers: int, num_logical: int, num_physical: int) -> torch.Tensor:
    """``phy2log [L, P]`` of the placement a server starts with: the logical experts in order, then
    replicas of experts 0, 1, 2, … in the redundant slots (as ``ExpertPlacement.trivial``)."""
    if num_physical < num_logical:
        raise ValueError(f"num_physical: {num_physical} slots are fewer than the {num_logical} logical experts")
    order = torch.arange(num_physical, dtype=torch.int64) % num_logical
    return order.expand(num_layers, num_physical).contiguous()
