"""``moeserve serve --speculative-algorithm NEXTN``: the openai client gets the tokens of decoding one
at a time, ``/metrics`` reports the mean accept length and ``bench serving`` shows it."""

from __future__ import annotations

import argparse
import signal

import openai
import pytest

from moeserve import LLM, SamplingParams
from moeserve.bench.serving import add_serving_args, run_serving_benchmark
from moeserve.models.tiny import make_tiny_model
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
