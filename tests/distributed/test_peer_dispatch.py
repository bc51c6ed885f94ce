"""The peer low-latency dispatcher (``distributed/peer_dispatch``).

One process playing every EP rank: the torch version on CPU, the Triton kernels through the
interpreter (CPU) and on a GPU at DeepSeek-V3's shapes, also replayed from a CUDA graph. Across
processes over torch symmetric memory: ``tests/distributed/peer_ranks.py`` (several GPUs, or
ranks sharing one GPU where the driver allows it).
"""

from __future__ import annotations

import pytest
import torch

from moeserve.config import build_engine_config
from moeserve.distributed.peer_dispatch import PeerLayout, PeerLowLatencyDispatcher, local_peer_memories
from moeserve.executor.model_runner import ModelRunner
from tests.distributed.layouts import greedy_tokens
from tests.distributed.peer_checks import (
    INTERPRETER_CHECKS,
    World,
    check_combine_timeout,
    check_dead_peer,
    check_rounds,
    run_round,
)
from tests.engine_utils import new_req, run_decode, run_extend
from tests.kernels.interpreter import interpreted

INTERPRETED = "tests.distributed.peer_checks:run_interpreted_checks"  # prefetched (tests/kernels/interpreter.py)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_rounds_give_each_token_its_experts_outputs(n: int, fp8: bool) -> None:
    check_rounds("cpu", n, torch.bfloat16, fp8)


def test_a_dead_peer_ends_the_wait_with_an_error() -> None:
    check_dead_peer("cpu", max_spins=1)


def test_a_combine_nobody_answers_ends_with_an_error() -> None:
    check_combine_timeout("cpu", max_spins=1)


def test_bad_calls_are_refused() -> None:
    world = World(2, 2, 4, 2, 128, torch.float32, False, "cpu")
    hidden, ids, weights = world.inputs([5], seed=0)[0]
    with pytest.raises(ValueError, match="max_dispatch_tokens_per_rank"):
        world.dispatchers[0].dispatch_a(hidden, ids, weights)
    hidden, ids, weights = world.inputs([2], seed=0)[0]
    with pytest.raises(ValueError, match="laid out for"):
        world.dispatchers[0].dispatch_a(hidden.half(), ids, weights)
    with pytest.raises(ValueError, match="4-byte"):
        PeerLayout.for_model(2, 2, 4, 2, 127, torch.bfloat16, False)
    layout = PeerLayout.for_model(2, 2, 4, 2, 128, torch.float32, False)
    with pytest.raises(ValueError, match="bytes"):
        PeerLowLatencyDispatcher(local_peer_memories(1, 64, "cpu")[0], layout, False, torch.float32)


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, object]:
    return interpreted(INTERPRETED)


@pytest.mark.parametrize("name", list(INTERPRETER_CHECKS))
def test_interpreted(interpreted_results: dict[str, object], name: str) -> None:
    assert interpreted_results[name] == "ok", interpreted_results[name]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_rounds_at_deepseek_shapes(n: int, fp8: bool) -> None:
    """EP ``n`` with DeepSeek-V3's 256 experts, hidden 7168, top-8, 128 tokens per rank."""
    check_rounds("cuda", n, torch.bfloat16, fp8, dim=7168, e_local=256 // n, top_k=8, cap=128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_dead_peer_and_combine_timeout() -> None:
    check_dead_peer("cuda", max_spins=1000)
    check_combine_timeout("cuda", max_spins=1000)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_round_replays_from_a_cuda_graph(fp8: bool) -> None:
    """Dispatch, experts and combine of every rank captured in one graph, replayed on new tokens
    and routing written in place: each replay gives the closed form, bit for bit."""
    world = World(4, 8, 64, 8, 7168, torch.bfloat16, fp8, "cuda")
    tokens = [64, 17, 0, 40]
    static = world.inputs(tokens, seed=0)
    run_round(world, [static])  # warm up (compiles the kernels)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        outs = _step(world, static)
    torch.cuda.current_stream().wait_stream(stream)
    for replay in range(3):
        fresh = world.inputs(tokens, seed=10 + replay)
        for buffers, new in zip(static, fresh):
            for b, x in zip(buffers, new):
                b.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        for x, out in zip(static, outs):
            assert torch.equal(out, world.expected_combine(*x))
    for m in world.memories:
        m.raise_if_failed()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_engine_with_peer_dispatch_gives_the_one_gpu_tokens(layout_model):
    """The engine on one GPU with low-latency dispatch as peer writes (an EP group of one, its
    decode steps in CUDA graphs) gives the same greedy tokens as without dispatch."""
    want = greedy_tokens(layout_model, device="cuda")
    assert greedy_tokens(layout_model, device="cuda", moe_a2a_backend="symm_mem", deepep_mode="low_latency",
                         max_dispatch_tokens_per_rank=8) == want


def _step(world: World, batch: list[tuple]) -> list[torch.Tensor]:
    """One round on every rank, without the host-side checks (so that a graph can capture it)."""
    sent = [d.dispatch_a(*x) for d, x in zip(world.dispatchers, batch)]
    recvs = [d.dispatch_b(p) for d, p in zip(world.dispatchers, sent)]
    back = [d.combine_a(world.experts(r, recv), h) for r, (d, (recv, h)) in enumerate(zip(world.dispatchers, recvs))]
    return [d.combine_b(p) for d, p in zip(world.dispatchers, back)]


def test_engine_fails_the_step_after_a_peer_wait_gave_up(layout_model):
    """A wait that gave up (its error bit set on the device) fails the engine's next step, read
    without a host sync of its own: the step after sets nothing, the one after that raises."""
    config = build_engine_config(layout_model, moe_a2a_backend="symm_mem", deepep_mode="low_latency",
                                 max_dispatch_tokens_per_rank=8, dtype="float32", page_size=4)
    runner = ModelRunner(config)
    req = new_req(runner, list(range(2, 14)))
    run_extend(runner, req, 0, 8)
    for _ in range(2):  # healthy decode steps
        req.prompt_ids = req.prompt_ids[:req.kv_len + 1]
        run_decode(runner, [req])
    runner.moe_options.peer_memory["memory"].error.fill_(2)  # as a combine that gave up would
    req.prompt_ids = list(range(2, 14))[:req.kv_len + 1]
    run_decode(runner, [req])  # the step that "failed": its copy of the word is read next step
    req.prompt_ids = list(range(2, 14))[:req.kv_len + 1]
    with pytest.raises(RuntimeError, match="EP rank 0: a peer never signalled during combine"):
        run_decode(runner, [req])
