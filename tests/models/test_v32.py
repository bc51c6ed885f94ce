"""DeepSeek-V3.2 (sparse attention) against transformers' ``DeepseekV32ForCausalLM`` on the same tiny
checkpoints: greedy, fp32, full forwards on the transformers side; the engine with chunked prefill,
cached decode and its prefix cache. The tiny configs keep ``index_topk`` far below the prompts so the
selection is active, and have >= 16 index heads (with few, ReLU makes exact zero-score ties that any
top-k breaks its own way)."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import ModelConfig
from moeserve.layers.indexer import Indexer
from moeserve.models.tiny import make_tiny_model
from tests.disagg.pd_utils import bootstrap_server, pd_scheduler, run_pair, settle
from tests.distributed.layouts import LENGTHS as LAYOUT_LENGTHS
from tests.distributed.layouts import greedy_tokens
from tests.distributed.layouts import requests as layout_requests
from tests.distributed.test_layouts import LAYOUTS
from tests.hf_models import load_hf_model
from tests.models.test_fp8_checkpoint import _dequantized_copy

# prompts shorter and longer than every config's index_topk, and some far longer
LENGTHS = (5, 30, 57)
NEW_TOKENS = 12

SHAPES = {
    "preset": dict(seed=0),  # index_topk 16, 16 index heads of 32
    # odd sizes everywhere: 3 heads, an index head wider than its rope part by 8, a top-k of 7
    "odd": dict(seed=5, hidden_size=96, num_attention_heads=3, q_lora_rank=40, kv_lora_rank=24,
                index_topk=7, index_n_heads=24, index_head_dim=24, initializer_range=0.05),
}


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=gen).tolist() for n in LENGTHS]


def _hf_full_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy by whole forwards (no cache on the reference side)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _greedy(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS, cached: list | None = None) -> list[list[int]]:
    """Greedy continuations; ``cached`` collects each prompt's tokens that came from the prefix cache."""
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    if cached is not None:
        cached += [out.cached_tokens for out in outs]
    return [out.token_ids for out in outs]


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory) -> tuple[str, list[list[int]], list[list[int]]]:
    """A tiny V3.2 checkpoint, its prompts and transformers' greedy continuations."""
    shape = dict(SHAPES[request.param])
    seed = shape.pop("seed")
    path = make_tiny_model(str(tmp_path_factory.mktemp(f"v32-{request.param}")), "v32", seed=seed, **shape)
    prompts = _prompts(seed)
    hf = load_hf_model(path)
    assert type(hf).__name__ == "DeepseekV32ForCausalLM"
    return path, prompts, [_hf_full_greedy(hf, p, NEW_TOKENS) for p in prompts]


def test_greedy_matches_transformers_with_chunked_prefill_and_cached_decode(checkpoint):
    path, prompts, want = checkpoint
    llm = LLM(path, dtype="float32", page_size=4, chunked_prefill_size=8, max_total_tokens=1024)
    assert _greedy(llm, prompts) == want
    # again: now every prompt's prefix comes from the prefix cache, index keys included
    cached = []
    assert _greedy(llm, prompts, cached=cached) == want
    assert cached[-1] >= LENGTHS[-1] - 4, cached


def test_the_selection_changes_the_output(checkpoint):
    """Without the indexer's selection (a top-k above every context) the long prompts continue
    otherwise: the test above could not pass with selection off."""
    path, prompts, want = checkpoint
    llm = LLM(path, dtype="float32", max_total_tokens=1024)
    topk = llm.config.model.index_topk
    for module in llm.runner.model.modules():
        if isinstance(module, Indexer):
            module.topk = 10_000
    got = _greedy(llm, prompts)
    # a token sampled where its context held no more than index_topk tokens saw the same attention
    same = topk - LENGTHS[0] + 1
    assert got[0][:same] == want[0][:same]
    assert got[-1] != want[-1]


