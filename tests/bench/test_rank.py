"""The one-rank emulator of a DP-attention + EP deployment (``bench rank``, ``bench deployment``): the
emulated dispatcher hands the local experts the busiest rank's rows in each layout, one rank alone
is exactly the engine, the network models give their sources' figures, and the overlap schedule
hides communication behind the other micro-batch's compute."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from moeserve.bench.network import DEEPEP_LL_US, DeepEPModel, MeasuredModel, PlainIBModel, Traffic, network_model
from moeserve.bench.rank import OpRecord, RankRunner, RankSpec, build_step, rank_config, schedule_ms
from moeserve.config import ModelConfig
from moeserve.distributed.dispatcher import LocalDispatcher, MaskedDispatchOutput
from moeserve.distributed.emulated import EmulatedDispatcher, EmulatedEP
from moeserve.executor import overlap
from moeserve.executor.model_runner import ModelRunner
from moeserve.kernels.fp8 import FP8_DTYPE, per_token_group_quant_fp8
from moeserve.models.tiny import make_tiny_model


def _routing(tokens: int, k: int, experts: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    return torch.randn(tokens, 16, generator=gen), ids, weights


def test_emulated_dispatch_hands_over_the_busiest_ranks_rows_in_each_layout():
    hidden, ids, weights = _routing(10, 2, 12)
    group = EmulatedEP(4, balancedness=0.5)  # the busiest rank receives twice the mean: 40 rows
    recv, handle = EmulatedDispatcher("normal", 3, group, layer_id=1).dispatch(hidden, ids, weights)
    assert recv.hidden.shape == (40, 16) and recv.seg_indptr.tolist() == [0, 14, 27, 40]
    out = EmulatedDispatcher("normal", 3, group, 1).combine(recv.hidden, handle)
    assert out.shape == (10, 16)
    masked, handle = EmulatedDispatcher("low_latency", 3, group, 1).dispatch(hidden, ids, weights)
    assert isinstance(masked, MaskedDispatchOutput)
    assert masked.hidden.shape == (3, 14, 16) and masked.masked_m.tolist() == [14, 14, 14]
    assert masked.expected_m == 14  # every slot holds the busiest rank's share: the GEMM's tile hint
    assert EmulatedDispatcher("low_latency", 3, group, 1).combine(masked.hidden, handle).shape == (10, 16)
    per_layer = EmulatedEP(4, {1: 1.0, 2: 0.25})
    assert per_layer.busiest_rows(1, 20) == 20 and per_layer.busiest_rows(2, 20) == 80
    empty, handle = EmulatedDispatcher("low_latency", 3, group, 1).dispatch(hidden[:0], ids[:0], weights[:0])
    assert EmulatedDispatcher("low_latency", 3, group, 1).combine(empty.hidden, handle).shape == (0, 16)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_emulated_fp8_dispatch_hands_over_what_the_ep_dispatchers_send(mode):
    """For FP8 experts the tokens travel as FP8 values with their 1x128 scales, as the EP
    dispatchers send them: the same rows as the BF16 emulation, quantized."""
    hidden, ids, weights = _routing(10, 2, 12)
    group = EmulatedEP(4, balancedness=0.5)
    plain, _ = EmulatedDispatcher(mode, 3, group, layer_id=1).dispatch(hidden, ids, weights)
    recv, handle = EmulatedDispatcher(mode, 3, group, layer_id=1, fp8=True).dispatch(hidden, ids, weights)
    q, scale = per_token_group_quant_fp8(plain.hidden)
    assert recv.hidden.dtype == FP8_DTYPE and recv.out_dtype == hidden.dtype
    assert torch.equal(recv.hidden.view(torch.uint8), q.view(torch.uint8)) and torch.equal(recv.hidden_scale, scale)


def test_one_rank_alone_in_contiguous_layout_is_the_engines_dispatch():
    hidden, ids, weights = _routing(9, 2, 6, seed=1)
    emulated = EmulatedDispatcher("normal", 6, EmulatedEP(1), layer_id=0)
    local = LocalDispatcher(6)
    (recv_e, h_e), (recv_l, h_l) = emulated.dispatch(hidden, ids, weights), local.dispatch(hidden, ids, weights)
    assert torch.equal(recv_e.hidden, recv_l.hidden) and torch.equal(recv_e.seg_indptr, recv_l.seg_indptr)
    assert torch.equal(emulated.combine(recv_e.hidden * 2, h_e), local.combine(recv_l.hidden * 2, h_l))


@pytest.mark.parametrize("bad", [dict(ep_size=0), dict(ep_size=4, balancedness=0.0), dict(ep_size=4, balancedness=1.5),
                                 dict(ep_size=1, balancedness=0.9)])
def test_emulated_groups_refuse_what_cannot_be(bad):
    with pytest.raises(ValueError, match="ep_size|balancedness"):
        EmulatedEP(**bad)


def test_deepep_model_gives_its_readme_figures():
    model = DeepEPModel()
    ll = Traffic(tokens=128, hidden=7168, top_k=8, ep_size=8)
    assert model.seconds("low_latency", "dispatch", ll) == pytest.approx(77e-6)
    assert model.seconds("low_latency", "combine", ll) == pytest.approx(114e-6)
    at72 = model.seconds("low_latency", "dispatch", Traffic(128, 7168, 8, 72))
    assert DEEPEP_LL_US[64][0] * 1e-6 < at72 < DEEPEP_LL_US[128][0] * 1e-6  # on log(EP) between its neighbours
    assert model.seconds("low_latency", "dispatch", Traffic(256, 7168, 8, 8)) == pytest.approx(2 * 77e-6)
    # normal, EP32 over 4 nodes: one copy per destination node (3.6 of them), FP8, at 58 GB/s
    normal = Traffic(4096, 7168, 8, 32)
    nodes = 4 * (1 - 0.75 ** 8)
    assert model.seconds("normal", "dispatch", normal) == pytest.approx(4096 * nodes * 7168 * (1 + 4 / 128) / 58e9)
    # the busiest rank moves 1 / balancedness of the mean; one rank alone moves nothing
    skewed = Traffic(4096, 7168, 8, 32, balancedness=0.8)
    even = model.seconds("normal", "dispatch", normal)
    assert model.seconds("normal", "dispatch", skewed) == pytest.approx(even / 0.8)
    assert model.seconds("normal", "combine", Traffic(4096, 7168, 8, 1)) == 0.0


def test_plain_and_measured_models(tmp_path):
    ib = PlainIBModel()
    small, large = (ib.seconds("normal", "dispatch", Traffic(t, 7168, 8, 32)) for t in (1024, 4096))
    assert ib.latency_s < small < large < 4 * small  # latency plus bytes over the slower link
    report = {"config": {"world_size": 2}, "device_name": "GPU", "rows": [
        {"mode": "normal", "op": "dispatch", "variant": "eager", "tokens_per_rank": 4096, "time_us": 3100,
         "gbps_deepep": 37.0},
        {"mode": "normal", "op": "combine", "variant": "eager", "tokens_per_rank": 4096, "time_us": 1300,
         "gbps_deepep": 90.0},
        {"mode": "low_latency", "op": "dispatch", "variant": "graph", "tokens_per_rank": 128, "time_us": 2400,
         "gbps_deepep": 1.0}]}
    path = tmp_path / "dispatch.json"
    path.write_text(json.dumps(report))
    measured = network_model(f"measured:{path}")
    assert isinstance(measured, MeasuredModel)
    assert measured.seconds("low_latency", "dispatch", Traffic(64, 7168, 8, 2)) == pytest.approx(64 * 2400 / 128 * 1e-6)
    with pytest.raises(ValueError, match="low-latency combine"):
        measured.seconds("low_latency", "combine", Traffic(64, 7168, 8, 2))
    with pytest.raises(ValueError, match="unknown model"):
        network_model("carrier-pigeon")


def _records(order: list[tuple[int, str, float]]) -> list[OpRecord]:
    return [OpRecord(mb, 3, name, 100, ms) for mb, name, ms in order]


def test_the_schedule_sums_without_overlap_and_hides_communication_with_it():
    one = [("op_attn_core", 2.0), ("op_moe_dispatch_a", 0.5), ("op_moe_dispatch_b", 0.1), ("op_moe_experts", 2.0),
           ("op_moe_combine_a", 0.5), ("op_moe_combine_b", 0.1)]
    plain = _records([(0, n, ms) for n, ms in one])
    step, net = schedule_ms(plain, lambda r, op: 1.5)
    assert net == 3.0 and step == pytest.approx(sum(ms for _, ms in one) + 3.0)
    # two half micro-batches in the prefill executor's order: one's all-to-all runs under the other's compute
    half = [(n, ms / 2) for n, ms in one]
    order = [(0, *half[0]), (0, *half[1]), (1, *half[0]), (1, *half[1]), (0, *half[2]), (0, *half[3]),
             (0, *half[4]), (1, *half[2]), (1, *half[3]), (1, *half[4]), (0, *half[5]), (1, *half[5])]
    step2, net2 = schedule_ms(_records(order), lambda r, op: 0.75)
    compute = sum(ms for _, ms in one)
    assert net2 == 3.0 and max(compute, net2) <= step2 < step


@pytest.fixture(scope="module")
def wide_path(tmp_path_factory) -> str:
    """A tiny V3 with DeepSeek-V3's expert counts (256 routed, top-8 of 8 groups), so that the
    reference deployment's EP sizes and redundancy fit."""
    return make_tiny_model(str(tmp_path_factory.mktemp("rank") / "v3"), preset="v3", n_routed_experts=256,
                           num_experts_per_tok=8, n_group=8, topk_group=4, num_hidden_layers=3)


