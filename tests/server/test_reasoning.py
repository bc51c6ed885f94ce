"""``--reasoning-parser deepseek-r1``: reasoning apart from the answer, however the text is cut into
pieces, and through the chat endpoint (in process, the engine replaced by scripted chunks)."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx
import pytest

from moeserve.config import ParallelConfig, build_engine_config
from moeserve.models.tiny_chat import embedded_model_path
from moeserve.models.tokenizer import load_tokenizer
from moeserve.scheduler.ranks import RankAddresses
from moeserve.server.api import ServerConfig, ServerState, build_app
from moeserve.server.engine_client import Chunk, EngineClient
from moeserve.server.metrics import Metrics
from moeserve.server.reasoning import ReasoningParser

CASES = [  # completion text -> (reasoning, content)
    ("Let me see.</think>The answer is 4.", ("Let me see.", "The answer is 4.")),
    ("<think>\nLet me see.</think>Four", ("\nLet me see.", "Four")),  # the model opens the tag itself
    ("still thinking when it stopped", ("still thinking when it stopped", "")),
    ("</think>straight to it", ("", "straight to it")),
    ("a < b and </thin is not the tag</think>ok </think> twice", ("a < b and </thin is not the tag", "ok </think> twice")),
    ("<th", ("", "")),  # a start tag cut off before it was written whole
]


def _split(pieces: list[str]) -> tuple[str, str]:
    parser = ReasoningParser("deepseek-r1")
    reasoning = content = ""
    for piece in pieces:
        out = parser.feed(piece)
        reasoning, content = reasoning + out.reasoning, content + out.content
    out = parser.finish()
    return reasoning + out.reasoning, content + out.content


@pytest.mark.parametrize("text, want", CASES)
def test_every_way_of_cutting_the_text_gives_the_same_split(text, want):
    assert _split([text]) == want
    for cuts in itertools.combinations(range(1, len(text)), 2):  # every cut into three pieces
        a, b = cuts
        assert _split([text[:a], text[a:b], text[b:]]) == want, cuts
    assert _split(list(text)) == want  # a character at a time


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="reasoning_parser"):
        ReasoningParser("o1")


PIECES = ["<th", "ink>Two plus", " two.</th", "ink>It is", " 4."]  # one token each, the last one stops


@pytest.fixture
def state(monkeypatch):
    addrs = RankAddresses.derive(ParallelConfig())
    client = EngineClient(None, Metrics("m"), addrs)
    engine = build_engine_config(embedded_model_path())
    state = ServerState(client, load_tokenizer(embedded_model_path()), engine,
                        ServerConfig(reasoning_parser="deepseek-r1"), kv_capacity=4096)

    async def scripted(prompt_ids, params, ticket=None, bootstrap=None):
        for i, piece in enumerate(PIECES):
            yield Chunk(piece, [7 + i], [], "stop" if i == len(PIECES) - 1 else None, len(prompt_ids))

    monkeypatch.setattr(client, "generate", scripted)
    yield state
    client.close()
    addrs.cleanup()


def _post(state: ServerState, body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.post("/v1/chat/completions", json=body)
    return asyncio.run(go())


BODY = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 8}


def test_the_message_has_reasoning_content_and_usage_counts_its_tokens(state):
    r = _post(state, BODY)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["reasoning_content"] == "Two plus two."
    assert choice["message"]["content"] == "It is 4."
    # up to the token that completes the closing tag (the 4th: "ink>It is")
    assert r.json()["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}
    assert r.json()["usage"]["completion_tokens"] == 5


def test_streamed_deltas_carry_reasoning_then_content(state):
    r = _post(state, {**BODY, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two plus two."
    assert "".join(d.get("content") or "" for d in deltas) == "It is 4."
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])
    assert events[-1]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 4}


def test_separate_reasoning_false_keeps_the_text_whole(state):
    r = _post(state, {**BODY, "separate_reasoning": False})
    message = r.json()["choices"][0]["message"]
    assert message["content"] == "".join(PIECES) and "reasoning_content" not in message
