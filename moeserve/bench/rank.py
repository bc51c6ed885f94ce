"""One rank of a DP-attention + EP deployment, emulated on one device: ``moeserve bench rank``, and
both roles of a reference deployment side by side with its published figures: ``moeserve bench
deployment``.

Under DP attention and EP every GPU runs the same program on its own share, so one rank's step
and a model of the network predict the deployment. The emulator builds exactly one rank's share
of the model: every attention layer with its weights and this rank's KV cache, the dense layers
and the LM head as DP runs them (whole, on the rank's own tokens), the shared experts, the router,
and ``(routed + redundant) / ep_size`` expert slots per MoE layer. It times a real step of the
engine over it (prefill: ``tokens_per_rank`` tokens in prompts of ``input_len``; decode:
``batch_per_rank`` sequences over ``context`` cached tokens, under CUDA graphs), with the
all-to-all replaced by local copies of the busiest rank's rows (``distributed/emulated.py``) and
its time modelled (``bench/network.py``). The step is then scheduled: every operation of the model
at its measured time (an eager pass timed operation by operation, scaled to the measured step) on
the compute stream, each dispatch and combine on the network between its issue and its wait half.
Without two-batch overlap that is the sum; with it, the two micro-batches' operations in the order
the overlap executor runs them, so one's all-to-all hides behind the other's compute.

What is measured: the step's compute (including the local copies), the per-operation split, the
peak memory. What is modelled: the network time, the schedule, and every throughput derived from
them (marked so in the report).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from moeserve.bench.network import NetworkModel, Traffic, network_model
from moeserve.bench.one_batch import default_device, sync
from moeserve.config import EngineConfig, ModelConfig, default_page_size, engine_config_for
from moeserve.core import ForwardBatch, ForwardMode, Req, SamplingParams, ScheduleBatch, ScheduledSeq
from moeserve.distributed.emulated import EmulatedEP
from moeserve.eplb.algorithm import trivial_phy2log
from moeserve.eplb.placement import ExpertPlacement
from moeserve.executor import overlap
from moeserve.executor.model_runner import ModelRunner
from moeserve.flags import add_config_flags
from moeserve.layers.moe import MoEOptions

GB = 1e9
GPU_MEMORY_GB = {"H100 80 GB": 80 * 2**30 / GB, "H200 141 GB": 141 * 2**30 / GB * 0.99}
MEMORY_HEADROOM = 0.95  # of a GPU's memory a deployment can fill (the rest: CUDA context, NCCL, fragments)
COMM_OPS = {"op_moe_dispatch_a": ("dispatch", "op_moe_dispatch_b"), "op_moe_combine_a": ("combine", "op_moe_combine_b")}


# ---------------------------------------------------------------------------------------- the rank
@dataclass(frozen=True)
class RankSpec:
    """One rank's share and load."""

    role: str  # prefill | decode
    ep_size: int
    redundant: int = 0
    tokens_per_rank: int = 16384  # prefill
    input_len: int = 4096  # prefill
    batch_per_rank: int = 256  # decode
    context: int = 2000  # decode: cached tokens per sequence
    balancedness: float | dict[int, float] = 1.0
    two_batch_overlap: bool = False

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        if self.role == "prefill" and (self.tokens_per_rank < 1 or self.input_len < 1):
            raise ValueError("tokens_per_rank and input_len must be >= 1")
        if self.role == "decode" and (self.batch_per_rank < 1 or self.context < 1):
            raise ValueError("batch_per_rank and context must be >= 1")
        if self.redundant < 0:
            raise ValueError(f"redundant must be >= 0, got {self.redundant}")

    @property
    def dispatch_mode(self) -> str:
        """DeepEP's: normal (contiguous layout) for prefill, low latency (masked) for decode."""
        return "normal" if self.role == "prefill" else "low_latency"

    def prompts(self) -> list[int]:
        """Prefill: the prompt lengths making up ``tokens_per_rank`` (the last may be shorter)."""
        full, rest = divmod(self.tokens_per_rank, self.input_len)
        return [self.input_len] * full + ([rest] if rest else [])


