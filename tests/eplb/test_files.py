"""The distribution and placement files: round trips in JSON and .pt, inline JSON, and errors
that name the field that is wrong."""

from __future__ import annotations

import json

import pytest
import torch

from moeserve.eplb.algorithm import rebalance_experts, trivial_phy2log
from moeserve.eplb.files import (
    DISTRIBUTION_FORMAT,
    PLACEMENT_FORMAT,
    initial_phy2log,
    load_distribution,
    load_placement,
    save_distribution,
    save_placement,
)

L, E, G, K, N, P = 4, 16, 4, 2, 4, 24  # layers, logical experts, groups, nodes, EP ranks, physical slots


def counts(seed: int = 0) -> torch.Tensor:
    """``[L, E]`` token counts; layer 0 is dense (all zeros)."""
    count = torch.randint(0, 1000, (L, E), generator=torch.Generator().manual_seed(seed))
    count[0] = 0
    return count


@pytest.mark.parametrize("suffix", ["json", "pt"])
def test_distribution_round_trip(tmp_path, suffix):
    path = str(tmp_path / f"dist.{suffix}")
    save_distribution(path, counts(), num_groups=G, mode="per_pass", model="tiny-v3", passes=12,
                      per_pass=[[1, 2]], meta={"rank": 0})
    dist = load_distribution(path)
    assert torch.equal(dist.logical_count, counts()) and dist.logical_count.dtype == torch.int64
    assert (dist.num_groups, dist.num_layers, dist.num_logical) == (G, L, E)
    assert {k: dist.meta[k] for k in ("format", "version", "mode", "model", "passes", "num_layers",
                                      "num_logical_experts")} == {
        "format": DISTRIBUTION_FORMAT, "version": 1, "mode": "per_pass", "model": "tiny-v3", "passes": 12,
        "num_layers": L, "num_logical_experts": E}
    assert dist.meta["meta"] == {"rank": 0}
    fractional = counts().double() / 3
    save_distribution(path, fractional)
    loaded = load_distribution(path).logical_count
    assert loaded.dtype == torch.float64 and torch.allclose(loaded, fractional)


def test_distribution_json_is_the_documented_layout(tmp_path):
    path = tmp_path / "dist.json"
    save_distribution(str(path), counts(), num_groups=G, model="m", passes=3)
    obj = json.loads(path.read_text())
    assert obj == {"format": DISTRIBUTION_FORMAT, "version": 1, "mode": "stat", "num_layers": L,
                   "num_logical_experts": E, "num_groups": G, "model": "m", "passes": 3,
                   "logical_count": counts().tolist()}


@pytest.mark.parametrize("suffix", ["json", "pt"])
def test_placement_round_trip(tmp_path, suffix):
    path = str(tmp_path / f"placement.{suffix}")
    phy2log = rebalance_experts(counts(), P, G, K, N)[0]
    save_placement(path, phy2log, E, N, meta={"num_redundant": P - E})
    loaded, meta = load_placement(path)
    assert torch.equal(loaded, phy2log) and loaded.dtype == torch.int64
    assert meta == {"format": PLACEMENT_FORMAT, "version": 1, "num_layers": L, "num_logical_experts": E,
                    "num_physical_experts": P, "ep_size": N, "meta": {"num_redundant": P - E}}
    if suffix == "json":
        assert json.loads(open(path).read())["phy2log"] == phy2log.tolist()


def test_initial_phy2log_from_each_kind_of_spec(tmp_path):
    sizes = dict(num_layers=L, num_logical=E, num_physical=P, ep_size=N, num_groups=G, num_nodes=K)
    assert torch.equal(initial_phy2log("trivial", **sizes), trivial_phy2log(L, E, P))
    planned = rebalance_experts(counts(), P, G, K, N)[0]
    for suffix in ("json", "pt"):
        save_placement(str(tmp_path / f"p.{suffix}"), planned, E, N)
        assert torch.equal(initial_phy2log(str(tmp_path / f"p.{suffix}"), **sizes), planned)
        # a distribution is balanced for the server's sizes, as rebalance_experts does
        save_distribution(str(tmp_path / f"d.{suffix}"), counts(), num_groups=G)
        assert torch.equal(initial_phy2log(str(tmp_path / f"d.{suffix}"), **sizes), planned)
    inline = json.dumps({"phy2log": planned.tolist()})
    assert torch.equal(initial_phy2log(inline, **sizes), planned)
    inline = json.dumps({"logical_count": counts().tolist()})
    assert torch.equal(initial_phy2log("  " + inline, **sizes), planned)
    # the server's sizes decide: a global placement for 3 nodes
    global_sizes = {**sizes, "num_nodes": 3, "ep_size": 6}
    assert torch.equal(initial_phy2log(inline, **global_sizes), rebalance_experts(counts(), P, G, 3, 6)[0])


def placement_obj(**changes):
    obj = {"format": PLACEMENT_FORMAT, "version": 1, "num_layers": L, "num_logical_experts": E,
           "num_physical_experts": P, "ep_size": N, "phy2log": trivial_phy2log(L, E, P).tolist()}
    return {**obj, **changes}


