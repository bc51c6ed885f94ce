"""Dispatch and combine of the ``torch`` all-to-all EP backend, one process per GPU, beside DeepEP;
on GPUs also the ``symm_mem`` backend's low-latency mode (peer writes, only real tokens moved).

``moeserve bench dispatch [--world-size N] [--output-json PATH]``. Every rank routes random
tokens (top-k distinct experts each, experts spread evenly over the ranks) and times dispatch
and combine separately: all ranks line up first (host barrier, then a one-element NCCL
all-reduce), so each call starts together; a call's time is the slowest rank's (CUDA events),
the median over the timed iterations. Normal mode runs DeepSeek-V3's prefill shape (4096 tokens
per rank), low-latency mode its decode shape (128 tokens per rank), eagerly and replayed from
CUDA graphs. A bare ``all_to_all_single`` of the same buffers gives the transport's share.

Bytes per rank, as DeepEP's tests count them, so the GB/s compare with its README:

- normal: every token a rank receives, counted once per receiving rank however many of that
  rank's experts it chose (its own tokens too), times the bytes of one token; "NVLink" counts
  only those from other ranks. The torch backend sends a token once per chosen expert, so it
  moves more than this, which shows as a lower rate.
- low-latency: every (token, expert) selection times the bytes of one token.

DeepEP's figures are its README's: H800 GPUs (NVLink ~160 GB/s), EP8, FP8 dispatch and BF16
combine; normal kernels over NVLink, low-latency kernels over RDMA only. Here the payload is
``--dtype`` both ways and EP is the world size, so the FP8 column says what DeepEP's FP8
dispatch would move for the same tokens; with ``--fp8-dispatch`` the dispatchers send FP8 tokens
with their 1x128 scales, as they do for FP8 experts, and the dispatch rows count those bytes.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from moeserve.distributed.dispatcher import Dispatcher
from moeserve.distributed.ep_dispatch import TorchLowLatencyDispatcher, TorchNormalDispatcher
from moeserve.distributed.groups import Group, init_world
from moeserve.distributed.peer_dispatch import PeerLayout, PeerLowLatencyDispatcher, symmetric_peer_memory

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FP8_GROUP = 128  # DeepEP's FP8 tokens: one byte per value plus one fp32 scale per 128 values
# DeepEP README, H800, EP8: (figure, what it is)
DEEPEP = {
    ("normal", "dispatch"): "153 GB/s (NVLink, FP8)",
    ("normal", "combine"): "158 GB/s (NVLink, BF16)",
    ("low_latency", "dispatch"): "77 us (RDMA, FP8)",
    ("low_latency", "combine"): "114 us (RDMA, BF16)",
}
DEEPEP_NORMAL_GBPS = {"dispatch": 153.0, "combine": 158.0}  # the normal rows' figures as numbers


def add_dispatch_args(parser: argparse.ArgumentParser) -> None:
    p = parser
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks, one process each (default: every visible GPU; 2 on CPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (NCCL) or cpu (gloo, for trying it out); default: cuda when there is a GPU")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--num-experts", type=int, default=256, help="routed experts, spread evenly over the ranks")
    p.add_argument("--normal-tokens", type=int, default=4096, help="tokens per rank in normal mode")
    p.add_argument("--ll-tokens", type=int, default=128,
                   help="tokens per rank in low-latency mode (also its max_dispatch_tokens_per_rank)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="payload type (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30, help="timed iterations of each call")
    p.add_argument("--no-cuda-graph", action="store_true", help="skip the low-latency CUDA-graph timings")
    p.add_argument("--fp8-dispatch", action="store_true",
                   help="dispatch FP8 tokens with their 1x128 scales (as for FP8 experts); combine stays --dtype")
    p.add_argument("--output-json", default=None, help="write the configuration and every row here")


@dataclass(frozen=True)
class DispatchBenchConfig:
    world_size: int
    device: str
    hidden: int
    top_k: int
    num_experts: int
    normal_tokens: int
    ll_tokens: int
    dtype: str
    warmup: int
    iters: int
    cuda_graph: bool
    fp8_dispatch: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 2:
            raise ValueError(f"world_size must be at least 2, got {self.world_size}")
        if self.device == "cuda" and self.world_size > torch.cuda.device_count():
            raise ValueError(f"world_size {self.world_size} needs as many GPUs; {torch.cuda.device_count()} visible")
        if self.num_experts % self.world_size:
            raise ValueError(f"{self.num_experts} experts do not spread evenly over {self.world_size} ranks")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, {self.num_experts}], got {self.top_k}")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("iters must be >= 1 and warmup >= 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> DispatchBenchConfig:
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        world = args.world_size or (torch.cuda.device_count() if device == "cuda" else 2)
        dtype = args.dtype or ("bfloat16" if device == "cuda" else "float32")
        return cls(world, device, args.hidden, args.top_k, args.num_experts, args.normal_tokens, args.ll_tokens,
                   dtype, args.warmup, args.iters, device == "cuda" and not args.no_cuda_graph, args.fp8_dispatch)

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def token_bytes(self) -> int:
        return self.hidden * DTYPES[self.dtype].itemsize

    @property
    def fp8_token_bytes(self) -> float:
        return self.hidden + self.hidden / FP8_GROUP * 4

    @property
    def dispatch_token_bytes(self) -> float:
        """What the dispatch sends of one token (``fp8_dispatch``: its FP8 values and scales, in whole groups)."""
        return self.hidden + -(-self.hidden // FP8_GROUP) * 4 if self.fp8_dispatch else self.token_bytes


@dataclass
class Row:
    """One timed call. Bytes are per rank, averaged over the ranks."""

    mode: str  # normal | low_latency
    op: str  # dispatch | combine | all_to_all
    variant: str  # eager | cuda graph | symm_mem eager | symm_mem cuda graph
    tokens_per_rank: int
    time_us: float  # median over iterations of the slowest rank
    bytes_deepep: float  # DeepEP's count (see the module docstring)
    bytes_nvlink: float  # the part of it from other ranks
    bytes_moved: float  # what the torch backend sends to other ranks
    bytes_fp8: float = 0.0  # DeepEP's count with its FP8 tokens (normal dispatch)
    deepep: str = ""

    @property
    def gbps_deepep(self) -> float:
        return self.bytes_deepep / self.time_us / 1e3

    @property
    def gbps_nvlink(self) -> float:
        return self.bytes_nvlink / self.time_us / 1e3


def run_dispatch_benchmark(args: argparse.Namespace) -> str:
    """Spawn the ranks, time every call; the table (and ``--output-json``) of the results."""
    import torch.multiprocessing as mp

    cfg = DispatchBenchConfig.from_args(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rows.json")  # the ranks meet in a file store beside it: no port to pick
        mp.start_processes(_rank_main, args=(cfg, f"file://{tmp}/store", path), nprocs=cfg.world_size,
                           start_method="spawn", daemon=True)
        with open(path) as f:
            result = json.load(f)
    rows = [Row(**r) for r in result["rows"]]
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"config": asdict(cfg), "device_name": result["device_name"], "notes": result["notes"],
                       "rows": [{**asdict(r), "gbps_deepep": r.gbps_deepep, "gbps_nvlink": r.gbps_nvlink}
                                for r in rows]}, f, indent=2)
    return format_table(cfg, rows, result["device_name"], result["notes"])


def main(argv: list[str] | None = None) -> None:
    """``python -m moeserve.bench.dispatch [flags]``, for machines where the CLI is not installed."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_dispatch_args(parser)
    print(run_dispatch_benchmark(parser.parse_args(argv)), flush=True)


