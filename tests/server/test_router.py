"""The PD router against fake prefill and decode workers, all served by uvicorn on loopback ports of one
background event loop: what each leg gets, what the client gets back, cancellation both ways, the
policies, the health checks, retries on another prefill worker, the circuit breaker, and the openai client
through the router."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moeserve.server.router import (
    GENERATION_PATHS,
    Circuit,
    Router,
    RouterConfig,
    Worker,
    add_router_args,
    bootstrap_fields,
    build_router_app,
    config_from_args,
)

WAIT_S = 10  # the longest a test waits for something that takes milliseconds
POLL_S = 0.005
PIECES = ("Hello", ", ", "world")
BAD_PROMPT = {"error": {"message": "prompt too long", "type": "invalid_request_error", "param": None, "code": 400}}
OVERLOADED = {"error": {"message": "overloaded", "type": "server_error", "param": None, "code": 503}}
BROKEN = {"error": {"message": "the engine died", "type": "server_error", "param": None, "code": 500}}


def _until(condition: Callable[[], Any], what: str = "the condition", timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(POLL_S)


def _whole(path: str, name: str) -> dict:
    """A fake's whole answer, shaped for the endpoint and naming the fake."""
    text = "".join(PIECES)
    if path == "/generate":
        return {"text": text, "meta_info": {"server": name, "finish_reason": {"type": "stop"}}}
    if path == "/v1/chat/completions":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        return {"id": "chat-1", "object": "chat.completion", "created": 0, "model": name, "choices": [choice]}
    choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": name, "choices": [choice]}


