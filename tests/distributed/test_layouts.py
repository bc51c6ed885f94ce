"""Every parallel layout gives the single-process engine's greedy tokens (gloo, real processes)."""

from __future__ import annotations

import re

import pytest

from moeserve import LLM
from tests.distributed.layouts import greedy_tokens

LAYOUTS = {
    "tp2": {"tp_size": 2},
    "tp2-dp2-auto": {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "moe_a2a_backend": "torch"},
    "tp2-normal-dplmhead": {"tp_size": 2, "moe_a2a_backend": "torch", "deepep_mode": "normal",
                            "enable_dp_lm_head": True},
    "tp2-lowlatency": {"tp_size": 2, "moe_a2a_backend": "torch", "deepep_mode": "low_latency",
                       "max_dispatch_tokens_per_rank": 8},
    "tp4-dp4-auto-dense1": {"tp_size": 4, "dp_size": 4, "enable_dp_attention": True, "moe_a2a_backend": "torch",
                            "moe_dense_tp_size": 1},
    "tp4-dp2-normal-dense2-dplmhead": {"tp_size": 4, "dp_size": 2, "enable_dp_attention": True,
                                       "moe_a2a_backend": "torch", "deepep_mode": "normal", "moe_dense_tp_size": 2,
                                       "enable_dp_lm_head": True},
    "tp4-dp4-lowlatency-dense4-redundant": {"tp_size": 4, "dp_size": 4, "enable_dp_attention": True,
                                            "moe_a2a_backend": "torch", "deepep_mode": "low_latency",
                                            "moe_dense_tp_size": 4, "ep_num_redundant_experts": 4},
    # one rank: low-latency dispatch as peer writes into its own buffers (the torch version on CPU)
    "tp1-symm-lowlatency": {"moe_a2a_backend": "symm_mem", "deepep_mode": "low_latency",
                            "max_dispatch_tokens_per_rank": 8},
    "tp4-auto-redundant-dplmhead": {"tp_size": 4, "moe_a2a_backend": "torch", "ep_num_redundant_experts": 4,
                                    "enable_dp_lm_head": True},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(layout_model, layout_reference, name):
    assert greedy_tokens(layout_model, **LAYOUTS[name]) == layout_reference


def test_bad_layouts_are_refused(layout_model):
    with pytest.raises(ValueError, match="dp_size"):
        LLM(layout_model, tp_size=4, dp_size=3, enable_dp_attention=True)
    with pytest.raises(ValueError, match="moe_dense_tp_size"):
        LLM(layout_model, tp_size=4, moe_dense_tp_size=3)
    with pytest.raises(ValueError, match="ep_size"):
        LLM(layout_model, tp_size=2, ep_size=2)  # EP needs an all-to-all backend
    with pytest.raises(RuntimeError, match="physical experts"):
        LLM(layout_model, tp_size=4, moe_a2a_backend="torch", ep_num_redundant_experts=1)
    with pytest.raises(RuntimeError, match="symm_mem needs CUDA"):
        LLM(layout_model, tp_size=2, moe_a2a_backend="symm_mem")
    with pytest.raises(RuntimeError, match="DeepEP"):
        LLM(layout_model, tp_size=2, moe_a2a_backend="deepep")


def test_fp8_experts_over_ep_give_the_single_process_fp8_tokens(layout_model):
    """With FP8 weights the EP dispatchers send FP8 tokens with their scales (both modes under
    ``auto``: normal for prefill, low-latency for decode); greedy tokens stay the single-process
    engine's with the same FP8 weights."""
    want = greedy_tokens(layout_model, quantization="fp8")
    assert greedy_tokens(layout_model, quantization="fp8", **LAYOUTS["tp2-dp2-auto"]) == want


@pytest.mark.parametrize("name", ["tp2", "tp2-dp2-lowlatency"])
def test_decode_graph_buckets_agreed_by_every_rank(layout_model, layout_reference, capfd, name):
    """Decode graphs with several ranks, their buckets run eagerly (``debug_eager_graphs``, as CPU
    cannot capture): each decode step every rank pads to the bucket the agreement picked (idle DP
    groups with padding only) and runs it with every DP group at that size. Tokens stay the
    single-process engine's, and every rank ran buckets."""
    layouts = {**LAYOUTS, "tp2-dp2-lowlatency": {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True,
                                                 "moe_a2a_backend": "torch", "deepep_mode": "low_latency",
                                                 "max_dispatch_tokens_per_rank": 8}}
    assert greedy_tokens(layout_model, debug_eager_graphs=True, **layouts[name]) == layout_reference
    replays = [int(n) for n in re.findall(r"decode CUDA graphs replayed (\d+) times", capfd.readouterr().err)]
    assert len(replays) == 2 and min(replays) > 0, replays
