"""moeserve against transformers' DeepSeek V2/V3 on the same checkpoints."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import build_engine_config
from moeserve.executor.model_runner import ModelRunner
from tests.engine_utils import new_req, run_extend
from tests.hf_models import hf_greedy, load_hf_model

VARIANTS = ["v3", "v2-lite", "v2"]
PROMPT_LENS = [1, 7, 23, 41, 64]


def _prompts(seed: int, lens: list[int], vocab: int = 320) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lens]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_prefill_logits_match_transformers(hf_model_path, variant, seed):
    path = hf_model_path(variant, seed)
    hf = load_hf_model(path)
    runner = ModelRunner(build_engine_config(path, dtype="float32", page_size=4, max_total_tokens=512))
    for ids in _prompts(seed, [5, 37]):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        got = run_extend(runner, new_req(runner, ids), 0, len(ids))
        err = (got - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), f"{variant}: max |diff| {err}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_prefill_logits_match_one_shot(hf_model_path, variant):
    """Prefill split into chunks that end mid-page gives the logits of one whole prefill."""
    path = hf_model_path(variant, 0)
    runner = ModelRunner(build_engine_config(path, dtype="float32", page_size=4, max_total_tokens=512))
    ids = _prompts(0, [30])[0]
    whole = run_extend(runner, new_req(runner, ids, "whole"), 0, len(ids))
    req = new_req(runner, ids, "chunked")
    parts = [run_extend(runner, req, a, b) for a, b in [(0, 5), (5, 18), (18, 30)]]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_generation_matches_transformers(hf_model_path, variant, seed):
    """A mixed-length batch under continuous batching, chunked prefill and small pages."""
    path = hf_model_path(variant, seed)
    hf = load_hf_model(path)
    prompts = _prompts(seed, PROMPT_LENS)
    expected = [hf_greedy(hf, p, 32) for p in prompts]
    llm = LLM(path, dtype="float32", page_size=4, chunked_prefill_size=10, max_running_requests=3,
              max_total_tokens=1024)
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    for prompt, exp, out in zip(prompts, expected, outs):
        assert out.token_ids == exp, f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length"
    assert llm.scheduler.pages.num_free == llm.scheduler.pages.capacity
