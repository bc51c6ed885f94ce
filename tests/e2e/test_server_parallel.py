"""The server in parallel layouts (one node and two "nodes" on loopback) answers like one rank."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

import openai
import pytest

from moeserve import LLM, SamplingParams
from moeserve.models.tiny import make_tiny_model
from tests.e2e.server_utils import alive, descendants, free_port_run, rank_pids, start_server, tcp_listeners, wait_for

PROMPTS = ["The capital of", "abc", "Once upon a time there was", "zz"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("par") / "v3"), preset="v3", seed=6, initializer_range=0.1)


@pytest.fixture(scope="module")
def expected(model_path) -> list[str]:
    llm = LLM(model_path, dtype="auto", max_total_tokens=2048)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    return [o.text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def _answers(base_url: str) -> list[str]:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none")
    texts = []
    for prompt in PROMPTS:
        out = client.completions.create(model="m", prompt=prompt, max_tokens=10, temperature=0,
                                        extra_body={"ignore_eos": True})
        texts.append(out.choices[0].text)
    stream = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=10, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == texts[0]
    return texts


COMMON = ["--served-model-name", "m", "--max-total-tokens", "2048", "--page-size", "4", "--chunked-prefill-size", "8"]


def test_api_workers_carry_dp_attention_streams_step_by_step(model_path, expected, tmp_path):
    """DP attention + EP behind two API workers on one port: the same answers as one rank, every
    socket on loopback; every
    stream gets its tokens one step at a time (one token a chunk, the chunks apart, not clumped);
    controls and stored responses work whichever worker a request lands on; a worker that dies
    takes the server down cleanly."""
    srv = start_server(["--model-path", model_path, *COMMON, "--tp-size", "2", "--dp-size", "2",
                        "--enable-dp-attention", "--moe-a2a-backend", "torch", "--load-balance-method",
                        "shortest_queue", "--api-workers", "2"],
                       str(tmp_path / "log"))
    tree = descendants(srv.proc.pid)
    try:
        workers = [pid for pid in tree if _comm(pid).startswith("moeserve-api")]
        assert len(workers) == 2 and len(rank_pids(srv.proc.pid)) == 2
        assert _answers(srv.base_url) == expected
        _assert_loopback_only(srv.proc.pid, http_port=srv.port)
        with ThreadPoolExecutor(6) as pool:
            streams = list(pool.map(lambda i: _stream_arrivals(srv.base_url, PROMPTS[i % len(PROMPTS)]), range(6)))
        for sizes, gaps in streams:
            assert sizes == [1] * 12  # one token a chunk, every token
            assert sum(gap > 0.001 for gap in gaps) >= len(gaps) // 2, gaps  # step by step, not in clumps
        for _ in range(4):  # a new connection each: the kernel spreads them over the workers
            assert httpx.post(f"{srv.base_url}/flush_cache", timeout=30).status_code == 200
        os.kill(max(workers), signal.SIGKILL)
        assert srv.proc.wait(30) == 1, srv.log()
        assert wait_for(lambda: not any(alive(pid) for pid in tree), timeout=30)
    finally:
        srv.stop()
        for pid in tree:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _stream_arrivals(base_url: str, prompt: str) -> tuple[list[int], list[float]]:
    """A streamed completion of 12 tokens: the token count of each content chunk, and the gaps
    between the chunks' arrivals."""
    body = {"model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True}
    sizes, times = [], []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["token_ids"]:
                    sizes.append(len(chunk["choices"][0]["token_ids"]))
                    times.append(time.monotonic())
    return sizes, [b - a for a, b in zip(times, times[1:])]


def _assert_loopback_only(pid: int, http_port: int | None = None) -> None:
    """Every TCP socket the process tree listens on is on 127.0.0.1 (the default address)."""
    listeners = tcp_listeners([pid, *descendants(pid)])
    assert listeners and all(addr == "127.0.0.1" for addr, _ in listeners), listeners
    if http_port is not None:
        assert ("127.0.0.1", http_port) in listeners


def test_two_nodes_on_loopback_match_single_rank(model_path, expected, tmp_path):
    dist_addr = f"127.0.0.1:{free_port_run(4)}"  # the store, the output and two DP inputs
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    layout = ["--tp-size", "4", "--dp-size", "2", "--enable-dp-attention", "--moe-a2a-backend", "torch",
              "--moe-dense-tp-size", "2", "--nnodes", "2", "--dist-init-addr", dist_addr,
              "--dist-secret-file", str(secret)]
    log1 = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen([sys.executable, "-m", "moeserve.server.cli", "serve", "--model-path", model_path,
                              *COMMON, *layout, "--node-rank", "1"], stdout=log1, stderr=subprocess.STDOUT)
    try:
        srv = start_server(["--model-path", model_path, *COMMON, *layout, "--node-rank", "0"],
                           str(tmp_path / "node0.log"))
        try:
            assert _answers(srv.base_url) == expected
            _assert_loopback_only(srv.proc.pid, http_port=srv.port)
            _assert_loopback_only(node1.pid)
        finally:
            assert srv.stop() == 0, srv.log()
        node1.send_signal(signal.SIGTERM)
        assert node1.wait(30) == 0
    finally:
        if node1.poll() is None:
            node1.kill()


def test_a_dying_rank_takes_the_server_down_cleanly(model_path, tmp_path):
    srv = start_server(["--model-path", model_path, *COMMON, "--tp-size", "2", "--moe-a2a-backend", "torch"],
                       str(tmp_path / "log"))
    tree = descendants(srv.proc.pid)
    try:
        ranks = rank_pids(srv.proc.pid)
        assert len(ranks) == 2
        os.kill(max(ranks), signal.SIGKILL)  # rank 1, not the one talking to the API
        assert srv.proc.wait(30) == 1, srv.log()
        assert wait_for(lambda: not any(alive(pid) for pid in tree), timeout=15)
    finally:
        for pid in [srv.proc.pid, *tree]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
