"""Every parallel layout gives the single-process engine's greedy tokens (gloo, real processes)."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams

# prompts of mixed lengths and outputs of mixed lengths: with data-parallel attention some DP
# groups get no request, and others finish early and then run idle batches for many steps
LENGTHS = [(12, 20), (30, 4), (7, 16), (19, 3), (40, 12), (5, 2)]

LAYOUTS = {
    "tp2": dict(tp_size=2),
    "tp2-dp2-auto": dict(tp_size=2, dp_size=2, enable_dp_attention=True, moe_a2a_backend="torch"),
    "tp2-normal-dplmhead": dict(tp_size=2, moe_a2a_backend="torch", deepep_mode="normal", enable_dp_lm_head=True),
    "tp2-lowlatency": dict(tp_size=2, moe_a2a_backend="torch", deepep_mode="low_latency",
                           max_dispatch_tokens_per_rank=8),
    "tp4-dp4-auto-dense1": dict(tp_size=4, dp_size=4, enable_dp_attention=True, moe_a2a_backend="torch",
                                moe_dense_tp_size=1),
    "tp4-dp2-normal-dense2-dplmhead": dict(tp_size=4, dp_size=2, enable_dp_attention=True, moe_a2a_backend="torch",
                                           deepep_mode="normal", moe_dense_tp_size=2, enable_dp_lm_head=True),
    "tp4-dp4-lowlatency-dense4-redundant": dict(tp_size=4, dp_size=4, enable_dp_attention=True,
                                                moe_a2a_backend="torch", deepep_mode="low_latency",
                                                moe_dense_tp_size=4, ep_num_redundant_experts=4),
    "tp4-auto-redundant-dplmhead": dict(tp_size=4, moe_a2a_backend="torch", ep_num_redundant_experts=4,
                                        enable_dp_lm_head=True),
}


def _requests():
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 320, (n,), generator=gen).tolist() for n, _ in LENGTHS]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in LENGTHS]
    return prompts, params


@pytest.fixture(scope="module")
def model_path(hf_model_path):
    return hf_model_path("v3", 0)


@pytest.fixture(scope="module")
def reference(model_path):
    prompts, params = _requests()
    llm = LLM(model_path, dtype="float32", page_size=4, max_total_tokens=1024, chunked_prefill_size=16)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(model_path, reference, name):
    prompts, params = _requests()
    with LLM(model_path, dtype="float32", page_size=4, max_total_tokens=1024, chunked_prefill_size=16,
             **LAYOUTS[name]) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference


def test_bad_layouts_are_refused(model_path):
    with pytest.raises(ValueError, match="dp_size"):
        LLM(model_path, tp_size=4, dp_size=3, enable_dp_attention=True)
    with pytest.raises(ValueError, match="moe_dense_tp_size"):
        LLM(model_path, tp_size=4, moe_dense_tp_size=3)
    with pytest.raises(ValueError, match="ep_size"):
        LLM(model_path, tp_size=2, ep_size=2)  # EP needs an all-to-all backend
    with pytest.raises(RuntimeError, match="physical experts"):
        LLM(model_path, tp_size=4, moe_a2a_backend="torch", ep_num_redundant_experts=1)
    with pytest.raises(RuntimeError, match="DeepEP"):
        LLM(model_path, tp_size=2, moe_a2a_backend="deepep")