def test_an_emulated_rank_holds_its_share_and_at_ep1_gives_the_engines_logits(wide_path):
    with open(f"{wide_path}/config.json") as f:
        model = ModelConfig.from_dict(json.load(f))
    spec = RankSpec("prefill", ep_size=32, redundant=32, tokens_per_rank=24, input_len=8)
    runner = RankRunner(rank_config(model, spec, "cpu", None), spec)
    moe = runner.model.model.layers[1].mlp
    assert moe.experts.num_experts == 9  # (256 + 32) / 32 slots
    batch = build_step(runner, spec)
    assert runner.forward(batch).shape == (3, model.vocab_size)
    # one rank of one: the engine itself
    alone = RankSpec("prefill", ep_size=1, tokens_per_rank=24, input_len=8)
    emulated = RankRunner(rank_config(model, alone, "cpu", None), alone)
    engine = ModelRunner(rank_config(model, alone, "cpu", None))
    assert emulated.model.model.layers[1].mlp.experts.num_experts == 256
    step = build_step(emulated, alone)
    torch.testing.assert_close(emulated.forward(step), engine.forward(step), rtol=0, atol=0)


def test_decode_overlap_hides_the_dispatch_behind_projections_and_the_combine_behind_the_shared_experts(wide_path):
    """In decode's overlapped order (what the overlap executor runs), each micro-batch's dispatch is in
    flight while the other micro-batch runs its norm and attention projections, and its combine while
    the other runs attention core to gate and this one its shared experts (the combine carries BF16,
    twice the dispatch's FP8 bytes)."""
    with open(f"{wide_path}/config.json") as f:
        model = ModelConfig.from_dict(json.load(f))
    spec = RankSpec("decode", ep_size=72, redundant=32, batch_per_rank=4, context=8, two_batch_overlap=True)
    runner = RankRunner(rank_config(model, spec, "cpu", None), spec)
    order: list[tuple[int, int, str]] = []

    def recorder(op):
        return lambda mb, batch: order.append((mb, op.__self__.layer_id, op.__name__.removeprefix("op_")))

    ops = [op if op is overlap.YIELD else recorder(op) for op in runner.model.operations(overlap.DECODE.name)]
    overlap.run(ops, 0, None)
    plain = list(order)
    order.clear()
    overlap.run_overlapped(ops, (0, 1), (None, None), overlap.DECODE.delta)
    assert sorted(order) == sorted(plain + [(1, layer, name) for _, layer, name in plain])

    def between(mb: int, layer: int, issue: str, wait: str) -> set[tuple[int, str]]:
        start, end = order.index((mb, layer, issue)), order.index((mb, layer, wait))
        return {(m, name) for m, _, name in order[start + 1:end]}

    moe_layers = sorted({layer for _, layer, name in plain if name == "moe_dispatch_a"})
    assert moe_layers
    for layer in moe_layers[:-1]:  # the last layer's windows run into the model's end
        for mb in (0, 1):
            other = 1 - mb
            assert {(other, "input_norm"), (other, "attn_prepare")} <= between(mb, layer, "moe_dispatch_a",
                                                                               "moe_dispatch_b")
            combine_window = between(mb, layer, "moe_combine_a", "moe_combine_b")
            assert (mb, "shared_experts") in combine_window
            assert {(other, "attn_core"), (other, "attn_output"), (other, "mlp_gate")} <= combine_window


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeserve.server.cli", *args], capture_output=True, text=True,
                          timeout=600)


