"""Prefill and decode servers behind the PD router, as real processes on loopback: greedy output
through the router is the single-process engine's, for every transfer backend and layout."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import socket
import time

import httpx
import openai
import pytest
import zmq

from moeserve import LLM, SamplingParams
from moeserve.models.tiny import make_tiny_model
from moeserve.scheduler.channel import terminate
from moeserve.server import procs
from tests.disagg.backend_pair import backend_available
from tests.e2e.server_utils import descendants, metric, tcp_listeners, wait_for

SERVER = ["--max-total-tokens", "4096", "--page-size", "4", "--chunked-prefill-size", "16"]
PROMPTS = ["The capital of", "Once upon a time there was a very long story about " * 3, "abc"]
HETERO_PREFILL = ["--tp-size", "2", "--moe-a2a-backend", "torch", "--deepep-mode", "normal"]
HETERO_DECODE = ["--tp-size", "4", "--dp-size", "4", "--enable-dp-attention", "--moe-a2a-backend", "torch",
                 "--deepep-mode", "low_latency"]
CONSTRAINED = [{"regex": r"(yes|no), [a-z]{2,6}\."},
               {"json_schema": '{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, '
                               '"maximum": 999}}, "required": ["n"], "additionalProperties": false}'}]
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not backend_available(b), reason=f"{b} cannot be imported"))
            for b in ("torch", "nixl", "mooncake")]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("pdr") / "v3"), preset="v3", seed=8, initializer_range=0.1)


@pytest.fixture(scope="module")
def offline(model_path):
    with LLM(model_path, dtype="auto", page_size=4, max_total_tokens=4096) as llm:
        yield llm


@pytest.fixture(scope="module", params=BACKENDS)
def mixed(request, model_path, tmp_path_factory):
    """Every topology in one deployment per backend: two prefill servers (p1 with attention TP 2, whose
    second rank only mirrors the first) and two decode servers (d1 with DP attention over 4 ranks and
    low-latency EP), behind the router. The router pairs (p0, d0) and (p1, d1) in turn; the tests send
    the crossed pairs' legs themselves, so each prefill server writes to two decode servers and each
    decode server reads from two prefill servers, between equal and unequal layouts."""
    tmp = tmp_path_factory.mktemp(f"pdr-{request.param}")
    deployment = procs.pd_deployment(
        ["--model-path", model_path, "--served-model-name", "m", *SERVER, "--disaggregation-secret-file",
         str(tmp / "secret")], [], [], request.param, str(tmp), num_prefill=2, num_decode=2,
        prefill_each=[[], HETERO_PREFILL], decode_each=[[], HETERO_DECODE])
    yield deployment
    for server, code in zip(deployment, procs.stop_all(deployment)):
        assert code == 0, f"{server.name} did not exit cleanly; see {server.log_path}"


def _greedy(offline, prompt, max_tokens, logprobs=None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)
    return offline.generate([prompt], params, use_tqdm=False)[0]


def _check_answers(router_url: str, offline) -> None:
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="none", max_retries=0)
    for prompt in PROMPTS:  # the second is longer than a prefill chunk
        want = _greedy(offline, prompt, 12, logprobs=2)
        got = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, logprobs=2,
                                        extra_body={"ignore_eos": True}).choices[0]
        assert got.text == want.text
        assert got.logprobs.token_logprobs[0] == pytest.approx(want.logprobs[0].logprob, abs=1e-4)  # from prefill
        stream = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == want.text
    ids = offline.tokenizer.encode(PROMPTS[1])
    r = httpx.post(f"{router_url}/generate", timeout=60, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200 and r.json()["output_ids"] == _greedy(offline, ids, 8).token_ids
    for grammar in CONSTRAINED:  # the prefill server samples the first token under the grammar, decode the rest
        want = offline.generate([ids], SamplingParams(max_tokens=40, temperature=0, **grammar), use_tqdm=False)[0]
        assert want.finish_reason == "stop" and want.text.startswith(("yes", "no", "{"))
        for _ in range(2):  # each pair in turn
            r = httpx.post(f"{router_url}/generate", timeout=60, json={
                "input_ids": ids, "sampling_params": {"max_new_tokens": 40, "temperature": 0, **grammar}})
            assert r.status_code == 200 and r.json()["output_ids"] == want.token_ids, r.text
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat_ids = offline.tokenizer.apply_chat_template(messages)
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, n=2,
                                          extra_body={"ignore_eos": True})
    assert [c.message.content for c in chat.choices] == [_greedy(offline, chat_ids, 8).text] * 2


def _assert_drained(deployment) -> None:
    for server in deployment[:-1]:  # every rank's pages come back (the metric sums the DP groups)
        assert wait_for(lambda url=server.url: metric(url, "moeserve:kv_pages_used") == 0, timeout=30), server.name
        assert httpx.get(f"{server.url}/health").status_code == 200


def test_through_the_router_greedy_output_is_one_engines(mixed, offline):
    _check_answers(mixed[-1].url, offline)  # every request in turn on (p0, d0) and (p1, d1)
    _assert_drained(mixed)


def test_crossed_pairs_answer_like_one_engine(mixed, offline):
    """Both legs sent as the router sends them, to the pairs it does not make here: the plain prefill
    server into the DP-attention decode server, the attention-TP prefill server into the plain one."""
    p0, p1, d0, d1, _ = mixed
    before = sum(metric(p.url, "moeserve:kv_transfers", result="success") for p in (p0, p1))
    for prefill, decode in ((p0, d1), (p1, d0)):
        for prompt in PROMPTS:
            want = _greedy(offline, prompt, 12, logprobs=2)
            got = asyncio.run(_legs(prefill, decode, "/v1/completions", {
                "model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "logprobs": 2}))["choices"][0]
            assert got["text"] == want.text
            assert got["logprobs"]["token_logprobs"][0] == pytest.approx(want.logprobs[0].logprob, abs=1e-4)
        got = asyncio.run(_legs(prefill, decode, "/generate", {
            "input_ids": [5, 17, 42, 7, 9], "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                "ignore_eos": True}}))
        assert got["output_ids"] == _greedy(offline, [5, 17, 42, 7, 9], 8).token_ids
        got = asyncio.run(_legs(prefill, decode, "/v1/completions", {
            "model": "m", "prompt": "abc", "max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2}))
        assert [c["text"] for c in got["choices"]] == [_greedy(offline, "abc", 6).text] * 2
    _assert_drained(mixed)
    # every room of this test was counted by its prefill server: 2 x (3 prompts, /generate, n = 2)
    assert wait_for(lambda: sum(metric(p.url, "moeserve:kv_transfers", result="success")
                                for p in (p0, p1)) - before == 2 * (len(PROMPTS) + 3), timeout=10)
    assert all(metric(p.url, "moeserve:kv_transfer_bytes") > 0 for p in (p0, p1))


async def _legs(prefill: procs.Proc, decode: procs.Proc, path: str, body: dict) -> dict:
    """Both legs at once, as the router sends them; the decode leg's answer."""
    body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}
    async with httpx.AsyncClient(timeout=120, trust_env=False) as client:
        p, d = await asyncio.gather(client.post(f"{prefill.url}{path}", json=body),
                                    client.post(f"{decode.url}{path}", json=body))
    assert p.status_code == 200, p.text
    assert d.status_code == 200, d.text
    return d.json()


