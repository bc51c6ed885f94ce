"""``moeserve serve`` with default flags (the shipped model) plus an API key, against a hostile
client: every case gets a 4xx with a message (or the documented clamp), nothing runs that should
not, and afterwards the server still answers as before with every KV page returned."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import re
import socket

import httpx
import openai
import pytest
import zmq

from moeserve.models.tiny_chat import held_out_prompts, is_correct
from moeserve.scheduler.channel import ChannelKeys, terminate
from tests.e2e.server_utils import metric, start_server, wait_for

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUESTIONS = ["What is 123+456?", "Reverse: hello"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(["--api-key", KEY], str(tmp_path_factory.mktemp("hostile") / "server.log"))
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def answers(server) -> list[str]:
    """The server's greedy answers before anyone attacked it."""
    return [_chat(server, q, temperature=0).json()["choices"][0]["message"]["content"] for q in QUESTIONS]


def test_embedded_model_answers_held_out_prompts(server):
    """With no model given, ``moeserve serve`` serves the shipped chat model: it answers held-out
    questions over HTTP (before anyone attacked it)."""
    async def ask_all(items):
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0)
        replies = await asyncio.gather(*(
            client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": q}],
                                           temperature=0, max_tokens=16) for q, _ in items))
        await client.close()
        return replies

    items = held_out_prompts(100, seed=7)
    replies = asyncio.run(ask_all(items))
    correct = sum(is_correct(q, r.choices[0].message.content) for (q, _), r in zip(items, replies))
    assert all(r.choices[0].finish_reason == "stop" for r in replies)  # the model ends its answers
    assert correct >= 95, f"{correct}/100 correct"


def _chat(server, question: str, **fields) -> httpx.Response:
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": question}], "max_tokens": 16, **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)


def _still_serving(server, answers: list[str]) -> None:
    for question, answer in zip(QUESTIONS, answers):
        r = _chat(server, question, temperature=0)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == answer
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert wait_for(lambda: metric(server.base_url, "moeserve:kv_pages_used") == 0)


