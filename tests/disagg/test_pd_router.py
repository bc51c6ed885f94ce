"""Prefill and decode servers behind the PD router, as real processes on loopback: greedy output
through the router is the single-process engine's, for every transfer backend and layout."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from moeserve import LLM, SamplingParams
from moeserve.models.tiny import make_tiny_model
from moeserve.server import procs
from tests.disagg.backend_pair import backend_available
from tests.e2e.server_utils import metric, wait_for

SERVER = ["--max-total-tokens", "4096", "--page-size", "4", "--chunked-prefill-size", "16"]
PROMPTS = ["The capital of", "Once upon a time there was a very long story about " * 3, "abc"]
HETERO_PREFILL = ["--tp-size", "2", "--moe-a2a-backend", "torch", "--deepep-mode", "normal"]
HETERO_DECODE = ["--tp-size", "4", "--dp-size", "4", "--enable-dp-attention", "--moe-a2a-backend", "torch",
                 "--deepep-mode", "low_latency"]
TOPOLOGIES = {  # (prefill servers, decode servers, prefill flags, decode flags)
    "1p1d": (1, 1, [], []),
    "2p1d": (2, 1, [], []),
    "1p2d": (1, 2, [], []),
    "hetero": (1, 1, HETERO_PREFILL, HETERO_DECODE),
}
BACKENDS = [pytest.param(b, marks=pytest.mark.skipif(not backend_available(b), reason=f"{b} cannot be imported"))
            for b in ("torch", "nixl", "mooncake")]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("pdr") / "v3"), preset="v3", seed=8, initializer_range=0.1)


@pytest.fixture(scope="module")
def offline(model_path):
    with LLM(model_path, dtype="auto", page_size=4, max_total_tokens=4096) as llm:
        yield llm


def _greedy(offline, prompt, max_tokens, logprobs=None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)
    return offline.generate([prompt], params, use_tqdm=False)[0]


def _deployment(model_path, tmp_path, backend, topology):
    n_prefill, n_decode, prefill_args, decode_args = TOPOLOGIES[topology]
    secret = ["--disaggregation-secret-file", str(tmp_path / "secret")]
    return procs.pd_deployment(["--model-path", model_path, "--served-model-name", "m", *SERVER, *secret],
                               prefill_args, decode_args, backend, str(tmp_path), n_prefill, n_decode)


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
    messages = [{"role": "user", "content": "What is 2+2?"}]
    chat_ids = offline.tokenizer.apply_chat_template(messages)
    chat = client.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, n=2,
                                          extra_body={"ignore_eos": True})
    assert [c.message.content for c in chat.choices] == [_greedy(offline, chat_ids, 8).text] * 2


def _assert_drained(deployment) -> None:
    for server in deployment[:-1]:  # every rank's pages come back (the metric sums the DP groups)
        assert wait_for(lambda url=server.url: metric(url, "moeserve:kv_pages_used") == 0, timeout=30), server.name
        assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("topology", list(TOPOLOGIES))
@pytest.mark.parametrize("backend", BACKENDS)
def test_through_the_router_greedy_output_is_one_engines(model_path, offline, tmp_path, backend, topology):
    deployment = _deployment(model_path, tmp_path, backend, topology)
    with procs.running(deployment):
        _check_answers(deployment[-1].url, offline)
        _assert_drained(deployment)


def test_200_concurrent_requests_all_complete_and_nothing_leaks(model_path, tmp_path):
    deployment = _deployment(model_path, tmp_path, "torch", "1p1d")
    with procs.running(deployment):
        prefill, decode, router = deployment

        async def run() -> list[int]:
            client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=300)
            calls = [client.completions.create(model="m", prompt=f"request {i} " * (1 + i % 7), max_tokens=2 + i % 9,
                                               temperature=0.8, seed=i, stream=i % 2 == 0,
                                               extra_body={"ignore_eos": True}) for i in range(200)]
            results = await asyncio.gather(*calls)
            counts = []
            for i, res in enumerate(results):
                if i % 2 == 0:
                    counts.append(sum([len(c.choices[0].token_ids or []) async for c in res if c.choices]))
                else:
                    counts.append(res.usage.completion_tokens)
            await client.close()
            return counts

        assert asyncio.run(run()) == [2 + i % 9 for i in range(200)]
        _assert_drained(deployment)
        assert metric(prefill.url, "moeserve:kv_transfers", result="success") == 200
        assert metric(decode.url, "moeserve:kv_transfers", result="success") == 200
        assert metric(prefill.url, "moeserve:pd_queue_reqs") == 0 and metric(decode.url, "moeserve:pd_queue_reqs") == 0


@pytest.mark.parametrize("decode_flags, needle", [(["--page-size", "8"], "page_size: prefill 4 vs decode 8"),
                                                  ("other model", "model: prefill ")])
def test_a_mismatched_pair_is_refused_at_the_handshake(model_path, tmp_path, decode_flags, needle):
    if decode_flags == "other model":
        other = make_tiny_model(str(tmp_path / "v2"), preset="v2-lite", seed=3)
        decode_flags = ["--model-path", other]
    common = ["--served-model-name", "m", *SERVER, "--disaggregation-secret-file", str(tmp_path / "secret")]
    deployment = procs.pd_deployment(common, ["--model-path", model_path], ["--model-path", model_path, *decode_flags],
                                     "torch", str(tmp_path))
    with procs.running(deployment):
        r = httpx.post(f"{deployment[-1].url}/v1/completions", timeout=60,
                       json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 3})
        assert r.status_code >= 500 and needle in r.json()["error"]["message"], r.text
        _assert_drained(deployment)
