"""``moeserve serve --speculative-algorithm NEXTN``: the openai client gets the tokens of decoding one
at a time, alone and as a PD deployment, ``/metrics`` reports the mean accept length and ``bench
serving`` shows it."""

from __future__ import annotations

import argparse
import signal

import openai
import pytest

from moeserve import LLM, SamplingParams
from moeserve.bench.serving import add_serving_args, run_serving_benchmark
from moeserve.models.tiny import make_tiny_model
from moeserve.server import procs
from tests.e2e.server_utils import metric, start_server, wait_for


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("spec") / "v3"), preset="v3", seed=5, mtp=True)


def test_speculative_server_matches_plain_decoding(model_path, tmp_path):
    prompts = ["The capital of", "Once upon a time there was"]
    with LLM(model_path, dtype="float32", page_size=4) as llm:
        expected = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0,
                                                                          ignore_eos=True), use_tqdm=False)]
    srv = start_server(["--model-path", model_path, "--dtype", "float32", "--page-size", "4",
                        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"], str(tmp_path / "log"))
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="none")
        for prompt, text in zip(prompts, expected):
            out = client.completions.create(model="v3", prompt=prompt, max_tokens=16, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == text and out.usage.completion_tokens == 16
        assert wait_for(lambda: metric(srv.base_url, "moeserve:spec_verify_seqs") > 0)
        assert 1 <= metric(srv.base_url, "moeserve:spec_accept_length") <= 3
        parser = argparse.ArgumentParser()
        add_serving_args(parser)
        args = parser.parse_args(["--base-url", srv.base_url, "--num-prompts", "6", "--random-input-len", "12",
                                  "--random-output-len", "10", "--disable-tqdm"])
        summary = run_serving_benchmark(args)
        assert summary["completed"] == 6 and 1 <= summary["spec_accept_length"] <= 3
    finally:
        assert srv.stop(signal.SIGTERM) == 0, srv.log()


def test_pd_deployment_with_speculation_matches_plain_decoding(model_path, tmp_path):
    """A prefill server and a DP-attention decode server (tp 4, dp 4, low-latency dispatch), both
    speculating, behind the PD router: the openai client gets the tokens of one engine decoding one
    token at a time, and the decode server verifies the prefill server's drafts."""
    prompts = ["The capital of", "Once upon a time there was a very long story about " * 3]
    with LLM(model_path, dtype="float32", page_size=4) as llm:
        expected = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0,
                                                                          ignore_eos=True), use_tqdm=False)]
    spec = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2"]
    common = ["--model-path", model_path, "--served-model-name", "m", "--dtype", "float32", "--page-size", "4",
              "--chunked-prefill-size", "16", "--disaggregation-secret-file", str(tmp_path / "secret"), *spec]
    decode = ["--tp-size", "4", "--dp-size", "4", "--enable-dp-attention", "--moe-a2a-backend", "torch",
              "--deepep-mode", "low_latency"]
    deployment = procs.pd_deployment(common, [], decode, "torch", str(tmp_path))
    with procs.running(deployment):
        prefill_srv, decode_srv, router = deployment
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)
        for prompt, text in zip(prompts, expected):
            out = client.completions.create(model="m", prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == text and out.usage.completion_tokens == 12
        assert wait_for(lambda: metric(decode_srv.url, "moeserve:spec_verify_seqs") > 0)
        assert metric(prefill_srv.url, "moeserve:spec_verify_seqs") == 0  # it drafts, the decode side verifies
        for srv in (prefill_srv, decode_srv):
            assert wait_for(lambda url=srv.url: metric(url, "moeserve:kv_pages_used") == 0, timeout=30)