# ---- 1. values the sampler cannot use ----------------------------------------------------------
@pytest.mark.parametrize("fields", [{"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-300},
                                    {"temperature": 1e-300, "top_p": 1e-300, "top_k": 0}],
                         ids=["temperature", "top_p", "both"])
def test_vanishing_temperature_or_top_p_is_greedy(server, answers, fields):
    r = _chat(server, QUESTIONS[0], **fields)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == answers[0]  # the documented clamp: greedy
    native = httpx.post(f"{server.base_url}/generate", headers=AUTH, timeout=60,
                        json={"text": "abc", "sampling_params": {"max_new_tokens": 4, **fields}})
    assert native.status_code == 200, native.text
    _still_serving(server, answers)


# ---- 8. lenient validation --------------------------------------------------------------------
BAD = [
    ("repetition_penalty tiny", {"repetition_penalty": 1e-300}, "repetition_penalty"),
    ("repetition_penalty huge", {"repetition_penalty": 1e30}, "repetition_penalty"),
    ("temperature huge", {"temperature": 1e30}, "temperature"),
    ("top_k negative", {"top_k": -5}, "top_k"),
    ("100 stop strings", {"stop": [f"s{i}" for i in range(100)]}, "stop"),
    ("empty stop", {"stop": ""}, "stop"),
    ("seed too large", {"seed": 2**64}, "seed"),
    ("seed + n overflows", {"seed": 2**63 - 1, "n": 2}, "seed"),
    ("stop id too large", {"stop_token_ids": [10**30]}, "stop_token_ids"),
    ("max_tokens huge", {"max_tokens": 2**70}, "max_tokens"),
    ("logprobs too many", {"logprobs": True, "top_logprobs": 1000}, "logprobs"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("name, fields, needle", BAD, ids=[b[0] for b in BAD])
def test_out_of_range_values_get_400_before_any_stream(server, answers, name, fields, needle, stream):
    r = _chat(server, QUESTIONS[0], stream=stream, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


def test_bad_token_ids_get_400(server, answers):
    for prompt in ([10**30], [-1], [1, "x"]):
        r = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400 and "error" in r.json(), r.text
    _still_serving(server, answers)


def _raw(server, data: bytes) -> tuple[int, dict]:
    """Send raw bytes as one HTTP request; the status and JSON body of the answer."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(data)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _length(reply):
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, body = reply.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def _length(reply: bytes) -> int:
    found = re.search(rb"content-length: (\d+)", reply.split(b"\r\n\r\n", 1)[0], re.IGNORECASE)
    return int(found.group(1)) if found else 0


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{extra}Connection: close\r\n\r\n").encode() + body


@pytest.mark.parametrize("name, request_bytes, status", [
    ("invalid utf-8", _post("/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 2}'), 400),
    ("nested json", _post("/v1/completions", b"[" * 100_000 + b"]" * 100_000), 400),
    ("not json", _post("/v1/completions", b"prompt=hello"), 400),
    ("unknown path", b"GET /v2/nothing HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
     + b"\r\nConnection: close\r\n\r\n", 404),
    ("wrong method", b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
     + b"\r\nConnection: close\r\n\r\n", 405),
], ids=lambda v: v if isinstance(v, str) else None)
def test_every_error_has_the_openai_envelope(server, answers, name, request_bytes, status):
    got, body = _raw(server, request_bytes)
    assert got == status and set(body) == {"error"}, body
    assert body["error"]["message"] and body["error"]["code"] == status
    _still_serving(server, answers)


def test_wrong_keys_are_refused(server):
    for header in ({}, {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": f"Bearer {KEY}x"},
                   {"Authorization": KEY}, {"Authorization": f"bearer {KEY}"}):
        r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x"}, headers=header)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


# ---- 3. huge requests --------------------------------------------------------------------------
def test_a_10mb_prompt_is_refused_without_tokenizing(server, answers):
    text = "What is 123+456? " * 600_000  # 10 MB
    r = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": text, "max_tokens": 2})
    assert r.status_code == 400 and "at least" in r.json()["error"]["message"], r.text
    r = _chat(server, text)
    assert r.status_code == 400 and "at least" in r.json()["error"]["message"], r.text
    _still_serving(server, answers)


def test_a_body_over_the_limit_gets_413_before_it_is_sent(server, answers):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000000\r\nConnection: close\r\n\r\n")
    status, body = _raw(server, head.encode() + b'{"prompt": "')  # the rest never comes
    assert status == 413 and "larger than" in body["error"]["message"]
    assert metric(server.base_url, "moeserve:refused_requests_total", reason="body_too_large") >= 1
    _still_serving(server, answers)


# ---- 2. the engine channel ---------------------------------------------------------------------
def _channel(server) -> tuple[str, list[str]]:
    """The output and input addresses of the engine channel, as the server logged them."""
    line = next(x for x in server.log().splitlines() if "engine channel:" in x)
    addrs = line.split("engine channel:", 1)[1].split("(")[0].split(",")
    addrs = [a.strip() for a in addrs]
    assert all(a.startswith("ipc://") for a in addrs), addrs  # one node: no TCP port at all
    return addrs[0], addrs[1:]


def _strangers(ctx: zmq.Context, kind: int, addr: str) -> list[zmq.Socket]:
    """Peers a local attacker can make: no keys, and CURVE keys of its own."""
    plain = ctx.socket(kind)
    own = ChannelKeys.generate()
    keyed = ctx.socket(kind)
    keyed.curve_serverkey, keyed.curve_publickey, keyed.curve_secretkey = (
        own.server_public, own.client_public, own.client_secret)
    for sock in (plain, keyed):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        sock.connect(addr)
    return [plain, keyed]


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_pickle_or_garbage_on_the_output_socket_runs_nothing(server, answers, tmp_path):
    output, _ = _channel(server)
    marker = tmp_path / "ran"
    payload = pickle.dumps([_Payload(str(marker))])
    ctx = zmq.Context()
    try:
        for sock in _strangers(ctx, zmq.PUSH, output):
            for frames in ([payload], [os.urandom(300)], [b"\x92\xa6tokens", os.urandom(64)]):
                try:
                    sock.send_multipart(frames)
                except zmq.Again:  # the handshake never completed: nothing can be sent
                    pass
        with socket.socket(socket.AF_UNIX) as raw:  # below ZMQ: bytes straight on the socket file
            raw.connect(output.removeprefix("ipc://"))
            raw.sendall(os.urandom(300) + payload)
        _still_serving(server, answers)
        assert not marker.exists()
    finally:
        terminate(ctx)


def test_a_foreign_peer_on_an_input_socket_receives_nothing(server, answers):
    _, inputs = _channel(server)
    ctx = zmq.Context()
    try:
        thieves = _strangers(ctx, zmq.PULL, inputs[0])
        for i in range(6):
            r = httpx.post(f"{server.base_url}/v1/completions", headers=AUTH, timeout=60,
                           json={"prompt": f"request {i}", "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert all(t.poll(200) == 0 for t in thieves)
        _still_serving(server, answers)
    finally:
        terminate(ctx)


def test_the_channel_directory_is_private(server):
    output, _ = _channel(server)
    run_dir = os.path.dirname(output.removeprefix("ipc://"))
    assert os.stat(run_dir).st_mode & 0o777 == 0o700
