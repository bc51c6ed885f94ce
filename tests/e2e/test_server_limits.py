"""Overload (503 + Retry-After) and a dying engine (unhealthy, clean exit) on a real server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from moeserve.models.tiny import make_tiny_model
from tests.e2e.server_utils import alive, descendants, metric, rank_pids, start_server, wait_for


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("lim") / "v2"), preset="v2-lite", seed=2)


def test_full_queue_answers_503_with_retry_after(model_path, tmp_path):
    # Chunks of 4 tokens make a 500-token prompt wait ~125 steps for its first token: the queue
    # (requests without a first token) stays full long enough for a second request to be refused.
    srv = start_server(["--model-path", model_path, "--max-queued-requests", "1", "--chunked-prefill-size", "4",
                        "--max-total-tokens", "4096"], str(tmp_path / "log"))
    try:
        slow = {"prompt": [2 + i % 300 for i in range(500)], "max_tokens": 4, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=slow, timeout=120) as first:
            refused = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1" and "queue" in refused.json()["error"]["message"]
            assert "[DONE]" in "".join(first.iter_lines())
        assert httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    finally:
        assert srv.stop() == 0


def test_a_burst_cannot_pass_the_queue_limit(model_path, tmp_path):
    # 400-token prompts in chunks of 4 tokens: the first request needs 100 steps to its first token,
    # the eighth 800, so a burst of 48 arrives long before any place in the queue comes free
    srv = start_server(["--model-path", model_path, "--max-queued-requests", "8", "--chunked-prefill-size", "4",
                        "--max-total-tokens", "8192"], str(tmp_path / "log"))
    try:
        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120,
                                         limits=httpx.Limits(max_connections=64)) as client:
                body = {"prompt": [2 + i % 300 for i in range(400)], "max_tokens": 1, "ignore_eos": True}
                return await asyncio.gather(*[client.post("/v1/completions", json=body) for _ in range(48)])

        statuses = [r.status_code for r in asyncio.run(burst())]
        assert statuses.count(200) == 8 and statuses.count(503) == 40, statuses
        assert metric(srv.base_url, "moeserve:refused_requests_total", reason="queue_full") == 40
        many = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": [[5, 6]] * 32, "max_tokens": 1})
        assert many.status_code == 400 and "32 completions" in many.json()["error"]["message"]
        again = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": [[5, 6]] * 8, "max_tokens": 1})
        assert again.status_code == 200 and len(again.json()["choices"]) == 8  # every place came back
        assert wait_for(lambda: metric(srv.base_url, "moeserve:kv_pages_used") == 0)
    finally:
        assert srv.stop() == 0


def test_engine_death_makes_the_server_unhealthy_and_exit(model_path, tmp_path):
    srv = start_server(["--model-path", model_path, "--max-total-tokens", "4096"], str(tmp_path / "log"))
    tree = descendants(srv.proc.pid)
    try:
        engines = rank_pids(srv.proc.pid)
        assert len(engines) == 1, tree
        body = {"prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True}
        whole = {**body, "stream": False}
        with ThreadPoolExecutor(1) as pool, httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body,
                                                         timeout=30) as r:
            in_flight = pool.submit(httpx.post, f"{srv.base_url}/v1/completions", json=whole, timeout=30)
            lines = r.iter_lines()
            next(lines)
            assert wait_for(lambda: metric(srv.base_url, "moeserve:num_running_reqs") == 2)
            os.kill(engines[0], signal.SIGKILL)
            rest = "\n".join(lines)
            answer = in_flight.result()
        event = json.loads(next(x for x in rest.splitlines() if '"error"' in x).removeprefix("data: "))
        assert event["error"]["type"] == "server_error" and "engine" in event["error"]["message"]
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "server_error", answer.text
        assert srv.proc.wait(30) == 1, srv.log()
        assert wait_for(lambda: not any(alive(pid) for pid in tree), timeout=10)
        assert "rank0 exited (code -9)" in srv.log()
    finally:
        for pid in [srv.proc.pid, *tree]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
