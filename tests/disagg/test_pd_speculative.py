"""Speculative decoding across a PD pair (one prefill and one decode scheduler in one process): the
prefill side runs the MTP module over the prompt and sends its draft chain in the aux record, the
decode side verifies and drafts on. Greedy tokens equal one monolithic engine's without
speculation, every page, slot and draft comes back, and a pair that disagrees is refused."""

from __future__ import annotations

import time

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.models.tiny import make_tiny_model
from moeserve.models.tiny_chat import embedded_model_path, held_out_prompts
from moeserve.models.tokenizer import load_tokenizer
from tests.disagg.pd_utils import ENGINE, add_pair, bootstrap_server, pd_scheduler, run_pair, settle

PROMPTS_LENS = [7, 30, 45, 3, 16]


def _prompts(lens, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("pdmtp") / "v3"), preset="v3", seed=3, mtp=True)


def _case(name: str, mtp_path: str) -> tuple[str, list[list[int]], list[SamplingParams]]:
    """A model, prompts and their settings: the random tiny V3 (random drafts, rarely kept) or the
    shipped chat model (trained MTP module, most drafts kept)."""
    if name == "random":
        params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (12, 1, 9, 20, 2)]
        return mtp_path, _prompts(PROMPTS_LENS), params
    path = embedded_model_path()
    tokenizer = load_tokenizer(path)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p, _ in held_out_prompts(4, seed=2)]
    return path, prompts, [SamplingParams(max_tokens=m, temperature=0) for m in (14, 3, 20, 9)]


def _pair(mtp_path, tmp_path, prefill_settings, decode_settings):
    secret = str(tmp_path / "secret")
    server = bootstrap_server(secret)
    port, _ = server.__enter__()
    prefill = pd_scheduler(mtp_path, "prefill", "fake", port, secret, **prefill_settings)
    decode = pd_scheduler(mtp_path, "decode", "fake", port, secret, **decode_settings)
    return server, prefill, decode, port


def _close(server, *scheds):
    for s in scheds:
        s.role.close()
    server.__exit__(None, None, None)


@pytest.mark.parametrize(("model", "steps"), [("random", 1), ("random", 3), ("shipped", 2)])
def test_pd_speculative_greedy_tokens_equal_monolithic_decoding(mtp_path, tmp_path, model, steps):
    path, prompts, params = _case(model, mtp_path)
    with LLM(path, **ENGINE) as llm:  # one token at a time
        tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    spec = {"speculative_algorithm": "NEXTN", "speculative_num_steps": steps}
    with LLM(path, **ENGINE, **spec) as llm:  # request by request, as the pair runs them below
        for prompt, p in zip(prompts, params):
            llm.generate([prompt], p, use_tqdm=False)
        mono = llm.scheduler.spec
    server, prefill, decode, port = _pair(path, tmp_path, spec, spec)
    try:
        reqs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):  # the longer prompts take several chunks
            reqs += run_pair(prefill, decode, [prompt], p, port, first=i)
        settle(prefill, decode)
        assert [r.output_ids for r in reqs] == tokens
        # the monolithic engine's drafts, request by request: the chain in the aux record and the
        # MTP layer's KV of the prompt arrived intact
        assert (decode.spec.verified, decode.spec.emitted) == (mono.verified, mono.emitted)
        if model == "shipped":
            assert decode.spec.accept_length > 1.5
        assert prefill.spec.verified == 0  # the prefill side drafts, it never verifies
        for sched in (prefill, decode):
            assert sched.pages.num_used == 0 and sched.num_requests == 0 and sched.role.num_pending == 0
            assert not sched.spec.drafts and not sched.spec.draft_probs
        assert prefill.role.aux.num_free == decode.role.aux.num_free == 4 * 256
        assert prefill.runner.kv_pool.buffer.shape[0] == prefill.config.model.num_layers + 1  # MTP's KV travels
    finally:
        _close(server, prefill, decode)


def test_pd_speculative_sampling_and_aborts_release_everything(mtp_path, tmp_path):
    """Seeded sampled requests (drafts from a point mass on the decode side), one aborted mid-decode."""
    spec = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2}
    server, prefill, decode, port = _pair(mtp_path, tmp_path, spec, spec)
    try:
        params = SamplingParams(max_tokens=16, temperature=1.0, top_k=8, seed=4, ignore_eos=True)
        reqs = run_pair(prefill, decode, _prompts([9, 21]), params, port)
        assert all(len(r.output_ids) == 16 for r in reqs)
        again = run_pair(prefill, decode, _prompts([9]), params, port, first=5)
        assert again[0].output_ids == reqs[0].output_ids  # the seed fixes the output
        long = SamplingParams(max_tokens=200, temperature=0.7, seed=1, ignore_eos=True)
        [req] = add_pair(prefill, decode, _prompts([12]), long, port, first=9)
        deadline = time.monotonic() + 60
        while len(req.output_ids) < 5:
            prefill.step()
            decode.step()
            assert time.monotonic() < deadline
        assert decode.spec.drafts
        decode.abort(req.rid)
        settle(prefill, decode)
        for sched in (prefill, decode):
            assert sched.pages.num_used == 0 and sched.num_requests == 0 and not sched.spec.drafts
    finally:
        _close(server, prefill, decode)


def test_a_pair_that_disagrees_on_speculation_is_refused(mtp_path, tmp_path):
    server, prefill, decode, port = _pair(mtp_path, tmp_path, {"speculative_algorithm": "NEXTN"}, {})
    try:
        reqs = run_pair(prefill, decode, _prompts([6]), SamplingParams(max_tokens=4, temperature=0), port)
        assert reqs[0].finish_reason.value == "error"
        assert "num_layers" in reqs[0].finish_message and "num_drafts" in reqs[0].finish_message
        assert prefill.abort("p0") is not None  # the router cancels the other leg when one fails
        settle(prefill, decode)
        assert prefill.pages.num_used == decode.pages.num_used == 0
    finally:
        _close(server, prefill, decode)
