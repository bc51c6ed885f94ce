"""``moeserve eplb plan``: a recorded distribution in, the placement ``rebalance_experts`` gives out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from moeserve.eplb.algorithm import balancedness, rebalance_experts, trivial_phy2log
from moeserve.eplb.files import load_placement, save_distribution
from moeserve.server.cli import main

L, E, G = 4, 32, 8


def zipf_counts(seed: int = 0) -> torch.Tensor:
    """``[L, E]`` token counts, Zipf over the experts in a random order per layer; layer 0 dense."""
    gen = torch.Generator().manual_seed(seed)
    base = 1e5 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2
    count = torch.stack([base[torch.randperm(E, generator=gen)] for _ in range(L)]).round().long()
    count[0] = 0
    return count


@pytest.fixture
def distribution(tmp_path) -> str:
    path = str(tmp_path / "dist.json")
    save_distribution(path, zipf_counts(), num_groups=G, model="tiny", passes=50)
    return path


@pytest.mark.parametrize("nnodes, num_groups, suffix", [(2, None, "json"), (1, None, "pt"), (3, 4, "json")])
def test_plan_writes_the_rebalanced_placement(tmp_path, capsys, distribution, nnodes, num_groups, suffix):
    ep_size, redundant = 6 if nnodes == 3 else 8, 16
    out = str(tmp_path / f"placement.{suffix}")
    argv = ["eplb", "plan", "--distribution", distribution, "--ep-size", str(ep_size), "--redundant",
            str(redundant), "--nnodes", str(nnodes), "--out", out, "--per-layer"]
    assert main(argv + (["--num-groups", str(num_groups)] if num_groups else [])) == 0
    groups = num_groups or G
    expected = rebalance_experts(zipf_counts(), E + redundant, groups, nnodes, ep_size)[0]
    phy2log, meta = load_placement(out)
    assert torch.equal(phy2log, expected)
    assert (meta["num_logical_experts"], meta["num_physical_experts"], meta["ep_size"]) == (E, E + redundant, ep_size)
    printed = capsys.readouterr().out
    before = balancedness(trivial_phy2log(L, E, E + redundant), zipf_counts(), ep_size)
    after = balancedness(expected, zipf_counts(), ep_size)
    assert f"before {before:.4f}" in printed and f"after {after:.4f}" in printed and after > before
    assert ("hierarchical" if groups % nnodes == 0 else "global") in printed
    assert printed.count("\n") >= 4 + 1 + L  # the summary, the table header and a row per layer


@pytest.mark.parametrize("flags, message", [
    (["--ep-size", "5"], "--ep-size 5"),
    (["--ep-size", "8", "--redundant", "-8"], "--redundant"),
    (["--ep-size", "8", "--nnodes", "3"], "--nnodes 3"),
    (["--ep-size", "8", "--num-groups", "5"], "--num-groups 5"),
    (["--ep-size", "0"], "--ep-size"),
])
def test_plan_rejects_bad_flags(tmp_path, capsys, distribution, flags, message):
    out = tmp_path / "placement.json"
    assert main(["eplb", "plan", "--distribution", distribution, "--out", str(out), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert not out.exists()


def test_plan_rejects_bad_files(tmp_path, capsys):
    out = str(tmp_path / "placement.json")
    bad = tmp_path / "bad.json"
    cases = [(str(tmp_path / "missing.json"), "--distribution"), (str(bad), "logical_count")]
    bad.write_text(json.dumps({"format": "moeserve-expert-distribution", "logical_count": [[1, 2], [3]]}))
    for path, message in cases:
        assert main(["eplb", "plan", "--distribution", path, "--ep-size", "2", "--out", out]) == 2
        assert message in capsys.readouterr().err


def test_plan_runs_as_a_module(tmp_path, distribution):
    out = str(tmp_path / "placement.json")
    run = subprocess.run([sys.executable, "-m", "moeserve.server.cli", "eplb", "plan", "--distribution", distribution,
                          "--ep-size", "8", "--redundant", "8", "--out", out], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "balancedness" in run.stdout
    assert torch.equal(load_placement(out)[0], rebalance_experts(zipf_counts(), E + 8, G, 1, 8)[0])
    bad = subprocess.run([sys.executable, "-m", "moeserve.server.cli", "eplb", "plan", "--distribution", distribution,
                          "--ep-size", "7", "--out", out], capture_output=True, text=True)
    assert bad.returncode == 2 and "--ep-size 7" in bad.stderr