def test_bench_rank_reports_measured_and_modelled_figures(wide_path, tmp_path):
    out = tmp_path / "rank.json"
    run = _cli("bench", "rank", "--model-path", wide_path, "--role", "decode", "--ep-size", "72", "--redundant", "32",
               "--batch-per-rank", "6", "--context", "20", "--enable-two-batch-overlap", "--distribution", "zipf:1.2",
               "--network", "ib400", "--repeats", "1", "--profile", "--json", str(out))
    assert run.returncode == 0, run.stderr
    report = json.loads(out.read_text())
    assert report["role"] == "decode" and report["spec"]["two_batch_overlap"]
    assert set(report["spec"]["balancedness"]) == {"1", "2"} and all(
        0 < b <= 1 for b in report["spec"]["balancedness"].values())
    mod = report["modelled"]
    assert mod["network"] == "ib400" and mod["network_ms"] > 0 and mod["step_ms"] > 0
    assert mod["tokens_per_s_per_node"] == pytest.approx(8 * mod["tokens_per_s_per_gpu"])
    assert math.isclose(mod["usd_per_million_tokens"], 2.0 / (mod["tokens_per_s_per_gpu"] * 3600) * 1e6)
    assert "moe_experts" in report["measured"]["breakdown_ms"] and "modelled (ib400)" in run.stdout
    assert report["measured"]["kernels"] and all(k["ms_per_step"] > 0 for k in report["measured"]["kernels"])
    bad = _cli("bench", "rank", "--model-path", wide_path, "--role", "prefill", "--ep-size", "7", "--repeats", "1")
    assert bad.returncode != 0 and "do not divide over 7 EP ranks" in bad.stderr


