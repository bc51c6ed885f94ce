"""The balancer's pure functions: the maps agree, every GPU gets the same number of slots, replicas
spread, the hierarchical policy keeps groups on one node, and a skewed load gets better balanced
with more redundant slots than a plain greedy placement does."""

from __future__ import annotations

import pytest
import torch

from moeserve.eplb.algorithm import (
    balanced_packing,
    balancedness,
    gpu_loads,
    layer_balancedness,
    rebalance_experts,
    replicate_experts,
    trivial_phy2log,
)
from moeserve.eplb.placement import ExpertPlacement


def zipf_load(layers: int, experts: int, s: float = 1.5, seed: int = 0, tokens: float = 1e5) -> torch.Tensor:
    """``[L, E]`` Zipf-distributed load, the expert ranks permuted at random in each layer."""
    gen = torch.Generator().manual_seed(seed)
    base = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** s
    return torch.stack([base[torch.randperm(experts, generator=gen)] for _ in range(layers)]) * tokens


def greedy_baseline(weight: torch.Tensor, num_redundant: int, num_gpus: int) -> torch.Tensor:
    """``phy2log [L, P]``: the experts, then replicas of the heaviest ones, dealt round-robin to GPUs."""
    layers, experts = weight.shape
    num_physical = experts + num_redundant
    per_gpu = num_physical // num_gpus
    rows = []
    for layer in range(layers):
        hottest = weight[layer].argsort(descending=True, stable=True).tolist()
        physical = list(range(experts)) + [hottest[i % experts] for i in range(num_redundant)]
        row = [0] * num_physical
        for i, expert in enumerate(physical):
            row[(i % num_gpus) * per_gpu + i // num_gpus] = expert
        rows.append(row)
    return torch.tensor(rows)


def check_maps(phy2log, log2phy, logcnt, num_logical, num_physical):
    """The three maps describe one placement, exactly as ``ExpertPlacement`` builds it."""
    layers = phy2log.shape[0]
    assert phy2log.shape == (layers, num_physical) and phy2log.dtype == torch.int64
    assert log2phy.shape == (layers, num_logical, num_physical - num_logical + 1) and log2phy.dtype == torch.int64
    assert logcnt.shape == (layers, num_logical) and (logcnt >= 1).all()
    assert (logcnt.sum(-1) == num_physical).all()
    reference = ExpertPlacement.from_phy2log(phy2log, num_logical, 1)
    assert torch.equal(logcnt, reference.logcnt) and torch.equal(log2phy, reference.log2phy)
    for layer in range(layers):
        for expert in range(num_logical):
            slots = log2phy[layer, expert]
            assert (slots[: logcnt[layer, expert]] >= 0).all() and (slots[logcnt[layer, expert]:] == -1).all()
            assert (phy2log[layer, slots[: logcnt[layer, expert]]] == expert).all()


def most_copies_on_one_gpu(phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """``[L, E]``: the most replicas of each expert any one GPU holds."""
    layers, num_physical = phy2log.shape
    gpu = torch.arange(num_physical) // (num_physical // num_gpus)
    num_logical = int(phy2log.max()) + 1
    copies = torch.zeros(layers, num_gpus, num_logical, dtype=torch.int64)
    copies.view(layers, -1).scatter_add_(1, gpu * num_logical + phy2log, torch.ones_like(phy2log))
    return copies.max(1).values


SIZES = [  # (L, E, P, G, K, N)
    (3, 16, 16, 4, 2, 4),
    (3, 16, 24, 4, 2, 4),
    (4, 64, 96, 8, 2, 8),
    (4, 64, 80, 8, 1, 8),
    (2, 24, 36, 3, 2, 6),  # G % K != 0: global
    (2, 12, 16, 4, 4, 4),  # one GPU per node
]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("load", ["zipf", "uniform", "zero", "one_hot"])
def test_rebalance_gives_consistent_maps_and_equal_slots_per_gpu(sizes, load):
    layers, experts, physical, groups, nodes, gpus = sizes
    weight = {"zipf": zipf_load(layers, experts, seed=1), "uniform": torch.ones(layers, experts) * 7,
              "zero": torch.zeros(layers, experts, dtype=torch.int64),
              "one_hot": torch.nn.functional.one_hot(torch.arange(layers) % experts, experts) * 1000}[load]
    phy2log, log2phy, logcnt = rebalance_experts(weight, physical, groups, nodes, gpus)
    check_maps(phy2log, log2phy, logcnt, experts, physical)
    # phy2log has P slots, P / N per GPU by construction: what is checked is that the GPUs' loads add up
    loads = gpu_loads(phy2log, weight, gpus)
    assert loads.shape == (layers, gpus)
    torch.testing.assert_close(loads.sum(-1), weight.double().sum(-1))


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("seed", range(4))
def test_replicas_of_one_expert_spread_over_the_gpus(sizes, seed):
    """No GPU holds two replicas of an expert unless the expert has more replicas than its node has
    GPUs; then each holds at most its even share."""
    layers, experts, physical, groups, nodes, gpus = sizes
    for s in (0.8, 1.5, 3.0):
        weight = zipf_load(layers, experts, s=s, seed=seed)
        phy2log, _, logcnt = rebalance_experts(weight, physical, groups, nodes, gpus)
        gpus_per_node = gpus // nodes if groups % nodes == 0 else gpus
        share = (logcnt + gpus_per_node - 1) // gpus_per_node  # [L, E]
        assert (most_copies_on_one_gpu(phy2log, gpus) <= share).all()


def test_balanced_packing_keeps_labels_apart_even_when_greedy_would_not():
    # unlabelled greedy: 10 -> pack 0, then both 1s -> pack 1 (the lighter); labelled: one 1 each
    weight = torch.tensor([[10.0, 1.0, 1.0, 0.5]])
    pack, _ = balanced_packing(weight, 2)
    assert pack[0, 1] == pack[0, 2]
    pack, rank = balanced_packing(weight, 2, labels=torch.tensor([[0, 1, 1, 2]]))
    assert pack[0, 1] != pack[0, 2]
    # greedy alone gets stuck (the last item's label is in the only pack with room): a move makes room
    weight, labels = torch.tensor([[10.0, 9.0, 1.0, 1.0]]), torch.tensor([[0, 1, 2, 0]])
    pack, rank = balanced_packing(weight, 2, labels=labels)
    assert pack[0, 0] != pack[0, 3]
    assert sorted(zip(pack[0].tolist(), rank[0].tolist())) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def reference_packing(weights: list[float], num_packs: int) -> list[tuple[int, int]]:
    """(pack, rank in pack) of each item: heaviest first (ties: lower index), into the lightest pack
    with room (ties: lower pack)."""
    per_pack = len(weights) // num_packs
    loads, sizes, place = [0.0] * num_packs, [0] * num_packs, [(0, 0)] * len(weights)
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        pack = min((p for p in range(num_packs) if sizes[p] < per_pack), key=lambda p: (loads[p], p))
        place[item] = (pack, sizes[pack])
        loads[pack] += weights[item]
        sizes[pack] += 1
    return place


@pytest.mark.parametrize("num_packs", [2, 4, 8])
def test_balanced_packing_is_the_greedy_heaviest_first_packing(num_packs):
    weight = torch.cat([zipf_load(3, 32, seed=3), torch.randint(0, 4, (2, 32)).double()])  # the last rows: ties
    pack, rank = balanced_packing(weight, num_packs)
    for row in range(weight.shape[0]):
        assert list(zip(pack[row].tolist(), rank[row].tolist())) == reference_packing(weight[row].tolist(), num_packs)


def test_balanced_packing_with_nothing_to_choose_keeps_the_order():
    weight = zipf_load(2, 6)
    pack, rank = balanced_packing(weight, 6)
    assert pack.tolist() == [list(range(6))] * 2 and rank.tolist() == [[0] * 6] * 2
    pack, rank = balanced_packing(weight, 1)
    assert pack.tolist() == [[0] * 6] * 2 and rank.tolist() == [list(range(6))] * 2
    with pytest.raises(ValueError, match="num_packs"):
        balanced_packing(weight, 4)


def test_replicate_experts_gives_extra_replicas_to_the_most_loaded_per_replica():
    weight = torch.tensor([[100.0, 10.0, 60.0, 0.0]])
    phy2log, rank, logcnt = replicate_experts(weight, 7)
    # per replica: 100 > 60 -> expert 0 (50); 60 > 50 -> expert 2 (30); 50 > 33.3 -> expert 0
    assert phy2log.tolist() == [[0, 1, 2, 3, 0, 2, 0]]
    assert rank.tolist() == [[0, 0, 0, 0, 1, 1, 2]]
    assert logcnt.tolist() == [[3, 1, 2, 1]]


def test_replicate_experts_spreads_replicas_over_equal_loads():
    phy2log, _, logcnt = replicate_experts(torch.zeros(2, 5), 12)
    assert phy2log.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]] * 2  # as the trivial placement
    assert logcnt.tolist() == [[3, 3, 2, 2, 2]] * 2
    _, _, logcnt = replicate_experts(torch.tensor([[6.0, 6.0, 3.0]]), 6)
    assert logcnt.tolist() == [[2, 2, 2]]


