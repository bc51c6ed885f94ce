"""Overload on a real monolithic server: a burst queues in the engine (no queue limit by default)
and every request is answered; ``--queue-timeout`` ends a request that could not start in time
with 503 naming the flag, while the request that kept the server busy completes."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from moeserve.models.tiny import make_tiny_model
from tests.e2e.server_utils import metric, start_server, wait_for

BURST = 256
# About 3 ms a decode step on a 2-core CPU, so ~9 s: far longer than the 1 s queue timeout; the test
# checks that it was still running when the timed-out requests were answered, then its client leaves
LONG_TOKENS = 3000
TIMED_OUT = "the request waited more than 1.0 s in the queue (--queue-timeout)"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    # 4096 positions, so that one request can decode for seconds
    return make_tiny_model(str(tmp_path_factory.mktemp("overload") / "v3"), preset="v3", seed=5,
                           max_position_embeddings=4096)


def test_a_burst_of_256_requests_is_queued_and_answered(model_path, tmp_path):
    # 256 at once against 128 running places: half of them wait in the engine's queue
    srv = start_server(["--model-path", model_path, "--max-total-tokens", "16384", "--max-running-requests", "128"],
                       str(tmp_path / "log"))
    try:
        async def burst() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=BURST)  # a connection each: all arrive together
            async with httpx.AsyncClient(base_url=srv.base_url, timeout=120, limits=limits) as client:
                return await asyncio.gather(*[
                    client.post("/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 3, "ignore_eos": True})
                    for i in range(BURST)])

        answers = asyncio.run(burst())
        statuses = Counter(r.status_code for r in answers)
        assert statuses == {200: BURST}, (statuses, next(r.text for r in answers if r.status_code != 200))
        assert all(r.json()["usage"]["completion_tokens"] == 3 for r in answers)
        assert wait_for(lambda: metric(srv.base_url, "moeserve:kv_pages_used") == 0)
    finally:
        assert srv.stop() == 0, srv.log()


def _events(url: str, body: dict, first: threading.Event | None = None,
            leave: threading.Event | None = None) -> list[tuple[float, str]]:
    """Every ``data:`` payload of a streamed answer, with the time it arrived; the client leaves at
    the first one after ``leave`` is set."""
    events = []
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append((time.monotonic(), line.removeprefix("data: ")))
                if first is not None:
                    first.set()
                if leave is not None and leave.is_set():
                    break
    return events


def _post(url: str, body: dict) -> tuple[float, httpx.Response]:
    answer = httpx.post(url, json=body, timeout=120)
    return time.monotonic(), answer


def test_queue_timeout_ends_requests_that_could_not_start(model_path, tmp_path):
    srv = start_server(["--model-path", model_path, "--max-total-tokens", "8192", "--max-running-requests", "1",
                        "--queue-timeout", "1"], str(tmp_path / "log"))
    url = f"{srv.base_url}/v1/completions"
    short = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}
    try:
        with ThreadPoolExecutor(3) as pool:
            started, answered = threading.Event(), threading.Event()
            long = pool.submit(_events, url, {"prompt": "hi", "max_tokens": LONG_TOKENS, "ignore_eos": True,
                                              "stream": True}, started, answered)
            assert started.wait(60)  # it holds the only running place from here
            sent = time.monotonic()
            plain = pool.submit(_post, url, short)
            streamed = pool.submit(_events, url, {**short, "stream": True})
            (refused_at, refused), stream_events = plain.result(), streamed.result()
            answered.set()  # the long request's client leaves now: its abort frees the running place
            long_events = long.result()

        assert refused.status_code == 503, refused.text
        assert refused.json()["error"] == {"message": TIMED_OUT, "type": "server_error", "param": None, "code": 503}
        assert refused_at - sent >= 1.0
        (error_at, error), (_, done) = stream_events
        assert json.loads(error)["error"]["message"] == TIMED_OUT and json.loads(error)["error"]["code"] == 503
        assert done == "[DONE]"

        # the long request was still running when both were answered: it never finished
        chunks = [json.loads(payload)["choices"][0] for _, payload in long_events]
        assert all(c["finish_reason"] is None for c in chunks), "the long request ended before the timeout fired"
        assert long_events[-1][0] > max(refused_at, error_at)

        assert wait_for(lambda: metric(srv.base_url, "moeserve:kv_pages_used") == 0)
        again = httpx.post(url, json=short, timeout=60)
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4, again.text
    finally:
        assert srv.stop() == 0, srv.log()
