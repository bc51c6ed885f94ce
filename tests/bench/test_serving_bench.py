"""``bench serving`` against a fake streaming OpenAI server started in this process."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moeserve.bench.serving import (
    MIN_TOKEN_ID,
    ServingBenchConfig,
    add_serving_args,
    latency_stats,
    percentile,
    run_serving_benchmark,
    sample_random_requests,
    sample_requests,
    sample_shared_prefix_requests,
)

MODEL = "fake-model"
VOCAB_SIZE = 1000
FAIL_EVERY = 5  # every 5th completion request answers HTTP 500
FIRST_TOKEN_DELAY_S = 0.01
TOKEN_DELAY_S = 0.002


class FakeServer:
    """An OpenAI-style server that streams one token per chunk and remembers what it sent.

    With ``report_cached`` it acts as a prefix cache: ``cached_tokens`` is the longest prefix a
    prompt shares with any prompt served before it."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.n_requests = 0
        self.sent: list[int] = []  # output tokens streamed by each successful request
        self.prompt_ids: list[int] = []
        self.models: set[str] = set()
        self.in_flight = self.max_in_flight = 0
        self.serve_model_info = True
        self.report_cached = False
        self.served: list[list[int]] = []
        self.cached: dict[tuple[int, ...], int] = {}  # cached_tokens reported, by prompt

    def app(self) -> FastAPI:
        app = FastAPI()
        app.get("/v1/models")(self._models)
        app.get("/get_model_info")(self._model_info)
        app.post("/v1/completions")(self._completions)
        return app

    async def _models(self) -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    async def _model_info(self) -> JSONResponse:
        if not self.serve_model_info:
            return JSONResponse({"error": "not here"}, status_code=404)
        return JSONResponse({"model_path": MODEL, "vocab_size": VOCAB_SIZE})

    async def _completions(self, request: Request) -> Response:
        body = await request.json()
        self.n_requests += 1
        if self.n_requests % FAIL_EVERY == 0:
            return JSONResponse({"error": "injected failure"}, status_code=500)
        self.models.add(body["model"])
        self.prompt_ids += body["prompt"]
        self.sent.append(body["max_tokens"])
        # Half the streams omit usage, so the client must fall back to counting chunks.
        usage = self._usage(body) if self.n_requests % 2 == 0 and body["stream_options"]["include_usage"] else None
        self.served.append(body["prompt"])
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return StreamingResponse(self._stream(body["max_tokens"], usage), media_type="text/event-stream")

    def _usage(self, body: dict) -> dict:
        prompt, n_out = body["prompt"], body["max_tokens"]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n_out, "total_tokens": len(prompt) + n_out}
        if self.report_cached:  # every other report has null details, as some servers send
            cached = max((len(os.path.commonprefix([prompt, p])) for p in self.served), default=0)
            if self.n_requests % 4 != 0:
                self.cached[tuple(prompt)] = cached
            usage["prompt_tokens_details"] = None if self.n_requests % 4 == 0 else {"cached_tokens": cached}
        return usage

    async def _stream(self, n_out: int, usage: dict | None) -> AsyncIterator[str]:
        await asyncio.sleep(FIRST_TOKEN_DELAY_S)
        for i in range(n_out):
            yield _event({"object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]})
            await asyncio.sleep(TOKEN_DELAY_S)
        yield _event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if usage:
            yield _event({"choices": [], "usage": usage})
        self.in_flight -= 1  # before [DONE], so the client never sees a finished request still counted
        yield "data: [DONE]\n\n"


def _event(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeServer, str]]:
    fake = FakeServer()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        threading.Event().wait(0.01)
    yield fake, f"http://127.0.0.1:{port}/"
    uv.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def fake(server: tuple[FakeServer, str]) -> FakeServer:
    server[0].reset()
    return server[0]


def _args(base_url: str, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serving_args(parser)
    return parser.parse_args(["--base-url", base_url, "--num-prompts", "20", "--random-input-len", "16",
                              "--random-output-len", "8", "--random-range-ratio", "0.5", "--disable-tqdm",
                              *extra])


def _check_run(summary: dict, report: dict, fake: FakeServer, num_prompts: int = 20) -> None:
    records = report["requests"]
    ok = [r for r in records if r["success"]]
    failed = [r for r in records if not r["success"]]
    assert summary == report["summary"]
    assert summary["completed"] + summary["failed"] == len(records) == num_prompts
    assert summary["failed"] == len(failed) == num_prompts // FAIL_EVERY
    assert all("HTTP 500" in r["error"] and "injected failure" in r["error"] for r in failed)
    assert sorted(r["output_len"] for r in ok) == sorted(fake.sent)
    assert summary["total_output_tokens"] == sum(fake.sent)
    assert summary["total_input_tokens"] == sum(r["prompt_len"] for r in ok)
    for r in ok:
        assert 0 < r["ttft_ms"] <= r["e2e_latency_ms"]
        assert len(r["itl_ms"]) == r["output_len"] - 1  # one token per chunk
        assert 8 // 2 <= r["output_len"] <= 8 and 16 // 2 <= r["prompt_len"] <= 16
    for metric in ("ttft", "itl", "e2e_latency"):
        assert summary[f"median_{metric}_ms"] <= summary[f"p90_{metric}_ms"] <= summary[f"p99_{metric}_ms"]
    assert fake.models == {MODEL}
    # The fake reports no cached tokens here: unknown, not 0.
    assert summary["total_cached_tokens"] is None and summary["cache_hit_rate"] is None
    assert all(r["cached_tokens"] is None for r in records)


def test_finite_rate_with_max_concurrency(server: tuple[FakeServer, str], fake: FakeServer, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    args = _args(server[1], "--request-rate", "200", "--max-concurrency", "3", "--seed", "7",
                 "--output-json", str(out_json), "--plot", str(out_png))
    summary = run_serving_benchmark(args)
    report = json.loads(out_json.read_text())
    _check_run(summary, report, fake)
    assert fake.max_in_flight <= 3
    assert report["config"]["model"] == MODEL and report["config"]["request_rate"] == 200
    assert "api_key" not in report["config"]
    starts = [r["start_s"] for r in report["requests"]]
    assert starts[0] < starts[-1]  # spread out by the Poisson arrivals
    assert min(fake.prompt_ids) >= MIN_TOKEN_ID and max(fake.prompt_ids) < VOCAB_SIZE
    assert out_png.stat().st_size > 1000 and out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out
    assert [line.split()[-1] for line in out.splitlines() if line.startswith("Cache")] == ["-", "-"]


def test_client_processes_split_the_run(server: tuple[FakeServer, str], fake: FakeServer, tmp_path: Path) -> None:
    """``--client-processes 2``: every request sent once, from two processes sharing the concurrency
    limit, timed from one epoch, the records in request order as with one process."""
    out_json = tmp_path / "bench.json"
    summary = run_serving_benchmark(_args(server[1], "--max-concurrency", "4", "--client-processes", "2",
                                          "--output-json", str(out_json)))
    report = json.loads(out_json.read_text())
    _check_run(summary, report, fake)
    assert fake.max_in_flight <= 4
    assert all(0 <= r["start_s"] < summary["duration_s"] for r in report["requests"])
    sent = sample_requests(ServingBenchConfig.from_args(_args(server[1], "--max-concurrency", "4")), VOCAB_SIZE,
                           random.Random(1))
    assert [r["prompt_len"] for r in report["requests"]] == [len(req.prompt) for req in sent]


def test_infinite_rate_without_model_info(server: tuple[FakeServer, str], fake: FakeServer, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    fake.serve_model_info = False
    out_json = tmp_path / "bench.json"
    summary = run_serving_benchmark(_args(server[1], "--model", MODEL, "--output-json", str(out_json)))
    report = json.loads(out_json.read_text())
    _check_run(summary, report, fake)
    assert report["config"]["request_rate"] is None  # inf, kept strict JSON
    assert max(fake.prompt_ids) < 256  # the fallback vocabulary
    assert "/get_model_info" in capsys.readouterr().err


def test_shared_prefix_run_reports_cached_tokens(server: tuple[FakeServer, str], fake: FakeServer,
                                                 tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake.report_cached = True
    out_json = tmp_path / "bench.json"
    groups, per_group, prefix_len, question_len = 3, 5, 24, 6
    summary = run_serving_benchmark(_args(
        server[1], "--dataset", "generated-shared-prefix", "--gsp-num-groups", str(groups),
        "--gsp-prompts-per-group", str(per_group), "--gsp-system-prompt-len", str(prefix_len),
        "--gsp-question-len", str(question_len), "--gsp-output-len", "4", "--seed", "5",
        "--output-json", str(out_json)))
    report = json.loads(out_json.read_text())
    records, n = report["requests"], groups * per_group
    assert report["config"]["num_requests"] == len(records) == n  # --num-prompts 20 is ignored
    assert summary["completed"] == n - n // FAIL_EVERY and summary["failed"] == n // FAIL_EVERY
    # The same seed and vocabulary give the prompts that were sent, in the order they were sent.
    prompts = [r.prompt for r in sample_shared_prefix_requests(groups, per_group, prefix_len, question_len, 4,
                                                                VOCAB_SIZE, random.Random(5))]
    assert sorted(fake.served) == sorted(p for p, r in zip(prompts, records, strict=True) if r["success"])
    for prompt, record in zip(prompts, records, strict=True):
        assert record["prompt_len"] == len(prompt) == prefix_len + question_len
        assert record["cached_tokens"] == fake.cached.get(tuple(prompt))  # None where null or no usage
    assert set(fake.cached.values()) <= {0, prefix_len}  # a group-mate's prefix, or nothing
    # Among any 13 earlier arrivals at least one group-mate of the 14th was served before it.
    assert summary["total_cached_tokens"] == sum(fake.cached.values()) >= prefix_len
    assert summary["cache_hit_rate"] == pytest.approx(summary["total_cached_tokens"] / summary["total_input_tokens"])
    captured = capsys.readouterr()
    assert f"{100 * summary['cache_hit_rate']:.2f}%" in captured.out
    assert "--num-prompts 20 is ignored" in captured.err


def test_shared_prefix_requests_share_one_prefix_per_group() -> None:
    groups, per_group, prefix_len, question_len = 4, 6, 32, 8
    reqs = sample_shared_prefix_requests(groups, per_group, prefix_len, question_len, 5, 100_000, random.Random(3))
    assert len(reqs) == groups * per_group
    assert all(len(r.prompt) == prefix_len + question_len and r.output_len == 5 for r in reqs)
    assert all(MIN_TOKEN_ID <= t < 100_000 for r in reqs for t in r.prompt)
    by_prefix: dict[tuple[int, ...], list[list[int]]] = {}
    for r in reqs:
        by_prefix.setdefault(tuple(r.prompt[:prefix_len]), []).append(r.prompt)
    assert sorted(len(g) for g in by_prefix.values()) == [per_group] * groups
    for group in by_prefix.values():  # the shared prefix and not a token more
        assert {len(os.path.commonprefix([a, b])) for a in group for b in group if a is not b} == {prefix_len}
    prefixes = list(by_prefix)
    assert all(len(os.path.commonprefix([a, b])) < prefix_len for a in prefixes for b in prefixes if a is not b)
    first = {tuple(r.prompt[:prefix_len]) for r in reqs[:per_group]}
    assert len(first) > 1  # interleaved, not one group after the other
    assert reqs == sample_shared_prefix_requests(groups, per_group, prefix_len, question_len, 5, 100_000,
                                                 random.Random(3))


@pytest.mark.parametrize("name", ["gsp_num_groups", "gsp_prompts_per_group", "gsp_system_prompt_len",
                                  "gsp_question_len", "gsp_output_len"])
def test_shared_prefix_settings_must_be_positive(name: str) -> None:
    args = _args("http://127.0.0.1:1", "--dataset", "generated-shared-prefix", f"--{name.replace('_', '-')}", "0")
    with pytest.raises(ValueError, match=f"^{name} must be >= 1$"):
        ServingBenchConfig.from_args(args)


def test_random_requests_follow_the_lengths_and_seed() -> None:
    reqs = sample_random_requests(50, 40, 10, 0.25, 300, random.Random(3))
    assert all(10 <= len(r.prompt) <= 40 and 2 <= r.output_len <= 10 for r in reqs)
    assert all(MIN_TOKEN_ID <= t < 300 for r in reqs for t in r.prompt)
    assert reqs == sample_random_requests(50, 40, 10, 0.25, 300, random.Random(3))


@pytest.mark.parametrize("n", [1, 2, 7, 100])
def test_percentiles_match_statistics_quantiles(n: int) -> None:
    values = [random.Random(i).expovariate(1.0) for i in range(n)]
    stats = latency_stats(values)
    if n > 1:  # ``statistics.quantiles(method="inclusive")`` interpolates like numpy's default
        reference = statistics.quantiles(values, n=100, method="inclusive")
        assert [stats["median"], stats["p90"], stats["p99"]] == pytest.approx([reference[i] for i in (49, 89, 98)])
    assert stats["mean"] == pytest.approx(statistics.fmean(values))
    assert stats["std"] == pytest.approx(statistics.pstdev(values))
    assert percentile(sorted(values), 0) == min(values) and percentile(sorted(values), 100) == max(values)
    assert latency_stats([]) == dict.fromkeys(stats)