def _events(path: str, name: str) -> list[bytes]:
    """A fake's stream: one event per piece, then [DONE]."""
    events = []
    for i, piece in enumerate(PIECES):
        finish = "stop" if i == len(PIECES) - 1 else None
        if path == "/generate":
            payload: dict = {"text": "".join(PIECES[:i + 1]), "meta_info": {"server": name}}
        elif path == "/v1/chat/completions":
            payload = {"id": "chat-1", "object": "chat.completion.chunk", "created": 0, "model": name,
                       "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": finish}]}
        else:
            payload = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": name,
                       "choices": [{"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}]}
        events.append(f"data: {json.dumps(payload)}\n\n".encode())
    return [*events, b"data: [DONE]\n\n"]


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Fake:
    """A fake prefill or decode server. Records each generation request; answers ``status`` (with ``error``
    as the body, or none) when it is not 200, else ``_whole`` or, when the body asks to stream, ``_events``.

    ``hold_at=0`` holds the answer until ``release`` is set; ``hold_at=n`` holds a stream after n events;
    ``quiet_head`` sends a stream's head at once and its first event once released (as a real decode server
    does: its first token waits for the prefill); ``fail_at=n`` breaks a stream off after n events.
    ``disconnected`` is set when the router hangs up on a request it has not had the whole answer to."""

    def __init__(self, name: str, status: int = 200, error: dict | None = None, hold_at: int | None = None,
                 fail_at: int | None = None, quiet_head: bool = False) -> None:
        self.name, self.status, self.error, self.hold_at, self.fail_at = name, status, error, hold_at, fail_at
        self.quiet_head = quiet_head
        self.health = 200
        self.health_checks = 0
        self.paths: list[str] = []
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.release, self.answered, self.disconnected = threading.Event(), threading.Event(), threading.Event()
        self.served: _Served | None = None
        self.app = self._app()

    def _app(self) -> FastAPI:
        app = FastAPI()
        for path in GENERATION_PATHS:
            app.add_api_route(path, self._generation, methods=["POST"])

        @app.get("/health")
        async def health() -> Response:
            self.health_checks += 1
            return Response(status_code=self.health)

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": self.name, "object": "model", "owned_by": "fake"}]}

        return app

    async def _generation(self, request: Request) -> Response:
        body = await request.json()
        self.paths.append(request.url.path)
        self.bodies.append(body)
        self.auth.append(request.headers.get("authorization"))
        if self.hold_at == 0 and not await self._held(request):
            return Response(status_code=499)  # nobody is left to read it
        if self.status != 200:
            return JSONResponse(self.error, self.status) if self.error else Response(status_code=self.status)
        if body.get("stream"):
            return StreamingResponse(self._stream(request.url.path), media_type="text/event-stream")
        self.answered.set()
        return JSONResponse(_whole(request.url.path, self.name))

    async def _held(self, request: Request) -> bool:
        """Wait for ``release``; False (and ``disconnected`` set) if the router hangs up first."""
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            while not self.release.is_set():
                if gone.done():
                    self.disconnected.set()
                    return False
                await asyncio.sleep(POLL_S)
            return True
        finally:
            gone.cancel()

    async def _stream(self, path: str) -> AsyncIterator[bytes]:
        finished = False
        try:
            for i, event in enumerate(_events(path, self.name)):
                if i and i == self.fail_at:
                    raise RuntimeError("the fake breaks its stream off")
                held = i == self.hold_at if i else self.quiet_head
                while held and not self.release.is_set():
                    await asyncio.sleep(POLL_S)  # a disconnect cancels this
                yield event
            finished = True
            self.answered.set()
        finally:
            if not finished and self.fail_at is None:
                self.disconnected.set()


class _Loop:
    """An event loop in a background thread: the fakes and routers serve there, and the tests talk to them
    from the main thread with blocking clients."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="servers", daemon=True)
        self.thread.start()

    def submit(self, work: Any) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(work, self.loop)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT_S)
        self.loop.close()


class _Served:
    """An ASGI app under uvicorn on a loopback socket bound here first (port 0: a free one), so that no
    one can take the port between choosing it and listening on it."""

    def __init__(self, loop: _Loop, app: Any, lifespan: str = "off", port: int = 0) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart on the same port
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, lifespan=lifespan, log_config=None, log_level="warning",
                                timeout_graceful_shutdown=1)
        self.server = uvicorn.Server(config)
        self.done = loop.submit(self.server.serve(sockets=[self.sock]))
        _until(lambda: self.server.started or self.done.done(), "uvicorn to start")
        assert self.server.started, self.done.exception()

    def stop(self) -> None:
        self.server.should_exit = True

    def wait(self) -> None:
        self.done.result(WAIT_S)
        self.sock.close()


class _RouterHandle:
    def __init__(self, app: FastAPI, served: _Served) -> None:
        self.state: Router = app.state.router
        self.url, self.port = served.url, served.port

    def post(self, path: str, **kwargs: Any) -> httpx.Response:
        with httpx.Client(timeout=WAIT_S) as client:
            return client.post(self.url + path, **kwargs)

    def get(self, path: str, **kwargs: Any) -> httpx.Response:
        with httpx.Client(timeout=WAIT_S) as client:
            return client.get(self.url + path, **kwargs)

    def idle(self) -> bool:
        return all(w.in_flight == 0 for w in self.state.prefill.workers + self.state.decode.workers)


class _Cluster:
    """Fakes and routers of one test; ``stop`` takes them all down."""

    def __init__(self, loop: _Loop) -> None:
        self.loop = loop
        self.fakes: list[Fake] = []
        self.served: list[_Served] = []
        self.dead: list[socket.socket] = []

    def serve(self, app: Any, **kwargs: Any) -> _Served:
        served = _Served(self.loop, app, **kwargs)
        self.served.append(served)
        return served

    def fake(self, name: str, **behaviour: Any) -> Fake:
        fake = Fake(name, **behaviour)
        fake.served = self.serve(fake.app)
        self.fakes.append(fake)
        return fake

    def dead_url(self) -> str:
        """A port bound but not listening: connecting to it is refused, and no one else can take it."""
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.dead.append(sock)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def router(self, prefill: list[Fake | str], decode: list[Fake | str], **config: Any) -> _RouterHandle:
        """A router in front of the given fakes (or URLs); the i-th prefill's bootstrap port is 9001 + i."""
        urls = [w if isinstance(w, str) else w.served.url for w in prefill]
        app = build_router_app(RouterConfig(
            prefill=tuple((url, 9001 + i) for i, url in enumerate(urls)),
            decode=tuple(w if isinstance(w, str) else w.served.url for w in decode),
            **{"health_check_interval_s": 60.0, **config}))
        return _RouterHandle(app, self.serve(app, lifespan="on"))

    def stop(self) -> None:
        for fake in self.fakes:
            fake.release.set()  # so that no held request keeps a server waiting
        for served in self.served:
            served.stop()
        for served in self.served:
            served.wait()
        for sock in self.dead:
            sock.close()


@pytest.fixture(scope="module")
def loop() -> Iterator[_Loop]:
    loop = _Loop()
    yield loop
    loop.close()


@pytest.fixture
def cluster(loop: _Loop) -> Iterator[_Cluster]:
    cluster = _Cluster(loop)
    yield cluster
    cluster.stop()


@pytest.fixture
def background() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """For a request that waits on a held fake while the test goes on."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        yield pool


def _first_event(chunks: Iterator[bytes]) -> tuple[bytes, bytes]:
    """Read a stream up to the end of its first event: (that event, what came after it in the same read)."""
    received = b""
    while b"\n\n" not in received:
        received += next(chunks)
    end = received.index(b"\n\n") + 2
    return received[:end], received[end:]


def _who(fakes: list[Fake], text: str) -> list[str]:
    return [f.name for f in fakes if any(b.get("text") == text for b in f.bodies)]


def _metric(router: _RouterHandle, sample: str) -> float:
    """One sample of the router's /metrics, named as it is written there (labels included)."""
    for line in router.get("/metrics").text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == sample:
            return float(value)
    raise AssertionError(f"no {sample} in /metrics")


def _retries(router: _RouterHandle, path: str) -> float:
    return _metric(router, f'moeserve_router:retries_total{{endpoint="{path}"}}')


def _circuit_open(router: _RouterHandle, fake: Fake) -> float:
    return _metric(router, f'moeserve_router:worker_circuit_open{{role="decode",url="{fake.served.url}"}}')


def _hold_posts(router: _RouterHandle, url: str, until: Callable[[], Any]) -> None:
    """Hold the router's POSTs to ``url`` until ``until()`` (at most WAIT_S) before they connect: a leg that
    must fail only once the other leg has reached its worker."""
    async def hook(request: httpx.Request) -> None:
        if request.method == "POST" and str(request.url).startswith(url + "/"):
            deadline = time.monotonic() + WAIT_S
            while not until() and time.monotonic() < deadline:
                await asyncio.sleep(POLL_S)

    router.state.http.event_hooks["request"].append(hook)


def _heads(router: _RouterHandle, fake: Fake) -> threading.Event:
    """Set once the router has the head of an answer from ``fake`` (before reading its body)."""
    seen = threading.Event()

    async def hook(response: httpx.Response) -> None:
        if str(response.request.url).startswith(fake.served.url + "/"):
            seen.set()

    router.state.http.event_hooks["response"].append(hook)
    return seen


def test_both_legs_get_the_client_body_plus_the_bootstrap_fields(cluster):
    prefill, decode = cluster.fake("p"), cluster.fake("d")
    router = cluster.router([prefill], [decode])
    requests = [("/v1/completions", {"model": "m", "prompt": "Grüße, 世界", "max_tokens": 7, "temperature": 0.25,
                                     "stop": ["\n"], "logit_bias": {"42": -1.5}, "extra": {"x": [1, None, True]}}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 1, "seed": 2**40}),
                ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})]
    for path, sent in requests:
        r = router.post(path, json=sent)
        assert r.status_code == 200 and r.json() == _whole(path, "d")  # the decode's answer, not the prefill's
    _until(lambda: len(prefill.bodies) == 3, "the prefill legs")
    assert prefill.paths == decode.paths == [path for path, _ in requests]
    assert prefill.bodies == decode.bodies
    rooms = []
    for (_, sent), got in zip(requests, decode.bodies):
        room = got.pop("bootstrap_room")
        assert type(room) is int and 0 <= room < 2**63
        rooms.append(room)
        assert got == {**sent, "bootstrap_host": "127.0.0.1", "bootstrap_port": 9001}
    assert len(set(rooms)) == 3
    _until(router.idle, "the router to have nothing in flight")  # a prefill leg may end after its answer


