"""``bench compare-hf`` on the CPU: one set of weights in both engines, the report, the roofline."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from moeserve.bench import compare_hf as cmp
from moeserve.bench import roofline as rl
from moeserve.bench.kernels import Ceilings
from moeserve.bench.one_batch import admit, engine_config_from_args, random_prompts, release
from moeserve.config import ModelConfig
from moeserve.core import ForwardMode, ScheduleBatch, ScheduledSeq
from moeserve.executor.model_runner import ModelRunner
from moeserve.models.tiny import make_tiny_model
from moeserve.planner import Layout, preset_config, weight_memory
from moeserve.server.cli import main

CEILINGS = Ceilings(copy_gbps=2.0, bf16_tflops=3.0, fp8_tflops=6.0)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "v3"), preset="v3", seed=0)


def make_runner(path: str, load_format: str) -> ModelRunner:
    parser = argparse.ArgumentParser()
    cmp.add_compare_hf_args(parser)
    args = parser.parse_args(["--model-path", path, "--load-format", load_format, "--device", "cpu",
                              "--dtype", "float32", "--page-size", "4", "--seed", "3"])
    return ModelRunner(engine_config_from_args(args, max_running_requests=8, max_total_tokens=512))


@pytest.fixture(scope="module")
def runner(tiny_path) -> ModelRunner:
    return make_runner(tiny_path, "dummy")


@pytest.fixture(scope="module")
def hf(runner):
    return cmp.build_hf_model(runner.model, runner.config.model)


def all_logits(runner: ModelRunner, prompts: list[list[int]]) -> torch.Tensor:
    pool = runner.new_page_pool()
    reqs = admit(pool, prompts, 1)
    try:
        seqs = [ScheduledSeq(r, 0, r.seq_len) for r in reqs]
        return runner.forward(ScheduleBatch(ForwardMode.EXTEND, seqs), all_logits=True)
    finally:
        release(pool, reqs)


# --------------------------------------------------------------------------------- same weights


@pytest.mark.parametrize("load_format", ["dummy", "auto"])
def test_transformers_on_moeserves_weights_gives_moeserves_logits(tiny_path, load_format):
    runner = make_runner(tiny_path, load_format)
    hf = cmp.build_hf_model(runner.model, runner.config.model)
    prompts = random_prompts(2, 11, runner.config.model.vocab_size, seed=7)
    ours = all_logits(runner, prompts)  # [2 * 11, V]
    with torch.inference_mode():
        theirs = hf(input_ids=torch.tensor(prompts)).logits.flatten(0, 1)
    assert (ours - theirs).norm() / theirs.norm() < 1e-4
    assert cmp.same_logits_error(runner, hf, prompts) < 1e-4


def test_the_weights_are_shared_not_copied(runner, hf):
    ours = {t.untyped_storage().data_ptr() for t in runner.model.parameters()}
    for name, t in list(hf.named_parameters()) + [(n, b) for n, b in hf.named_buffers() if "rotary" not in n]:
        assert t.untyped_storage().data_ptr() in ours, name


def test_a_cache_filled_in_groups_equals_one_filled_at_once(hf):
    prompts = random_prompts(3, 6, 320, seed=2)
    whole, first = cmp.hf_fill_cache(hf, prompts, 100, torch.device("cpu"))
    grouped, first_grouped = cmp.hf_fill_cache(hf, prompts, 6, torch.device("cpu"))  # one sequence a call
    assert torch.equal(first, first_grouped)
    for a, b in zip(whole.layers, grouped.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


# ------------------------------------------------------------------------------------ the report


def test_compare_measures_every_cell_on_both_engines(runner):
    spec = cmp.CompareSpec(batch_sizes=[1, 3], contexts=[5], prefill=[(2, 7)], decode_steps=2,
                           max_prefill_tokens=8)
    report = cmp.compare(runner, spec, CEILINGS)
    assert [(c.kind, c.batch, c.length) for c in report.cells] == [
        ("decode", 1, 5), ("decode", 3, 5), ("prefill", 2, 7)]
    assert report.same_logits_rel_err < 1e-4
    m = runner.config.model
    for c in report.cells:
        assert c.moeserve_s > 0 and c.hf_s > 0 and not c.moeserve_error and not c.hf_error
        assert c.speedup == pytest.approx(c.hf_s / c.moeserve_s)
        assert c.of_roofline == pytest.approx(c.moeserve_s / c.roofline_s)
        work_fn = rl.decode_work if c.kind == "decode" else rl.prefill_work
        assert c.roofline_s == rl.roofline(work_fn(m, c.batch, c.length, "fp32", 4), CEILINGS, "fp32").step_s
    decode = report.cells[1]
    assert 1 <= decode.experts_measured <= min(m.n_routed_experts, 3 * m.num_experts_per_tok)
    text = cmp.format_report(report)
    assert "transformers 5" in text and " decode     3     5 |" in text and "prefill     2     7 |" in text
    json.dumps(cmp.report_dict(report))


def test_a_cell_that_runs_out_of_memory_reads_oom_and_the_run_goes_on(runner, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(cmp, "hf_decode", out_of_memory)
    spec = cmp.CompareSpec(batch_sizes=[2], contexts=[4], prefill=[(1, 4)], decode_steps=1)
    report = cmp.compare(runner, spec, CEILINGS)
    decode, prefill = report.cells
    assert decode.hf_error == "OOM" and decode.hf_s is None and decode.speedup is None
    assert decode.moeserve_s > 0 and prefill.hf_s > 0
    assert "OOM" in cmp.format_report(report)


def test_cli_writes_the_report(tiny_path, tmp_path, capsys):
    out = tmp_path / "cmp.json"
    argv = ["bench", "compare-hf", "--model-path", tiny_path, "--load-format", "dummy", "--device", "cpu",
            "--batch-sizes", "2", "--contexts", "4", "--prefill", "1x6", "--decode-steps", "1",
            "--page-size", "4", "--json", str(out)]
    assert main(argv) == 0
    assert "same weights: last-token logits differ by" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert [c["kind"] for c in report["cells"]] == ["decode", "prefill"]
    assert report["same_logits_rel_err"] < 1e-4 and report["ceilings"]["copy_gbps"] > 0


def test_the_default_shapes_are_the_acceptance_ones():
    parser = argparse.ArgumentParser()
    cmp.add_compare_hf_args(parser)
    spec = cmp.spec_from_args(parser.parse_args([]))
    assert (spec.batch_sizes, spec.contexts, spec.prefill) == ([32, 128], [256, 2048], [(8, 1024)])
    assert spec.kv_tokens(16) == 128 * 130 * 16  # 2048 + 16 steps + 1 tokens: 130 pages of 16 each
    assert spec.max_batch == 128
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill", "8by1024"])


# ------------------------------------------------------------------------------------ roofline


def tiny_config(**overrides) -> ModelConfig:
    hf = {"model_type": "deepseek_v3", "vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
          "moe_intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": 12,
          "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 4, "n_routed_experts": 4,
          "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1,
          "topk_group": 1, "topk_method": "noaux_tc"}
    return ModelConfig.from_dict({**hf, **overrides})


def test_decode_work_matches_a_hand_count():
    m = tiny_config()
    # per layer: q_a 12x16, q_b 12x12, kv_a 10x16, kv_b 16x8, o 16x8 = 752 values; norms 16+16+12+8 = 52
    attention = 752 + 52
    dense, expert, router = 3 * 16 * 32, 3 * 16 * 8, 4 * 16
    experts = 4 * (1 - (1 - 2 / 4) ** 3)  # batch 3, top-2 of 4: 3.5
    assert rl.expected_experts(4, 2, 3) == experts == 3.5
    weights = 2 * (2 * attention + dense + expert + router + experts * expert + 16 + 100 * 16) + 4 * 4
    w = rl.decode_work(m, batch=3, context=10)
    assert w.weight_bytes == weights == 13120
    assert w.kv_bytes == 3 * (10 + 1) * 2 * 10 * 2  # read 10 rows and write 1, 2 layers of 8 + 2 values
    per_token = 2 * 752 + dense + router + 2 * expert + expert  # attention, dense, router, top-2, shared
    assert w.linear_flops == 2 * 3 * (per_token + 100 * 16)
    assert w.attention_flops == 2 * 3 * 2 * (2 * (8 + 2) * 10 + 2 * 8 * 10)  # layers x batch x heads x absorbed
    assert rl.decode_work(m, 3, 10, experts_per_layer=1.0).weight_bytes == weights - 2 * 2.5 * expert


def test_fp8_weights_count_one_byte_and_a_block_scale_per_decoder_linear():
    m = tiny_config()
    fp8 = rl.decode_work(m, 3, 10, weight_dtype="fp8")
    linears = 2 * (752 + 5 * 4) + (3 * 16 * 32 + 3 * 4) + (3 * 16 * 8 + 3 * 4) * (1 + 3.5)
    plain = 2 * (2 * 52 + 4 * 16 + 16 + 100 * 16) + 4 * 4
    assert fp8.weight_bytes == linears + plain


def test_prefill_work_matches_a_hand_count():
    m = tiny_config()
    w = rl.prefill_work(m, batch=2, input_len=5)
    assert w.experts_per_layer == 4 * (1 - 0.5 ** 10)
    assert w.kv_bytes == 2 * 5 * 2 * 10 * 2
    per_token = 2 * 752 + 3 * 16 * 32 + 4 * 16 + 3 * 3 * 16 * 8
    assert w.linear_flops == 2 * (10 * per_token + 2 * 100 * 16)
    assert w.attention_flops == 2 * 2 * 2 * 2 * (6 + 4) * 15  # 2 x layers x batch x heads x dims x causal pairs


def test_roofline_takes_the_larger_floor():
    w = rl.StepWork(weight_bytes=3e9, kv_bytes=1e9, linear_flops=6e12, attention_flops=3e12, experts_per_layer=1)
    bf16 = rl.roofline(w, CEILINGS)
    assert bf16.memory_s == pytest.approx(2.0) and bf16.compute_s == pytest.approx(3.0)
    assert bf16.step_s == pytest.approx(3.0) and bf16.bound == "compute"
    fp8 = rl.roofline(w, CEILINGS, "fp8")  # linear FLOPs at the fp8 rate
    assert fp8.compute_s == pytest.approx(2.0) and fp8.bound == "memory"


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_all_experts_read_is_the_planners_weight_memory_less_the_embedding(dtype):
    m = preset_config("dsv3", 4)
    planned = weight_memory(m, Layout(world=1), dtype)
    assert rl.weight_bytes(m, dtype, m.n_routed_experts) == sum(planned.values()) - planned["embedding"]


def test_dsv3_decode_at_batch_32_is_memory_bound_near_11_ms_on_an_h200():
    m = preset_config("dsv3", 4)
    roof = rl.roofline(rl.decode_work(m, 32, 256), Ceilings(copy_gbps=4300, bf16_tflops=790, fp8_tflops=1600))
    assert roof.bound == "memory" and 10e-3 < roof.step_s < 12e-3
    assert math.isclose(rl.expected_experts(256, 8, 32), 256 * (1 - (31 / 32) ** 32))