@pytest.mark.parametrize("mixed", ["torch"], indirect=True)
def test_128_concurrent_requests_all_complete_and_nothing_leaks(mixed):
    servers, router = mixed[:-1], mixed[-1]
    transfers = {s.name: metric(s.url, "moeserve:kv_transfers", result="success") for s in servers}

    async def run() -> list[int]:
        client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=300)
        calls = [client.completions.create(model="m", prompt=f"request {i} " * (1 + i % 7), max_tokens=2 + i % 9,
                                           temperature=0.8, seed=i, stream=i % 2 == 0,
                                           extra_body={"ignore_eos": True}) for i in range(128)]
        results = await asyncio.gather(*calls)
        counts = []
        for i, res in enumerate(results):
            if i % 2 == 0:
                counts.append(sum([len(c.choices[0].token_ids or []) async for c in res if c.choices]))
            else:
                counts.append(res.usage.completion_tokens)
        await client.close()
        return counts

    assert asyncio.run(run()) == [2 + i % 9 for i in range(128)]
    _assert_drained(mixed)
    for side in (servers[:2], servers[2:]):  # 128 rooms on each side, 64 on each server
        assert wait_for(lambda side=side: sum(metric(s.url, "moeserve:kv_transfers", result="success")
                                              - transfers[s.name] for s in side) == 128, timeout=10)
    assert all(metric(s.url, "moeserve:pd_queue_reqs") == 0 for s in servers)


