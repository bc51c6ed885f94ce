"""The recorder over HTTP, end to end: start, serve, dump; ``moeserve eplb plan`` on the dump; the
placement it prints is the one a server loaded with ``--init-expert-location`` runs with."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from moeserve import LLM
from moeserve.eplb.files import load_distribution, load_placement
from tests.e2e.server_utils import metric, start_server, wait_for

ENGINE = ["--dtype", "float32", "--page-size", "4", "--max-total-tokens", "2048", "--served-model-name", "m"]


@pytest.fixture(scope="module")
def model_path(hf_model_path):
    return hf_model_path("v3", 0)


def test_dump_plan_and_load_back_give_the_printed_placement(model_path, tmp_path):
    args = ["--model-path", model_path, *ENGINE, "--expert-distribution-recorder-mode", "stat",
            "--ep-num-redundant-experts", "4", "--expert-distribution-recorder-dir", str(tmp_path / "dumps")]
    server = start_server(args, str(tmp_path / "server.log"))
    try:
        url = server.base_url
        assert httpx.post(f"{url}/start_expert_distribution_record").json() == {"mode": "stat"}
        for i in range(6):
            r = httpx.post(f"{url}/v1/completions", timeout=60, json={
                "model": "m", "prompt": [5 + i, 17, 42, 7 * i + 3], "max_tokens": 8, "ignore_eos": True})
            assert r.status_code == 200
        assert httpx.post(f"{url}/stop_expert_distribution_record").json()["passes"] > 0
        dumped = httpx.post(f"{url}/dump_expert_distribution_record", timeout=60).json()
        assert wait_for(lambda: 0 < metric(url, "moeserve:expert_balancedness") <= 1, timeout=10)
        refused = httpx.post(f"{url}/rebalance_experts")  # recording only: no weights staged to move
        assert refused.status_code == 400 and "--enable-eplb" in refused.json()["error"]["message"]
    finally:
        server.stop()
    dist = load_distribution(dumped["path"])
    assert dist.logical_count.shape == (3, 8) and dist.logical_count[0].sum() == 0  # layer 0 is dense
    assert dist.logical_count[1:].sum() == 2 * 2 * 6 * (4 + 7)  # every MoE layer, top-2, prompt + 7 decodes

    placement = str(tmp_path / "placement.json")
    printed = subprocess.run([sys.executable, "-m", "moeserve.server.cli", "eplb", "plan", "--distribution",
                              dumped["path"], "--ep-size", "1", "--redundant", "4", "--out", placement],
                             capture_output=True, text=True, check=True).stdout
    assert "balancedness" in printed
    planned, _ = load_placement(placement)
    with LLM(model_path, dtype="float32", page_size=4, max_total_tokens=2048, ep_num_redundant_experts=4,
             init_expert_location=placement, expert_distribution_recorder_mode="stat") as llm:
        assert llm.expert_stats()["phy2log"] == planned.tolist()
    with LLM(model_path, dtype="float32", page_size=4, max_total_tokens=2048, ep_num_redundant_experts=4,
             init_expert_location=json.dumps({"phy2log": planned.tolist()}),
             expert_distribution_recorder_mode="stat") as llm:  # inline JSON too
        assert llm.expert_stats()["phy2log"] == planned.tolist()


def test_a_placement_that_does_not_fit_the_model_is_refused_naming_the_field(model_path, tmp_path):
    with pytest.raises(ValueError, match="init_expert_location"):
        LLM(model_path, dtype="float32", ep_num_redundant_experts=4,
            init_expert_location=json.dumps({"phy2log": [[0, 1, 2]]}))
