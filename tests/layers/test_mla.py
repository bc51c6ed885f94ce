"""Absorbed MLA (decode over the latent cache) against expanded MLA at the same positions."""

from __future__ import annotations

import pytest
import torch

from moeserve.config import build_engine_config
from moeserve.executor.model_runner import ModelRunner
from tests.engine_utils import new_req, run_decode, run_extend

PROMPT_LENS = (9, 16, 3)
DECODE_STEPS = 6


@pytest.mark.parametrize("variant", ["v3", "v2-lite"])
def test_absorbed_decode_equals_expanded_recompute(hf_model_path, variant):
    runner = ModelRunner(build_engine_config(hf_model_path(variant, 0), dtype="float32", page_size=4,
                                             max_total_tokens=512))
    gen = torch.Generator().manual_seed(7)
    fulls = [torch.randint(2, 320, (n + DECODE_STEPS,), generator=gen).tolist() for n in PROMPT_LENS]
    reqs = []
    for i, (full, n) in enumerate(zip(fulls, PROMPT_LENS)):
        req = new_req(runner, full, f"d{i}")  # pages for every token it will hold
        req.prompt_ids = full[:n]
        run_extend(runner, req, 0, n, all_logits=False)
        reqs.append(req)
    for step in range(DECODE_STEPS):
        for req, full, n in zip(reqs, fulls, PROMPT_LENS):
            req.output_ids = full[n:n + step + 1]
        absorbed = run_decode(runner, reqs)  # [B, V], each at position n + step
        for row, (full, n) in enumerate(zip(fulls, PROMPT_LENS)):
            fresh = new_req(runner, full[:n + step + 1], f"x{step}-{row}")
            expanded = run_extend(runner, fresh, 0, n + step + 1)[-1]
            torch.testing.assert_close(absorbed[row], expanded, rtol=1e-5, atol=1e-5)
            runner.page_pool.free(fresh.page_table)
