"""``moeserve serve`` as a real process tree on loopback, driven by the openai client."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from moeserve import LLM, SamplingParams
from moeserve.models.tiny import make_tiny_model
from tests.e2e.server_utils import alive, descendants, metric, start_server, wait_for

API_KEY = "test-key"
PROMPTS = ["The capital of", "abc", "Once upon a time there was"]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    # a context of 2,048 for the tool list the template writes into the prompt
    return make_tiny_model(str(tmp_path_factory.mktemp("srv") / "v3"), preset="v3", seed=4, initializer_range=0.1,
                           max_position_embeddings=2048)


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    srv = start_server(["--model-path", model_path, "--served-model-name", "tiny", "--api-key", API_KEY,
                        "--tool-call-parser", "deepseekv3",
                        "--page-size", "4", "--max-total-tokens", "4096", "--chunked-prefill-size", "64",
                        "--max-queued-requests", "256"], log)
    yield srv
    tree = descendants(srv.proc.pid)
    assert tree, "the server should have an engine process"
    assert srv.stop(signal.SIGTERM) == 0, srv.log()
    assert wait_for(lambda: not any(alive(pid) for pid in tree), timeout=10), "processes left behind"


@pytest.fixture(scope="module")
def offline(model_path):
    return LLM(model_path, dtype="auto", page_size=4, max_total_tokens=4096)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY)


def _greedy(offline, prompts, max_tokens=12):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.text for o in offline.generate(prompts, params, use_tqdm=False)]


def test_completions_match_offline_engine(client, offline):
    expected = _greedy(offline, PROMPTS)
    for prompt, text in zip(PROMPTS, expected):
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == text and out.choices[0].finish_reason == "length"
        assert out.usage.completion_tokens == 12
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == text


def test_batch_of_prompts_and_token_ids(client, offline):
    ids = offline.tokenizer.encode(PROMPTS[2])
    out = client.completions.create(model="tiny", prompt=[ids, ids], max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == [_greedy(offline, [ids])[0]] * 2


def test_chat_completions_match_offline_engine(client, offline):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ids = offline.tokenizer.apply_chat_template(messages)
    expected = _greedy(offline, [ids], 10)[0]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == expected and out.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == len(ids)


def test_n_seed_logprobs_and_stop(client, offline):
    out = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=1.0, n=2, seed=7,
                                    extra_body={"ignore_eos": True})
    again = client.completions.create(model="tiny", prompt="abc", max_tokens=8, temperature=1.0, n=2, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == [c.text for c in again.choices]
    assert sorted(c.index for c in out.choices) == [0, 1]
    lp = client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0, logprobs=2,
                                   extra_body={"ignore_eos": True}).choices[0].logprobs
    # alternatives that decode to the same text share a key, as in OpenAI's format
    assert len(lp.token_logprobs) == 4 and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    assert len(chat.choices[0].logprobs.content) == 3
    full = _greedy(offline, ["Once upon a time there was"], 16)[0]
    stop = full[4:6]
    cut = client.completions.create(model="tiny", prompt="Once upon a time there was", max_tokens=16, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[:full.find(stop)]


def test_native_generate_returns_token_ids(server, offline):
    ids = offline.tokenizer.encode("abc")
    expected = offline.generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                                use_tqdm=False)[0]
    r = httpx.post(f"{server.base_url}/generate", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0,
                                                               "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == expected.token_ids
    assert r.json()["meta_info"]["finish_reason"] == {"type": "length"}


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(f"{server.base_url}/health_generate", headers=headers, timeout=30).status_code == 200
    assert metric(server.base_url, "moeserve:generation_tokens_total") > 0
    assert metric(server.base_url, "moeserve:time_to_first_token_seconds_count") > 0


def test_a_repeated_prefix_is_reported_cached_in_usage_and_metrics(server, client, offline):
    """The second request of a shared 40-token prefix gets its whole pages from the prefix cache:
    OpenAI's ``prompt_tokens_details.cached_tokens``, in streamed usage too, and on /metrics."""
    system = "You are a careful assistant who answers in one short line. " * 3
    prompts = [system + "Question one?", system + "Another question, longer than that one?"]
    hits_before = metric(server.base_url, "moeserve:prefix_cache_hit_tokens")
    first = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=4, temperature=0)
    second = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=4, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(second)
    usage = chunks[-1].usage
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 4 == 0 and cached <= usage.prompt_tokens - 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == _greedy(offline, prompts[1:], 4)[0]
    assert wait_for(lambda: metric(server.base_url, "moeserve:prefix_cache_hit_tokens") >= hits_before + cached)
    assert 0 < metric(server.base_url, "moeserve:prefix_cache_hit_rate") <= 1
    assert metric(server.base_url, "moeserve:kv_pages_cached") > 0
    assert wait_for(lambda: metric(server.base_url, "moeserve:kv_pages_used") == 0)


