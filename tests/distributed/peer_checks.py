"""Checks of the peer low-latency dispatcher with one process playing every EP rank
(``local_peer_memories``): run on CPU by the torch version, through Triton's interpreter, and on
one GPU by the Triton kernels (``test_peer_dispatch.py``).

The toy experts multiply each row by its global expert id + 1, so each token's combined output
has a closed form; the masked layout is checked row for row against the tokens each source sent.
"""

from __future__ import annotations

import torch

from moeserve.distributed.peer_dispatch import PeerLayout, PeerLowLatencyDispatcher, local_peer_memories
from moeserve.kernels.combine import topk_weighted_sum
from moeserve.kernels.fp8 import FP8_BLOCK, per_token_group_dequant_fp8, per_token_group_quant_fp8


class World:
    """``n`` ranks of ``e_local`` experts each, in this process."""

    def __init__(self, n: int, e_local: int, cap: int, top_k: int, dim: int, dtype: torch.dtype, fp8: bool,
                 device: str, max_spins: int = 1 << 20) -> None:
        self.n, self.e_local, self.cap, self.top_k, self.dim = n, e_local, cap, top_k, dim
        self.dtype, self.fp8, self.device = dtype, fp8, device
        layout = PeerLayout.for_model(n, e_local, cap, top_k, dim, dtype, fp8)
        self.memories = local_peer_memories(n, layout.nbytes, device)
        self.dispatchers = [PeerLowLatencyDispatcher(m, layout, fp8, dtype, max_spins) for m in self.memories]

    def inputs(self, tokens: list[int], seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per rank: ``hidden [T_r, D]``, ``topk_ids [T_r, k]`` (distinct experts), ``topk_weights``."""
        gen = torch.Generator().manual_seed(seed)
        out = []
        for t in tokens:
            hidden = torch.randn(t, self.dim, generator=gen).to(self.dtype)
            ids = torch.rand(t, self.n * self.e_local, generator=gen).topk(self.top_k, dim=1).indices
            weights = torch.rand(t, self.top_k, generator=gen).softmax(-1)
            out.append((hidden.to(self.device), ids.to(self.device), weights.to(self.device)))
        return out

    def sent(self, hidden: torch.Tensor) -> torch.Tensor:
        """A token as its expert sees it: after FP8 quantization when the dispatch is FP8."""
        if not self.fp8:
            return hidden
        values, scales = per_token_group_quant_fp8(hidden, FP8_BLOCK)
        return per_token_group_dequant_fp8(values, scales, FP8_BLOCK).to(self.dtype)

    def experts(self, rank: int, recv) -> torch.Tensor:
        """The toy experts on the masked layout -> ``[E_local, N * C, D]``."""
        x = recv.hidden
        if recv.hidden_scale is not None:
            x = per_token_group_dequant_fp8(x.flatten(0, 1), recv.hidden_scale.flatten(0, 1), FP8_BLOCK)
            x = x.view(recv.hidden.shape).to(recv.out_dtype)
        scale = torch.arange(rank * self.e_local + 1, (rank + 1) * self.e_local + 1, device=x.device)
        return x * scale.to(x.dtype).view(-1, 1, 1)

    def expected_combine(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        rows = self.sent(hidden).unsqueeze(1) * (ids + 1).to(hidden.dtype).unsqueeze(-1)  # [T, k, D]
        return topk_weighted_sum(rows.flatten(0, 1), weights)

    def check_layout(self, rank: int, recv, inputs) -> None:
        """Expert ``e`` of ``rank`` holds every source's tokens choosing it, source 0 first, in order."""
        for e in range(self.e_local):
            g = rank * self.e_local + e
            want = torch.cat([hidden[(ids == g).any(1)] for hidden, ids, _ in inputs])
            m = int(recv.masked_m[e])
            assert m == want.shape[0], (rank, e, m, want.shape[0])
            if self.fp8:
                values, scales = per_token_group_quant_fp8(want, FP8_BLOCK)
                assert torch.equal(recv.hidden[e, :m].view(torch.uint8), values.view(torch.uint8))
                assert torch.equal(recv.hidden_scale[e, :m], scales)
            else:
                assert torch.equal(recv.hidden[e, :m], want)
        assert recv.hidden.shape[:2] == (self.e_local, self.n * self.cap)


def run_round(world: World, batches: list[list[tuple]], order: str = "together") -> list[list[torch.Tensor]]:
    """Dispatch, experts and combine of each batch (a micro-batch: one input per rank) on every
    rank; with ``order="interleaved"`` each step runs for all micro-batches before the next step
    (two-batch overlap's pattern: both dispatches in flight at once). Checks the layouts."""
    pending = [[d.dispatch_a(*x) for d, x in zip(world.dispatchers, batch)] for batch in batches] \
        if order == "interleaved" else None
    outs = []
    for b, batch in enumerate(batches):
        sent = pending[b] if pending else [d.dispatch_a(*x) for d, x in zip(world.dispatchers, batch)]
        recvs = [d.dispatch_b(p) for d, p in zip(world.dispatchers, sent)]
        for rank, (recv, _) in enumerate(recvs):
            world.check_layout(rank, recv, batch)
        outs.append([d.combine_a(world.experts(r, recv), h)
                     for r, (d, (recv, h)) in enumerate(zip(world.dispatchers, recvs))])
    return [[d.combine_b(p) for d, p in zip(world.dispatchers, back)] for back in outs]


def check_rounds(device: str, n: int, dtype: torch.dtype, fp8: bool, dim: int = 256, e_local: int = 4,
                 top_k: int = 4, cap: int = 6) -> None:
    """Several rounds (buffer sets reused) and a two-micro-batch round: every combined token
    equals its closed form, bit for bit, and no wait gave up."""
    world = World(n, e_local, cap, top_k, dim, dtype, fp8, device)
    token_rounds = [[cap, 3, 0, 5][:n] + [2] * max(0, n - 4), [1] * n, [0] * n, [cap] * n]
    for i, tokens in enumerate(token_rounds):
        batches = [world.inputs(tokens, seed=i)]
        if i == 1:  # two micro-batches in flight at once
            batches.append(world.inputs([cap - r % 2 for r in range(n)], seed=100 + i))
        for batch, outs in zip(batches, run_round(world, batches, "interleaved" if i == 1 else "together")):
            for x, out in zip(batch, outs):
                assert out.shape == x[0].shape and out.dtype == dtype
                assert torch.equal(out, world.expected_combine(*x)), (i, (out - world.expected_combine(*x)).abs().max())
    for m in world.memories:
        m.raise_if_failed()


def check_dead_peer(device: str, max_spins: int) -> None:
    """A rank that stops dispatching after a full round: the others' waits give up (no hang) and
    say so (what the full round left in the buffers does not pass for this round's counts)."""
    world = World(3, 2, 4, 2, 128, torch.float32, False, device, max_spins=max_spins)
    for _ in range(2):  # both buffer sets used once
        run_round(world, [world.inputs([3, 2, 1], seed=6)])
    batch = world.inputs([3, 2, 1], seed=7)
    sent = [d.dispatch_a(*x) for d, x in list(zip(world.dispatchers, batch))[:2]]  # rank 2 is dead
    world.dispatchers[0].dispatch_b(sent[0])
    try:
        world.memories[0].raise_if_failed()
    except RuntimeError as e:
        assert "dispatch" in str(e) and "rank 0" in str(e)
    else:
        raise AssertionError("a missing peer went unnoticed")
    world.memories[0].raise_if_failed()  # the error word was cleared with the report


def check_combine_timeout(device: str, max_spins: int) -> None:
    """After full rounds, a combine whose experts never answer gives up and says so."""
    world = World(2, 2, 4, 2, 128, torch.float32, False, device, max_spins=max_spins)
    for _ in range(2):
        run_round(world, [world.inputs([2, 2], seed=6)])
    batch = world.inputs([2, 2], seed=8)
    sent = [d.dispatch_a(*x) for d, x in zip(world.dispatchers, batch)]
    recvs = [d.dispatch_b(p) for d, p in zip(world.dispatchers, sent)]
    back = world.dispatchers[0].combine_a(world.experts(0, recvs[0][0]), recvs[0][1])  # rank 1 never combines
    world.dispatchers[0].combine_b(back)
    try:
        world.memories[0].raise_if_failed()
    except RuntimeError as e:
        assert "combine" in str(e)
    else:
        raise AssertionError("a missing combine went unnoticed")


INTERPRETER_CHECKS = {
    "rounds_n3_fp32": lambda: check_rounds("cpu", 3, torch.float32, False),
    "rounds_n2_fp8": lambda: check_rounds("cpu", 2, torch.float32, True),
    "rounds_n1": lambda: check_rounds("cpu", 1, torch.float32, False),
    "dead_peer": lambda: check_dead_peer("cpu", max_spins=5),
    "combine_timeout": lambda: check_combine_timeout("cpu", max_spins=5),
}


def run_interpreted_checks() -> None:
    """The checks with the Triton kernels forced onto CPU tensors (run under ``TRITON_INTERPRET``)."""
    from moeserve.kernels import peer_a2a
    from tests.kernels.interpreter import run_checks

    peer_a2a.use_triton = lambda t: True
    run_checks(INTERPRETER_CHECKS)
