"""Speculative decoding under data-parallel attention, attention TP and expert parallelism (gloo,
real processes): every rank runs the same model and draft passes, idle ranks idle passes, the
ranks of an attention-TP group append their leader's tokens, and greedy tokens equal the
single-process engine's without speculation."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.models.tiny import make_tiny_model
from tests.distributed.layouts import ENGINE
from tests.distributed.test_layouts import LAYOUTS

LENGTHS = [(12, 20), (30, 4), (7, 16), (19, 3), (40, 12), (5, 2)]


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(13)
    prompts = [torch.randint(2, 320, (n,), generator=gen).tolist() for n, _ in LENGTHS]
    return prompts, [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in LENGTHS]


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("spec-layouts") / "v3"), preset="v3", seed=3, mtp=True)


@pytest.fixture(scope="module")
def reference(mtp_path) -> list[list[int]]:
    with LLM(mtp_path, **ENGINE) as llm:
        return [o.token_ids for o in llm.generate(*_requests(), use_tqdm=False)]


@pytest.mark.parametrize("name", ["tp4-dp4-auto-dense1", "tp4-dp4-lowlatency-dense4-redundant", "tp2",
                                  "tp4-dp2-normal-dense2-dplmhead"])
def test_dp_attention_and_ep_with_speculation_match_single_process(mtp_path, reference, name):
    with LLM(mtp_path, **ENGINE, **LAYOUTS[name], speculative_algorithm="NEXTN", speculative_num_steps=2) as llm:
        assert [o.token_ids for o in llm.generate(*_requests(), use_tqdm=False)] == reference


def test_sampled_speculation_under_attention_tp_follows_the_leader(mtp_path):
    """Unseeded and seeded sampled requests under attention TP 2: the ranks keep to the leader's
    draws (different tokens on two ranks would split their batches and stall their collectives),
    every request gets its tokens, and a seed gives the same output twice."""
    prompts, _ = _requests()
    params = [SamplingParams(max_tokens=m, temperature=1.0, ignore_eos=True, seed=i if i % 2 else None)
              for i, (_, m) in enumerate(LENGTHS)]
    with LLM(mtp_path, **ENGINE, **LAYOUTS["tp2"], speculative_algorithm="NEXTN", speculative_num_steps=2) as llm:
        runs = [llm.generate(prompts, params, use_tqdm=False) for _ in range(2)]
    for run in runs:
        assert [len(o.token_ids) for o in run] == [m for _, m in LENGTHS]
    assert [o.token_ids for o in runs[0]][1::2] == [o.token_ids for o in runs[1]][1::2]


def test_the_shipped_model_under_dp_attention_and_ep_keeps_its_greedy_output():
    """The shipped chat model (trained MTP module, most drafts kept) at tp 4 / dp 4 with EP: the
    tokens of decoding it one token at a time in one process."""
    from moeserve.models.tiny_chat import embedded_model_path, held_out_prompts

    path = embedded_model_path()
    params = SamplingParams(max_tokens=10, temperature=0)
    with LLM(path, **ENGINE) as llm:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                   for p, _ in held_out_prompts(8, seed=3)]
        reference = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, **ENGINE, **LAYOUTS["tp4-dp4-auto-dense1"], speculative_algorithm="NEXTN") as llm:
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == reference