class RankRunner(ModelRunner):
    """The model runner of one emulated rank: the placement of ``ep_size`` ranks (this is rank 0)
    and emulated dispatchers."""

    def __init__(self, config: EngineConfig, spec: RankSpec) -> None:
        self.spec = spec
        super().__init__(config)

    def _initial_placement(self) -> ExpertPlacement:
        cfg, spec = self.config.model, self.spec
        num_logical = max(cfg.n_routed_experts, 1)
        num_physical = num_logical + spec.redundant
        if num_physical % spec.ep_size:
            raise ValueError(f"redundant: {num_physical} expert slots ({num_logical} + {spec.redundant}) do not "
                             f"divide over {spec.ep_size} EP ranks")
        phy2log = trivial_phy2log(cfg.num_layers, num_logical, num_physical)
        return ExpertPlacement.from_phy2log(phy2log, num_logical, spec.ep_size)

    def _moe_options(self) -> MoEOptions:
        return dataclasses.replace(super()._moe_options(), deepep_mode=self.spec.dispatch_mode,
                                   emulated=EmulatedEP(self.spec.ep_size, self.spec.balancedness))


def rank_config(model: ModelConfig, spec: RankSpec, device: str, quantization: str | None,
                page_size: int | None = None, cuda_graphs: bool = True, kv_cache_dtype: str = "auto") -> EngineConfig:
    page = page_size or default_page_size(device)
    if spec.role == "prefill":
        tokens = spec.tokens_per_rank + page * (len(spec.prompts()) + 1)
        running, chunk = len(spec.prompts()), spec.tokens_per_rank
    else:
        tokens = spec.batch_per_rank * (spec.context + 1 + page) + page
        running, chunk = spec.batch_per_rank, 8192
    return engine_config_for(model, load_format="dummy", device=device, quantization=quantization, page_size=page,
                             max_total_tokens=tokens, max_running_requests=running, chunked_prefill_size=chunk,
                             max_prefill_tokens=chunk, disable_cuda_graph=not cuda_graphs or spec.role == "prefill",
                             cuda_graph_max_bs=max(running, 1), enable_two_batch_overlap=spec.two_batch_overlap,
                             tbo_min_tokens=2, context_length=max(spec.context + 8, spec.input_len + 8, 16),
                             kv_cache_dtype=kv_cache_dtype)


# ------------------------------------------------------------------------------------ the step
def build_step(runner: ModelRunner, spec: RankSpec, seed: int = 0) -> ScheduleBatch:
    """The step the rank runs, over requests holding pages of the runner's cache (decode: the
    cache filled with random latents, as after the prompts' prefill)."""
    pool, vocab = runner.new_page_pool(), runner.config.model.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    if spec.role == "prefill":
        seqs = []
        for i, n in enumerate(spec.prompts()):
            req = Req(f"p{i}", torch.randint(0, vocab, (n,), generator=gen).tolist(), params)
            req.page_table = pool.alloc(pool.pages_for(n))
            seqs.append(ScheduledSeq(req, 0, n))
        return ScheduleBatch(ForwardMode.EXTEND, seqs)
    seqs = []
    for i in range(spec.batch_per_rank):
        req = Req(f"d{i}", torch.randint(0, vocab, (spec.context,), generator=gen).tolist(), params)
        req.output_ids.append(int(torch.randint(0, vocab, (1,), generator=gen)))
        req.page_table = pool.alloc(pool.pages_for(spec.context + 1))
        req.kv_len = spec.context
        seqs.append(ScheduledSeq(req, spec.context, spec.context + 1))
    torch.manual_seed(seed)
    runner.kv_pool.fill_normal_()  # real latents to attend over (their values do not change the time)
    return ScheduleBatch(ForwardMode.DECODE, seqs)


def step_ms(runner: ModelRunner, batch: ScheduleBatch, repeats: int) -> list[float]:
    """Wall times of the engine's step (``runner.forward``: decode replays its CUDA graph), from an
    idle device to the logits' argmax on the host; each step writes the same cache slots."""
    device, times = runner.device, []
    runner.forward(batch).argmax(-1).tolist()  # warm-up
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        runner.forward(batch).argmax(-1).tolist()
        times.append((time.perf_counter() - start) * 1e3)
    return times


@dataclass
class OpRecord:
    micro_batch: int
    layer: int | None
    name: str
    tokens: int
    ms: float = 0.0


