"""Worker side of the multi-process EP dispatch tests: top-level functions, so that ``spawn`` can
import them in the child processes. Every rank rebuilds every rank's inputs from fixed seeds, so
each can compute its own reference and the tokens its experts must receive."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moeserve.distributed.dispatcher import Dispatcher, LocalDispatcher, make_dispatcher
from moeserve.distributed.groups import Group
from moeserve.kernels import fp8
from moeserve.layers.moe import Experts

DIM, INTER = 16, 8


def run_world(world_size: int, fn: Callable[..., None], *args: object) -> None:
    """Run ``fn(ep, *args)`` on ``world_size`` spawned gloo ranks; a failure on any rank raises here.
    The ranks meet in a file store (no port to pick and hand over)."""
    with tempfile.TemporaryDirectory(prefix="moeserve-ep-") as tmp:
        mp.start_processes(_entry, args=(world_size, f"file://{tmp}/store", fn, args), nprocs=world_size,
                           start_method="spawn")


def _entry(rank: int, world_size: int, init_method: str, fn: Callable[..., None], args: tuple) -> None:
    torch.set_num_threads(1)  # the test machine's cores are shared by all ranks
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        fn(Group(dist.group.WORLD, rank, world_size, list(range(world_size))), *args)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# problem set-up, identical on every rank


@dataclass
class Problem:
    w13: torch.Tensor  # [E, 2I, D]
    w2: torch.Tensor  # [E, D, I]
    hidden: list[torch.Tensor]  # per rank [T_r, D]
    topk_ids: list[torch.Tensor]  # per rank [T_r, k] physical ids
    topk_weights: list[torch.Tensor]  # per rank [T_r, k] fp32


def make_weights(num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    w13 = torch.randn(num_experts, 2 * INTER, DIM, generator=g) / DIM**0.5
    w2 = torch.randn(num_experts, DIM, INTER, generator=g) / INTER**0.5
    return w13, w2


def make_problem(num_experts: int, top_k: int, token_counts: list[int], seed: int) -> Problem:
    w13, w2 = make_weights(num_experts)
    hidden, ids, weights = [], [], []
    for rank, count in enumerate(token_counts):
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        hidden.append(torch.randn(count, DIM, generator=g))
        ids.append(torch.rand(count, num_experts, generator=g).topk(top_k, dim=1).indices)  # distinct per token
        weights.append(torch.rand(count, top_k, generator=g).softmax(-1))
    return Problem(w13, w2, hidden, ids, weights)


def make_experts(w13: torch.Tensor, w2: torch.Tensor, first: int = 0, count: int | None = None,
                 fp8_weights: bool = False) -> Experts:
    """``Experts`` holding physical experts ``first .. first + count - 1`` of the stacked weights
    (``fp8_weights``: block-quantized, with their scales)."""
    count = w13.shape[0] if count is None else count
    experts = Experts(list(range(first, first + count)), w13.shape[0], DIM, INTER, fp8=fp8_weights)
    for j in range(count):
        for weight, scale, src in ((experts.w13, experts.w13_scale_inv, w13), (experts.w2, experts.w2_scale_inv, w2)):
            if scale is None:
                weight.data[j].copy_(src[first + j])
            else:
                q, s = fp8.block_quant_fp8(src[first + j], (fp8.FP8_BLOCK, fp8.FP8_BLOCK))
                weight.data[j].copy_(q)
                scale.data[j].copy_(s)
    return experts


def reference(p: Problem, rank: int, fp8_weights: bool = False) -> torch.Tensor:
    """The single-process engine's MoE output for ``rank``'s tokens: every expert local."""
    dispatcher = LocalDispatcher(p.w13.shape[0])
    recv, handle = dispatcher.dispatch(p.hidden[rank], p.topk_ids[rank], p.topk_weights[rank])
    return dispatcher.combine(make_experts(p.w13, p.w2, fp8_weights=fp8_weights)(recv), handle)


def expected_rows(p: Problem, expert: int) -> torch.Tensor:
    """Rows that physical ``expert`` must receive, in the documented order: source rank, then
    the source's token order -> ``[n, D]``."""
    rows = [h[(ids == expert).any(1)] for h, ids in zip(p.hidden, p.topk_ids)]
    return torch.cat(rows)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------------------------
