"""Overload (503 + Retry-After) and a dying engine (unhealthy, clean exit) on a real server."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from moeserve.models.tiny import make_tiny_model
from tests.e2e.server_utils import alive, descendants, start_server, wait_for


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


def test_engine_death_makes_the_server_unhealthy_and_exit(model_path, tmp_path):
    srv = start_server(["--model-path", model_path, "--max-total-tokens", "4096"], str(tmp_path / "log"))
    tree = descendants(srv.proc.pid)
    try:
        engines = [pid for pid in tree if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()]
        assert len(engines) == 1, tree
        body = {"prompt": "x", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(engines[0], signal.SIGKILL)
            rest = "\n".join(lines)
        assert "error" in rest and "engine" in rest
        assert srv.proc.wait(30) == 1, srv.log()
        assert wait_for(lambda: not any(alive(pid) for pid in tree), timeout=10)
        assert "rank0 exited (code -9)" in srv.log()
    finally:
        for pid in [srv.proc.pid, *tree]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