def test_continue_final_message_and_continuous_usage_stats(client, offline):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    text = offline.tokenizer.render_chat(messages, continue_final_message=True, add_generation_prompt=False)
    assert text.endswith("My favourite is")  # left open: no end of turn, no new assistant turn
    want = _greedy(offline, [offline.tokenizer.encode(text, add_special_tokens=False)], 6)[0]
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                            stream=True, extra_body={"continue_final_message": True,
                                                                     "add_generation_prompt": False,
                                                                     "ignore_eos": True},
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert counts and counts == sorted(counts) and chunks[-1].usage.completion_tokens == 6
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model="tiny", messages=messages[:1], max_tokens=2,
                                       extra_body={"continue_final_message": True})


def test_flush_cache_empties_the_prefix_cache_and_is_refused_while_requests_run(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    client.completions.create(model="tiny", prompt="A prefix worth keeping for later, " * 4, max_tokens=2)
    assert wait_for(lambda: metric(server.base_url, "moeserve:kv_pages_cached") > 0)
    stream = client.completions.create(model="tiny", prompt="busy", max_tokens=200, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))  # a request is running
    r = httpx.post(f"{server.base_url}/flush_cache", headers=headers)
    assert r.status_code == 400 and "running" in r.json()["error"]["message"]
    stream.close()
    assert wait_for(lambda: httpx.post(f"{server.base_url}/flush_cache", headers=headers).status_code == 200)
    assert wait_for(lambda: metric(server.base_url, "moeserve:kv_pages_cached") == 0)
    assert client.completions.create(model="tiny", prompt="still serving", max_tokens=2).choices[0].text is not None


def test_64_concurrent_requests_all_complete_and_pages_return(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
        tasks = [client.completions.create(model="tiny", prompt=f"request {i}", max_tokens=8 + i % 9,
                                           temperature=0.8, seed=i, stream=i % 2 == 0,
                                           extra_body={"ignore_eos": True}) for i in range(64)]
        results = await asyncio.gather(*tasks)
        counts = []
        for i, res in enumerate(results):
            if i % 2 == 0:
                counts.append(sum([1 async for c in res if c.choices and c.choices[0].finish_reason]))
            else:
                counts.append(res.usage.completion_tokens == 8 + i % 9)
        await client.close()
        return counts

    assert all(asyncio.run(run()))
    assert wait_for(lambda: metric(server.base_url, "moeserve:kv_pages_used") == 0)
    assert metric(server.base_url, "moeserve:num_running_reqs") == 0


def test_client_disconnect_mid_stream_aborts_and_frees_pages(server):
    aborted_before = _aborted(server)
    body = {"model": "tiny", "prompt": "a long one", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in got)
    assert wait_for(lambda: _aborted(server) == aborted_before + 1)
    assert wait_for(lambda: metric(server.base_url, "moeserve:kv_pages_used") == 0)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a long one", "max_tokens": 400}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400}),
    ("/generate", {"text": "a long one", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}),
])
def test_client_disconnect_without_streaming_aborts_behind_the_api_key(server, path, body):
    aborted_before = _aborted(server)
    data = json.dumps({"model": "tiny", "temperature": 0, "ignore_eos": True, **body}).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(head.encode() + data)
        assert wait_for(lambda: metric(server.base_url, "moeserve:num_running_reqs") == 1)
    assert wait_for(lambda: _aborted(server) == aborted_before + 1)
    assert wait_for(lambda: metric(server.base_url, "moeserve:kv_pages_used") == 0)


def _aborted(server) -> float:
    try:
        return metric(server.base_url, "moeserve:requests_total", finish_reason="abort")
    except KeyError:
        return 0.0


