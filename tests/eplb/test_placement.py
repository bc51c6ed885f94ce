"""The placement maps on the device and how a routed logical expert picks a physical slot."""

from __future__ import annotations

import pytest
import torch

from moeserve.eplb.placement import ExpertLocation, ExpertPlacement

# 4 logical experts, 8 slots on 2 ranks: expert 0 has three replicas (slots 0, 4, 5), expert 1 two
PHY2LOG = torch.tensor([[0, 1, 2, 3, 0, 0, 1, 3]])


def _location() -> ExpertLocation:
    return ExpertLocation(ExpertPlacement.from_phy2log(PHY2LOG, 4, ep_size=2), "cpu")


def test_maps_have_a_fixed_width_of_one_plus_the_redundant_slots():
    place = ExpertPlacement.from_phy2log(PHY2LOG, 4, ep_size=2)
    assert place.log2phy.shape == (1, 4, 5)  # 8 - 4 + 1
    assert place.log2phy[0, 0].tolist() == [0, 4, 5, -1, -1]
    assert place.logcnt[0].tolist() == [3, 2, 1, 2]
    with pytest.raises(ValueError, match="at least one physical slot"):
        ExpertPlacement.from_phy2log(torch.tensor([[0, 0, 1, 1]]), 3, ep_size=1)
    with pytest.raises(ValueError, match="outside"):
        ExpertPlacement.from_phy2log(torch.tensor([[0, 1, 5, 1]]), 3, ep_size=1)


def test_static_prefers_a_local_replica_else_a_fixed_one_per_rank():
    loc = _location()
    ids = torch.tensor([[0, 1], [2, 3], [0, 2]])
    rank0 = loc.layer_map(0, ep_rank=0).to_physical(ids)
    rank1 = loc.layer_map(0, ep_rank=1).to_physical(ids)
    assert rank0.tolist() == [[0, 1], [2, 3], [0, 2]]  # every expert has a slot on rank 0 (slots 0-3)
    assert rank1.tolist() == [[4, 6], [2, 7], [4, 2]]  # rank 1 (slots 4-7) has 0, 1, 3; expert 2 only on rank 0


def test_dynamic_spreads_over_the_replicas_and_fake_over_every_slot():
    loc = _location()
    torch.manual_seed(0)
    ids = torch.zeros(4000, 1, dtype=torch.int64)
    picked = loc.layer_map(0, 0, "dynamic").to_physical(ids).flatten()
    counts = torch.bincount(picked, minlength=8)
    assert set(picked.tolist()) == {0, 4, 5}
    assert counts[[0, 4, 5]].min() > 1100  # about 4000 / 3 each
    fake = loc.layer_map(0, 0, "fake").to_physical(torch.zeros(4000, 2, dtype=torch.int64))
    assert (fake[:, 0] != fake[:, 1]).all()  # k distinct slots per token
    assert torch.bincount(fake.flatten(), minlength=8).min() > 800  # 8000 / 8 each, roughly


def test_update_layer_changes_values_in_place_and_routing_follows():
    loc = _location()
    pointers = (loc.phy2log.data_ptr(), loc.log2phy.data_ptr(), loc.logcnt.data_ptr())
    routing = loc.layer_map(0, ep_rank=0)
    new = ExpertPlacement.from_phy2log(torch.tensor([[3, 2, 1, 0, 3, 3, 2, 0]]), 4, ep_size=2)
    loc.update_layer(0, new)
    assert (loc.phy2log.data_ptr(), loc.log2phy.data_ptr(), loc.logcnt.data_ptr()) == pointers
    assert routing.to_physical(torch.tensor([[0, 3]])).tolist() == [[3, 0]]  # the old map object sees it
    with pytest.raises(ValueError, match="cannot replace"):
        loc.update_layer(0, ExpertPlacement.from_phy2log(torch.tensor([[0, 1, 2, 3, 0, 1]]), 4, ep_size=2))


def _static_reference(place: ExpertPlacement, layer: int, ep_rank: int, expert: int) -> int:
    """The static rule, one expert at a time: the first replica on the rank, else replica ``rank mod count``."""
    replicas = place.log2phy[layer, expert, :place.logcnt[layer, expert]].tolist()
    local = [p for p in replicas if p // place.slots_per_rank == ep_rank]
    return local[0] if local else replicas[ep_rank % len(replicas)]


def test_static_routing_is_one_table_a_rank_that_follows_every_rebalance():
    gen = torch.Generator().manual_seed(1)
    logical, ep = 16, 4

    def random_placement(layers: int = 3) -> ExpertPlacement:  # every expert once, 8 replicas at random
        extra = torch.randint(0, logical, (layers, 8), generator=gen)
        rows = [torch.cat([torch.arange(logical), e])[torch.randperm(logical + 8, generator=gen)] for e in extra]
        return ExpertPlacement.from_phy2log(torch.stack(rows), logical, ep_size=ep)

    place = random_placement()
    loc = ExpertLocation(place, "cpu")
    maps = {(layer, r): loc.layer_map(layer, r) for layer in range(3) for r in range(ep)}
    ids = torch.arange(logical).repeat(2, 1).T  # [16, 2]: every expert, twice
    for step in range(3):
        for (layer, r), m in maps.items():
            want = [_static_reference(place, layer, r, e) for e in range(logical)]
            assert m.to_physical(ids)[:, 1].tolist() == want, (step, layer, r)
        place = random_placement()
        for layer in range(3):
            loc.update_layer(layer, place)
