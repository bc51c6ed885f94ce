"""``bench dispatch`` on two CPU ranks (gloo) at tiny shapes: every row, and byte counts that
follow from the shapes alone."""

from __future__ import annotations

import argparse
import json

import pytest

from moeserve.bench.dispatch import DispatchBenchConfig, add_dispatch_args, run_dispatch_benchmark

HIDDEN, TOP_K, EXPERTS, NORMAL_TOKENS, LL_TOKENS, WORLD = 32, 2, 8, 16, 4, 2
FP32 = 4


def _args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_dispatch_args(parser)
    return parser.parse_args(["--device", "cpu", "--world-size", str(WORLD), "--hidden", str(HIDDEN),
                              "--top-k", str(TOP_K), "--num-experts", str(EXPERTS),
                              "--normal-tokens", str(NORMAL_TOKENS), "--ll-tokens", str(LL_TOKENS),
                              "--warmup", "1", "--iters", "3", *extra])


def test_two_cpu_ranks(tmp_path):
    out = tmp_path / "dispatch.json"
    table = run_dispatch_benchmark(_args("--output-json", str(out)))
    for mode in ("normal", "low_latency"):
        for op in ("dispatch", "combine", "all_to_all"):
            assert any(line.split()[:3] == [mode, op, "eager"] for line in table.splitlines()), (mode, op, table)
    assert "153 GB/s" in table and "77 us" in table

    result = json.loads(out.read_text())
    assert result["config"]["dtype"] == "float32" and result["config"]["cuda_graph"] is False
    rows = {(r["mode"], r["op"]): r for r in result["rows"]}
    assert len(rows) == len(result["rows"]) == 6
    assert all(r["time_us"] > 0 for r in rows.values())

    token = HIDDEN * FP32
    ll = rows["low_latency", "dispatch"]
    assert ll["bytes_deepep"] == LL_TOKENS * TOP_K * token  # every (token, expert) selection
    assert 0 <= ll["bytes_nvlink"] <= ll["bytes_deepep"]
    assert ll["bytes_moved"] == (EXPERTS - EXPERTS // WORLD) * LL_TOKENS * token  # the other ranks' blocks

    normal = rows["normal", "dispatch"]
    # each token reaches between 1 and min(k, N) ranks, once each however many experts it chose there
    assert NORMAL_TOKENS * token <= normal["bytes_deepep"] <= NORMAL_TOKENS * min(TOP_K, WORLD) * token
    assert normal["bytes_fp8"] == pytest.approx(normal["bytes_deepep"] / token * (HIDDEN + HIDDEN / 128 * 4))
    assert normal["bytes_nvlink"] < normal["bytes_deepep"]
    assert rows["normal", "combine"]["bytes_deepep"] == normal["bytes_deepep"]


def test_fp8_dispatch_sends_and_counts_fp8_tokens(tmp_path):
    """``--fp8-dispatch``: the dispatchers send each token as FP8 values and one fp32 scale per 1x128
    group (one group here), and the dispatch rows count those bytes; combine stays float32."""
    out = tmp_path / "dispatch.json"
    run_dispatch_benchmark(_args("--fp8-dispatch", "--output-json", str(out)))
    result = json.loads(out.read_text())
    assert result["config"]["fp8_dispatch"] is True
    rows = {(r["mode"], r["op"]): r for r in result["rows"]}
    fp8_token, token = HIDDEN + 4, HIDDEN * FP32
    ll = rows["low_latency", "dispatch"]
    assert ll["bytes_deepep"] == LL_TOKENS * TOP_K * fp8_token
    assert ll["bytes_moved"] == (EXPERTS - EXPERTS // WORLD) * LL_TOKENS * fp8_token
    assert rows["low_latency", "combine"]["bytes_deepep"] == LL_TOKENS * TOP_K * token
    normal = rows["normal", "dispatch"]
    assert normal["bytes_deepep"] / fp8_token == pytest.approx(rows["normal", "combine"]["bytes_deepep"] / token)
    assert all(r["time_us"] > 0 for r in rows.values())


def test_config_is_checked():
    with pytest.raises(ValueError, match="spread evenly"):
        DispatchBenchConfig.from_args(_args("--num-experts", "7"))
    with pytest.raises(ValueError, match="top_k"):
        DispatchBenchConfig.from_args(_args("--top-k", "9"))
    with pytest.raises(ValueError, match="at least 2"):
        DispatchBenchConfig.from_args(_args("--world-size", "1"))