# checks (run on every rank)


def check_world(ep: Group, num_experts: int, top_k: int, rounds: list[list[int]], capacity: int) -> None:
    """All checks of one spawned world (spawning is the slow part)."""
    check_dispatchers(ep, num_experts, top_k, rounds, capacity)
    check_fp8_dispatchers(ep, num_experts, top_k, rounds, capacity)
    check_capacity_error(ep, num_experts, capacity)


def check_fp8_dispatchers(ep: Group, num_experts: int, top_k: int, rounds: list[list[int]], capacity: int) -> None:
    """FP8 dispatch (for FP8 experts): each local expert receives its tokens as FP8 values and 1x128
    scales, exactly what quantizing the expected rows gives, and the output equals the single-process
    engine's with the same FP8 experts, which quantize the tokens themselves."""
    e_local = num_experts // ep.size
    w13, w2 = make_weights(num_experts)
    experts = make_experts(w13, w2, ep.rank * e_local, e_local, fp8_weights=True)
    dispatchers = {"normal": make_dispatcher("normal", ep, e_local, capacity, alignment=4, fp8=True),
                   "low_latency": make_dispatcher("low_latency", ep, e_local, capacity, fp8=True)}
    for seed, counts in enumerate(rounds):
        p = make_problem(num_experts, top_k, counts, seed)
        ref = reference(p, ep.rank, fp8_weights=True)
        mine = p.hidden[ep.rank], p.topk_ids[ep.rank], p.topk_weights[ep.rank]
        for name, dispatcher in dispatchers.items():
            what = f"fp8 {name} counts={counts} rank={ep.rank}"
            recv, handle = dispatcher.dispatch(*mine)
            assert recv.hidden.dtype == fp8.FP8_DTYPE and recv.out_dtype == mine[0].dtype, what
            for e in range(e_local):
                q, s = fp8.per_token_group_quant_fp8(expected_rows(p, ep.rank * e_local + e))
                if name == "low_latency":
                    got, got_scale = recv.hidden[e, :q.shape[0]], recv.hidden_scale[e, :q.shape[0]]
                else:
                    start = int(recv.seg_indptr[e])
                    got, got_scale = recv.hidden[start:start + q.shape[0]], recv.hidden_scale[start:start + q.shape[0]]
                assert torch.equal(got.view(torch.uint8), q.view(torch.uint8)), f"{what}: values of expert {e}"
                assert torch.equal(got_scale, s), f"{what}: scales of expert {e}"
            out = dispatcher.combine(experts(recv), handle)
            assert out.dtype == mine[0].dtype and out.shape == (counts[ep.rank], DIM), what
            close(out, ref, what)
            close(_two_batch_overlap(dispatcher, experts, *mine), out, f"{what} a/b halves")


