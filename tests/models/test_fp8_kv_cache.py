"""The FP8 KV cache (``--kv-cache-dtype fp8_e4m3``) on the tiny DeepSeek checkpoints, fp32 compute.

Against transformers rounded the same way: each MLA layer's latent and rotated rope key go through
``quantize_kv_rows`` and back before transformers expands them, which is what the engine stores and
every one of its readers dequantizes (the new tokens of a prefill too). The two sides' fp32 latents
still differ in their last bits (other summation orders); a value within that distance of an e4m3
rounding boundary (one in ~10^5 here) rounds the other way on one side, moving one key element by an
e4m3 step (1/16 of it) and the logits by ~1e-4 relative, so greedy tokens agree unless two top logits
are that close: they are equal on these prompts, as in ``test_hf_parity``.

Against the unquantized cache FP8 is not exact (``test_agreement_with_the_unquantized_cache``
measures it; a loose bound only): the first layer's output moves by ~3% (relative norm, transformers
rounded as above against not), and these random-weight models amplify it, their routers picking
other experts for some tokens: 9% to 27% by the logits of two prompts, whose greedy continuations
part from the unquantized cache's after a few to a few tens of tokens. The prefix cache and PD transfer move the stored bytes, so with them the
tokens are those of the same FP8 engine without them, exactly.
"""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import build_engine_config
from moeserve.executor.model_runner import ModelRunner
from moeserve.kernels.fp8 import dequantize_kv_rows, quantize_kv_rows
from moeserve.models.tiny import make_tiny_model
from tests.disagg.pd_utils import ENGINE as PD_ENGINE
from tests.disagg.pd_utils import bootstrap_server, pd_scheduler, run_pair, settle
from tests.engine_utils import new_req, run_extend
from tests.hf_models import hf_greedy, load_hf_model

FP8 = {"kv_cache_dtype": "fp8_e4m3"}
ENGINE = {"dtype": "float32", "page_size": 4, "max_total_tokens": 1024}
PROMPT_LENS = [1, 7, 23, 41, 64]
NEW_TOKENS = 32


def _prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(2000 + seed)
    return [torch.randint(2, 320, (n,), generator=gen).tolist() for n in lens]


def _greedy(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS, cached: list | None = None) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), use_tqdm=False)
    if cached is not None:
        cached += [o.cached_tokens for o in outs]
    return [o.token_ids for o in outs]


def _round_like_the_cache(attention: torch.nn.Module) -> None:
    """Transformers' MLA expands the latent and rope key as the FP8 cache would hand them back."""
    expand = attention.expand_kv

    def expand_rounded(latent: torch.Tensor, rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        width = latent.shape[-1]  # [B, 1, S, L] and [B, 1, S, R]
        values, scales = quantize_kv_rows(latent.reshape(-1, width), rope.reshape(-1, rope.shape[-1]))
        rows = dequantize_kv_rows(values, scales, width, latent.dtype)
        return expand(rows[:, :width].view(latent.shape), rows[:, width:].view(rope.shape))

    attention.expand_kv = expand_rounded


def test_greedy_matches_transformers_with_the_cache_rounding(hf_model_path):
    """A mixed-length batch under continuous batching, chunked prefill and small pages."""
    path = hf_model_path("v3", 0)
    hf = load_hf_model(path)
    for layer in hf.model.layers:
        _round_like_the_cache(layer.self_attn)
    prompts = _prompts(PROMPT_LENS)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    with LLM(path, **ENGINE, **FP8, chunked_prefill_size=10, max_running_requests=3) as llm:
        assert llm.runner.kv_pool.buffer.dtype == torch.uint8
        assert _greedy(llm, prompts) == want


def test_agreement_with_the_unquantized_cache(hf_model_path):
    """Prefill logits of the FP8 cache against the fp32 cache's (measured 27% and 9% relative norm
    for these two prompts: a bound of 50% catches a cache read wrongly, ~100%), and how many greedy
    tokens agree (printed, not asserted)."""
    path = hf_model_path("v3", 0)
    runners = {kv: ModelRunner(build_engine_config(path, **ENGINE, kv_cache_dtype=kv)) for kv in ("auto", "fp8")}
    for ids in _prompts([9, 41]):
        exact, fp8 = (run_extend(r, new_req(r, ids), 0, len(ids)) for r in runners.values())
        error = ((fp8 - exact).norm() / exact.norm()).item()
        print(f"prompt of {len(ids)}: prefill logits relative error {error:.4f}")
        assert error < 0.5
    prompts = _prompts(PROMPT_LENS)
    with LLM(path, **ENGINE) as llm:
        exact = _greedy(llm, prompts)
    with LLM(path, **ENGINE, **FP8) as llm:
        fp8 = _greedy(llm, prompts)
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), NEW_TOKENS) for x, y in zip(exact, fp8)]
    print(f"greedy tokens equal to the fp32 cache's before parting, of {NEW_TOKENS}: {agree}")


