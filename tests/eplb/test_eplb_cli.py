"""``moeserve eplb record`` / ``simulate`` / ``drift`` end to end, on the shipped chat model and on
synthetic Zipf loads."""

from __future__ import annotations

import json
import os

import pytest
import torch

from moeserve.eplb.files import load_distribution
from moeserve.eplb.workload import load_recording, prompt_ids
from moeserve.models import tiny_chat
from moeserve.models.tiny_chat import embedded_model_path
from moeserve.models.tokenizer import load_tokenizer
from moeserve.server.cli import main
from moeserve.server.eplb_commands import _record_prompts

ZIPF = ["--num-experts", "32", "--num-layers", "4", "--num-groups", "4", "--top-k", "4", "--num-tokens", "4096"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict[str, str]:
    """The shipped model's two tasks, recorded (a handful of prompts, few tokens); the raw dumps kept."""
    root = tmp_path_factory.mktemp("recorded")
    dirs = {}
    for task in ("addition", "reversal"):
        dirs[task], dirs[f"{task} dumps"] = str(root / task), str(root / f"{task}-dumps")
        argv = ["eplb", "record", "--dataset", f"builtin:{task}", "--out", dirs[task], "--num-prompts", "6",
                "--max-tokens", "4", "--expert-distribution-recorder-dir", dirs[f"{task} dumps"]]
        assert main(argv) == 0
    return dirs


def test_record_writes_the_routed_experts_of_each_phase(recorded):
    routing = load_recording(recorded["addition"])
    meta = json.loads(open(f"{recorded['addition']}/meta.json").read())
    assert meta["dataset"] == "builtin:addition" and meta["num_prompts"] == 6 and meta["model"]
    assert (meta["num_logical_experts"], meta["num_groups"], meta["top_k"], meta["layer_ids"]) == (8, 4, 2, [1, 2, 3])
    tok = load_tokenizer(embedded_model_path())
    prompts = _record_prompts("builtin:addition", 6, 0)
    assert all(tiny_chat.solve(p) for p in prompts)  # the model's task, as it was trained on it
    assert meta["phases"]["prefill"]["tokens"] == sum(len(prompt_ids(tok, p)) for p in prompts)  # chat template
    assert 0 < meta["phases"]["decode"]["tokens"] <= 6 * 3
    assert routing.only("decode").num_tokens == meta["phases"]["decode"]["tokens"]
    assert (routing.topk_ids[..., 0] != routing.topk_ids[..., 1]).all()
    # against the recorder's own counts in the raw dump
    [dump] = os.listdir(recorded["addition dumps"])
    dist = load_distribution(os.path.join(recorded["addition dumps"], dump))
    assert torch.equal(routing.counts(), dist.logical_count[[1, 2, 3]])


def test_simulate_replays_a_recorded_directory(recorded, tmp_path, capsys):
    out = tmp_path / "sim.json"
    argv = ["eplb", "simulate", "--distribution", recorded["reversal"], "--ep-size", "1", "2", "4", "8",
            "--redundant", "0", "8", "--tokens-per-gpu", "4", "--rebalance-every", "2", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert len(report["results"]) == 2 * 4 * 3 and report["num_logical_experts"] == 8
    by = {(r["setting"], r["ep_size"], r["redundant"]): r["balancedness"] for r in report["results"]}
    assert by["trivial", 1, 0] == by["eplb", 1, 0] == 1.0
    assert all(0 < v <= 1 for v in by.values())
    assert "EPLB online" in capsys.readouterr().out
    assert main([*argv[:-2], "--phase", "decode"]) == 0


def test_drift_from_addition_to_reversal(recorded, tmp_path, capsys):
    out, png = tmp_path / "drift.json", tmp_path / "drift.png"
    argv = ["eplb", "drift", "--from", recorded["addition"], "--to", recorded["reversal"], "--steps", "0", "0.5", "1",
            "--ep-size", "2", "4", "--redundant", "0", "--tokens-per-gpu", "4", "--rebalance-every", "2",
            "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert [(r["w"], r["ep_size"]) for r in report["results"]] == [(w, ep) for w in (0, 0.5, 1) for ep in (2, 4)]
    for row in report["results"]:
        assert all(0 < row[s]["balancedness"] <= 1 for s in ("trivial", "stale", "online", "ceiling"))
    first = report["results"][0]
    assert first["stale"] == first["ceiling"]  # w = 0: the traffic is A
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "EPLB on A (stale)" in capsys.readouterr().out


def test_simulate_on_zipf_writes_json_and_a_plot(tmp_path, capsys):
    out, png = tmp_path / "zipf.json", tmp_path / "zipf.png"
    argv = ["eplb", "simulate", "--distribution", "zipf:1.0", "--ep-size", "4", "8", "16", "--redundant", "0", "16",
            *ZIPF, "--json", str(out), "--plot", str(png)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["tokens"] == 4096 and report["top_k"] == 4 and report["elapsed_s"] > 0
    eplb = {(r["ep_size"], r["redundant"]): r["balancedness"] for r in report["results"] if r["setting"] == "eplb"}
    trivial = {(r["ep_size"], r["redundant"]): r["balancedness"] for r in report["results"]
               if r["setting"] == "trivial"}
    assert all(eplb[key] > trivial[key] for key in eplb)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "simulated in" in capsys.readouterr().out
    # --placement-from the same distribution: the same report
    same = tmp_path / "same.json"
    assert main([*argv[:-4], "--placement-from", "zipf:1.0", "--json", str(same)]) == 0
    assert json.loads(same.read_text())["results"] == report["results"]


@pytest.mark.parametrize("command, flags, message", [
    ("simulate", ["--ep-size", "0"], "--ep-size"),
    ("simulate", ["--ep-size", "5"], "--ep-size"),
    ("simulate", ["--redundant", "-1"], "--redundant"),
    ("simulate", ["--tokens-per-gpu", "0"], "--tokens-per-gpu"),
    ("simulate", ["--rebalance-every", "0"], "--rebalance-every"),
    ("simulate", ["--num-groups", "5"], "--num-groups"),
    ("simulate", ["--distribution", "zipf:x"], "--distribution"),
    ("simulate", ["--distribution", "no/such/dir"], "--distribution"),
    ("simulate", ["--placement-from", "zipf:1", "--num-experts", "16", "--distribution", "RECORDED"],
     "--placement-from"),
    ("drift", ["--steps", "0", "1.5"], "--steps"),
    ("drift", ["--to", "RECORDED"], "--to"),
    ("record", ["--dataset", "builtin:multiplication"], "--dataset"),
    ("record", ["--dataset", "no/such/file.jsonl"], "--dataset"),
    ("record", ["--dataset", "builtin", "--max-tokens", "0"], "--max-tokens"),
])
def test_bad_input_exits_2_naming_the_flag(tmp_path, capsys, command, flags, message):
    base = {"simulate": ["--distribution", "zipf:1", "--ep-size", "4", *ZIPF],
            "drift": ["--from", "zipf:1", "--to", "zipf:1:1", "--ep-size", "4", "--redundant", "0", *ZIPF],
            "record": ["--dataset", "builtin", "--out", str(tmp_path / "rec")]}[command]
    if "RECORDED" in flags:  # a recording of another size: the shipped model's 3 layers of 8 experts
        from moeserve.eplb.workload import routing_from_per_token, save_recording

        ids = torch.zeros(4, 2, dtype=torch.int64)
        ids[:, 1] = 1
        passes = [{"phase": "prefill", "positions": None, "topk_ids": {str(layer): ids for layer in (1, 2, 3)}}]
        save_recording(str(tmp_path / "small"), routing_from_per_token(passes, 8, 4))
        flags = [str(tmp_path / "small") if f == "RECORDED" else f for f in flags]
    assert main(["eplb", command, *base, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert not (tmp_path / "rec").exists()