def with_expert(value, layer=1, slot=2):
    """The trivial ``phy2log`` as lists, with ``value`` in one slot."""
    rows = trivial_phy2log(L, E, P).tolist()
    rows[layer][slot] = value
    return rows


MODEL = dict(num_layers=L, num_logical=E, num_physical=P, ep_size=N, num_groups=G, num_nodes=K)
BAD_SPECS = [  # (spec object, words the message must hold)
    (placement_obj(phy2log=trivial_phy2log(3, E, P).tolist(), num_layers=3), ["phy2log", "3 layers", "has 4"]),
    (placement_obj(num_logical_experts=8), ["num_logical_experts", "8", "16"]),
    (placement_obj(phy2log=trivial_phy2log(L, E, 28).tolist(), num_physical_experts=28),
     ["phy2log", "28 physical slots", "24"]),
    (placement_obj(ep_size=8), ["ep_size", "8", "4"]),
    (placement_obj(phy2log=with_expert(16)), ["phy2log", "logical expert 16", "layer 1"]),
    (placement_obj(phy2log=with_expert(-1)), ["phy2log", "-1"]),
    (placement_obj(phy2log=with_expert(0, slot=10)), ["phy2log", "logical expert 10", "no physical slot", "layer 1"]),
    (placement_obj(phy2log=with_expert(0.5)), ["phy2log", "integers"]),
    (placement_obj(phy2log=[[0, 1], [0]]), ["phy2log"]),
    (placement_obj(num_layers=5), ["num_layers", "5"]),
    (placement_obj(num_physical_experts=20), ["num_physical_experts", "20"]),
    (placement_obj(format="something-else"), ["format", "something-else"]),
    (placement_obj(version=2), ["version", "2"]),
    ({"logical_count": counts(1)[:3].tolist()}, ["logical_count", "3 layers", "has 4"]),
    ({"logical_count": counts(1)[:, :8].tolist()}, ["logical_count", "8 logical experts", "16"]),
    ({"logical_count": (-counts(1)).tolist()}, ["logical_count", ">= 0"]),
    ({"logical_count": counts(1).tolist(), "mode": "sometimes"}, ["mode", "sometimes"]),
    ({"logical_count": counts(1).tolist(), "num_layers": 9}, ["num_layers", "9"]),
    ({"logical_count": counts(1).tolist(), "num_groups": 3}, ["num_groups", "3"]),
    ({"logical_count": counts(1).tolist(), "format": PLACEMENT_FORMAT}, ["format", PLACEMENT_FORMAT]),
    ({"model": "m"}, ["phy2log", "logical_count"]),
]


@pytest.mark.parametrize("obj, words", BAD_SPECS)
def test_initial_phy2log_errors_name_the_field(tmp_path, obj, words):
    for spec in (json.dumps(obj), str(tmp_path / "spec.json"), str(tmp_path / "spec.pt")):
        if spec.endswith(".json"):
            (tmp_path / "spec.json").write_text(json.dumps(obj))
        elif spec.endswith(".pt"):
            torch.save(obj, spec)
        with pytest.raises(ValueError) as info:
            initial_phy2log(spec, **MODEL)
        message = str(info.value)
        assert message.startswith("init_expert_location: ") and all(w in message for w in words), message


def test_initial_phy2log_rejects_what_is_no_spec(tmp_path):
    for spec, words in [("placement.yaml", ["trivial", ".json"]), ("{not json", ["inline JSON"]),
                        ("[1, 2]", ["trivial"]), (str(tmp_path / "missing.json"), [])]:
        with pytest.raises((ValueError, OSError)) as info:
            initial_phy2log(spec, **MODEL)
        assert all(w in str(info.value) for w in words)
    with pytest.raises(ValueError, match="ep_size"):
        initial_phy2log("trivial", **{**MODEL, "ep_size": 5})
    (tmp_path / "broken.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="broken.pt"):
        initial_phy2log(str(tmp_path / "broken.pt"), **MODEL)
    # sizes the balancer refuses, named and prefixed
    with pytest.raises(ValueError, match="init_expert_location: num_groups"):
        initial_phy2log(json.dumps({"logical_count": counts().tolist()}), **{**MODEL, "num_groups": 5})


def test_loaders_check_the_file_itself(tmp_path):
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(placement_obj(phy2log=with_expert(16))))
    with pytest.raises(ValueError, match="phy2log holds logical expert 16"):
        load_placement(str(path))
    path.write_text(json.dumps({k: v for k, v in placement_obj().items() if k != "num_logical_experts"}))
    with pytest.raises(ValueError, match="num_logical_experts"):
        load_placement(str(path))
    path.write_text(json.dumps(placement_obj()))
    with pytest.raises(ValueError, match="format"):
        load_distribution(str(path))  # a placement is no distribution
    path.write_text("[1, 2, 3]")
    with pytest.raises(ValueError, match="JSON object"):
        load_distribution(str(path))
    with pytest.raises(ValueError, match="ep_size"):
        save_placement(str(tmp_path / "p.json"), trivial_phy2log(L, E, P), E, 5)
    with pytest.raises(ValueError, match="mode"):
        save_distribution(str(tmp_path / "d.json"), counts(), mode="never")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["placement.json"]  # nothing half-written left behind