def check_dispatchers(ep: Group, num_experts: int, top_k: int, rounds: list[list[int]], capacity: int) -> None:
    """For each round of per-rank token counts: normal mode (alignment 1 and 4) and low-latency
    mode give the reference output, with the documented layouts; a/b halves match one-shot."""
    e_local = num_experts // ep.size
    w13, w2 = make_weights(num_experts)
    experts = make_experts(w13, w2, ep.rank * e_local, e_local)
    normal1 = make_dispatcher("normal", ep, e_local, capacity)
    normal4 = make_dispatcher("normal", ep, e_local, capacity, alignment=4)
    low_latency = make_dispatcher("low_latency", ep, e_local, capacity)
    for seed, counts in enumerate(rounds):
        p = make_problem(num_experts, top_k, counts, seed)
        ref = reference(p, ep.rank)
        mine = p.hidden[ep.rank], p.topk_ids[ep.rank], p.topk_weights[ep.rank]
        for name, dispatcher in [("normal", normal1), ("normal/align4", normal4), ("low_latency", low_latency)]:
            what = f"{name} counts={counts} rank={ep.rank}"
            recv, handle = dispatcher.dispatch(*mine)
            if name == "low_latency":
                _check_masked(recv, p, ep.rank * e_local, ep.size * capacity, what)
                # this rank's T * k rows spread over the local experts' share: the tile hint
                assert recv.expected_m == -(-mine[1].numel() // e_local), f"{what}: expected_m"
            else:
                _check_contiguous(recv, p, ep.rank * e_local, dispatcher.alignment, what)
            out = dispatcher.combine(experts(recv), handle)
            assert out.shape == (counts[ep.rank], DIM), what
            close(out, ref, what)
            close(_two_batch_overlap(dispatcher, experts, *mine), out, f"{what} a/b halves")


def _check_contiguous(recv, p: Problem, first: int, alignment: int, what: str) -> None:
    seg = recv.seg_indptr.tolist()
    assert all(s % alignment == 0 for s in seg), f"{what}: segments {seg} not aligned to {alignment}"
    assert recv.hidden.shape[0] == seg[-1], what
    for e in range(len(seg) - 1):
        rows = expected_rows(p, first + e)
        n = rows.shape[0]
        assert int(recv.tokens_per_expert[e]) == n, what
        assert seg[e + 1] - seg[e] == -(-n // alignment) * alignment, f"{what}: segment {e} length"
        assert torch.equal(recv.hidden[seg[e]:seg[e] + n], rows), f"{what}: rows of local expert {e}"
        assert not recv.hidden[seg[e] + n:seg[e + 1]].any(), f"{what}: padding of local expert {e} not zero"


def _check_masked(recv, p: Problem, first: int, max_m: int, what: str) -> None:
    e_local = recv.masked_m.shape[0]
    assert recv.hidden.shape == (e_local, max_m, DIM), what
    assert recv.masked_m.dtype == torch.int32, what
    for e in range(e_local):
        rows = expected_rows(p, first + e)
        n = rows.shape[0]
        assert int(recv.masked_m[e]) == n, f"{what}: masked_m[{e}]"
        valid = recv.hidden[e, :n]
        # the valid rows as a multiset, then in the documented order
        assert torch.equal(_sorted_rows(valid), _sorted_rows(rows)), f"{what}: tokens of local expert {e}"
        assert torch.equal(valid, rows), f"{what}: order of local expert {e}'s rows"
        assert not recv.hidden[e, n:].any(), f"{what}: rows past masked_m[{e}] not zero"


def _sorted_rows(x: torch.Tensor) -> torch.Tensor:
    return x[torch.argsort(x[:, 0])] if x.shape[0] else x


def _two_batch_overlap(dispatcher: Dispatcher, experts: Experts, hidden, topk_ids, topk_weights) -> torch.Tensor:
    """Run the tokens as two micro-batches, each half issued before the other's wait, as TBO does."""
    half = hidden.shape[0] // 2
    parts = [(hidden[s], topk_ids[s], topk_weights[s]) for s in (slice(0, half), slice(half, None))]
    pending = [dispatcher.dispatch_a(*part) for part in parts]
    received = [dispatcher.dispatch_b(x) for x in pending]
    pending = [dispatcher.combine_a(experts(recv), handle) for recv, handle in received]
    return torch.cat([dispatcher.combine_b(x) for x in pending])


def check_capacity_error(ep: Group, num_experts: int, capacity: int) -> None:
    """Every rank over capacity: each raises a ValueError naming the limit, before any collective
    (so none hangs), and the group still works afterwards."""
    dispatcher = make_dispatcher("low_latency", ep, num_experts // ep.size, capacity)
    p = make_problem(num_experts, 2, [capacity + 1] * ep.size, seed=99)
    try:
        dispatcher.dispatch(p.hidden[ep.rank], p.topk_ids[ep.rank], p.topk_weights[ep.rank])
    except ValueError as e:
        assert "max_dispatch_tokens_per_rank" in str(e), str(e)
    else:
        raise AssertionError("T > max_dispatch_tokens_per_rank did not raise")
    dist.barrier(group=ep.group)
