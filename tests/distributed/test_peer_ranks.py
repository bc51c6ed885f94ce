"""The peer low-latency dispatcher across processes over torch symmetric memory, one rank per GPU
(torch's symmetric memory refuses ranks that share a device, so this needs several GPUs).

Every rank draws every rank's tokens from the same seeds, so it knows what it must receive (the
masked layout, row for row) and what combine must give (the toy experts' closed form, bit for
bit): eager rounds with both buffer sets, two micro-batches in flight at once, then one step
captured in a CUDA graph and replayed on new tokens.
"""

from __future__ import annotations

import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeserve.distributed.groups import Group, init_world
from moeserve.distributed.peer_dispatch import PeerLayout, PeerLowLatencyDispatcher, symmetric_peer_memory
from tests.distributed.peer_checks import World

WORLD = torch.cuda.device_count()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WORLD < 2, reason="needs at least 2 GPUs")]

E_LOCAL, TOP_K, DIM, CAP = 4, 4, 1024, 32


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_peer_dispatch_across_processes(fp8: bool, tmp_path) -> None:
    mp.start_processes(_rank_main, args=(WORLD, f"file://{tmp_path}/store", fp8), nprocs=WORLD, start_method="spawn",
                       daemon=True)


def _rank_main(rank: int, world: int, init_method: str, fp8: bool) -> None:
    try:
        init_world(init_method, rank, world, "cuda", local_rank=rank)
        _check(Group(dist.group.WORLD, rank, world, list(range(world))), fp8)
        torch.cuda.synchronize()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        os._exit(1)


def _check(ep: Group, fp8: bool) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    # the world's tokens, drawn alike on every rank; its local buffers are not used
    world = World(ep.size, E_LOCAL, CAP, TOP_K, DIM, torch.bfloat16, fp8, str(device))
    layout = PeerLayout.for_model(ep.size, E_LOCAL, CAP, TOP_K, DIM, torch.bfloat16, fp8)
    memory = symmetric_peer_memory(ep, layout.nbytes, device)
    dispatcher = PeerLowLatencyDispatcher(memory, layout, fp8, torch.bfloat16)
    tokens = [CAP, 0, 7, 19, 1, CAP, 12, 30][:ep.size]
    for round_ in range(4):
        batches = [world.inputs(tokens, seed=round_)]
        if round_ == 2:  # two micro-batches in flight at once
            batches.append(world.inputs(tokens[::-1], seed=50))
        sent = [dispatcher.dispatch_a(*b[ep.rank]) for b in batches]
        back = []
        for batch, pending in zip(batches, sent):
            recv, handle = dispatcher.dispatch_b(pending)
            world.check_layout(ep.rank, recv, batch)
            back.append(dispatcher.combine_a(world.experts(ep.rank, recv), handle))
        for batch, pending in zip(batches, back):
            out = dispatcher.combine_b(pending)
            assert torch.equal(out, world.expected_combine(*batch[ep.rank])), f"rank {ep.rank} round {round_}"
    _check_graph(ep, world, dispatcher, tokens)
    memory.raise_if_failed()


def _check_graph(ep: Group, world: World, dispatcher: PeerLowLatencyDispatcher, tokens: list[int]) -> None:
    static = world.inputs(tokens, seed=100)[ep.rank]

    def step() -> torch.Tensor:
        recv, handle = dispatcher.dispatch(*static)
        return dispatcher.combine(world.experts(ep.rank, recv), handle)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for replay in range(3):
        fresh = world.inputs(tokens, seed=200 + replay)
        for buffer, new in zip(static, fresh[ep.rank]):
            buffer.copy_(new)
        graph.replay()
        assert torch.equal(out, world.expected_combine(*fresh[ep.rank])), f"rank {ep.rank} replay {replay}"