def test_bench_deployment_prints_both_roles_beside_the_reference(wide_path, tmp_path):
    out = tmp_path / "deployment.json"
    run = _cli("bench", "deployment", "--model-path", wide_path, "--quantization", "none", "--scale-load", "0.01",
               "--overlap", "off", "--repeats", "1", "--context", "37", "--input-len", "200", "--batch-per-rank", "3",
               "--json", str(out))
    assert run.returncode == 0, run.stderr
    for needle in ("50,302", "22,282", "DeepSeek profile", "prefill (EP32)", "decode (EP72)", "moeserve, modelled"):
        assert needle in run.stdout
    report = json.loads(out.read_text())
    assert [r["role"] for r in report["results"]] == ["prefill", "decode"]
    prefill, decode = (r["spec"] for r in report["results"])
    # the longer sequences asked for (the reference's load scaled by 0.01: 163 tokens, one prompt of 200)
    assert (prefill["input_len"], prefill["tokens_per_rank"], decode["context"], decode["batch_per_rank"]) == (
        200, 200, 37, 3)
    # the same measured operations, scheduled again with another network model: no device needed
    again = tmp_path / "again.json"
    run = _cli("bench", "deployment", "--model-path", wide_path, "--from-json", str(out), "--network", "ib400",
               "--json", str(again))
    assert run.returncode == 0, run.stderr
    redone = json.loads(again.read_text())["results"]
    for old, new in zip(report["results"], redone):
        assert new["measured"] == old["measured"] and new["modelled"]["network"] == "ib400"
        assert new["modelled"]["network_ms"] != old["modelled"]["network_ms"]
