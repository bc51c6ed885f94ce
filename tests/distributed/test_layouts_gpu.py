"""The parallel layouts over NCCL, one rank per GPU, give the one-GPU engine's greedy tokens.

The CPU twin (``test_layouts``) runs them over gloo. Here the ranks are real GPU processes, so
this covers what gloo cannot: NCCL device groups beside gloo host groups, all-to-alls of CUDA
tensors with uneven splits, tensors created on the right device. Worlds of 2 GPUs and of the
largest power of two visible (4 or 8); with more than the tiny model's 4 attention heads, the
attention-TP layouts add DP groups so that each attention-TP group splits the heads evenly.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.layouts import greedy_tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs"),
]

HEADS = 4  # attention heads of the tiny test model: attention TP splits them


def layouts(n: int) -> dict[str, dict]:
    """The layouts of a world of ``n`` ranks."""
    ep = {"moe_a2a_backend": "torch"}
    dpa = {"tp_size": n, "dp_size": n, "enable_dp_attention": True}  # DP attention, attention TP 1
    dp = max(1, n // HEADS)  # attention TP over the world, as far as the heads go
    wide = {"tp_size": n} if dp == 1 else {"tp_size": n, "dp_size": dp, "enable_dp_attention": True}
    w = f"tp{n}" if dp == 1 else f"tp{n}-dp{dp}"
    low_latency = {"deepep_mode": "low_latency", "max_dispatch_tokens_per_rank": 8}
    cases = {
        # no EP (every rank holds every expert), dense FFN TP over the world
        f"{w}-dense{n}": {**wide, "moe_dense_tp_size": n},
        # DP attention, dispatch mode chosen per step, dense TP 1, LM head vocab-parallel over the world
        f"tp{n}-dp{n}-auto-dense1": {**dpa, **ep},
        f"tp{n}-dp{n}-normal-dense{n}-dplmhead": {**dpa, **ep, "deepep_mode": "normal", "moe_dense_tp_size": n,
                                                  "enable_dp_lm_head": True},
        f"{w}-lowlatency": {**wide, **ep, **low_latency},
        f"tp{n}-dp{n}-lowlatency-redundant": {**dpa, **ep, **low_latency, "ep_num_redundant_experts": n},
        f"{w}-auto-redundant-dplmhead": {**wide, **ep, "ep_num_redundant_experts": n, "enable_dp_lm_head": True},
        # low-latency dispatch as peer writes over torch symmetric memory
        f"{w}-symm-lowlatency": {**wide, "moe_a2a_backend": "symm_mem", **low_latency},
        f"tp{n}-dp{n}-symm-auto": {**dpa, "moe_a2a_backend": "symm_mem"},
        # decode CUDA graphs on every rank, each step at the bucket the ranks agree on
        f"{w}-dense{n}-graphs": {**wide, "moe_dense_tp_size": n, "cuda_graph_multi_rank": True},
        f"tp{n}-dp{n}-symm-lowlatency-graphs": {**dpa, "moe_a2a_backend": "symm_mem", **low_latency,
                                                "cuda_graph_multi_rank": True},
        # two-batch overlap, every step split (the peer dispatcher's two buffer sets in turn)
        f"tp{n}-dp{n}-symm-auto-tbo": {**dpa, "moe_a2a_backend": "symm_mem", "enable_two_batch_overlap": True,
                                       "tbo_min_tokens": 2},
    }
    if n >= 4:  # attention TP and DP both above one
        cases[f"tp{n}-dp2-normal-dense2-dplmhead"] = {
            "tp_size": n, "dp_size": 2, "enable_dp_attention": True, **ep, "deepep_mode": "normal",
            "moe_dense_tp_size": 2, "enable_dp_lm_head": True}
    return cases


def worlds(num_gpus: int) -> list[int]:
    """2, and the largest of 4 and 8 that the GPUs hold (the whole grid of worlds takes too long)."""
    largest = max((n for n in (2, 4, 8) if n <= num_gpus), default=0)
    return sorted({2, largest}) if largest else []


CASES = [(n, name) for n in (2, 4, 8) for name in layouts(n)]


@pytest.fixture(scope="module")
def model_path(hf_model_path):
    return hf_model_path("v3", 0)


@pytest.fixture(scope="module")
def reference(model_path):
    # the engine on one GPU (cuda:0, in this process). The rank processes launch kernels one by
    # one, so the reference does too: the comparison is about the layout alone.
    return greedy_tokens(model_path, device="cuda", disable_cuda_graph=True)


@pytest.mark.parametrize(("world", "name"), CASES, ids=[name for _, name in CASES])
def test_layout_matches_one_gpu(model_path, reference, world, name):
    if world not in worlds(torch.cuda.device_count()):
        pytest.skip(f"world {world} is not run on {torch.cuda.device_count()} GPUs")
    assert greedy_tokens(model_path, device="cuda", **layouts(world)[name]) == reference
