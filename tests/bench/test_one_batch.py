"""``bench one-batch`` on a tiny model on the CPU: the pass machinery and the report."""

from __future__ import annotations

import argparse
import itertools
import json

import pytest

from moeserve.bench.one_batch import (
    add_one_batch_args,
    admit,
    bench_one_batch,
    engine_config_from_args,
    prefill_chunks,
    random_prompts,
    run_pass,
)
from moeserve.core import Req, SamplingParams
from moeserve.executor.model_runner import ModelRunner
from moeserve.models.tiny import make_tiny_model
from moeserve.server.cli import main


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "v3"), preset="v3", seed=0)


@pytest.fixture(scope="module")
def runner(tiny_path) -> ModelRunner:
    args = parse(["--model-path", tiny_path, "--device", "cpu", "--page-size", "4", "--max-total-tokens", "256"])
    return ModelRunner(engine_config_from_args(args, max_running_requests=8))


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_one_batch_args(parser)
    return parser.parse_args(argv)


def test_prefill_chunks_cover_every_prompt_token_within_the_budget():
    reqs = [Req(str(i), list(range(n)), SamplingParams()) for i, n in enumerate([5, 12, 3])]
    calls = list(prefill_chunks(reqs, 7))
    assert all(sum(s.end - s.start for s in call) <= 7 for call in calls)
    for req in reqs:
        pieces = [(s.start, s.end) for call in calls for s in call if s.req is req]
        assert pieces[0][0] == 0 and pieces[-1][1] == len(req.prompt_ids)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))  # contiguous, in order
    with pytest.raises(ValueError, match="max_prefill_tokens"):
        list(prefill_chunks(reqs, 0))


def test_a_pass_gives_the_same_greedy_tokens_whether_prefill_is_split_or_not(runner):
    prompts = random_prompts(3, 13, runner.config.model.vocab_size, seed=4)
    pool = runner.new_page_pool()
    whole = run_pass(runner, prompts, output_len=4, max_prefill_tokens=1000, pool=pool)
    split = run_pass(runner, prompts, output_len=4, max_prefill_tokens=5, pool=pool)
    assert whole.tokens == split.tokens and all(len(t) == 4 for t in whole.tokens)
    assert len(whole.step_s) == 3 and all(s > 0 for s in whole.step_s)
    assert pool.num_used == 0  # every page given back


def test_admit_refuses_a_batch_the_kv_cache_cannot_hold(runner):
    pool = runner.new_page_pool()
    free = pool.num_free
    with pytest.raises(ValueError, match="KV cache holds"):
        admit(pool, [[1] * 100] * 3, output_len=8)
    assert pool.num_free == free


def test_bench_one_batch_reports_rates_from_its_timed_pass(runner):
    r = bench_one_batch(runner, batch_size=2, input_len=9, output_len=3, max_prefill_tokens=8)
    assert r.decode_steps == 2 and r.tokens_match_warmup is True
    assert r.prefill_s > 0 and r.prefill_tok_s == pytest.approx(2 * 9 / r.prefill_s)
    assert r.decode_tok_s == pytest.approx(2 / (r.decode_step_ms / 1e3))
    assert r.peak_memory_gb is None and r.weights_gb > 0 and r.kv_cache_tokens == 256
    one = bench_one_batch(runner, batch_size=1, input_len=4, output_len=1, warmup=False)
    assert one.decode_steps == 0 and one.decode_step_ms is None and one.tokens_match_warmup is None