class _OpTimer:
    """Wraps a model's operations: each call's device time (CUDA events; host time on the CPU), in
    the order they ran."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.records: list[OpRecord] = []
        self._marks: list[tuple[Any, Any]] = []

    def wrap(self, ops: list, states: tuple) -> list:
        """``ops`` timed; a call's micro-batch is the index of its state in ``states``."""
        return [op if op is overlap.YIELD else self._timed(op, states) for op in ops]

    def _timed(self, op, states: tuple):
        layer = getattr(getattr(op, "__self__", None), "layer_id", None)
        name = getattr(op, "__name__", repr(op))

        def call(state, batch: ForwardBatch) -> None:
            start = self._mark()
            op(state, batch)
            self._marks.append((start, self._mark()))
            micro_batch = next(i for i, s in enumerate(states) if s is state)
            self.records.append(OpRecord(micro_batch, layer, name, batch.num_tokens))
        return call

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def finish(self) -> list[OpRecord]:
        if self.cuda:
            torch.cuda.synchronize()
        for record, (a, b) in zip(self.records, self._marks):
            record.ms = a.elapsed_time(b) if self.cuda else (b - a) * 1e3
        return self.records


@torch.inference_mode()
def time_ops(runner: ModelRunner, batch: ScheduleBatch, overlapped: bool) -> list[OpRecord]:
    """One eager pass of the model's layers, operation by operation (both micro-batches, in the
    overlap executor's order, when ``overlapped``)."""
    timer = _OpTimer(runner.device)
    if not overlapped:
        fb = runner.build_batch(batch)
        state = runner.model.begin(fb)
        overlap.run(timer.wrap(runner.model.operations(), (state,)), state, fb)
        runner.model.end(state, fb)
        return timer.finish()
    split = overlap.split_batch(batch, runner.config.runner.tbo_token_distribution_threshold)
    batches = (runner.build_batch(split.first), runner.build_batch(split.second))
    for b in batches:
        b.launch_batch_size = len(batch.seqs)
    strategy = overlap.PREFILL if batch.mode is ForwardMode.EXTEND else overlap.DECODE
    states = (runner.model.begin(batches[0]), runner.model.begin(batches[1]))
    overlap.run_overlapped(timer.wrap(runner.model.operations(strategy.name), states), states, batches, strategy.delta)
    for s, b in zip(states, batches):
        runner.model.end(s, b)
    return timer.finish()


