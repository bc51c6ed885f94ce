"""What the layout tests share: the requests, the engine settings and one greedy run of them."""

from __future__ import annotations

import torch

from moeserve import LLM, SamplingParams

# prompts of mixed lengths and outputs of mixed lengths: with data-parallel attention some DP
# groups get no request, and others finish early and then run idle batches for many steps
LENGTHS = [(12, 20), (30, 4), (7, 16), (19, 3), (40, 12), (5, 2)]

# fp32 (not the checkpoint's bf16): the layouts sum partial results in different orders, and
# fp32 keeps those rounding differences far below the gaps between the top logits
ENGINE = {"dtype": "float32", "page_size": 4, "max_total_tokens": 1024, "chunked_prefill_size": 16}


def requests() -> tuple[list[list[int]], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 320, (n,), generator=gen).tolist() for n, _ in LENGTHS]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in LENGTHS]
    return prompts, params


def greedy_tokens(model_path: str, **settings: object) -> list[list[int]]:
    """The output tokens of ``requests()`` from an engine with ``ENGINE`` and ``settings``."""
    prompts, params = requests()
    with LLM(model_path, **ENGINE, **settings) as llm:
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