def test_a_stream_is_relayed_as_it_comes_without_waiting_for_prefill(cluster):
    prefill = cluster.fake("p", hold_at=0)  # answers only once released
    decode = cluster.fake("d", hold_at=1)  # one event, then waits
    router = cluster.router([prefill], [decode])
    expected = _events("/v1/completions", "d")
    with httpx.Client(timeout=WAIT_S) as client, client.stream(
            "POST", router.url + "/v1/completions", json={"prompt": "Hi", "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        chunks = r.iter_bytes()
        first, more = _first_event(chunks)
        assert first == expected[0] and not more
        assert not prefill.answered.is_set()  # the first event came through while the prefill was still busy
        decode.release.set()
        rest = b"".join(chunks)
    assert rest == b"".join(expected[1:])
    prefill.release.set()
    assert prefill.answered.wait(WAIT_S)  # the prefill leg of a request that succeeded is left to finish
    assert not prefill.disconnected.is_set() and not decode.disconnected.is_set()
    _until(router.idle, "the router to have nothing in flight")


@pytest.mark.parametrize("error", [BAD_PROMPT, None], ids=["with-body", "without-body"])
def test_a_prefill_error_is_returned_and_the_decode_leg_cancelled(cluster, background, error):
    prefill = cluster.fake("p", status=400, error=error, hold_at=0)
    decode = cluster.fake("d", hold_at=0)
    router = cluster.router([prefill], [decode])
    answer = background.submit(router.post, "/v1/completions", json={"prompt": "Hi"})
    _until(lambda: decode.bodies, "the decode leg to arrive")
    prefill.release.set()
    r = answer.result(WAIT_S)
    assert r.status_code == 400
    assert r.json() == (error or {"error": {"message": f"prefill worker {prefill.served.url} answered 400",
                                            "type": "invalid_request_error", "param": None, "code": 400}})
    assert decode.disconnected.wait(WAIT_S)
    _until(router.idle, "the router to have nothing in flight")


def test_a_prefill_error_mid_stream_ends_the_stream_with_it_and_cancels_decode(cluster):
    prefill = cluster.fake("p", status=503, error=OVERLOADED, hold_at=0)
    decode = cluster.fake("d", hold_at=1)
    router = cluster.router([prefill], [decode])
    with httpx.Client(timeout=WAIT_S) as client, client.stream(
            "POST", router.url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "stream": True}) as r:
        chunks = r.iter_bytes()
        first, more = _first_event(chunks)
        prefill.release.set()  # fails only now, after the decode's first bytes
        rest = more + b"".join(chunks)
    assert r.status_code == 200 and first == _events("/v1/chat/completions", "d")[0]
    assert rest == b"data: " + json.dumps(OVERLOADED).encode() + b"\n\ndata: [DONE]\n\n"
    assert decode.disconnected.wait(WAIT_S)


def test_an_unreachable_prefill_worker_gets_a_502_and_ends_the_decode_leg(cluster):
    decode = cluster.fake("d", hold_at=0)
    dead = cluster.dead_url()
    router = cluster.router([dead], [decode])
    r = router.post("/generate", json={"text": "Hi"})
    assert r.status_code == 502
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["type"] == "server_error" and dead in r.json()["error"]["message"]
    _until(router.idle, "the router to have nothing in flight")
    if decode.bodies:  # the leg was cancelled after it reached the decode worker, not before
        assert decode.disconnected.wait(WAIT_S)


def test_a_decode_error_is_returned_and_the_prefill_leg_cancelled(cluster, background):
    prefill = cluster.fake("p", hold_at=0)
    decode = cluster.fake("d", status=503, error=OVERLOADED, hold_at=0)
    router = cluster.router([prefill], [decode])
    answer = background.submit(router.post, "/v1/completions", json={"prompt": "Hi", "stream": True})
    _until(lambda: prefill.bodies, "the prefill leg to arrive")
    decode.release.set()
    r = answer.result(WAIT_S)
    assert r.status_code == 503 and r.json() == OVERLOADED
    assert prefill.disconnected.wait(WAIT_S)


def test_a_decode_stream_cut_short_ends_with_an_error_event_and_cancels_prefill(cluster):
    prefill = cluster.fake("p", hold_at=0)
    decode = cluster.fake("d", fail_at=1)
    router = cluster.router([prefill], [decode])
    with httpx.Client(timeout=WAIT_S) as client, client.stream(
            "POST", router.url + "/generate", json={"text": "Hi", "stream": True}) as r:
        body = r.read()
    first, error, done = body.split(b"\n\n")[:3]
    assert first + b"\n\n" == _events("/generate", "d")[0] and done == b"data: [DONE]"
    envelope = json.loads(error.removeprefix(b"data: "))["error"]
    assert envelope["code"] == 502 and envelope["type"] == "server_error" and "decode worker" in envelope["message"]
    assert prefill.disconnected.wait(WAIT_S)


def test_a_client_leaving_mid_stream_cancels_both_legs(cluster):
    prefill = cluster.fake("p", hold_at=0)
    decode = cluster.fake("d", hold_at=1)
    router = cluster.router([prefill], [decode])
    with httpx.Client(timeout=WAIT_S) as client, client.stream(
            "POST", router.url + "/generate", json={"text": "Hi", "stream": True}) as r:
        _first_event(r.iter_bytes())
    # leaving the block closed the connection with the stream half read
    assert decode.disconnected.wait(WAIT_S) and prefill.disconnected.wait(WAIT_S)
    _until(router.idle, "the router to have nothing in flight")
    assert 'outcome="disconnected"} 1.0' in router.get("/metrics").text


def test_a_client_leaving_a_plain_request_cancels_both_legs(cluster):
    prefill, decode = cluster.fake("p", hold_at=0), cluster.fake("d", hold_at=0)
    router = cluster.router([prefill], [decode])
    body = json.dumps({"prompt": "Hi"}).encode()
    with socket.create_connection(("127.0.0.1", router.port), timeout=WAIT_S) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        _until(lambda: prefill.bodies and decode.bodies, "both legs to arrive")
    assert decode.disconnected.wait(WAIT_S) and prefill.disconnected.wait(WAIT_S)
    _until(router.idle, "the router to have nothing in flight")


def test_round_robin_alternates_over_two_prefill_and_two_decode_workers(cluster):
    prefill, decode = [cluster.fake("p0"), cluster.fake("p1")], [cluster.fake("d0"), cluster.fake("d1")]
    router = cluster.router(prefill, decode)
    for i in range(4):
        assert router.post("/generate", json={"text": f"#{i}"}).status_code == 200
    _until(lambda: sum(len(p.bodies) for p in prefill) == 4, "the prefill legs")
    assert [_who(prefill, f"#{i}") for i in range(4)] == [["p0"], ["p1"], ["p0"], ["p1"]]
    assert [_who(decode, f"#{i}") for i in range(4)] == [["d0"], ["d1"], ["d0"], ["d1"]]
    ports = {b["text"]: b["bootstrap_port"] for d in decode for b in d.bodies}
    assert [ports[f"#{i}"] for i in range(4)] == [9001, 9002, 9001, 9002]  # each decode told its prefill's


def test_least_load_picks_the_worker_with_fewer_requests_in_flight(cluster, background):
    prefill = [cluster.fake("p0", hold_at=0), cluster.fake("p1")]
    decode = [cluster.fake("d0", hold_at=0), cluster.fake("d1")]
    router = cluster.router(prefill, decode, policy="least_load")
    held = background.submit(router.post, "/generate", json={"text": "#0"})
    _until(lambda: prefill[0].bodies and decode[0].bodies, "#0 to be held at p0 and d0")
    for i in (1, 2):
        assert router.post("/generate", json={"text": f"#{i}"}).status_code == 200
        _until(lambda: [w.in_flight for w in router.state.prefill.workers + router.state.decode.workers]
               == [1, 0, 1, 0], "only #0 in flight")
    # round robin would have sent #2 to p0 and d0
    assert [_who(prefill, f"#{i}") for i in range(3)] == [["p0"], ["p1"], ["p1"]]
    assert [_who(decode, f"#{i}") for i in range(3)] == [["d0"], ["d1"], ["d1"]]
    prefill[0].release.set()
    decode[0].release.set()
    assert held.result(WAIT_S).status_code == 200


def test_a_worker_is_down_after_two_failed_checks_in_a_row_and_up_after_one_success():
    worker = Worker("decode", "http://d")
    for ok, healthy in [(False, True), (True, True), (False, True), (False, False), (False, False), (True, True)]:
        worker.record(ok)
        assert worker.healthy is healthy


def test_an_unhealthy_decode_worker_is_skipped_until_it_recovers(cluster):
    prefill, decode = cluster.fake("p"), [cluster.fake("d0"), cluster.fake("d1")]
    router = cluster.router([prefill], decode, health_check_interval_s=0.02)
    d0 = router.state.decode.workers[0]
    decode[0].health = 503
    _until(lambda: not d0.healthy, "d0 to be marked down")
    assert router.get("/v1/models").json()["data"][0]["id"] == "d1"  # the first healthy one
    for i in range(2):
        assert router.post("/generate", json={"text": f"#{i}"}).status_code == 200
    decode[0].health = 200
    _until(lambda: d0.healthy, "d0 to be marked up")
    for i in range(2, 4):
        assert router.post("/generate", json={"text": f"#{i}"}).status_code == 200
    assert [_who(decode, f"#{i}") for i in range(2)] == [["d1"], ["d1"]]
    assert sorted(_who(decode, "#2") + _who(decode, "#3")) == ["d0", "d1"]


def test_a_stopped_prefill_worker_is_skipped_and_used_again_once_back(cluster):
    prefill, decode = [cluster.fake("p0"), cluster.fake("p1")], cluster.fake("d")
    router = cluster.router(prefill, [decode], health_check_interval_s=0.02)
    p1 = router.state.prefill.workers[1]
    prefill[1].served.stop()
    prefill[1].served.wait()
    _until(lambda: not p1.healthy, "p1 to be marked down")
    for i in range(3):
        assert router.post("/generate", json={"text": f"#{i}"}).status_code == 200
    assert [b["bootstrap_port"] for b in decode.bodies] == [9001, 9001, 9001]
    cluster.serve(prefill[1].app, port=prefill[1].served.port)
    _until(lambda: p1.healthy, "p1 to be marked up")
    for i in range(3, 5):
        assert router.post("/generate", json={"text": f"#{i}"}).status_code == 200
    assert sorted(b["bootstrap_port"] for b in decode.bodies[3:]) == [9001, 9002]


def test_router_health_is_503_without_a_healthy_decode_worker(cluster):
    prefill, decode = cluster.fake("p"), cluster.fake("d")
    router = cluster.router([prefill], [decode], health_check_interval_s=0.02)
    assert router.get("/health").status_code == 200
    decode.health = 503
    _until(lambda: router.get("/health").status_code == 503, "the router's /health to say 503")
    r = router.post("/v1/completions", json={"prompt": "Hi"})
    assert r.status_code == 503
    assert r.json() == {"error": {"message": "no healthy decode worker", "type": "server_error", "param": None,
                                  "code": 503}}
    assert router.get("/v1/models").status_code == 503
    assert not prefill.bodies and not decode.bodies
    decode.health = 200
    _until(lambda: router.get("/health").status_code == 200, "the router's /health to say 200")


def test_a_body_that_is_not_a_json_object_gets_a_400_envelope(cluster):
    prefill, decode = cluster.fake("p"), cluster.fake("d")
    router = cluster.router([prefill], [decode])
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe", b""):
        r = router.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["code"] == 400 and "JSON" in error["message"]
    assert router.get("/nowhere").json()["error"]["code"] == 404
    assert not prefill.bodies and not decode.bodies


def test_the_openai_client_works_through_the_router(cluster):
    prefill, decode = cluster.fake("p"), cluster.fake("d")
    router = cluster.router([prefill], [decode], api_key="client-key", worker_api_key="worker-key")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="client-key", max_retries=0, timeout=WAIT_S)
    text = "".join(PIECES)
    assert client.completions.create(model="m", prompt="Hi", max_tokens=3).choices[0].text == text
    stream = client.completions.create(model="m", prompt="Hi", max_tokens=3, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == text
    messages = [{"role": "user", "content": "Hi"}]
    assert client.chat.completions.create(model="m", messages=messages).choices[0].message.content == text
    stream = client.chat.completions.create(model="m", messages=messages, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream) == text
    _until(lambda: len(prefill.auth) == 4, "the prefill legs")
    assert prefill.auth == decode.auth == ["Bearer worker-key"] * 4
    stranger = openai.OpenAI(base_url=router.url + "/v1", api_key="nope", max_retries=0, timeout=WAIT_S)
    with pytest.raises(openai.AuthenticationError):
        stranger.completions.create(model="m", prompt="Hi")
    assert len(decode.bodies) == 4
    assert router.get("/health").status_code == 200  # open without the key


def test_models_and_metrics_and_no_client_key_to_the_workers(cluster):
    prefill, decode = cluster.fake("p"), [cluster.fake("d0"), cluster.fake("d1")]
    router = cluster.router([prefill], decode, api_key="k")
    key = {"Authorization": "Bearer k"}
    assert router.get("/v1/models", headers=key).json()["data"][0]["id"] == "d0"
    assert router.get("/v1/models").status_code == 401
    assert router.post("/generate", json={"text": "Hi"}, headers=key).status_code == 200
    assert router.post("/generate", content=b"{", headers=key).status_code == 400
    _until(lambda: prefill.auth, "the prefill leg")
    assert prefill.auth == decode[0].auth == [None]  # the client's key stays at the router
    _until(router.idle, "the router to have nothing in flight")
    metrics = router.get("/metrics").text
    for line in ['moeserve_router:requests_total{endpoint="/generate",outcome="ok"} 1.0',
                 'moeserve_router:requests_total{endpoint="/generate",outcome="invalid"} 1.0',
                 f'moeserve_router:worker_healthy{{role="decode",url="{decode[1].served.url}"}} 1.0',
                 f'moeserve_router:worker_in_flight{{role="prefill",url="{prefill.served.url}"}} 0.0']:
        assert line in metrics


def test_router_args_and_config_checks(capsys):
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    args = parser.parse_args(["--pd-disaggregation", "--prefill", "http://p0:30000", "9000", "--prefill",
                              "http://p1:30000", "--decode", "http://d0:30001", "--decode", "http://d1:30001",
                              "--policy", "least_load", "--api-key", "k", "--worker-api-key", "w"])
    assert config_from_args(args) == RouterConfig(
        prefill=(("http://p0:30000", 9000), ("http://p1:30000", 8998)), decode=("http://d0:30001", "http://d1:30001"),
        host="127.0.0.1", port=8000, policy="least_load", health_check_interval_s=5.0, request_timeout_s=600.0,
        api_key="k", worker_api_key="w")
    for bad in (["--prefill", "http://p", "x"], ["--prefill", "http://p", "1", "2"], ["--policy", "random"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert "--prefill" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--pd-disaggregation"):
        config_from_args(parser.parse_args(["--prefill", "http://p", "--decode", "http://d"]))
    good: dict[str, Any] = {"prefill": (("http://p:1", 2),), "decode": ("http://d:1",)}
    for field, value in [("prefill", ()), ("decode", ()), ("decode", ("ftp://d",)), ("decode", ("http://d:x",)),
                         ("decode", ("http://d", "http://d/")), ("prefill", (("http://p", 0),)), ("policy", "random"),
                         ("health_check_interval_s", 0), ("request_timeout_s", -1.0), ("port", 70000)]:
        with pytest.raises(ValueError, match=field):
            RouterConfig(**{**good, field: value})
    assert bootstrap_fields(Worker("prefill", "http://[::1]:30000", 8998))["bootstrap_host"] == "::1"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_no_healthy_worker_of_a_role_gets_a_503_with_retry_after(cluster, role):
    prefill, decode = cluster.fake("p"), cluster.fake("d")
    router = cluster.router([prefill], [decode], health_check_interval_s=0.02)
    down = prefill if role == "prefill" else decode
    worker = (router.state.prefill if role == "prefill" else router.state.decode).workers[0]
    down.health = 503
    _until(lambda: not worker.healthy, f"the {role} worker to be marked down")
    r = router.post("/v1/completions", json={"prompt": "Hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"  # its next health check, rounded up
    assert r.json() == {"error": {"message": f"no healthy {role} worker", "type": "server_error", "param": None,
                                  "code": 503}}
    if role == "decode":
        assert router.get("/v1/models").headers["retry-after"] == "1"
    assert not prefill.bodies and not decode.bodies


def test_no_decode_worker_with_a_closed_circuit_gets_a_503_with_retry_after(cluster):
    prefill, decode = cluster.fake("p"), cluster.fake("d", status=500)
    router = cluster.router([prefill], [decode], circuit_breaker_failures=1, circuit_breaker_cooldown_s=30.0)
    worker = router.state.decode.workers[0]
    assert router.post("/generate", json={"text": "#0"}).status_code == 500
    _until(lambda: not worker.circuit.closed, "the circuit to open")
    r = router.post("/generate", json={"text": "#1"})
    assert r.status_code == 503 and 1 <= int(r.headers["retry-after"]) <= 30  # the rest of the cooldown
    error = r.json()["error"]
    assert error["code"] == 503 and error["type"] == "server_error" and "circuit" in error["message"]
    assert _who([decode], "#1") == [] and worker.healthy  # the circuit alone keeps it out


def test_an_unreachable_prefill_worker_is_retried_once_on_the_other(cluster, background):
    dead, prefill, decode = cluster.dead_url(), cluster.fake("p1"), cluster.fake("d", hold_at=0)
    router = cluster.router([dead, prefill], [decode])
    _hold_posts(router, dead, until=lambda: decode.bodies)  # the first decode leg arrives before its prefill fails
    answer = background.submit(router.post, "/generate", json={"text": "Hi"})
    _until(lambda: len(decode.bodies) == 2 and decode.disconnected.is_set(),
           "the first decode leg to be cancelled and the second to arrive")
    decode.release.set()
    r = answer.result(WAIT_S)
    assert r.status_code == 200 and r.json() == _whole("/generate", "d")
    first, second = decode.bodies
    assert (first["bootstrap_port"], second["bootstrap_port"]) == (9001, 9002)
    assert first["bootstrap_room"] != second["bootstrap_room"]
    _until(lambda: prefill.bodies, "the second prefill leg")
    assert prefill.bodies == [second]
    assert _retries(router, "/generate") == 1.0
    assert 'moeserve_router:requests_total{endpoint="/generate",outcome="ok"} 1.0' in router.get("/metrics").text
    _until(router.idle, "the router to have nothing in flight")


def test_a_request_is_retried_once_only(cluster):
    dead, decode = [cluster.dead_url(), cluster.dead_url()], cluster.fake("d", hold_at=0)
    router = cluster.router(dead, [decode])
    r = router.post("/generate", json={"text": "Hi"})
    assert r.status_code == 502 and f"worker {dead[1]} failed" in r.json()["error"]["message"]  # the retry's failure
    assert _retries(router, "/generate") == 1.0
    workers = router.state.prefill.workers
    _until(lambda: [w.circuit.failures for w in workers] == [1, 1], "one failure at each prefill worker")
    _until(router.idle, "the router to have nothing in flight")
    assert [w.circuit.failures for w in workers] == [1, 1] and len(decode.bodies) <= 2


def test_a_busy_prefill_worker_is_retried_on_the_other(cluster, background):
    prefill = [cluster.fake("p0", status=503, error=OVERLOADED, hold_at=0), cluster.fake("p1")]
    decode = cluster.fake("d", hold_at=0)
    router = cluster.router(prefill, [decode])
    answer = background.submit(router.post, "/v1/completions", json={"prompt": "Hi"})
    _until(lambda: decode.bodies, "the decode leg to arrive")
    prefill[0].release.set()  # queue full, only now
    _until(lambda: len(decode.bodies) == 2 and decode.disconnected.is_set(),
           "the first decode leg to be cancelled and the second to arrive")
    decode.release.set()
    r = answer.result(WAIT_S)
    assert r.status_code == 200 and r.json() == _whole("/v1/completions", "d")
    assert [b["bootstrap_port"] for b in decode.bodies] == [9001, 9002]
    assert decode.bodies[0]["bootstrap_room"] != decode.bodies[1]["bootstrap_room"]
    _until(lambda: prefill[1].bodies, "the second prefill leg")
    assert prefill[0].bodies == [decode.bodies[0]] and prefill[1].bodies == [decode.bodies[1]]
    assert _retries(router, "/v1/completions") == 1.0


@pytest.mark.parametrize(("status", "error"), [(400, BAD_PROMPT), (500, BROKEN)], ids=["400", "500"])
def test_a_prefill_worker_that_took_the_request_up_and_failed_is_not_retried(cluster, background, status, error):
    prefill = [cluster.fake("p0", status=status, error=error, hold_at=0), cluster.fake("p1")]
    decode = cluster.fake("d", hold_at=0)
    router = cluster.router(prefill, [decode])
    answer = background.submit(router.post, "/v1/completions", json={"prompt": "Hi"})
    _until(lambda: decode.bodies, "the decode leg to arrive")
    prefill[0].release.set()
    r = answer.result(WAIT_S)
    assert r.status_code == status and r.json() == error
    assert decode.disconnected.wait(WAIT_S)
    assert len(decode.bodies) == 1 and not prefill[1].bodies
    assert _retries(router, "/v1/completions") == 0.0


def test_a_stream_is_retried_while_nothing_has_reached_the_client(cluster, background):
    prefill = [cluster.fake("p0", status=503, error=OVERLOADED, hold_at=0), cluster.fake("p1")]
    decode = cluster.fake("d", quiet_head=True)
    router = cluster.router(prefill, [decode])
    head = _heads(router, decode)
    answer = background.submit(router.post, "/v1/completions", json={"prompt": "Hi", "stream": True})
    assert head.wait(WAIT_S)  # the decode stream has begun, with no event yet
    prefill[0].release.set()
    _until(lambda: len(decode.bodies) == 2 and decode.disconnected.is_set(),
           "the first decode leg to be cancelled and the second to arrive")
    decode.release.set()
    r = answer.result(WAIT_S)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.content == b"".join(_events("/v1/completions", "d"))
    assert [b["bootstrap_port"] for b in decode.bodies] == [9001, 9002]
    assert _retries(router, "/v1/completions") == 1.0


def test_a_stream_that_has_begun_is_never_retried(cluster):
    prefill = [cluster.fake("p0", status=503, error=OVERLOADED, hold_at=0), cluster.fake("p1")]
    decode = cluster.fake("d", hold_at=1)
    router = cluster.router(prefill, [decode])
    with httpx.Client(timeout=WAIT_S) as client, client.stream(
            "POST", router.url + "/v1/completions", json={"prompt": "Hi", "stream": True}) as r:
        chunks = r.iter_bytes()
        first, more = _first_event(chunks)
        prefill[0].release.set()  # queue full, but the client has its first event
        rest = more + b"".join(chunks)
    assert r.status_code == 200 and first == _events("/v1/completions", "d")[0]
    assert rest == b"data: " + json.dumps(OVERLOADED).encode() + b"\n\ndata: [DONE]\n\n"
    assert decode.disconnected.wait(WAIT_S)
    assert len(decode.bodies) == 1 and not prefill[1].bodies
    assert _retries(router, "/v1/completions") == 0.0


def test_a_circuit_opens_after_failures_in_a_row_and_one_probe_decides_after_the_cooldown():
    circuit = Circuit(threshold=3, cooldown_s=10.0)
    for verdict in (False, False, True, False, None, False):  # a success starts the count again, a 4xx is no verdict
        circuit.settle(verdict, False, now=0.0)
    assert circuit.closed and circuit.failures == 2
    circuit.settle(False, False, now=1.0)
    assert not circuit.closed and not circuit.admits(10.9) and circuit.admits(11.0)
    circuit.settle(True, False, now=2.0)  # a leg sent before it opened
    assert not circuit.closed
    assert circuit.begin(11.0) and not circuit.admits(11.0)  # one probe at a time
    circuit.settle(None, True, now=12.0)  # the probe was cancelled: the next leg probes
    assert circuit.begin(12.0)
    circuit.settle(False, True, now=13.0)
    assert not circuit.admits(22.9) and circuit.begin(23.0)
    circuit.settle(True, True, now=24.0)
    assert circuit.closed and circuit.failures == 0 and not circuit.begin(24.0)
    worker = Worker("decode", "http://d", circuit=Circuit(threshold=1))
    worker.circuit.settle(False, False, time.monotonic())
    worker.record(True)  # a health check that passes
    assert worker.healthy and not worker.circuit.closed and not worker.available(time.monotonic())


def test_a_failing_decode_worker_is_left_out_until_a_probe_succeeds(cluster, background):
    prefill, decode = cluster.fake("p"), [cluster.fake("d0", status=500), cluster.fake("d1")]
    # long enough a cooldown for #5 and #6 to be sent while it lasts
    router = cluster.router([prefill], decode, circuit_breaker_cooldown_s=1.0, health_check_interval_s=0.02)
    d0 = router.state.decode.workers[0]
    assert [router.post("/generate", json={"text": f"#{i}"}).status_code for i in range(5)] == [500, 200] * 2 + [500]
    _until(lambda: _circuit_open(router, decode[0]) == 1.0, "d0's circuit to open")
    assert _circuit_open(router, decode[1]) == 0.0
    checks = decode[0].health_checks
    _until(lambda: decode[0].health_checks >= checks + 2, "two more health checks of d0")
    assert d0.healthy and not d0.circuit.closed  # passing health checks do not close it
    for i in (5, 6):
        assert router.post("/generate", json={"text": f"#{i}"}).status_code == 200
    decode[0].status, decode[0].hold_at = 200, 0  # d0 works again; its probe waits for the test
    _until(lambda: d0.circuit.admits(time.monotonic()), "the cooldown to end", timeout=WAIT_S)
    probe = background.submit(router.post, "/generate", json={"text": "#7"})
    _until(lambda: _who(decode, "#7"), "the probe to arrive")
    for i in (8, 9):  # while the probe is in flight
        assert router.post("/generate", json={"text": f"#{i}"}).status_code == 200
    assert _circuit_open(router, decode[0]) == 1.0
    decode[0].release.set()
    assert probe.result(WAIT_S).status_code == 200
    _until(lambda: d0.circuit.closed, "d0's circuit to close")
    assert _circuit_open(router, decode[0]) == 0.0
    for i in (10, 11):
        assert router.post("/generate", json={"text": f"#{i}"}).status_code == 200
    expected = "d0 d1 d0 d1 d0 d1 d1 d0 d1 d1".split()  # d0 failed #0, #2, #4; was left out; #7 was its probe
    assert [_who(decode, f"#{i}") for i in range(10)] == [[name] for name in expected]
    assert sorted(_who(decode, "#10") + _who(decode, "#11")) == ["d0", "d1"]  # round robin includes it again


def test_circuit_breaker_args_and_config_checks(capsys):
    parser = argparse.ArgumentParser()
    add_router_args(parser)
    base = ["--pd-disaggregation", "--prefill", "http://p", "--decode", "http://d"]
    config = config_from_args(parser.parse_args(base))
    assert (config.circuit_breaker_failures, config.circuit_breaker_cooldown_s) == (3, 10.0)
    config = config_from_args(parser.parse_args(
        [*base, "--circuit-breaker-failures", "5", "--circuit-breaker-cooldown-s", "0.5"]))
    assert (config.circuit_breaker_failures, config.circuit_breaker_cooldown_s) == (5, 0.5)
    for bad in (["--circuit-breaker-failures", "1.5"], ["--circuit-breaker-cooldown-s", "soon"]):
        with pytest.raises(SystemExit):
            parser.parse_args([*base, *bad])
    assert "--circuit-breaker" in capsys.readouterr().err
    with pytest.raises(ValueError, match="circuit_breaker_failures"):
        config_from_args(parser.parse_args([*base, "--circuit-breaker-failures", "0"]))
    good: dict[str, Any] = {"prefill": (("http://p:1", 2),), "decode": ("http://d:1",)}
    for field, value in [("circuit_breaker_failures", 0), ("circuit_breaker_failures", 2.0),
                         ("circuit_breaker_failures", True), ("circuit_breaker_cooldown_s", 0),
                         ("circuit_breaker_cooldown_s", -1.0), ("circuit_breaker_cooldown_s", float("nan")),
                         ("circuit_breaker_cooldown_s", float("inf"))]:
        with pytest.raises(ValueError, match=field):
            RouterConfig(**{**good, field: value})


def test_run_router_serves_until_sigterm_then_exits_0(cluster, tmp_path):
    script = ("import argparse, sys\nfrom moeserve.server.router import add_router_args, run_router\n"
              "parser = argparse.ArgumentParser()\nadd_router_args(parser)\n"
              "sys.exit(run_router(parser.parse_args(sys.argv[1:])))")
    port_file = tmp_path / "ports.json"
    proc = subprocess.Popen([sys.executable, "-c", script, "--pd-disaggregation", "--prefill", cluster.dead_url(),
                             "--decode", cluster.dead_url(), "--port", "0", "--port-file", str(port_file)],
                            cwd=Path(__file__).parents[2], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _until(lambda: proc.poll() is not None or port_file.exists(), "the router process to bind", timeout=60)
        port = json.loads(port_file.read_text())["port"]
        _until(lambda: proc.poll() is not None or _answers(f"http://127.0.0.1:{port}/health"),
               "the router process to listen", timeout=60)
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=WAIT_S)
        assert proc.returncode == 0, out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _answers(url: str) -> bool:
    try:
        httpx.get(url, timeout=1)
    except httpx.HTTPError:
        return False
    return True
