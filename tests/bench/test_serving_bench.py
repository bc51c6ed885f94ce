"""``bench serving`` against a fake streaming OpenAI server started in this process."""

from __future__ import annotations

import argparse
import asyncio
import json
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
    add_serving_args,
    latency_stats,
    percentile,
    run_serving_benchmark,
    sample_random_requests,
)

MODEL = "fake-model"
VOCAB_SIZE = 1000
FAIL_EVERY = 5  # every 5th completion request answers HTTP 500
FIRST_TOKEN_DELAY_S = 0.01
TOKEN_DELAY_S = 0.002


class FakeServer:
    """An OpenAI-style server that streams one token per chunk and remembers what it sent."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.n_requests = 0
        self.sent: list[int] = []  # output tokens streamed by each successful request
        self.prompt_ids: list[int] = []
        self.models: set[str] = set()
        self.in_flight = self.max_in_flight = 0
        self.serve_model_info = True

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
        usage = self.n_requests % 2 == 0 and body["stream_options"]["include_usage"]
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        return StreamingResponse(self._stream(len(body["prompt"]), body["max_tokens"], usage),
                                 media_type="text/event-stream")

    async def _stream(self, n_prompt: int, n_out: int, usage: bool) -> AsyncIterator[str]:
        await asyncio.sleep(FIRST_TOKEN_DELAY_S)
        for i in range(n_out):
            yield _event({"object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]})
            await asyncio.sleep(TOKEN_DELAY_S)
        yield _event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if usage:
            yield _event({"choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                                   "total_tokens": n_prompt + n_out}})
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
    assert "Serving Benchmark Result" in capsys.readouterr().out


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