def format_table(cfg: DispatchBenchConfig, rows: list[Row], device_name: str, notes: list[str]) -> str:
    title = (f"torch all-to-all EP backend: EP={cfg.world_size} on {device_name}; hidden {cfg.hidden}, "
             f"top-{cfg.top_k}, {cfg.num_experts} experts ({cfg.experts_per_rank} per rank), {cfg.dtype} payload")
    head = ("mode", "op", "variant", "tokens/rank", "time (us)", "GB/s DeepEP count", "GB/s NVLink",
            "moved/rank (MB)", "DeepEP EP8 (H800) / note")
    lines = [head]
    for r in rows:
        lines.append((r.mode, r.op, r.variant, str(r.tokens_per_rank), f"{r.time_us:.1f}", f"{r.gbps_deepep:.1f}",
                      f"{r.gbps_nvlink:.1f}", f"{r.bytes_moved / 1e6:.1f}", r.deepep))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = [title] + ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    text.append("DeepEP: H800 (NVLink ~160 GB/s), EP8, FP8 dispatch and BF16 combine; normal kernels over "
                "NVLink, low-latency kernels over RDMA only. Ours: EP=world, the same payload type both ways.")
    return "\n".join(text + notes)


# ---------------------------------------------------------------------------------------------
# rank side