def test_cli_runs_each_batch_size_and_writes_json(tiny_path, tmp_path, capsys):
    out = tmp_path / "one.json"
    argv = ["bench", "one-batch", "--model-path", tiny_path, "--device", "cpu", "--batch-size", "1", "3",
            "--input-len", "6", "--output-len", "3", "--page-size", "4", "--json", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "one batch: deepseek_v3, 3 layers (1 dense + 2 MoE)" in table and "decode tok/s" in table
    report = json.loads(out.read_text())
    assert [r["batch_size"] for r in report["results"]] == [1, 3]
    assert all(r["prefill_tok_s"] > 0 and r["decode_tok_s"] > 0 for r in report["results"])
    assert report["model"]["num_layers"] == 3 and report["device"] == "cpu"


def test_a_preset_builds_a_short_stack_of_its_shapes_with_dummy_weights():
    args = parse(["--preset", "dsv3", "--num-layers", "4", "--device", "cpu", "--disable-cuda-graph",
                  "--cuda-graph-max-bs", "64", "--quantization", "fp8"])
    cfg = engine_config_from_args(args, max_running_requests=128, max_total_tokens=4096)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.n_routed_experts) == (4, 7168, 256)
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert m.fp8_block is None  # a bf16 "checkpoint": only --quantization makes weights FP8
    assert cfg.load.load_format == "dummy" and cfg.load.quantization == "fp8"
    assert cfg.runner.disable_cuda_graph and cfg.runner.cuda_graph_max_bs == 64
    assert cfg.scheduler.max_running_requests == 128 and cfg.cache.max_total_tokens == 4096
    with pytest.raises(ValueError, match="--load-format dummy"):
        engine_config_from_args(parse(["--preset", "dsv3", "--load-format", "auto"]), 1)


def test_roofline_ratios_are_each_time_over_its_floor_and_need_a_gpu(runner, capsys):
    from moeserve.bench import roofline as rl
    from moeserve.bench.kernels import Ceilings
    from moeserve.bench.one_batch import attach_roofline

    r = bench_one_batch(runner, batch_size=2, input_len=9, output_len=3, max_prefill_tokens=8, warmup=False)
    ceilings = Ceilings(copy_gbps=1.0, bf16_tflops=0.5, fp8_tflops=1.0)
    attach_roofline(runner.config, r, ceilings)
    m = runner.config.model
    prefill = rl.roofline(rl.prefill_work(m, 2, 9, "fp32", 4), ceilings, "fp32").step_s
    decode = rl.roofline(rl.decode_work(m, 2, 10, "fp32", 4), ceilings, "fp32").step_s
    assert r.prefill_of_roofline == pytest.approx(r.prefill_s / prefill)
    assert r.decode_of_roofline == pytest.approx(r.decode_step_ms / 1e3 / decode)
    assert main(["bench", "one-batch", "--preset", "dsv3", "--num-layers", "2", "--device", "cpu", "--roofline"]) != 0
    assert "--roofline measures the GPU's ceilings: it needs --device cuda" in capsys.readouterr().err


def test_a_share_of_the_batch_held_to_a_json_schema_leaves_the_other_rows_alone(runner):
    """``--json-schema-share``: the constrained rows write what the schema allows (a new matcher
    takes every token), the free rows write the greedy tokens
    of a pass without grammars."""
    import xgrammar as xgr

    from moeserve.bench.structured import SCHEMA, synthetic_vocab

    vocab_size = runner.config.model.vocab_size
    prompts = random_prompts(4, 5, vocab_size, seed=2)
    free = run_pass(runner, prompts, output_len=30, max_prefill_tokens=64, json_schema_share=0.0)
    half = run_pass(runner, prompts, output_len=30, max_prefill_tokens=64, json_schema_share=0.5)
    assert half.tokens[2:] == free.tokens[2:] and half.tokens[:2] != free.tokens[:2]
    vocab = synthetic_vocab(vocab_size)
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[vocab_size - 1])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False)
    for tokens in half.tokens[:2]:
        matcher = xgr.GrammarMatcher(compiled)
        for token in tokens[1:]:  # the prefill's token is free
            assert matcher.accept_token(token)
            if matcher.is_terminated():
                matcher.reset()
        assert b"".join(vocab[t] for t in tokens[1:]).startswith(b'{"items":')
    with pytest.raises(ValueError, match="json_schema_share"):
        run_pass(runner, prompts, output_len=2, max_prefill_tokens=64, json_schema_share=1.5)