def test_hierarchical_keeps_each_group_on_one_node_and_global_does_not():
    layers, experts, groups, nodes, gpus, physical = 4, 32, 8, 2, 8, 48
    weight = zipf_load(layers, experts, seed=5)
    phy2log, _, _ = rebalance_experts(weight, physical, groups, nodes, gpus)
    node_of_slot = torch.arange(physical) // (physical // nodes)
    group_of_slot = phy2log // (experts // groups)  # [L, P]
    for layer in range(layers):
        nodes_of_group = [set(node_of_slot[group_of_slot[layer] == g].tolist()) for g in range(groups)]
        assert all(len(n) == 1 for n in nodes_of_group)
        assert [sum(n == {k} for n in nodes_of_group) for k in range(nodes)] == [groups // nodes] * nodes
    # 3 nodes do not divide 8 groups: the global policy, the same as one node and one group
    phy2log, _, _ = rebalance_experts(weight, 48, groups, 3, 6)
    assert torch.equal(phy2log, rebalance_experts(weight, 48, 1, 1, 6)[0])
    group_of_slot = phy2log // (experts // groups)
    node_of_slot = torch.arange(48) // 16
    spans = [len(set(node_of_slot[group_of_slot[layer] == g].tolist())) for layer in range(layers)
             for g in range(groups)]
    assert max(spans) > 1


@pytest.mark.parametrize("nodes", [1, 2])
def test_skewed_load_gets_more_even_with_redundant_slots_and_beats_a_greedy_baseline(nodes):
    layers, experts, groups, gpus = 4, 64, 8, 8
    weight = zipf_load(layers, experts, s=1.5, seed=0)
    trivial = balancedness(trivial_phy2log(layers, experts, experts), weight, gpus)
    seen = []
    for redundant in (0, 8, 16, 32):
        phy2log, _, _ = rebalance_experts(weight, experts + redundant, groups, nodes, gpus)
        seen.append(balancedness(phy2log, weight, gpus))
        assert seen[-1] >= balancedness(greedy_baseline(weight, redundant, gpus), weight, gpus)
    assert seen[0] >= trivial
    assert seen == sorted(seen) and seen[-1] > seen[0] + 0.3, seen
    if nodes == 1:
        assert seen[-1] > 0.99


def test_rebalance_is_deterministic():
    weight = zipf_load(4, 64, s=1.0, seed=7).round()  # integer-valued: ties between equal loads
    first = rebalance_experts(weight, 96, 8, 2, 8)
    strided = weight.t().contiguous().t()  # the same values, not contiguous
    for again in (rebalance_experts(weight.clone(), 96, 8, 2, 8), rebalance_experts(weight.long(), 96, 8, 2, 8),
                  rebalance_experts(strided, 96, 8, 2, 8)):
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    uniform = rebalance_experts(torch.ones(2, 16), 24, 4, 2, 4)
    assert all(torch.equal(a, b) for a, b in zip(uniform, rebalance_experts(torch.ones(2, 16), 24, 4, 2, 4)))


def test_balancedness_and_gpu_loads():
    phy2log = torch.tensor([[0, 1, 2, 0], [0, 1, 2, 3]])
    weight = torch.tensor([[8.0, 2.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    # layer 0: expert 0's 8 tokens split over slots 0 and 3 -> GPU 0: 4 + 2, GPU 1: 2 + 4
    assert gpu_loads(phy2log, weight, 2).tolist() == [[6.0, 6.0], [0.0, 0.0]]
    assert gpu_loads(phy2log, weight, 4).tolist() == [[4.0, 2.0, 2.0, 4.0], [0.0, 0.0, 0.0, 0.0]]
    assert layer_balancedness(phy2log, weight, 4).tolist() == [0.75, 1.0]
    assert balancedness(phy2log, weight, 4) == 0.75  # the layer without load is left out
    assert balancedness(phy2log, torch.zeros(2, 4), 4) == 1.0
    with pytest.raises(ValueError, match="num_gpus"):
        gpu_loads(phy2log, weight, 3)


@pytest.mark.parametrize("redundant", [0, 3, 8, 20])
def test_trivial_phy2log_is_the_servers_starting_placement(redundant):
    assert torch.equal(trivial_phy2log(3, 8, 8 + redundant), ExpertPlacement.trivial(3, 8, 1, redundant).phy2log)


@pytest.mark.parametrize("args, field", [
    ((torch.ones(2, 16), 24, 5, 2, 4), "num_groups"),
    ((torch.ones(2, 16), 12, 4, 2, 4), "num_replicas"),
    ((torch.ones(2, 16), 24, 4, 1, 5), "num_gpus"),
    ((torch.ones(2, 16), 24, 4, 3, 4), "num_nodes"),
    ((torch.ones(2, 16), 24, 0, 1, 4), "num_groups"),
    ((torch.ones(2, 16), 24, 4, 1, 0), "num_gpus"),
    ((torch.ones(16), 24, 4, 2, 4), "weight"),
    ((-torch.ones(2, 16), 24, 4, 2, 4), "weight"),
    ((torch.full((2, 16), float("nan")), 24, 4, 2, 4), "weight"),
])
def test_rebalance_rejects_sizes_that_do_not_fit(args, field):
    with pytest.raises(ValueError, match=field):
        rebalance_experts(*args)