BAD = [
    ("malformed json", b'{"model": "tiny", "prompt": ', "JSON"),
    ("wrong type", {"model": "tiny", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("over context", {"model": "tiny", "prompt": "word " * 2100}, "context length"),
    ("max_tokens < 1", {"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("bad stop type", {"model": "tiny", "prompt": "x", "stop": 5}, "stop"),
    ("empty stop", {"model": "tiny", "prompt": "x", "stop": [""]}, "stop"),
    ("top_p", {"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p"),
    ("empty prompt", {"model": "tiny", "prompt": ""}, "empty"),
]


@pytest.mark.parametrize("name, body, needle", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_400_and_the_server_keeps_serving(server, client, name, body, needle):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.base_url}/v1/completions", content=content, headers=headers)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices[0].text is not None


# every field of OpenAI's or SGLang's schema that the server does not honour yet: refused, named
NOT_HONOURED = [
    ("functions", {"functions": [{"name": "f", "parameters": {}}]}),
    ("reasoning_effort", {"reasoning_effort": "high"}),
]


@pytest.mark.parametrize("field, extra", NOT_HONOURED, ids=[f"{f}-{i}" for i, (f, _) in enumerate(NOT_HONOURED)])
def test_a_field_that_is_not_honoured_is_refused_by_name(server, field, extra):
    _assert_refused_by_name(server, field, extra)


def _assert_refused_by_name(server, field: str, extra: dict) -> None:
    """A chat request with ``extra`` is a 400 whose message names ``field``."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, json=body)
    assert r.status_code == 400 and field in r.json()["error"]["message"], r.text


def test_inert_values_and_unknown_fields_are_accepted(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [],
            "tool_choice": "none", "logit_bias": {}, "min_tokens": 0, "response_format": {"type": "text"},
            "user": "u1", "a_field_nobody_defined": 3}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, json=body)
    assert r.status_code == 200, r.text
    assert "a_field_nobody_defined" in server.log()  # ignored, but said


def test_a_wrong_model_is_a_404_model_not_found(server, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert err.value.body["type"] == "model_not_found" and "gpt-9" in err.value.body["message"]
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_tokenize_detokenize_version_and_server_info(server, offline):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for prefix in ("", "/v1"):
        r = httpx.post(f"{server.base_url}{prefix}/tokenize", headers=headers, json={"prompt": "The capital of"})
        assert r.status_code == 200, r.text
        tokens = r.json()["tokens"]
        assert tokens == offline.tokenizer.encode("The capital of") and r.json()["count"] == len(tokens)
        assert r.json()["max_model_len"] > 0
        r = httpx.post(f"{server.base_url}{prefix}/detokenize", headers=headers, json={"tokens": tokens})
        assert r.status_code == 200 and r.json()["prompt"] == offline.tokenizer.decode(tokens), r.text
    r = httpx.post(f"{server.base_url}/detokenize", headers=headers, json={"tokens": [10 ** 9]})
    assert r.status_code == 400 and "tokens" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/tokenize", headers=headers, json={"prompt": "a", "text": "b"})
    assert r.status_code == 400
    assert httpx.get(f"{server.base_url}/version", headers=headers).json()["version"]
    info = httpx.get(f"{server.base_url}/get_server_info", headers=headers).json()
    assert info["server"]["served_model_name"] == "tiny" and "api_key" not in info["server"]
    assert info["engine"]["cache"]["page_size"] == 4 and info["max_total_tokens"] > 0
    assert httpx.get(f"{server.base_url}/get_model_info", headers=headers).json()["served_model_name"] == "tiny"


def test_bad_chat_input_gets_400(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers,
                   json={"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = httpx.post(f"{server.base_url}/v1/chat/completions", headers=headers, json={"model": "tiny", "messages": []})
    assert r.status_code == 400


def test_wrong_api_key_gets_401(server):
    r = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong").models.list()


def test_bench_serving_against_the_server(server, tmp_path):
    import argparse

    from moeserve.bench.serving import add_serving_args, run_serving_benchmark

    parser = argparse.ArgumentParser()
    add_serving_args(parser)
    args = parser.parse_args(["--base-url", server.base_url, "--api-key", API_KEY, "--num-prompts", "16",
                              "--request-rate", "50", "--random-input-len", "24", "--random-output-len", "8",
                              "--output-json", str(tmp_path / "bench.json"), "--plot", str(tmp_path / "bench.png"),
                              "--disable-tqdm"])
    summary = run_serving_benchmark(args)
    assert summary["completed"] == 16 and summary["failed"] == 0
    assert summary["total_output_tokens"] == sum(r["output_len"] for r in
                                                 json.loads((tmp_path / "bench.json").read_text())["requests"])
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- structured outputs and logit controls (a random tiny model: only the grammar makes the shape)
class Person(pydantic.BaseModel):
    # a pattern, not max_length: xgrammar 0.2.9 lets control characters into a string with maxLength
    name: str = pydantic.Field(pattern=r"^[A-Za-z]{1,8}$")
    age: int = pydantic.Field(ge=0, le=120)
    mood: Literal["happy", "sad"]


PERSON_SCHEMA = Person.model_json_schema()
REGEX = r"(yes|no), because [a-z]{1,8}\."
EBNF = 'root ::= "answer: " ("yes" | "no") " (" [0-9] [0-9]? "%)"'


def test_chat_completions_parse_returns_a_valid_object(client):
    for seed in range(3):
        out = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": f"Who? {seed}"}],
                                            response_format=Person, max_tokens=80, temperature=1.0, seed=seed)
        person = out.choices[0].message.parsed
        assert isinstance(person, Person), out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop"


def test_json_schema_regex_and_ebnf_outputs_match_while_plain_requests_stay_greedy(server, client, offline):
    """Constrained and unconstrained requests run in one batch: the constrained ones match their
    grammars, the plain ones give the offline engine's greedy text."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{server.base_url}/v1/chat/completions"
    expected = _greedy(offline, PROMPTS)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    constrained = [({"response_format": fmt}, lambda t: Person.model_validate_json(t)),
                   ({"response_format": {"type": "json_object"}}, None),
                   ({"json_schema": json.dumps(PERSON_SCHEMA)}, lambda t: Person.model_validate_json(t)),
                   ({"regex": REGEX}, lambda t: re.fullmatch(REGEX, t) or pytest.fail(t)),
                   ({"ebnf": EBNF}, lambda t: re.fullmatch(r"answer: (yes|no) \([0-9]{1,2}%\)", t) or pytest.fail(t))]

    async def go():
        async with httpx.AsyncClient(timeout=120, headers=headers) as http:
            plain = [http.post(f"{server.base_url}/v1/completions", json={
                "model": "tiny", "prompt": p, "max_tokens": 12, "temperature": 0, "ignore_eos": True}) for p in PROMPTS]
            shaped = [http.post(url, json={"model": "tiny", "messages": [{"role": "user", "content": "Go"}],
                                           "max_tokens": 80, "temperature": 0.8, "seed": 3, **extra})
                      for extra, _ in constrained]
            return await asyncio.gather(*plain, *shaped)

    replies = asyncio.run(go())
    assert [r.json()["choices"][0]["text"] for r in replies[:len(PROMPTS)]] == expected
    for (extra, check), r in zip(constrained, replies[len(PROMPTS):]):
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", (extra, choice)
        if check is None:
            assert isinstance(json.loads(choice["message"]["content"]), dict)
        else:
            check(choice["message"]["content"])


def test_native_generate_takes_sglangs_grammar_fields(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for field, value, check in [("regex", REGEX, lambda t: re.fullmatch(REGEX, t)),
                                ("ebnf", EBNF, lambda t: t.startswith("answer: ")),
                                ("json_schema", json.dumps(PERSON_SCHEMA), Person.model_validate_json)]:
        r = httpx.post(f"{server.base_url}/generate", headers=headers, json={
            "text": "Q:", "sampling_params": {"max_new_tokens": 80, "temperature": 0, field: value}})
        assert r.status_code == 200, r.text
        assert check(r.json()["text"]), (field, r.json()["text"])


def test_logit_bias_and_min_tokens(server, client, offline):
    eos = offline.tokenizer.eos_token_id
    favourite = offline.tokenizer.encode("x", add_special_tokens=False)[-1]
    out = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0,
                                    logit_bias={str(favourite): 100})
    assert out.choices[0].text == offline.tokenizer.decode([favourite] * 6)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for min_tokens in (0, 4):  # the end token pushed up: it comes first unless min_tokens hold it back
        r = httpx.post(f"{server.base_url}/generate", headers=headers, json={
            "text": "abc", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "min_new_tokens": min_tokens,
                                               "logit_bias": {str(eos): 100}}})
        assert r.status_code == 200, r.text
        assert len(r.json()["output_ids"]) == min_tokens + 1 and r.json()["output_ids"][-1] == eos, r.json()


# ---- tool calls (the tiny model's template writes DeepSeek-V3's format, --tool-call-parser deepseekv3)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                               "unit": {"type": "string", "enum": ["C", "F"]}},
                                               "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                              "b": {"type": "integer", "minimum": 0, "maximum": 99}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def _valid_call(call) -> dict:
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args["city"] in ("Paris", "Oslo", "Rome") and args["unit"] in ("C", "F"), args
    else:
        assert call.function.name == "add" and set(args) == {"a", "b"} and all(0 <= v <= 99 for v in args.values())
    assert call.id.startswith("call_") and call.type == "function"
    return args


def test_tool_choice_required_and_named_give_a_valid_call_every_time(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for seed in range(2):
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            out = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=choice,
                                                 parallel_tool_calls=False, max_tokens=250, temperature=1.0,
                                                 seed=seed)
            message = out.choices[0].message
            assert out.choices[0].finish_reason == "tool_calls" and message.tool_calls, message
            for call in message.tool_calls:
                _valid_call(call)
            assert len(message.tool_calls) == 1
            if choice != "required":
                assert message.tool_calls[0].function.name == "add"


def test_a_tool_round_trip_streamed_and_not(client):
    """Call, tool result, final answer: the streamed call is the same call, delta by delta."""
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=250, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    _valid_call(call)
    stream = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=250, temperature=0, stream=True)
    calls, finish = {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            if d.id:
                calls[d.index] = [d.id, d.function.name, ""]
            calls[d.index][2] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(n, a) for _, n, a in calls.values()] == [(c.function.name, c.function.arguments)
                                                      for c in first.choices[0].message.tool_calls]
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "3 degrees, snow"}]
    final = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                           max_tokens=8, temperature=0)
    assert final.choices[0].message.tool_calls is None and isinstance(final.choices[0].message.content, str)
    auto = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=8, temperature=0)
    assert auto.choices[0].message.content is not None or auto.choices[0].message.tool_calls