def _rank_main(rank: int, cfg: DispatchBenchConfig, init_method: str, path: str) -> None:
    try:
        if cfg.device == "cpu":
            torch.set_num_threads(1)  # the ranks share the cores
        init_world(init_method, rank, cfg.world_size, cfg.device, local_rank=rank)
        host = dist.new_group(backend="gloo") if cfg.device == "cuda" else dist.group.WORLD
        ep = Group(dist.group.WORLD, rank, cfg.world_size, list(range(cfg.world_size)))
        bench = _RankBench(cfg, ep, host)
        rows, notes = bench.run()
        if rank == 0:
            name = torch.cuda.get_device_name() if cfg.device == "cuda" else "CPU (gloo)"
            with open(path, "w") as f:
                json.dump({"rows": [asdict(r) for r in rows], "device_name": name, "notes": notes}, f)
        del bench
        gc.collect()  # CUDA graphs before the communicators they hold
        dist.barrier(group=host)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        os._exit(1)


@dataclass
class _Inputs:
    hidden: torch.Tensor  # [T, D]
    topk_ids: torch.Tensor  # [T, k] int64, distinct per token
    topk_weights: torch.Tensor  # [T, k] fp32


class _RankBench:
    def __init__(self, cfg: DispatchBenchConfig, ep: Group, host: dist.ProcessGroup) -> None:
        self.cfg, self.ep, self.host = cfg, ep, host
        self.cuda = cfg.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self._flag = torch.zeros(1, device=self.device)
        self.notes: list[str] = []
        self._graphs: list[torch.cuda.CUDAGraph] = []

    def run(self) -> tuple[list[Row], list[str]]:
        rows = self._normal() + self._low_latency()
        if self.cfg.cuda_graph:
            rows += self._low_latency_graphs()
        if self.cuda and self.ep.size > 1:
            rows += self._peer_low_latency()
        return rows, self.notes

    # ---- inputs and byte counts ------------------------------------------------------------
    def _inputs(self, tokens: int, seed: int) -> _Inputs:
        cfg = self.cfg
        gen = torch.Generator(self.device).manual_seed(seed * 1000 + self.ep.rank)
        hidden = torch.randn(tokens, cfg.hidden, generator=gen, device=self.device).to(DTYPES[cfg.dtype])
        scores = torch.rand(tokens, cfg.num_experts, generator=gen, device=self.device)
        weights = torch.rand(tokens, cfg.top_k, generator=gen, device=self.device).softmax(-1)
        return _Inputs(hidden, scores.topk(cfg.top_k, dim=1).indices, weights)

    def _sent_to_ranks(self, x: _Inputs) -> tuple[list[int], list[int]]:
        """(tokens sent to each rank, counted once per rank; (token, expert) rows sent to each rank)."""
        n = self.ep.size
        dest = x.topk_ids // self.cfg.experts_per_rank  # [T, k]
        hits = torch.zeros(x.topk_ids.shape[0], n, dtype=torch.int64, device=self.device)
        hits.scatter_add_(1, dest, torch.ones_like(dest))  # [T, N] selections of each rank
        return (hits > 0).sum(0).tolist(), hits.sum(0).tolist()

    def _received(self, sent: list[int]) -> tuple[float, float]:
        """This rank's (total, from other ranks) of what every rank sent it; averaged over ranks."""
        table: list[list[int] | None] = [None] * self.ep.size
        dist.all_gather_object(table, sent, group=self.host)
        n = self.ep.size
        total = [sum(table[s][r] for s in range(n)) for r in range(n)]
        others = [total[r] - table[r][r] for r in range(n)]
        return statistics.mean(total), statistics.mean(others)

    # ---- timing ----------------------------------------------------------------------------
    def _align(self) -> None:
        """Every rank idle and lined up, so that the next call starts together everywhere."""
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier(group=self.host)
        if self.cuda:
            dist.all_reduce(self._flag, group=self.ep.group)  # on the device: the GPUs start together

    def _timed(self, fn: Callable[[], object]) -> tuple[float, object]:
        """(seconds, result) of one call; CUDA events on the GPU."""
        if not self.cuda:
            start = time.perf_counter()
            out = fn()
            return time.perf_counter() - start, out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, out

    def _slowest_median_us(self, times: list[float]) -> float:
        """Median over iterations of the slowest rank's time, in microseconds."""
        table: list[list[float] | None] = [None] * self.ep.size
        dist.all_gather_object(table, times, group=self.host)
        return statistics.median(max(col) for col in zip(*table)) * 1e6

    def _time_pair(self, dispatch: Callable[[], tuple], combine: Callable[[object, object], object]
                   ) -> tuple[float, float]:
        """Median µs of dispatch and of combine, each timed on its own."""
        t_dispatch, t_combine = [], []
        for i in range(self.cfg.warmup + self.cfg.iters):
            self._align()
            t_d, (recv, handle) = self._timed(dispatch)
            self._align()
            t_c, _ = self._timed(lambda recv=recv, handle=handle: combine(recv, handle))
            if i >= self.cfg.warmup:
                t_dispatch.append(t_d)
                t_combine.append(t_c)
            del recv, handle
        return self._slowest_median_us(t_dispatch), self._slowest_median_us(t_combine)

    def _time_one(self, fn: Callable[[], object]) -> float:
        times = []
        for i in range(self.cfg.warmup + self.cfg.iters):
            self._align()
            t, _ = self._timed(fn)
            if i >= self.cfg.warmup:
                times.append(t)
        return self._slowest_median_us(times)

    # ---- the modes -------------------------------------------------------------------------
    def _normal(self) -> list[Row]:
        cfg, n = self.cfg, self.ep.size
        x = self._inputs(cfg.normal_tokens, seed=1)
        dispatcher = TorchNormalDispatcher(self.ep, cfg.experts_per_rank, fp8=cfg.fp8_dispatch)
        dedup, pairs = self._sent_to_ranks(x)
        recv_total, recv_others = self._received(dedup)
        rows_out = self._mean(float(sum(pairs) - pairs[self.ep.rank]))  # this rank's rows to other ranks
        moved, moved_d = rows_out * cfg.token_bytes, rows_out * cfg.dispatch_token_bytes
        t_d, t_c = self._time_pair(lambda: dispatcher.dispatch(x.hidden, x.topk_ids, x.topk_weights),
                                   lambda recv, handle: dispatcher.combine(_expert_out(recv, x), handle))
        bytes_d, bytes_o = recv_total * cfg.token_bytes, recv_others * cfg.token_bytes
        sent_d, sent_o = recv_total * cfg.dispatch_token_bytes, recv_others * cfg.dispatch_token_bytes
        fp8 = recv_total * cfg.fp8_token_bytes
        t_a2a = self._time_normal_a2a(x, pairs)
        bf16 = recv_total * cfg.hidden * 2
        for op, kind, payload in (("dispatch", "FP8", fp8), ("combine", "BF16", bf16)):
            gbps = DEEPEP_NORMAL_GBPS[op]
            self.notes.append(f"normal {op}: at DeepEP's {gbps:.0f} GB/s, the {kind} tokens a rank receives "
                              f"({payload / 1e6:.1f} MB) take {payload / gbps / 1e3:.1f} us")
        tokens = cfg.normal_tokens
        return [
            Row("normal", "dispatch", "eager", tokens, t_d, sent_d, sent_o, moved_d, fp8, DEEPEP["normal", "dispatch"]),
            Row("normal", "combine", "eager", tokens, t_c, bytes_d, bytes_o, moved, 0.0, DEEPEP["normal", "combine"]),
            Row("normal", "all_to_all", "eager", tokens, t_a2a, bytes_d, bytes_o, moved,
                deepep=f"bare all_to_all_single of the dispatch's rows ({n} ranks)"),
        ]

    def _time_normal_a2a(self, x: _Inputs, pairs: list[int]) -> float:
        """A bare uneven all-to-all of the rows the normal dispatch sends."""
        table: list[list[int] | None] = [None] * self.ep.size
        dist.all_gather_object(table, pairs, group=self.host)
        recv_splits = [table[s][self.ep.rank] for s in range(self.ep.size)]
        send = x.hidden.new_empty(sum(pairs), x.hidden.shape[1]).normal_()
        recv = send.new_empty(sum(recv_splits), send.shape[1])
        return self._time_one(lambda: dist.all_to_all_single(recv, send, recv_splits, pairs, group=self.ep.group))

    def _low_latency_setup(self) -> tuple[_Inputs, TorchLowLatencyDispatcher, dict[str, tuple[float, ...]]]:
        """The inputs, the dispatcher and, for each op, (selections, others, moved) in bytes."""
        cfg = self.cfg
        x = self._inputs(cfg.ll_tokens, seed=2)
        dispatcher = TorchLowLatencyDispatcher(self.ep, cfg.experts_per_rank, cfg.ll_tokens, fp8=cfg.fp8_dispatch)
        _, pairs = self._sent_to_ranks(x)
        selections = self._mean(float(sum(pairs)))
        others = self._mean(float(sum(pairs) - pairs[self.ep.rank]))
        # the fixed [E, C, D] buffer, less the block that stays on this rank
        blocks = float(cfg.num_experts - cfg.experts_per_rank) * cfg.ll_tokens
        counts = {op: (selections * b, others * b, blocks * b)
                  for op, b in (("dispatch", cfg.dispatch_token_bytes), ("combine", cfg.token_bytes))}
        return x, dispatcher, counts

    def _low_latency(self) -> list[Row]:
        cfg = self.cfg
        x, dispatcher, counts = self._low_latency_setup()
        t_d, t_c = self._time_pair(lambda: dispatcher.dispatch(x.hidden, x.topk_ids, x.topk_weights),
                                   lambda recv, handle: dispatcher.combine(_expert_out(recv, x), handle))
        buf = x.hidden.new_zeros(cfg.num_experts, cfg.ll_tokens, cfg.hidden)
        out = torch.empty_like(buf)
        t_a2a = self._time_one(lambda: dist.all_to_all_single(out, buf, group=self.ep.group))
        tokens = cfg.ll_tokens
        return [
            Row("low_latency", "dispatch", "eager", tokens, t_d, *counts["dispatch"],
                deepep=DEEPEP["low_latency", "dispatch"]),
            Row("low_latency", "combine", "eager", tokens, t_c, *counts["combine"],
                deepep=DEEPEP["low_latency", "combine"]),
            Row("low_latency", "all_to_all", "eager", tokens, t_a2a, *counts["combine"],
                deepep="bare all_to_all_single of the [E, C, D] buffer"),
        ]

    def _low_latency_graphs(self) -> list[Row]:
        """Dispatch and combine captured in two CUDA graphs, timed by replay. A capture that
        fails on any rank skips the rows on every rank (a lone replay would hang)."""
        x, dispatcher, counts = self._low_latency_setup()
        try:
            dispatch, combine = self._capture(dispatcher, x)
            error = ""
        except Exception as e:
            dispatch = combine = None
            error = f"{type(e).__name__}: {e}"
        errors: list[str | None] = [None] * self.ep.size
        dist.all_gather_object(errors, error, group=self.host)
        if any(errors):
            self.notes.append(f"low-latency CUDA graphs skipped: {next(e for e in errors if e)}")
            return []
        t_d, t_c = self._time_one(dispatch.replay), self._time_one(combine.replay)
        tokens, variant = self.cfg.ll_tokens, "cuda graph"
        return [
            Row("low_latency", "dispatch", variant, tokens, t_d, *counts["dispatch"],
                deepep=DEEPEP["low_latency", "dispatch"]),
            Row("low_latency", "combine", variant, tokens, t_c, *counts["combine"],
                deepep=DEEPEP["low_latency", "combine"]),
        ]

    def _peer_low_latency(self) -> list[Row]:
        """The peer dispatcher over symmetric memory (``--moe-a2a-backend symm_mem``): eager, and
        from two CUDA graphs (dispatch, combine) replayed in turn, as its protocol needs."""
        cfg = self.cfg
        x, _, counts = self._low_latency_setup()
        dtype = DTYPES[cfg.dtype]
        try:
            layout = PeerLayout.for_model(self.ep.size, cfg.experts_per_rank, cfg.ll_tokens, cfg.top_k, cfg.hidden,
                                          dtype, cfg.fp8_dispatch)
            memory = symmetric_peer_memory(self.ep, layout.nbytes, self.device)
            dispatcher = PeerLowLatencyDispatcher(memory, layout, cfg.fp8_dispatch, dtype)
            eager = self._time_pair(lambda: dispatcher.dispatch(x.hidden, x.topk_ids, x.topk_weights),
                                    lambda recv, handle: dispatcher.combine(_expert_out(recv, x), handle))
            graphs = self._time_in_turn(*self._capture(dispatcher, x))
            memory.raise_if_failed()
        except Exception as e:  # every rank fails alike (the rendezvous is collective)
            self.notes.append(f"symm_mem low-latency rows skipped: {type(e).__name__}: {e}")
            return []
        rows = []
        for variant, (t_d, t_c) in (("symm_mem eager", eager), ("symm_mem cuda graph", graphs)):
            rows += [Row("low_latency", "dispatch", variant, cfg.ll_tokens, t_d, *counts["dispatch"][:2],
                         counts["dispatch"][1], deepep=DEEPEP["low_latency", "dispatch"]),
                     Row("low_latency", "combine", variant, cfg.ll_tokens, t_c, *counts["combine"][:2],
                         counts["combine"][1], deepep=DEEPEP["low_latency", "combine"])]
        return rows

    def _time_in_turn(self, first: torch.cuda.CUDAGraph, second: torch.cuda.CUDAGraph) -> tuple[float, float]:
        """Median µs of each of two graphs, replayed one after the other."""
        times: tuple[list[float], list[float]] = ([], [])
        for i in range(self.cfg.warmup + self.cfg.iters):
            for graph, out in zip((first, second), times):
                self._align()
                t, _ = self._timed(graph.replay)
                if i >= self.cfg.warmup:
                    out.append(t)
        return self._slowest_median_us(times[0]), self._slowest_median_us(times[1])

    def _capture(self, dispatcher: Dispatcher, x: _Inputs) -> tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as CUDA graphs need
            for _ in range(3):
                recv, handle = dispatcher.dispatch(x.hidden, x.topk_ids, x.topk_weights)
                dispatcher.combine(_expert_out(recv, x), handle)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        dispatch, combine = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(dispatch):
            recv, handle = dispatcher.dispatch(x.hidden, x.topk_ids, x.topk_weights)
        with torch.cuda.graph(combine, pool=dispatch.pool()):  # reads dispatch's outputs
            dispatcher.combine(_expert_out(recv, x), handle)
        self._graphs += [dispatch, combine]
        return dispatch, combine

    def _mean(self, value: float) -> float:
        values: list[float | None] = [None] * self.ep.size
        dist.all_gather_object(values, value, group=self.host)
        return statistics.mean(values)


def _expert_out(recv, x: _Inputs) -> torch.Tensor:
    """What the experts would hand to combine: the received layout in the tokens' dtype (FP8
    tokens come back in the dtype they had)."""
    if recv.hidden_scale is None:
        return recv.hidden
    return torch.empty(recv.hidden.shape, dtype=x.hidden.dtype, device=x.hidden.device)


if __name__ == "__main__":
    main()
