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