def test_config_reads_the_indexer_and_sizes_the_cache_row(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"), "v32")
    cfg = ModelConfig.from_path(path)
    assert (cfg.model_type, cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == ("deepseek_v32", 16, 16, 32)
    assert cfg.cache_row_dim == cfg.kv_cache_dim + 32
    llm = LLM(path, dtype="float32", max_total_tokens=64)
    assert llm.runner.kv_pool.buffer.shape[-1] == cfg.cache_row_dim
    with pytest.raises(ValueError, match="index_head_dim"):
        make_tiny_model(str(tmp_path / "bad"), "v32", index_head_dim=8)


def test_a_released_format_fp8_checkpoint_matches_its_dequantized_twin(tmp_path):
    fp8_path = make_tiny_model(str(tmp_path / "fp8"), "v32", fp8=True, seed=2, hidden_size=160,
                               initializer_range=0.1)
    from safetensors.torch import load_file

    stored = load_file(f"{fp8_path}/model.safetensors")
    indexer = "model.layers.1.self_attn.indexer."
    assert stored[indexer + "wq_b.weight"].dtype == torch.float8_e4m3fn
    assert stored[indexer + "wk.weight_scale_inv"].dtype == torch.float32
    assert stored[indexer + "weights_proj.weight"].dtype == torch.bfloat16  # never quantized
    hf = load_hf_model(_dequantized_copy(fp8_path, str(tmp_path / "plain")))
    prompts = _prompts(2)[1:]
    want = [_hf_full_greedy(hf, p, 8) for p in prompts]
    llm = LLM(fp8_path, dtype="float32", page_size=4, max_total_tokens=512)
    assert _greedy(llm, prompts, 8) == want


# ---- every layout and feature against the single-process engine ---------------------------------------

@pytest.fixture(scope="module")
def layout_path(tmp_path_factory) -> str:
    """One V3.2 checkpoint with an MTP module (unused unless speculation is on)."""
    return make_tiny_model(str(tmp_path_factory.mktemp("v32-layouts")), "v32", seed=3, mtp=True)


@pytest.fixture(scope="module")
def layout_reference(layout_path) -> list[list[int]]:
    return greedy_tokens(layout_path)


SPARSE_LAYOUTS = {
    # data-parallel attention with EP (auto dispatch) and two-batch overlap on every step
    "tp2-dp2-auto-tbo": {**LAYOUTS["tp2-dp2-auto"], "enable_two_batch_overlap": True, "tbo_min_tokens": 2},
    # two attention-TP ranks per DP group: each runs the replicated indexer and selects alike
    "tp4-dp2-normal-dense2-dplmhead": LAYOUTS["tp4-dp2-normal-dense2-dplmhead"],
    # MTP drafts verified per draft position, each with its own selection
    "mtp": {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2},
    # decode through the graph buckets (run eagerly, as a CPU cannot capture): the indexer sized by
    # each step's context bucket (16, 64, ... for index_topk 16), buckets of two micro-batches
    "graphs-tbo": {"debug_eager_graphs": True, "enable_two_batch_overlap": True, "tbo_min_tokens": 2},
    # several ranks replaying the bucket they agreed, each with the context bucket of its own batch
    "tp2-dp2-lowlatency-graphs": {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True,
                                  "moe_a2a_backend": "torch", "deepep_mode": "low_latency",
                                  "max_dispatch_tokens_per_rank": 8, "debug_eager_graphs": True},
}


def test_requests_select(layout_path):
    """The layout requests run past index_topk, so the layouts below compare sparse attention."""
    topk = ModelConfig.from_path(layout_path).index_topk
    assert max(p + m for p, m in LAYOUT_LENGTHS) > 2 * topk


@pytest.mark.parametrize("name", list(SPARSE_LAYOUTS))
def test_layout_matches_single_process(layout_path, layout_reference, name):
    assert greedy_tokens(layout_path, **SPARSE_LAYOUTS[name]) == layout_reference


def test_pd_transfers_the_index_keys_with_the_latent(layout_path, tmp_path):
    """Prefill and decode schedulers in one process (fake data path): the decode side's sparse
    attention reads index keys that only the transfer can have put there."""
    prompts, params = layout_requests()
    secret = str(tmp_path / "secret")
    with bootstrap_server(secret) as (port, _):
        prefill = pd_scheduler(layout_path, "prefill", "fake", port, secret)
        decode = pd_scheduler(layout_path, "decode", "fake", port, secret)
        try:
            want = greedy_tokens(layout_path)
            for prompt, p, expected in zip(prompts, params, want):
                [req] = run_pair(prefill, decode, [prompt], p, port, first=len(prompt))
                assert req.output_ids == expected
            settle(prefill, decode)
            assert prefill.pages.num_used == decode.pages.num_used == 0
        finally:
            prefill.role.close()
            decode.role.close()


@pytest.mark.gpu
def test_on_the_gpu_greedy_matches_transformers(checkpoint):
    """The GPU path: the selection in torch on the device, then MLA decode's Triton kernel over
    each token's selected slots (sparse prefill and decode), fp32 for exact comparison."""
    path, prompts, want = checkpoint
    llm = LLM(path, dtype="float32", device="cuda", page_size=4, chunked_prefill_size=8, max_total_tokens=1024)
    assert _greedy(llm, prompts) == want