BAD_CONTROLS = [
    ("priority", {"priority": 2}),  # without --enable-priority-scheduling
    ("tools", {"tools": "not-a-list"}),
    ("tool_choice", {"tool_choice": "required"}),
    ("tool_choice", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
    ("tool_choice", {"tools": TOOLS, "tool_choice": "required", "regex": "a+"}),
    ("regex", {"regex": "[a-"}),
    ("json_schema", {"json_schema": "{not json"}),
    ("json_schema", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}),
    ("ebnf", {"ebnf": "root ::= ("}),
    ("response_format", {"response_format": {"type": "json_schema"}}),
    ("response_format", {"response_format": {"type": "xml"}}),
    ("regex", {"regex": "a+", "ebnf": 'root ::= "a"'}),
    ("response_format", {"regex": "a+", "response_format": {"type": "json_object"}}),
    ("logit_bias", {"logit_bias": {"5": 1000}}),
    ("logit_bias", {"logit_bias": {"not-a-token": 1}}),
    ("logit_bias", {"logit_bias": {"99999999": 1}}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 2}),
]


@pytest.mark.parametrize("field, extra", BAD_CONTROLS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_CONTROLS)])
def test_a_bad_grammar_or_bias_is_a_400_naming_its_field(server, field, extra):
    _assert_refused_by_name(server, field, extra)


