"""Absorbed MLA (decode over the latent cache) against expanded MLA at the same positions."""

from __future__ import annotations

import pytest
import torch

from moeserve.config import build_engine_config
from moeserve.executor.model_runner import ModelRunner
from tests.engine_utils import new_req, pool_of, run_decode, run_extend

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
            pool_of(runner).free(fresh.page_table)


def test_batches_keep_the_page_promise_the_decode_kernels_rely_on(hf_model_path):
    """``ForwardBatch.page_size`` tells the decode kernels that token ``t`` of a sequence sits at
    ``page * page_size + t % page_size``, so that a block of tokens inside one page is one run of
    consecutive cache rows; check that the batches the runner builds keep that promise."""
    from moeserve.core import ForwardMode, ScheduleBatch, ScheduledSeq

    runner = ModelRunner(build_engine_config(hf_model_path("v3", 0), dtype="float32", page_size=4,
                                             max_total_tokens=512))
    page = runner.page_size
    spacer = new_req(runner, list(range(2, 7)), "spacer")  # later requests start mid-pool
    reqs = [new_req(runner, list(range(2, 2 + n)), f"r{n}") for n in (1, 4, 9, 14)]
    pool_of(runner).free(spacer.page_table)
    for req in reqs:
        req.kv_len = len(req.prompt_ids) - 1
    batch = runner.build_batch(ScheduleBatch(ForwardMode.DECODE,
                                             [ScheduledSeq(r, r.seq_len - 1, r.seq_len) for r in reqs]))
    assert batch.page_size == page
    indptr, indices = batch.kv_indptr.tolist(), batch.kv_indices.tolist()
    for b, req in enumerate(reqs):
        slots = indices[indptr[b]:indptr[b + 1]]
        assert len(slots) == req.seq_len
        assert slots == [req.page_table[t // page] * page + t % page for t in range(req.seq_len)]
        assert all(slots[t] % page == 0 for t in range(0, req.seq_len, page))
