"""The start-up warm-up: the shapes it runs for a GPU config reach every launch config and integer
specialization the kernels can pick over the server's whole range (checked against the kernels'
own config functions at every size), and its passes leave the engine as it was."""

from __future__ import annotations

import os

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import build_engine_config, engine_config_for
from moeserve.core import ForwardMode
from moeserve.distributed.groups import single as single_groups
from moeserve.executor.warmup import WarmupPass, plan_passes, run_passes, size_ladder
from moeserve.models.tiny import make_tiny_model
from moeserve.planner import preset_config
from moeserve.scheduler.event_loop import EngineLoop, use_triton_cache, warm_up_rank
from moeserve.server.cli import build_parser, engine_settings

EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE
GPU_PAGES = 100_000  # a GPU's KV cache, in 64-slot pages: room for every pass


def _gpu(preset: str = "dsv3", **settings: object):
    return engine_config_for(preset_config(preset, num_layers=4), device="cuda", **settings)


def _tokens(passes: list[WarmupPass], mode: ForwardMode = EXTEND, prefix: int = 0) -> list[int]:
    """The token counts of the one-sequence passes of ``mode`` after ``prefix`` cached tokens."""
    return [p.lengths[0] for p in passes if p.mode is mode and p.prefixes == (prefix,)]


def _int_class(x: int) -> str:
    """How Triton specializes an integer argument: 1, a multiple of 16, or neither."""
    return "one" if x == 1 else "d16" if x % 16 == 0 else "any"


def test_the_ladder_has_both_ends_and_every_residue_of_each_octave():
    sizes = size_ladder(8192)
    assert sizes[:4] == [1, 2, 3, 4] and sizes[-1] == 8192 and len(sizes) < 50
    for lo in (2**i for i in range(3, 13)):
        octave = [s for s in sizes if lo < s <= 2 * lo]
        assert {lo + 1, 2 * lo} <= set(octave) and {s % 2 for s in octave} == {0, 1}
        if lo >= 16:
            assert {_int_class(s) for s in octave} == {"d16", "any"}
    assert size_ladder(1) == [1] and size_ladder(100)[-2:] == [99, 100]