def test_prefix_cache_hits_give_the_tokens_of_a_cold_cache(hf_model_path):
    """A shared system prompt, then two waves of questions: the second wave's prefixes come from the
    FP8 cache's stored bytes, and the tokens are those of the engine without a prefix cache."""
    path = hf_model_path("v3", 0)
    system = _prompts([42], seed=1)[0]
    waves = [[system + q for q in _prompts([5, 2], seed=2)], [system + q for q in _prompts([7, 1, 11], seed=3)]]
    with LLM(path, **ENGINE, **FP8, disable_radix_cache=True) as llm:
        want = [_greedy(llm, wave, 12) for wave in waves]
    cached = []
    with LLM(path, **ENGINE, **FP8) as llm:
        assert [_greedy(llm, wave, 12, cached) for wave in waves] == want
    assert cached[2:] == [40] * 3  # whole pages of 4 of the 42-token prompt


@pytest.fixture(scope="module")
def v32_path(tmp_path_factory) -> str:
    """A tiny V3.2 (index_topk 16): its index keys are cached in FP8 too."""
    return make_tiny_model(str(tmp_path_factory.mktemp("v32-fp8")), "v32", seed=0)


def test_pd_transfer_gives_the_monolithic_tokens(v32_path, tmp_path):
    """Prefill and decode schedulers in one process (fake data path), both with FP8 caches of
    DeepSeek-V3.2: the decode side attends over latents and selects by index keys that only the
    transfer of the FP8 rows and their scales can have put there."""
    prompts = _prompts([7, 30, 45], seed=4)  # two of them longer than index_topk
    with LLM(v32_path, **PD_ENGINE, **FP8) as llm:
        pool = llm.runner.kv_pool
        assert pool.layout.row_bytes == 56 + 32 + 4 and pool.index_scales(0) is not None
        want = _greedy(llm, prompts, 10)
    secret = str(tmp_path / "secret")
    with bootstrap_server(secret) as (port, _):
        prefill = pd_scheduler(v32_path, "prefill", "fake", port, secret, **FP8)
        decode = pd_scheduler(v32_path, "decode", "fake", port, secret, **FP8)
        try:
            reqs = run_pair(prefill, decode, prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                            port)
            settle(prefill, decode)
            assert [r.output_ids for r in reqs] == want
            assert prefill.pages.num_used == decode.pages.num_used == 0
        finally:
            prefill.role.close()
            decode.role.close()


def test_v32_index_keys_from_the_prefix_cache_select_as_computed_ones(v32_path):
    """DeepSeek-V3.2 with its index keys in FP8: prompts longer than index_topk, again with every
    prefix from the prefix cache, give the same tokens (and, printed, how many agree with fp32's)."""
    prompts = _prompts([30, 57], seed=5)
    cached = []
    with LLM(v32_path, **ENGINE, **FP8, chunked_prefill_size=8) as llm:
        cold = _greedy(llm, prompts, 12)
        assert _greedy(llm, prompts, 12, cached) == cold
    assert cached == [28, 56]
    with LLM(v32_path, **ENGINE) as llm:
        exact = _greedy(llm, prompts, 12)
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), 12) for x, y in zip(exact, cold)]
    print(f"V3.2: greedy tokens equal to the fp32 cache's before parting, of 12: {agree}")