def kernel_breakdown(runner: ModelRunner, batch: ScheduleBatch, steps: int = 3, rows: int = 25) -> list[dict]:
    """The step's device time by kernel (torch.profiler over ``steps`` steps; host time by operator
    on the CPU), per step, the largest first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            runner.forward(batch).argmax(-1).tolist()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, key))[:rows]
    return [{"name": e.key, "ms_per_step": getattr(e, key) / 1e3 / steps, "calls_per_step": e.count / steps}
            for e in events if getattr(e, key) > 0]


def schedule_ms(records: list[OpRecord], comm_ms) -> tuple[float, float]:
    """``(step, network)``: the makespan of ``records`` (in run order) on one compute stream, each
    dispatch and combine on one network link from its issue half to its wait half, and the network
    time in all. ``comm_ms(record, op) -> ms`` models one all-to-all."""
    compute_free = link_free = network = 0.0
    pending: dict[tuple[int, int | None, str], float] = {}
    for r in records:
        start = compute_free
        for issue, (op, wait) in COMM_OPS.items():
            if r.name == wait:
                start = max(start, pending.pop((r.micro_batch, r.layer, op), start))
        compute_free = start + r.ms
        if r.name in COMM_OPS:
            op = COMM_OPS[r.name][0]
            t = comm_ms(r, op)
            begin = max(compute_free, link_free)
            link_free = begin + t
            network += t
            pending[(r.micro_batch, r.layer, op)] = link_free
    return compute_free, network


# ---------------------------------------------------------------------------------- the report
def run_rank(model: ModelConfig, spec: RankSpec, network: NetworkModel, *, device: str, quantization: str | None,
             repeats: int = 10, gpus_per_node: int = 8, gpu_hour_usd: float = 2.0, page_size: int | None = None,
             seed: int = 0, profile: bool = False, kv_cache_dtype: str = "auto") -> dict[str, Any]:
    """Build the rank, time its step, schedule it with the network; a JSON-able report."""
    config = rank_config(model, spec, device, quantization, page_size, kv_cache_dtype=kv_cache_dtype)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    runner = RankRunner(config, spec)
    try:
        batch = build_step(runner, spec, seed)
        times = step_ms(runner, batch, repeats)
        records = time_ops(runner, batch, spec.two_batch_overlap)
        peak = torch.cuda.max_memory_allocated(dev) / GB if dev.type == "cuda" else None
        kernels = kernel_breakdown(runner, batch) if profile else None
    finally:
        del runner
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out = report(model, spec, network, statistics.median(times), records, peak, gpus_per_node, gpu_hour_usd,
                 config, times)
    if kernels is not None:
        out["measured"]["kernels"] = kernels
    return out


def report(model: ModelConfig, spec: RankSpec, network: NetworkModel, measured_ms: float, records: list[OpRecord],
           peak_gb: float | None, gpus_per_node: int, gpu_hour_usd: float, config: EngineConfig,
           times: list[float]) -> dict[str, Any]:
    eager_ms = sum(r.ms for r in records)
    scale = measured_ms / eager_ms if eager_ms > 0 else 1.0  # the eager split, scaled to the real step
    for r in records:
        r.ms *= scale
    ops = [[r.micro_batch, r.layer, r.name, r.tokens, r.ms] for r in records]
    breakdown: dict[str, float] = defaultdict(float)
    for r in records:
        breakdown[r.name.removeprefix("op_")] += r.ms
    return {
        "role": spec.role, "spec": dataclasses.asdict(spec), "model": {"layers": model.num_layers,
                                                                       "routed_experts": model.n_routed_experts},
        "device": torch.cuda.get_device_name() if config.load.device == "cuda" else "cpu",
        "quantization": config.load.quantization, "dtype": str(config.load.torch_dtype(config.model)),
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "date": time.strftime("%Y-%m-%d"),
        "measured": {"step_ms": measured_ms, "step_ms_all": times, "eager_ops_ms": eager_ms, "ops": ops,
                     "peak_memory_gb": peak_gb, "breakdown_ms": dict(sorted(breakdown.items(), key=lambda kv: -kv[1]))},
        "modelled": {**project(model, spec, network, records, gpus_per_node, gpu_hour_usd),
                     "fits": None if peak_gb is None else {name: peak_gb <= cap * MEMORY_HEADROOM
                                                           for name, cap in GPU_MEMORY_GB.items()}},
    }


def project(model: ModelConfig, spec: RankSpec, network: NetworkModel, records: list[OpRecord], gpus_per_node: int,
            gpu_hour_usd: float) -> dict[str, Any]:
    """The modelled part of a report: ``records`` scheduled with ``network``, and what that gives."""
    bal = EmulatedEP(spec.ep_size, spec.balancedness)

    def comm_ms(r: OpRecord, op: str) -> float:
        traffic = Traffic(r.tokens, model.hidden_size, model.num_experts_per_tok, spec.ep_size, gpus_per_node,
                          bal.balancedness_of(r.layer))
        return network.seconds(spec.dispatch_mode, op, traffic) * 1e3

    step, net = schedule_ms(records, comm_ms)
    per_gpu = (spec.tokens_per_rank if spec.role == "prefill" else spec.batch_per_rank) / step * 1e3
    return {"network": network.name, "network_source": network.source, "network_ms": net, "step_ms": step,
            "tokens_per_s_per_gpu": per_gpu, "tokens_per_s_per_node": per_gpu * gpus_per_node,
            "usd_per_million_tokens": gpu_hour_usd / (per_gpu * 3600) * 1e6, "gpu_hour_usd": gpu_hour_usd}


def reschedule(saved: dict[str, Any], network: NetworkModel, model: ModelConfig, gpus_per_node: int = 8,
               gpu_hour_usd: float | None = None) -> dict[str, Any]:
    """A saved report's measured operations scheduled again with another network model (no device
    needed): the same JSON shape."""
    if "ops" not in saved.get("measured", {}):
        raise ValueError("--from-json: the report has no measured operations ('ops'); write it with this version's "
                         "bench rank or bench deployment --json")
    spec_fields = dict(saved["spec"])
    if isinstance(spec_fields["balancedness"], dict):
        spec_fields["balancedness"] = {int(k): v for k, v in spec_fields["balancedness"].items()}
    spec = RankSpec(**spec_fields)
    records = [OpRecord(mb, layer, name, tokens, ms) for mb, layer, name, tokens, ms in saved["measured"]["ops"]]
    usd = gpu_hour_usd if gpu_hour_usd is not None else saved["modelled"]["gpu_hour_usd"]
    out = json.loads(json.dumps(saved))
    out["modelled"].update(project(model, spec, network, records, gpus_per_node, usd))
    return out


def format_report(r: dict[str, Any]) -> str:
    s, m, mod = r["spec"], r["measured"], r["modelled"]
    load = (f"{s['tokens_per_rank']} tokens in prompts of {s['input_len']}" if r["role"] == "prefill"
            else f"{s['batch_per_rank']} sequences over {s['context']} cached tokens")
    lines = [f"{r['role']} rank of EP{s['ep_size']} (+{s['redundant']} redundant), {load}, "
             f"{r['model']['layers']} layers, {r['quantization'] or r['dtype']}, two-batch overlap "
             f"{'on' if s['two_batch_overlap'] else 'off'}, balancedness {s['balancedness']}, {r['device']}",
             f"  measured: compute step {m['step_ms']:.2f} ms"
             + (f", peak memory {m['peak_memory_gb']:.1f} GB" if m["peak_memory_gb"] is not None else ""),
             f"  modelled ({mod['network']}): network {mod['network_ms']:.2f} ms, step {mod['step_ms']:.2f} ms, "
             f"{mod['tokens_per_s_per_gpu']:.0f} tok/s per GPU, {mod['tokens_per_s_per_node']:.0f} per node, "
             f"${mod['usd_per_million_tokens']:.3f} per 1M tokens at ${mod['gpu_hour_usd']}/GPU-hour"]
    if mod["fits"]:
        lines.append("  fits: " + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in mod["fits"].items()))
    top = list(m["breakdown_ms"].items())[:8]
    lines.append("  step by operation (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in top))
    for k in (m.get("kernels") or [])[:10]:
        lines.append(f"    {k['ms_per_step']:9.3f} ms  {k['calls_per_step']:6.0f} calls  {k['name'][:80]}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- the CLI
def _add_model_args(p: argparse.ArgumentParser) -> None:
    from moeserve.planner import PRESETS

    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="dsv3", choices=sorted(PRESETS), help="the model's shapes (random weights)")
    src.add_argument("--model-path", default=None,
                     help="a checkpoint folder: its config.json's shapes (random weights)")
    p.add_argument("--num-layers", type=int, default=None, help="with --preset: stack this many layers")


def model_from(args: argparse.Namespace) -> ModelConfig:
    if args.model_path:
        with open(f"{args.model_path}/config.json") as f:
            return ModelConfig.from_dict(json.load(f))
    from moeserve.planner import preset_config

    return preset_config(args.preset, args.num_layers)


def add_rank_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    p.add_argument("--role", choices=("prefill", "decode"), required=True)
    p.add_argument("--redundant", type=int, default=0, help="redundant expert slots over the whole group")
    p.add_argument("--tokens-per-rank", type=int, default=16384, help="prefill: tokens a rank runs a step")
    p.add_argument("--input-len", type=int, default=4096, help="prefill: prompt length")
    p.add_argument("--batch-per-rank", type=int, default=256, help="decode: sequences a rank runs a step")
    p.add_argument("--context", type=int, default=2000, help="decode: cached tokens per sequence")
    add_config_flags(p, {"ep_size", "quantization", "enable_two_batch_overlap", "device", "page_size",
                         "kv_cache_dtype"},
                     defaults={"device": default_device()}, required={"ep_size"},
                     helps={"ep_size": "ranks of the EP group this rank is one of"})
    bal = p.add_mutually_exclusive_group()
    bal.add_argument("--balancedness", type=float, default=None,
                     help="mean / busiest rank's expert rows, every MoE layer (default 1.0: perfect balance)")
    bal.add_argument("--distribution", default=None,
                     help="a routing (a recording folder, or zipf:S; as eplb simulate takes) whose EPLB placement "
                          "at this EP size gives each layer's balancedness (eplb simulate's)")
    p.add_argument("--network", default="deepep", help="deepep | ib400 | measured:PATH (bench/network.py)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-hour-usd", type=float, default=2.0, help="for the cost per million tokens")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="also the step's device time by kernel")
    p.add_argument("--json", default=None, metavar="PATH")


def balancedness_from(args: argparse.Namespace, model: ModelConfig, tokens_per_rank: int) -> float | dict[int, float]:
    """``--balancedness``, or per MoE layer from ``--distribution`` through eplb simulate."""
    if args.distribution is None:
        return 1.0 if args.balancedness is None else args.balancedness
    from moeserve.eplb.simulator import simulate
    from moeserve.eplb.workload import load_source

    routing = load_source(args.distribution)
    found = simulate(routing, [args.ep_size], [args.redundant], tokens_per_gpu=tokens_per_rank,
                     gpus_per_node=args.gpus_per_node)
    rows = [r for r in found["results"] if r["setting"] == "eplb"]
    if not rows:
        raise ValueError(f"--distribution: EP{args.ep_size} with {args.redundant} redundant does not fit its routing "
                         f"({found['skipped']})")
    per_layer = [b if b is not None else 1.0 for b in rows[0]["per_layer"]["balancedness"]]
    moe_layers = [i for i in range(model.num_layers) if model.is_moe_layer(i)]
    return {layer: per_layer[i % len(per_layer)] for i, layer in enumerate(moe_layers)}


def spec_from(args: argparse.Namespace, model: ModelConfig) -> RankSpec:
    tokens = args.tokens_per_rank if args.role == "prefill" else args.batch_per_rank
    return RankSpec(args.role, args.ep_size, args.redundant, args.tokens_per_rank, args.input_len,
                    args.batch_per_rank, args.context, balancedness_from(args, model, tokens),
                    args.enable_two_batch_overlap)


def run_rank_benchmark(args: argparse.Namespace) -> int:
    model = model_from(args)
    result = run_rank(model, spec_from(args, model), network_model(args.network), device=args.device,
                      quantization=args.quantization, repeats=args.repeats, gpus_per_node=args.gpus_per_node,
                      gpu_hour_usd=args.gpu_hour_usd, page_size=args.page_size, seed=args.seed, profile=args.profile,
                      kv_cache_dtype=args.kv_cache_dtype)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


# --------------------------------------------------------------------------- reference deployments
# SGLang's 96 x H100 deployment of DeepSeek-V3 (LMSYS blog, 2025-05-05): per-node throughput, its
# settings, and the other columns of its tables. Prefill: 4 nodes, EP32, 16,384 tokens per GPU in
# 4,096-token prompts; decode: 9 nodes, EP72, 256 sequences per GPU over 2,000 cached tokens.
REFERENCES = {
    "sglang-96xh100": {
        "source": "https://lmsys.org/blog/2025-05-05-large-scale-ep/ (H100, DeepSeek-V3 FP8, 32 redundant experts)",
        "prefill": {"ep_size": 32, "redundant": 32, "tokens_per_rank": 16384, "input_len": 4096,
                    "per_node": {"SGLang (default)": 50302, "SGLang + simulated perfect EPLB": 59337,
                                 "DeepSeek profile (H800, perfect balance)": 62713,
                                 "DeepSeek blog (production, excl. cache hits)": 32206}},
        "decode": {"ep_size": 72, "redundant": 32, "batch_per_rank": 256, "context": 2000,
                   "per_node": {"SGLang (default, 256 seqs, 2K)": 22282,
                                "SGLang + simulated MTP (128 seqs, 4K)": 17373,
                                "DeepSeek profile (H800, 128 seqs, 4K)": 18598,
                                "DeepSeek blog (production)": 14800}},
    },
}


def add_deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reference", default="sglang-96xh100", choices=sorted(REFERENCES))
    _add_model_args(p)
    add_config_flags(p, {"quantization", "device"}, defaults={"quantization": "fp8", "device": default_device()})
    p.add_argument("--balancedness", type=float, default=1.0)
    p.add_argument("--network", default="deepep")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-hour-usd", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--overlap", choices=("both", "on", "off"), default="both", help="two-batch overlap")
    p.add_argument("--roles", nargs="+", choices=("prefill", "decode"), default=["prefill", "decode"])
    p.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                   help="no device: schedule the measured operations of these saved reports (--json of an earlier "
                        "run) with --network instead")
    p.add_argument("--profile", action="store_true", help="also each step's device time by kernel")
    p.add_argument("--json", default=None, metavar="PATH")
    # smaller loads, for a smoke test on a small device (the reference's are the defaults)
    p.add_argument("--scale-load", type=float, default=1.0, help="multiply the reference's per-rank load by this")
    # longer sequences than the reference's (its 2,000-token decode contexts, 4,096-token prompts)
    p.add_argument("--context", type=int, default=None, help="decode: cached tokens per sequence instead")
    p.add_argument("--batch-per-rank", type=int, default=None,
                   help="decode: sequences a GPU instead (fewer fit over long contexts)")
    p.add_argument("--input-len", type=int, default=None,
                   help="prefill: prompts of this many tokens instead (a rank's tokens at least one prompt)")


def run_deployment_benchmark(args: argparse.Namespace) -> int:
    ref = REFERENCES[args.reference]
    model = model_from(args)
    network = network_model(args.network)
    if args.from_json:
        results = []
        for path in args.from_json:
            with open(path) as f:
                saved = json.load(f)
            results += [reschedule(r, network, model, args.gpus_per_node, args.gpu_hour_usd) for r in saved["results"]]
        print(format_deployment(ref, results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"reference": args.reference, "reference_figures": ref, "results": results}, f, indent=2)
        return 0
    overlaps = {"both": (False, True), "on": (True,), "off": (False,)}[args.overlap]
    results = []
    for role in args.roles:
        r = ref[role]
        for tbo in overlaps:
            input_len = (args.input_len or max(1, int(r["input_len"] * args.scale_load))) if role == "prefill" else 0
            load = (dict(tokens_per_rank=max(1, int(r["tokens_per_rank"] * args.scale_load), input_len),
                         input_len=input_len) if role == "prefill"
                    else dict(batch_per_rank=args.batch_per_rank or max(2, int(r["batch_per_rank"] * args.scale_load)),
                              context=args.context or max(1, int(r["context"] * args.scale_load))))
            spec = RankSpec(role, r["ep_size"], r["redundant"], balancedness=args.balancedness,
                            two_batch_overlap=tbo, **load)
            out = run_rank(model, spec, network, device=args.device, quantization=args.quantization,
                           repeats=args.repeats, gpus_per_node=args.gpus_per_node, gpu_hour_usd=args.gpu_hour_usd,
                           profile=args.profile)
            print(format_report(out), file=sys.stderr, flush=True)
            results.append(out)
    print(format_deployment(ref, results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"reference": args.reference, "reference_figures": ref, "results": results}, f, indent=2)
    return 0


def format_deployment(ref: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = [f"reference: {ref['source']}",
             f"{'':54}{'tok/s per node':>16}{'per GPU':>10}{'step ms':>10}{'network ms':>12}{'peak GB':>9}"]
    for role in dict.fromkeys(r["role"] for r in results):
        lines.append(f"{role} (EP{ref[role]['ep_size']}):")
        for name, per_node in ref[role]["per_node"].items():
            lines.append(f"  {name:<52}{per_node:>16,}{per_node / 8:>10,.0f}")
        for r in (x for x in results if x["role"] == role):
            m, mod = r["measured"], r["modelled"]
            name = (f"moeserve, modelled ({mod['network']}), TBO {'on' if r['spec']['two_batch_overlap'] else 'off'}, "
                    f"b {r['spec']['balancedness']}")
            peak = "-" if m["peak_memory_gb"] is None else f"{m['peak_memory_gb']:.1f}"
            lines.append(f"  {name:<52}{mod['tokens_per_s_per_node']:>16,.0f}{mod['tokens_per_s_per_gpu']:>10,.0f}"
                         f"{mod['step_ms']:>10.1f}{mod['network_ms']:>12.1f}{peak:>9}")
    return "\n".join(lines)
