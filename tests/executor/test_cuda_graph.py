"""Decode through captured CUDA graphs gives what launching the kernels one by one gives."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.config import RunnerConfig, build_engine_config
from moeserve.executor.cuda_graph import context_buckets
from moeserve.executor.model_runner import ModelRunner
from moeserve.models.tiny import make_tiny_model
from tests.engine_utils import new_req, pool_of, run_decode, run_extend


def test_graph_buckets_cover_every_batch_size():
    sizes = RunnerConfig(cuda_graph_max_bs=60).graph_batch_sizes(max_running_requests=256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 60
    assert all(any(b >= n for b in sizes) for n in range(1, 61))
    assert RunnerConfig().graph_batch_sizes(max_running_requests=5) == [1, 2, 4, 5]


def test_a_sparse_models_context_buckets_reach_its_context_length():
    assert context_buckets(None, 163840) == [None]  # dense MLA: any length from device tensors
    assert context_buckets(2048, 163840) == [2048, 8192, 32768, 163840]  # not 131072 and then 163840
    assert context_buckets(2048, 4104) == [2048, 4104]
    assert context_buckets(2048, 1000) == [2048]
    assert context_buckets(16, 512) == [16, 64, 256, 512]


def _runner(path: str, graphs: bool) -> ModelRunner:
    return ModelRunner(build_engine_config(path, device="cuda", dtype="bfloat16", page_size=16,
                                           max_total_tokens=8192, max_running_requests=24,
                                           disable_cuda_graph=not graphs))


@pytest.mark.gpu
def test_graph_replay_matches_eager_decode(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"), preset="v3", seed=0, initializer_range=0.1)
    graphed, eager = _runner(path, True), _runner(path, False)
    assert graphed.graph_runner is not None and eager.graph_runner is None
    gen = torch.Generator().manual_seed(0)
    for batch_size in (1, 3, 8, 13, 24):  # exact buckets and padded ones
        lens = torch.randint(1, 300, (batch_size,), generator=gen).tolist()
        prompts = [torch.randint(2, 250, (n,), generator=gen).tolist() for n in lens]
        results = []
        for runner in (graphed, eager):
            reqs = [new_req(runner, ids + [7, 9], rid=str(i)) for i, ids in enumerate(prompts)]
            for r in reqs:
                run_extend(runner, r, 0, len(r.prompt_ids) - 2)
                r.prompt_ids = r.prompt_ids[:-1]  # decode the next two tokens one at a time
            first = run_decode(runner, reqs)
            for r in reqs:
                r.prompt_ids = r.prompt_ids + [9]
            results.append((first, run_decode(runner, reqs)))
            for r in reqs:
                pool_of(runner).free(r.page_table)
        for got, ref in zip(results[0], results[1]):
            torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
            assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["v3", "v32"])
def test_greedy_tokens_with_and_without_graphs(tmp_path, preset):
    """V3.2: prompts past index_topk (16), so the captured graphs of several context buckets select."""
    path = make_tiny_model(str(tmp_path / "m"), preset=preset, seed=1, initializer_range=0.1)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 250, (int(n),), generator=gen).tolist() for n in torch.randint(1, 90, (9,), generator=gen)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = []
    for disable in (False, True):
        with LLM(path, device="cuda", dtype="float32", disable_cuda_graph=disable, max_total_tokens=4096) as llm:
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [True, False])
def test_greedy_tokens_with_and_without_two_batch_overlap(tmp_path, graphs):
    """Decode buckets captured as two micro-batches (or eager steps split in two) give the tokens of
    whole batches: each half sizes its kernels' launches as the whole batch."""
    path = make_tiny_model(str(tmp_path / "m"), preset="v3", seed=2, initializer_range=0.1)
    gen = torch.Generator().manual_seed(2)
    lens = torch.randint(1, 300, (13,), generator=gen)
    prompts = [torch.randint(2, 250, (int(n),), generator=gen).tolist() for n in lens]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = []
    for tbo in (True, False):
        with LLM(path, device="cuda", dtype="bfloat16", disable_cuda_graph=not graphs, max_total_tokens=8192,
                 enable_two_batch_overlap=tbo, tbo_min_tokens=2) as llm:
            graph_runner = llm.runner.graph_runner
            if graphs:
                assert graph_runner.overlapped(8) == tbo and not graph_runner.overlapped(1)
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1]
