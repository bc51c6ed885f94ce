"""Low-latency dispatch -> experts -> combine captured in one CUDA graph over NCCL, then replayed
on new tokens and routing: each replay equals the same step run eagerly, bit for bit, and the
closed form of the toy experts.

The toy experts multiply each row by its global expert id + 1, so token ``t`` comes back as
``hidden[t] * sum_k topk_weights[t, k] * (topk_ids[t, k] + 1)``: computable without any
communication, so a row sent to the wrong expert, or the wrong token's row, shows.
"""

from __future__ import annotations

import gc
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeserve.distributed.ep_dispatch import TorchLowLatencyDispatcher
from moeserve.distributed.groups import Group, init_world

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs"),
]

E_LOCAL, TOP_K, DIM, CAPACITY = 4, 4, 256, 32
TOKENS = [CAPACITY, 23, 0, 5, 17, 1, 30, 9]  # tokens of rank r (r mod 8): full, partial, idle (from 3 GPUs)
REPLAYS = 5


def test_low_latency_step_replays_in_cuda_graph(tmp_path):
    world = torch.cuda.device_count()
    mp.start_processes(_rank_main, args=(world, f"file://{tmp_path}/store"), nprocs=world, start_method="spawn",
                       daemon=True)


def _rank_main(rank: int, world: int, init_method: str) -> None:
    try:
        init_world(init_method, rank, world, "cuda", local_rank=rank)
        host = dist.new_group(backend="gloo")
        _check_replays(Group(dist.group.WORLD, rank, world, list(range(world))))
        torch.cuda.synchronize()
        gc.collect()  # the graph first: a graph holding NCCL kernels keeps the communicator open
        dist.barrier(group=host)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        os._exit(1)


class _Step:
    """Static inputs, the dispatcher and the toy experts of one rank."""

    def __init__(self, ep: Group, device: torch.device) -> None:
        self.ep, self.device = ep, device
        self.num_experts = E_LOCAL * ep.size
        tokens = TOKENS[ep.rank % len(TOKENS)]
        self.hidden = torch.empty(tokens, DIM, dtype=torch.bfloat16, device=self.device)
        self.topk_ids = torch.empty(tokens, TOP_K, dtype=torch.int64, device=self.device)
        self.topk_weights = torch.empty(tokens, TOP_K, dtype=torch.float32, device=self.device)
        first = ep.rank * E_LOCAL  # global id of local expert 0
        scale = torch.arange(first + 1, first + E_LOCAL + 1, dtype=torch.bfloat16, device=self.device)
        self.scale = scale.view(E_LOCAL, 1, 1)
        self.dispatcher = TorchLowLatencyDispatcher(ep, E_LOCAL, CAPACITY)

    def fill(self, round_: int) -> None:
        """New random tokens and routing, in place (a replay reads these very buffers)."""
        gen = torch.Generator(self.device).manual_seed(1000 * round_ + self.ep.rank)
        tokens = self.hidden.shape[0]
        self.hidden.copy_(torch.randn(tokens, DIM, generator=gen, device=self.device))
        scores = torch.rand(tokens, self.num_experts, generator=gen, device=self.device)
        self.topk_ids.copy_(scores.topk(TOP_K, dim=1).indices)  # distinct experts per token
        self.topk_weights.copy_(torch.rand(tokens, TOP_K, generator=gen, device=self.device).softmax(-1))

    def __call__(self) -> torch.Tensor:
        recv, handle = self.dispatcher.dispatch(self.hidden, self.topk_ids, self.topk_weights)
        return self.dispatcher.combine(recv.hidden * self.scale, handle)  # [T, DIM] bf16

    def closed_form(self) -> torch.Tensor:
        factor = (self.topk_weights * (self.topk_ids + 1)).sum(1, keepdim=True)  # [T, 1] fp32
        return self.hidden.float() * factor


def _check_replays(ep: Group) -> None:
    step = _Step(ep, torch.device("cuda", torch.cuda.current_device()))
    step.fill(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture: NCCL communicators, allocator
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for round_ in range(1, REPLAYS + 1):
        step.fill(round_)
        out.fill_(float("nan"))  # the replay must write every row
        graph.replay()
        got = out.clone()
        eager = step()
        what = f"rank {ep.rank} replay {round_}"
        assert torch.equal(got, eager), f"{what}: the replay differs from the eager step"
        want = step.closed_form()
        if want.numel():
            err = ((got.float() - want).norm() / want.norm()).item()
            assert err < 1e-2, f"{what}: relative error {err:.3g} against the closed form"
    graph.reset()