# ---- prompt logprobs (echo), as lm-eval's loglikelihood requests send them
def test_echo_with_logprobs_gives_the_prompts_logprobs_equal_to_transformers(server, client, model_path, offline):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The capital of France is Paris, and the capital of Italy is Rome."
    ids = offline.tokenizer.encode(prompt)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    want_lp = [want[i - 1, ids[i]].item() for i in range(1, len(ids))]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(prompt) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(ids) + 1 and "".join(lp.tokens[:len(ids)]) == offline.tokenizer.decode(ids, False)
    assert lp.token_logprobs[1:len(ids)] == pytest.approx(want_lp, abs=1e-4)
    best = [max(top.values()) for top in lp.top_logprobs[1:len(ids)]]
    assert best == pytest.approx(want[:-1].max(-1).values.tolist(), abs=1e-4)  # top-1 alternative per position
    scored = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert scored.usage.completion_tokens == 0 and scored.choices[0].text == offline.tokenizer.decode(ids, False)
    assert scored.choices[0].logprobs.token_logprobs[1:] == pytest.approx(want_lp, abs=1e-4)
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, echo=True, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert text == prompt + plain.choices[0].text
    r = httpx.post(f"{server.base_url}/generate", headers={"Authorization": f"Bearer {API_KEY}"}, json={
        "input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    got = [entry[0] for entry in r.json()["meta_info"]["input_token_logprobs"][1:]]
    assert got == pytest.approx(want_lp, abs=1e-4)


# ---- real clients: LangChain and lm-eval
class Weather(pydantic.BaseModel):
    """The weather in a city now."""

    city: Literal["Paris", "Oslo", "Rome"]
    unit: Literal["C", "F"]


def test_langchain_binds_tools_and_gets_structured_output_by_every_method(server):
    chat_openai = pytest.importorskip("langchain_openai").ChatOpenAI
    llm = chat_openai(base_url=f"{server.base_url}/v1", api_key=API_KEY, model="tiny", temperature=0, max_tokens=250)
    message = llm.bind_tools([Weather], tool_choice="Weather").invoke("What is the weather in Rome?")
    assert [c["name"] for c in message.tool_calls] == ["Weather"]
    Weather.model_validate(message.tool_calls[0]["args"])
    for method in ("function_calling", "json_schema"):
        assert isinstance(llm.with_structured_output(Person, method=method).invoke("Who?"), Person), method
    free = llm.with_structured_output({"title": "anything", "type": "object"}, method="json_mode").invoke("JSON?")
    assert isinstance(free, dict)


def test_lm_eval_scores_a_local_multiple_choice_task_with_the_servers_logprobs(server, offline, model_path,
                                                                              tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # what lm-eval's API models send
    from lm_eval.tasks import TaskManager

    docs = [{"question": "Q: 2 + 2 =", "choices": ["4", "5", "22"], "answer": 0},
            {"question": "Q: the sky is", "choices": ["blue", "loud"], "answer": 1}]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tiny_choice.yaml").write_text(
        "task: tiny_choice\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n")
    out = lm_eval.simple_evaluate(
        model="local-completions", tasks=["tiny_choice"], task_manager=TaskManager(include_path=str(tmp_path)),
        model_args=f"base_url={server.base_url}/v1/completions,model=tiny,tokenizer={model_path},"
                   "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1",
        log_samples=True, apply_chat_template=False)
    got = [[ll for ll, _ in s["filtered_resps"]] for s in out["samples"]["tiny_choice"]]
    want = []
    for doc in docs:  # each choice's loglikelihood from the offline engine's prompt logprobs, tokenized as
        context = offline.tokenizer.encode(doc["question"], add_special_tokens=False)  # lm-eval does: no bos
        row = []
        for choice in doc["choices"]:
            ids = context + offline.tokenizer.encode(" " + choice, add_special_tokens=False)  # target_delimiter
            lps = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
            row.append(sum(lp.logprob for lp in lps.prompt_logprobs[len(context):]))
        want.append(row)
    assert got == [pytest.approx(w, abs=1e-3) for w in want]
    accuracy = sum(max(range(len(w)), key=w.__getitem__) == d["answer"] for w, d in zip(want, docs)) / len(docs)
    assert out["results"]["tiny_choice"]["acc,none"] == pytest.approx(accuracy)


# ---- the Responses API
def test_responses_create_stream_retrieve_tools_structured_and_continue(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    r = client.responses.create(model="tiny", instructions="Be brief.", input="Hello there", max_output_tokens=6,
                                temperature=0, extra_body={"ignore_eos": True})
    assert r.output_text == chat and r.status == "incomplete" and r.usage.output_tokens == 6
    assert client.responses.retrieve(r.id).output_text == chat
    events = list(client.responses.create(model="tiny", instructions="Be brief.", input="Hello there",
                                          max_output_tokens=6, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat
    assert events[-1].response.output_text == chat
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    called = client.responses.create(model="tiny", input="Weather in Rome?", tools=tools, tool_choice="required",
                                     parallel_tool_calls=False, max_output_tokens=250, temperature=0)
    call = next(item for item in called.output if item.type == "function_call")
    assert call.name in ("get_weather", "add") and isinstance(json.loads(call.arguments), dict)
    follow = client.responses.create(model="tiny", previous_response_id=called.id, max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}], temperature=0)
    assert follow.output[0].type == "message" and follow.previous_response_id == called.id
    shaped = client.responses.create(model="tiny", input="Who?", max_output_tokens=80, temperature=0, text={
        "format": {"type": "json_schema", "name": "person", "schema": PERSON_SCHEMA, "strict": True}})
    Person.model_validate_json(shaped.output_text)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.BadRequestError, match="previous_response_id"):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