def test_a_gpu_plan_reaches_every_launch_config_the_kernels_pick():
    """DeepSeek-V3 on one GPU, FP8: over every prefill size up to the chunk, the FP8 GEMMs' configs
    (each linear layer's shape), the grouped GEMM's by rows per expert and the integer classes of
    ``T``, ``T * top_k`` and its 16-row blocks (the expert-order kernel's arguments) are those the
    plan's sizes give; without decode graphs, the MLA decode kernel's split counts over every batch
    size up to the running cap too (Hopper's 128 heads, and 16 heads a rank of TP 8)."""
    triton = pytest.importorskip("triton")
    from moeserve.kernels.fp8 import FP8_DTYPE
    from moeserve.kernels.triton import gemm, mla

    config = _gpu(quantization="fp8", chunked_prefill_size=8192, max_running_requests=256)
    passes = plan_passes(config, "cuda", 1, None, GPU_PAGES)
    cfg, budget = config.model, 8192
    linears = [(cfg.q_lora_rank, cfg.hidden_size), (cfg.num_heads * cfg.qk_head_dim, cfg.q_lora_rank),
               (cfg.kv_cache_dim, cfg.hidden_size), (cfg.hidden_size, cfg.num_heads * cfg.v_head_dim),
               (2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]

    def dense(n: int, k: int):  # the FP8 GEMM's launch config for this layer's rows
        return lambda t: tuple(sorted(gemm.dense_config(t, n, k, FP8_DTYPE).items()))

    def expert_order(t: int) -> tuple:  # its arguments: the routed rows and their 16-row blocks
        routed = t * cfg.num_experts_per_tok
        return _int_class(t), _int_class(routed), _int_class(-(-routed // 16))

    def grouped(t: int) -> int:
        return gemm.contiguous_config(t * cfg.num_experts_per_tok, cfg.n_routed_experts, 0, 0, FP8_DTYPE)["BLOCK_M"]

    sizes = _tokens(passes)
    for key in (*(dense(n, k) for n, k in linears), expert_order, grouped):
        assert {key(t) for t in sizes} == {key(t) for t in range(1, budget + 1)}

    def split_key(b: int, heads: int, hopper: bool) -> tuple:
        splits = mla.decode_config(b, heads, 1152, torch.device("cpu"), 64, hopper)["num_kv_splits"]
        return splits == 1, triton.next_power_of_2(splits), _int_class(splits)

    sizes = [len(p.lengths) for p in passes if p.mode is DECODE]
    assert sizes == size_ladder(256)
    for heads, hopper in ((128, True), (16, True), (16, False)):
        assert ({split_key(b, heads, hopper) for b in sizes}
                == {split_key(b, heads, hopper) for b in range(1, 257)}), (heads, hopper)


def test_a_gpu_plan_follows_the_servers_role_graphs_and_layout():
    config = _gpu(chunked_prefill_size=4096, max_running_requests=128)
    passes = plan_passes(config, "cuda", 1, 64, GPU_PAGES)
    assert max(_tokens(passes)) == 4096 and _tokens(passes, prefix=64) == [64]  # a chunk after a cached one
    assert sorted(len(p.lengths) for p in passes if p.mode is EXTEND and len(p.lengths) > 1) == [3, 16]
    decode = [len(p.lengths) for p in passes if p.mode is DECODE]
    assert decode == [b for b in size_ladder(128) if b > 64]  # the graphs hold up to 64
    unchunked = _gpu(chunked_prefill_size=0, max_prefill_tokens=2048)
    assert max(_tokens(plan_passes(unchunked, "cuda", 1, None, GPU_PAGES))) == 2048

    prefill = plan_passes(_gpu(disaggregation_mode="prefill"), "cuda", 1, None, GPU_PAGES)
    decode_server = plan_passes(_gpu(disaggregation_mode="decode"), "cuda", 1, None, GPU_PAGES)
    assert all(p.mode is EXTEND for p in prefill) and len(prefill) > 40
    assert [p for p in decode_server if p.mode is EXTEND] == [WarmupPass(EXTEND, (4,), (0,))]

    two = plan_passes(config, "cuda", 2, 64, GPU_PAGES)
    assert two[0::2] == passes and [p.group for p in two[1::2]] == [i % 2 for i in range(len(passes))]
    small = plan_passes(config, "cuda", 1, 64, capacity_pages=8)  # 512 slots
    assert small and all(sum(-(-s // 64) for s in p.slots(0)) <= 8 for p in small)

    sparse = plan_passes(_gpu("dsv32", chunked_prefill_size=8192), "cuda", 1, None, GPU_PAGES)
    assert _tokens(sparse, prefix=2048) == size_ladder(8192)  # the indexer past its top-k
    widths = {max(q + 1 for q in p.prefixes) for p in sparse if p.mode is DECODE}
    assert widths == {16, 2064, 2065}  # dense, and the indexer at a width of a multiple of 16 and not

    # with 3 drafts: a verify step of 4 tokens, and room for the draft steps after the new tokens
    assert WarmupPass(DECODE, (1, 1), (15, 15)).slots(3) == [22, 22]
    assert WarmupPass(EXTEND, (5,), (64,)).slots(3) == [72]
    assert plan_passes(config, "cpu", 2, None, GPU_PAGES) == [WarmupPass(EXTEND, (4,), (0,)),
                                                              WarmupPass(DECODE, (1,), (4,))]


SETTINGS = {"dtype": "float32", "page_size": 4, "max_total_tokens": 1024, "chunked_prefill_size": 8,
            "max_running_requests": 4, "expert_distribution_recorder_mode": "per_pass"}


def _outputs(llm: LLM) -> list[list[int]]:
    """A greedy request, a seeded and an unseeded sampled one (the default generator seeded first)."""
    prompts = [[5, 17, 42, 7, 99, 3], [11, 12, 13], [250, 8, 31, 64, 2]]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)]
    torch.manual_seed(5)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("speculative", [False, True])
def test_warm_up_leaves_the_engine_as_it_was(hf_model_path, tmp_path, speculative):
    """A GPU's whole plan run on the CPU (every kind of pass, small limits; with MTP drafts, verify
    steps and draft passes), with the expert recorder on: no page in use or cached, nothing
    recorded, no EPLB pass counted, and a greedy, a seeded and an unseeded request then give what an
    engine without the warm-up gives."""
    settings = dict(SETTINGS)
    if speculative:
        path = make_tiny_model(str(tmp_path / "mtp"), preset="v3", seed=3, mtp=True)
        settings.update(speculative_algorithm="NEXTN", speculative_num_steps=2)
    else:
        path = hf_model_path("v3", 0)
    warm, cold = LLM(path, **settings), LLM(path, **settings)
    for llm in (warm, cold):
        llm.start_expert_distribution_record()
    sched, runner = warm.scheduler, warm.runner
    passes = plan_passes(sched.config, "cuda", 1, None, runner.num_pages - 1)
    assert len(passes) > 12
    run_passes(runner, sched.collectives, passes)
    assert sched.pages.num_used == 0 and sched.pages.num_cached == 0 and not sched.has_work
    recorder = runner.eplb.recorder
    assert recorder.recording and recorder.passes == [] and runner.eplb.passes == 0
    assert _outputs(warm) == _outputs(cold)
    assert len(recorder.passes) == len(cold.runner.eplb.recorder.passes) > 0  # recording goes on as before


def test_a_rank_warms_up_unless_told_not_to(hf_model_path):
    """The rank's start-up phases: weights and graphs, then the warm-up, which
    ``--skip-server-warmup`` leaves out."""
    path = hf_model_path("v3", 0)
    for skip in (False, True):
        config = build_engine_config(path, dtype="float32", page_size=4, max_total_tokens=512,
                                     skip_server_warmup=skip)
        phases = warm_up_rank(EngineLoop(config, single_groups(), addrs=None))
        assert set(phases) == {"weights", "graphs"} | (set() if skip else {"warmup"})


def test_the_warm_up_flags_reach_the_engine_config(hf_model_path, tmp_path, monkeypatch):
    path = hf_model_path("v3", 0)
    args = build_parser().parse_args(["serve", "--model-path", path, "--skip-server-warmup",
                                      "--triton-cache-dir", str(tmp_path / "triton")])
    runner = build_engine_config(path, **engine_settings(args)).runner
    assert runner.skip_server_warmup and runner.triton_cache_dir == str(tmp_path / "triton")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    use_triton_cache(runner)
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    default = build_engine_config(path, **engine_settings(build_parser().parse_args(["serve", "--model-path", path])))
    assert not default.runner.skip_server_warmup and default.runner.triton_cache_dir is None