BAD_BODIES = [  # what a monolithic server answers 400 to, through the router
    {"model": "m", "prompt": "hi", "max_tokens": -1},
    {"model": "m", "prompt": "hi", "temperature": 1e30},
    {"model": "m", "prompt": "hi", "top_k": -5},
    {"model": "m", "prompt": "hi", "stop": [""]},
    {"model": "m", "prompt": "hi", "seed": 2 ** 64},
    {"model": "m", "prompt": "hi", "logprobs": 10_000},
    {"model": "other", "prompt": "hi"},
    {"model": "m", "prompt": [10 ** 9]},
    {"model": "m", "prompt": "x " * 20_000, "max_tokens": 4},
]


@pytest.mark.parametrize("mixed", ["torch"], indirect=True)
def test_bad_input_through_the_router_gets_the_servers_own_4xx(mixed):
    """Each body a monolithic server answers 4xx to gets the same 4xx, message included, through the router."""
    prefill, decode, router = mixed[0], mixed[2], mixed[-1]
    for body in BAD_BODIES:
        direct = httpx.post(f"{decode.url}/v1/completions", timeout=30, json={
            **body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": random.getrandbits(62)})
        routed = httpx.post(f"{router.url}/v1/completions", timeout=30, json=body)
        assert 400 <= direct.status_code < 500, (body, direct.text)
        assert routed.status_code == direct.status_code, (body, routed.text)
        assert routed.json()["error"]["message"] == direct.json()["error"]["message"]
    _assert_drained(mixed)


def test_garbage_on_every_port_leaves_the_deployment_serving(mixed, offline, request):
    """Raw bytes and unauthenticated ZMQ peers at every TCP port the prefill and decode servers listen on
    (side channels, bootstrap servers, data paths): nothing of it reaches the KV cache or stops a server.
    Last of its backend's tests: the ones before set up every connection."""
    backend = request.node.callspec.params["mixed"]
    for server in mixed[:-1]:
        pids = [server.proc.pid, *descendants(server.proc.pid)]
        listeners = tcp_listeners(pids)
        if backend != "mooncake":  # Mooncake's TCP transport binds every interface (docs/security.md)
            assert all(addr == "127.0.0.1" for addr, _ in listeners), listeners
        _throw_garbage([port for _, port in listeners if port != server.port])
    for server in mixed:
        assert server.proc.poll() is None, f"{server.name} died"
    _check_answers(mixed[-1].url, offline)
    _assert_drained(mixed)


def _throw_garbage(ports: list[int]) -> None:
    """Every port at once (a port's replies are waited for briefly: one after another, a deployment's
    hundred listeners took half a minute)."""
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(_raw_garbage, ports))
    ctx = zmq.Context()  # one for every port: ending a context whose peers never spoke ZMQ can wait
    try:
        socks = []
        for port in ports:  # every socket connects at once; those whose peer answers like ZMQ can send
            for kind in (zmq.DEALER, zmq.PUSH):
                socks.append(sock := ctx.socket(kind))
                sock.connect(f"tcp://127.0.0.1:{port}")
        time.sleep(0.2)
        for sock in socks:
            try:
                sock.send_multipart([b"\x92\xa4room", os.urandom(64)], flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
    finally:
        terminate(ctx)


def _raw_garbage(port: int) -> None:
    rng = random.Random(port)
    for payload in (rng.randbytes(300), b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", rng.randbytes(1 << 16),
                    b"\xff\xff\xff\xff" * 16):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.sendall(payload)
                s.settimeout(0.05)
                try:
                    s.recv(64)
                except OSError:
                    pass
        except OSError:
            pass  # a port that closed (a one-time rendezvous) or refuses: fine


def test_a_mismatched_pair_is_refused_at_the_handshake(model_path, tmp_path):
    """One prefill server, two decode servers that do not match it (another page size; another model):
    the router's requests reach each in turn and end with the handshake's message naming both values."""
    other = make_tiny_model(str(tmp_path / "v2"), preset="v2-lite", seed=3)
    common = ["--served-model-name", "m", *SERVER, "--disaggregation-secret-file", str(tmp_path / "secret")]
    deployment = procs.pd_deployment(common, ["--model-path", model_path], [], "torch", str(tmp_path), num_decode=2,
                                     decode_each=[["--model-path", model_path, "--page-size", "8"],
                                                  ["--model-path", other]])
    with procs.running(deployment):
        for needle in ("page_size: prefill 4 vs decode 8", "model: prefill "):  # round robin: d0, then d1
            r = httpx.post(f"{deployment[-1].url}/v1/completions", timeout=60,
                           json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 3})
            assert r.status_code >= 500 and needle in r.json()["error"]["message"], r.text
        _assert_drained(deployment)
