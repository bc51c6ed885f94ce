"""Real prefill and decode servers on loopback (each an API process and its ranks), asked the way
the PD router asks them: the decode server's answer equals one monolithic server's."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

from moeserve.models.tiny import make_tiny_model
from tests.disagg.backend_pair import backend_available
from tests.e2e.server_utils import free_port, metric, start_server, wait_for

COMMON = ["--max-total-tokens", "2048", "--page-size", "4", "--chunked-prefill-size", "16"]
PROMPTS = ["The capital of", "Once upon a time there was a very long story about " * 3, "abc"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("pd") / "v3"), preset="v3", seed=7, initializer_range=0.1)


@pytest.fixture(scope="module")
def monolithic(model_path, tmp_path_factory):
    srv = start_server(["--model-path", model_path, *COMMON], str(tmp_path_factory.mktemp("mono") / "log"))
    yield srv
    assert srv.stop() == 0


def _pd_pair(model_path, tmp, backend, prefill_args=(), decode_args=()):
    secret, port = str(tmp / "secret"), free_port()
    pd = ["--disaggregation-transfer-backend", backend, "--disaggregation-secret-file", secret]
    prefill = start_server(["--model-path", model_path, *COMMON, *pd, "--disaggregation-mode", "prefill",
                            "--disaggregation-bootstrap-port", str(port), *prefill_args], str(tmp / "prefill.log"))
    decode = start_server(["--model-path", model_path, *COMMON, *pd, "--disaggregation-mode", "decode",
                           *decode_args], str(tmp / "decode.log"))
    return prefill, decode, port


async def _ask(prefill, decode, bootstrap_port, path, body):
    """Both legs at once, as the router sends them; the decode leg's answer."""
    room = random.getrandbits(63)
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port, "bootstrap_room": room}
    async with httpx.AsyncClient(timeout=120) as client:
        p, d = await asyncio.gather(client.post(f"{prefill.base_url}{path}", json=body),
                                    client.post(f"{decode.base_url}{path}", json=body))
    assert p.status_code == 200, p.text
    assert d.status_code == 200, d.text
    return d.json()


def _mono(srv, path, body):
    r = httpx.post(f"{srv.base_url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.skipif(
    not backend_available(b), reason=f"{b} cannot be imported here")) for b in ("torch",)])
def test_pd_servers_answer_like_one_server(model_path, monolithic, tmp_path, backend):
    prefill, decode, port = _pd_pair(model_path, tmp_path, backend)
    try:
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 2}
            got, want = asyncio.run(_ask(prefill, decode, port, "/v1/completions", body)), _mono(
                monolithic, "/v1/completions", body)
            assert got["choices"][0]["text"] == want["choices"][0]["text"]
            assert got["choices"][0]["logprobs"]["tokens"] == want["choices"][0]["logprobs"]["tokens"]
        body = {"input_ids": [5, 17, 42, 7, 9], "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                    "ignore_eos": True}}
        assert asyncio.run(_ask(prefill, decode, port, "/generate", body))["output_ids"] == _mono(
            monolithic, "/generate", body)["output_ids"]
        body = {"prompt": "abc", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2}
        got = asyncio.run(_ask(prefill, decode, port, "/v1/completions", body))
        assert [c["text"] for c in got["choices"]] == [c["text"] for c in _mono(monolithic, "/v1/completions",
                                                                                 body)["choices"]]
        for srv in (prefill, decode):
            assert wait_for(lambda url=srv.base_url: metric(url, "moeserve:kv_pages_used") == 0)
        assert metric(prefill.base_url, "moeserve:kv_transfers", result="success") == len(PROMPTS) + 3
        assert metric(prefill.base_url, "moeserve:kv_transfer_bytes") > 0
    finally:
        assert prefill.stop() == 0, prefill.log()
        assert decode.stop() == 0, decode.log()
