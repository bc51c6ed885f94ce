"""The prefix cache under data-parallel attention: each DP rank keeps its own tree (the ranks of an
attention-TP group keep identical ones), and greedy tokens equal the single-process engine's without
the cache."""

from __future__ import annotations

import re

import pytest
import torch

from moeserve import LLM, SamplingParams
from tests.distributed.layouts import ENGINE
from tests.distributed.test_layouts import LAYOUTS

GREEDY = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (9, 3, 14, 6)]


def _waves() -> list[list[list[int]]]:
    """A 42-token system prompt with two questions, then with four more (a DP group each, in turn)."""
    gen = torch.Generator().manual_seed(12)
    system = torch.randint(2, 320, (42,), generator=gen).tolist()
    ask = lambda n: system + torch.randint(2, 320, (n,), generator=gen).tolist()  # noqa: E731
    return [[ask(5), ask(2)], [ask(7), ask(1), ask(11), ask(4)]]


def _run(llm: LLM) -> tuple[list[list[int]], list[int]]:
    outs = [o for wave in _waves() for o in llm.generate(wave, GREEDY[:len(wave)], use_tqdm=False)]
    return [o.token_ids for o in outs], [o.cached_tokens for o in outs]


@pytest.fixture(scope="module")
def reference(layout_model):
    with LLM(layout_model, **ENGINE, disable_radix_cache=True) as llm:
        return _run(llm)


@pytest.mark.parametrize("name, skip_warmup", [("tp2-dp2-auto", False), ("tp4-dp2-normal-dense2-dplmhead", True)])
def test_dp_attention_with_the_prefix_cache_matches_single_process(layout_model, reference, capfd, name,
                                                                   skip_warmup):
    """Every rank warms its kernels up before it is ready (not with ``--skip-server-warmup``); the
    warm-up leaves the trees empty and the tokens as they were."""
    with LLM(layout_model, **ENGINE, **LAYOUTS[name], skip_server_warmup=skip_warmup) as llm:
        tokens, cached = _run(llm)
        world = llm.config.parallel.world_size
    assert tokens == reference[0] and reference[1] == [0] * 6
    assert cached == [0, 0] + [40] * 4  # the first wave filled both DP groups' trees: whole pages of 4
    warmups = re.findall(r"start-up: weights .* s, graphs .* s, warm-up (\w+)", capfd.readouterr().err)
    assert len(warmups) == world and all((w == "skipped") == skip_warmup for w in warmups), warmups
