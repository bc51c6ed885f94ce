"""The HTTP layer in process (no engine behind it): body limits, tokenization off the event loop,
the API key check, queue places given back on every path."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from moeserve.config import ParallelConfig, build_engine_config
from moeserve.models.tiny_chat import embedded_model_path
from moeserve.scheduler.ranks import RankAddresses
from moeserve.server import http
from moeserve.server.api import GuardedStream, ServerConfig, ServerState, build_app
from moeserve.server.engine_client import EngineClient
from moeserve.server.metrics import Metrics


class _SlowTokenizer:
    """Blocks in ``encode`` until told to go on, and notes the thread it ran in."""

    eos_token_id = None
    max_token_chars = 1

    def __init__(self) -> None:
        self.entered, self.go_on = threading.Event(), threading.Event()
        self.thread: str | None = None

    def min_tokens(self, text: str) -> int:
        return 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.thread = threading.current_thread().name
        self.entered.set()
        assert self.go_on.wait(30)
        return [1] * 100_000  # longer than any context: the request ends in a 400, not in the engine


@pytest.fixture
def make_state():
    made = []

    def make(tokenizer=None, **server) -> ServerState:
        addrs = RankAddresses.derive(ParallelConfig())
        client = EngineClient(None, Metrics("m"), addrs)
        engine = build_engine_config(embedded_model_path())
        state = ServerState(client, tokenizer, engine, ServerConfig(**server), kv_capacity=4096)
        made.append((client, addrs))
        return state

    yield make
    for client, addrs in made:
        client.close()
        addrs.cleanup()


def _client(state: ServerState) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://t")


def test_long_texts_are_tokenized_off_the_event_loop(make_state):
    tokenizer = _SlowTokenizer()
    state = make_state(tokenizer)

    async def scenario() -> tuple[int, int]:
        async with _client(state) as http:
            completion = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "x" * 10_000}))
            await asyncio.to_thread(tokenizer.entered.wait, 30)
            health = await http.get("/health")  # answered while the tokenizer is still busy
            tokenizer.go_on.set()
            return health.status_code, (await completion).status_code

    assert asyncio.run(scenario()) == (200, 400)
    assert tokenizer.thread.startswith("tokenize")
    assert state.client.queued == 0


def test_bodies_over_the_limit_get_413_declared_or_chunked(make_state):
    state = make_state(max_request_bytes=2048)

    async def chunks():
        for _ in range(10):
            yield b"x" * 1000

    async def scenario() -> list[httpx.Response]:
        async with _client(state) as http:
            return [await http.post("/v1/completions", content=b"{" + b" " * 4000 + b"}"),
                    await http.post("/v1/completions", content=chunks()),
                    await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": "x"})]

    declared, chunked, small = asyncio.run(scenario())
    for r in (declared, chunked):
        assert r.status_code == 413 and "larger than 2048 bytes" in r.json()["error"]["message"]
    assert small.status_code == 400  # under the limit: parsed and validated as usual


def test_the_api_key_is_compared_in_constant_time(make_state, monkeypatch):
    state = make_state(api_key="secret")
    calls = []

    def compare(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return a == b

    monkeypatch.setattr(http.hmac, "compare_digest", compare)

    async def scenario() -> list[int]:
        async with _client(state) as http:
            return [(await http.get("/v1/models", headers=h)).status_code
                    for h in ({"Authorization": "Bearer nope"}, {"Authorization": "Bearer secret"}, {})]

    assert asyncio.run(scenario()) == [401, 200, 401]
    assert calls == [(b"Bearer nope", b"Bearer secret"), (b"Bearer secret", b"Bearer secret"),
                     (b"", b"Bearer secret")]


def test_a_stream_whose_client_left_before_the_first_byte_gives_its_places_back(make_state):
    state = make_state()
    ticket = state.admit(3)
    started = []

    async def events():
        started.append(True)
        yield "never sent"

    async def gone(_: dict) -> None:
        raise OSError("the client went away")

    async def receive() -> dict:
        await asyncio.sleep(10)
        return {"type": "http.disconnect"}

    response = GuardedStream(events(), on_close=ticket.release)
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(Exception):
        asyncio.run(response(scope, receive, gone))
    assert not started and state.client.queued == 0


def test_a_starting_server_answers_503_until_the_engine_is_ready(make_state):
    """The port answers from the start; ``/health`` and requests say 503 (with Retry-After) until
    the launch clears ``starting`` (the ranks loaded, captured and warmed)."""
    state = make_state(tokenizer=_SlowTokenizer())
    state.starting = True

    async def scenario() -> list[httpx.Response]:
        async with _client(state) as http:
            return [await http.get("/health"), await http.get("/health_generate"),
                    await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})]

    health, generate, completion = asyncio.run(scenario())
    assert health.status_code == generate.status_code == completion.status_code == 503
    assert completion.headers["retry-after"] == "1" and "starting" in completion.json()["error"]["message"]
    assert state.client.queued == 0
    state.starting = False
    assert asyncio.run(_health(state)) == 200


async def _health(state: ServerState) -> int:
    async with _client(state) as http:
        return (await http.get("/health")).status_code


def test_stored_responses_are_shared_through_their_file(tmp_path):
    """API workers open one store: what one stores the others read; only the newest ``limit`` stay."""
    from moeserve.server.responses import ResponseStore

    path = str(tmp_path / "responses.sqlite")
    one, two = ResponseStore(path, limit=3), ResponseStore(path, limit=3)
    try:
        for i in range(5):
            one.put(f"resp_{i}", {"response": {"id": f"resp_{i}"}, "conversation": [{"role": "user", "content": "é"}]})
        assert two.get("resp_4") == {"response": {"id": "resp_4"}, "conversation": [{"role": "user", "content": "é"}]}
        assert [two.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]
        assert len(two) == 3 and two.get("nope") is None
    finally:
        one.close()
        two.close()
