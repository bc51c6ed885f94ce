"""One batch straight on the engine (``moeserve bench one-batch``), as SGLang's ``bench_one_batch``.

No scheduler and no server: ``B`` requests of ``I`` random prompt tokens get their pages from the
runner's page pool, one prefill runs all prompts (split into calls of at most
``--max-prefill-tokens`` tokens), then ``O - 1`` decode steps feed back the greedy token, so each
request ends with ``O`` output tokens. The whole pass runs once untimed first (Triton compiles
its kernels, the runner captures its CUDA graphs), then once timed; each call is timed from a
synchronised device to its sampled tokens on the host. Reported: prefill latency and tokens/s,
the median decode step and tokens/s (``B`` per step), peak device memory, weights, KV capacity.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import typing
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moeserve.bench.structured import json_constraints, sample_step
from moeserve.cache import PagePool
from moeserve.config import EngineConfig, build_engine_config, default_page_size, engine_config_for
from moeserve.core import ForwardMode, Req, SamplingParams, ScheduleBatch, ScheduledSeq
from moeserve.executor.grammar import Constraint
from moeserve.executor.model_runner import ModelRunner
from moeserve.executor.sampler import Sampler
from moeserve.flags import add_config_flags

GB = 1e9


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_model_args(p: argparse.ArgumentParser, preset: str | None = None, num_layers: int | None = None) -> None:
    """The model and engine flags the engine benchmarks share (one GPU, no parallelism)."""
    from moeserve.planner import PRESETS

    src = p.add_mutually_exclusive_group(required=preset is None)
    src.add_argument("--model-path", default=None, help="Hugging Face checkpoint folder")
    src.add_argument("--preset", default=preset, choices=sorted(PRESETS),
                     help="a released architecture with random weights (dsv3 = DeepSeek-V3)")
    p.add_argument("--num-layers", type=int, default=num_layers, help="with --preset: stack this many layers")
    p.add_argument("--num-dense-layers", type=int, default=None,
                   help="with --preset: dense layers among them (default: the released share, at least 1)")
    add_config_flags(p, names={"load_format", "dtype", "device", "page_size", "max_total_tokens",
                               "mem_fraction_static", "quantization", "disable_cuda_graph", "cuda_graph_max_bs",
                               "max_prefill_tokens", "kv_cache_dtype"},
                     defaults={"load_format": None, "device": default_device()})  # None: dummy with --preset
    p.add_argument("--seed", type=int, default=0, help="seeds random weights and prompts")


def add_one_batch_args(p: argparse.ArgumentParser) -> None:
    """Add the ``bench one-batch`` flags to ``p``."""
    add_model_args(p)
    p.add_argument("--batch-size", type=int, nargs="+", default=[1], help="one run per value")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=16, help="tokens per request: 1 from prefill, the rest decode")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument("--roofline", action="store_true",
                   help="CUDA: measure the copy and matmul ceilings first and print each step's time over its "
                        "roofline (bench/roofline.py; FP8 weights at the fp8 matmul rate)")
    p.add_argument("--profile", action="store_true",
                   help="after timing, run one more pass under torch.profiler and print its top kernels")
    p.add_argument("--json-schema-share", type=float, nargs="+", default=None, metavar="SHARE",
                   help="one run per value and batch size with this share of the batch held to a JSON schema by "
                        "xgrammar, every step through the engine's sampler (bench/structured.py); 0 is the "
                        "baseline through the same path")


# ----------------------------------------------------------------------------------------- config


def engine_config_from_args(args: argparse.Namespace, max_running_requests: int,
                            max_total_tokens: int | None = None) -> EngineConfig:
    """The engine the flags describe; ``max_total_tokens`` sizes the KV cache unless the flag does."""
    settings = {
        "device": args.device, "dtype": args.dtype, "seed": args.seed, "page_size": args.page_size,
        "max_total_tokens": args.max_total_tokens or max_total_tokens,
        "mem_fraction_static": args.mem_fraction_static, "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "disable_cuda_graph": args.disable_cuda_graph, "cuda_graph_max_bs": args.cuda_graph_max_bs,
        "max_running_requests": max_running_requests,
    }
    if args.model_path:
        return build_engine_config(args.model_path, load_format=args.load_format or "auto", **settings)
    if (args.load_format or "dummy") != "dummy":
        raise ValueError("--preset has no checkpoint: use --load-format dummy")
    from moeserve.planner import preset_config

    model = preset_config(args.preset, args.num_layers, args.num_dense_layers)
    return engine_config_for(model, load_format="dummy", **settings)


def describe(config: EngineConfig) -> str:
    """One line naming the model and how it runs."""
    m = config.model
    moe = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    experts = f", {m.n_routed_experts} experts top-{m.num_experts_per_tok}" if moe else ""
    quant = f", {config.load.quantization} weights" if config.load.quantization else ""
    graphs = "off" if config.runner.disable_cuda_graph else f"up to batch {config.runner.cuda_graph_max_bs}"
    kv = "" if config.cache.kv_cache_dtype == "auto" else f", {config.cache.kv_cache_dtype} KV cache"
    return (f"{m.model_type}, {m.num_layers} layers ({m.num_layers - moe} dense + {moe} MoE){experts}, "
            f"{config.load.torch_dtype(m)}{quant}{kv}, device {config.load.device}, CUDA graphs {graphs}")


# ------------------------------------------------------------------------------------------ a pass


def random_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch_size, input_len), generator=gen).tolist()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def admit(pool: PagePool, prompts: list[list[int]], output_len: int) -> list[Req]:
    """Requests holding pages of ``pool`` for their prompt and ``output_len`` tokens; all or none."""
    reqs = []
    for i, ids in enumerate(prompts):
        req = Req(f"bench-{i}", list(ids), SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True))
        pages = pool.alloc(pool.pages_for(len(ids) + output_len))
        if pages is None:
            release(pool, reqs)
            need = len(prompts) * pool.pages_for(len(ids) + output_len) * pool.page_size
            raise ValueError(f"the KV cache holds {pool.capacity * pool.page_size} tokens; {len(prompts)} requests "
                             f"of {len(ids)} + {output_len} tokens need {need} (raise --max-total-tokens)")
        req.page_table = pages
        reqs.append(req)
    return reqs


def release(pool: PagePool, reqs: list[Req]) -> None:
    for req in reqs:
        pool.free(req.page_table)
        req.page_table = []
        req.kv_len = 0


def prefill_chunks(reqs: list[Req], max_tokens: int) -> Iterator[list[ScheduledSeq]]:
    """The prompts in order, cut into calls of at most ``max_tokens`` tokens (a long prompt
    continues in the next call over its cached prefix)."""
    if max_tokens < 1:
        raise ValueError(f"max_prefill_tokens must be >= 1, got {max_tokens}")
    seqs, left = [], max_tokens
    for req in reqs:
        start = 0
        while start < len(req.prompt_ids):
            end = min(len(req.prompt_ids), start + left)
            seqs.append(ScheduledSeq(req, start, end))
            left -= end - start
            start = end
            if left == 0:
                yield seqs
                seqs, left = [], max_tokens
    if seqs:
        yield seqs


def timed_forward(runner: ModelRunner, batch: ScheduleBatch, device: torch.device) -> tuple[float, list[int]]:
    """Seconds from a synchronised device to the greedy tokens on the host, and the tokens."""
    sync(device)
    start = time.perf_counter()
    tokens = runner.forward(batch).argmax(-1).tolist()
    return time.perf_counter() - start, tokens


def prefill(runner: ModelRunner, reqs: list[Req], max_tokens: int, device: torch.device) -> float:
    """Prefill every prompt; each request gets its first output token. Returns seconds."""
    total = 0.0
    for seqs in prefill_chunks(reqs, max_tokens):
        seconds, tokens = timed_forward(runner, ScheduleBatch(ForwardMode.EXTEND, seqs), device)
        total += seconds
        for seq, token in zip(seqs, tokens):
            seq.req.kv_len = seq.end
            if seq.completes_fill:
                seq.req.output_ids.append(token)
    return total


def decode_step(runner: ModelRunner, reqs: list[Req], device: torch.device, grammars: Grammars | None = None) -> float:
    """One token for every request (``grammars``: through the sampler, its rows masked). Returns
    seconds."""
    seqs = [ScheduledSeq(r, r.seq_len - 1, r.seq_len) for r in reqs]
    batch = ScheduleBatch(ForwardMode.DECODE, seqs)
    if grammars is None:
        seconds, tokens = timed_forward(runner, batch, device)
    else:
        sync(device)
        start = time.perf_counter()
        tokens = sample_step(runner.forward(batch), reqs, grammars.constraints, grammars.sampler)
        seconds = time.perf_counter() - start
    for req, token in zip(reqs, tokens):
        req.kv_len = req.seq_len
        req.output_ids.append(token)
    return seconds


@dataclass
class Grammars:
    """A pass's matchers (None for a free row) and the sampler its steps go through."""

    constraints: list[Constraint | None]
    sampler: Sampler = dataclasses.field(default_factory=Sampler)


@dataclass
class Pass:
    prefill_s: float
    step_s: list[float]
    tokens: list[list[int]]


def run_pass(runner: ModelRunner, prompts: list[list[int]], output_len: int, max_prefill_tokens: int,
             pool: PagePool | None = None, json_schema_share: float | None = None, seed: int = 0) -> Pass:
    """Prefill, then ``output_len - 1`` decode steps (with ``json_schema_share``: through the
    sampler, that share of the rows held to a JSON schema); the pages (of ``pool``, or of a new
    allocator over the runner's cache) are given back at the end."""
    device = torch.device(runner.config.load.device)
    grammars = None
    if json_schema_share is not None:
        grammars = Grammars(json_constraints(runner.config.model.vocab_size, len(prompts), json_schema_share, seed))
    pool = pool or runner.new_page_pool()
    reqs = admit(pool, prompts, output_len)
    try:
        prefill_s = prefill(runner, reqs, max_prefill_tokens, device)
        steps = [decode_step(runner, reqs, device, grammars) for _ in range(output_len - 1)]
    finally:
        release(pool, reqs)
    return Pass(prefill_s, steps, [r.output_ids for r in reqs])


def profile_pass(runner: ModelRunner, prompts: list[list[int]], output_len: int, max_prefill_tokens: int,
                 rows: int = 30) -> str:
    """One more pass under ``torch.profiler``: its operators by self time on the device (CPU
    time on CPU), then the same split by input shapes, so one sees where a step goes and which
    call of an operator (a copy, a gather) costs it."""
    from torch.profiler import ProfilerActivity, profile

    cuda = runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        run_pass(runner, prompts, output_len, max_prefill_tokens)
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    by_op = prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=70)
    by_shape = prof.key_averages(group_by_input_shape=True).table(
        sort_by=key, row_limit=rows, max_name_column_width=40, max_shapes_column_width=90)
    return f"{by_op}\n{by_shape}"


# ----------------------------------------------------------------------------------------- results


@dataclass
class OneBatchResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_s: float
    prefill_tok_s: float
    decode_step_ms: float | None  # median over the decode steps; None without any
    decode_tok_s: float | None
    decode_steps: int
    peak_memory_gb: float | None  # CUDA: the most allocated during the timed pass
    weights_gb: float
    kv_cache_tokens: int
    tokens_match_warmup: bool | None  # greedy tokens of the timed pass equal the warm-up's
    json_schema_share: float | None = None  # of the rows held to a JSON schema (None: no sampler)
    prefill_of_roofline: float | None = None  # with --roofline: the time over its floor (1 is the floor)
    decode_of_roofline: float | None = None


def weights_bytes(runner: ModelRunner) -> int:
    """Bytes of the model's parameters and buffers, each storage once."""
    seen, total = set(), 0
    for t in list(runner.model.parameters()) + list(runner.model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def bench_one_batch(runner: ModelRunner, batch_size: int, input_len: int, output_len: int,
                    max_prefill_tokens: int = 16384, seed: int = 0, warmup: bool = True,
                    json_schema_share: float | None = None) -> OneBatchResult:
    """Time one batch on ``runner``: a warm-up pass, then the measured one."""
    if batch_size < 1 or input_len < 1 or output_len < 1:
        raise ValueError("batch_size, input_len and output_len must be >= 1")
    device = torch.device(runner.config.load.device)
    prompts = random_prompts(batch_size, input_len, runner.config.model.vocab_size, seed)
    grammar = dict(json_schema_share=json_schema_share, seed=seed)
    first = run_pass(runner, prompts, output_len, max_prefill_tokens, **grammar) if warmup else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timed = run_pass(runner, prompts, output_len, max_prefill_tokens, **grammar)
    peak = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else None
    step = statistics.median(timed.step_s) if timed.step_s else None
    return OneBatchResult(
        batch_size=batch_size, input_len=input_len, output_len=output_len,
        prefill_s=timed.prefill_s, prefill_tok_s=batch_size * input_len / timed.prefill_s,
        decode_step_ms=None if step is None else step * 1e3,
        decode_tok_s=None if step is None else batch_size / step,
        decode_steps=len(timed.step_s), peak_memory_gb=peak, weights_gb=weights_bytes(runner) / GB,
        kv_cache_tokens=runner.max_total_tokens,
        tokens_match_warmup=None if first is None else first.tokens == timed.tokens,
        json_schema_share=json_schema_share,
    )


def attach_roofline(config: EngineConfig, result: OneBatchResult, ceilings) -> None:
    """Fill ``result``'s roofline ratios: prefill as one step over all prompts, decode at the
    context of the middle decode step."""
    from moeserve.bench import roofline as rl

    m = config.model
    weights, kv_bytes = rl.engine_dtypes(config)
    b, n = result.batch_size, result.input_len
    floor = rl.roofline(rl.prefill_work(m, b, n, weights, kv_bytes), ceilings, weights).step_s
    result.prefill_of_roofline = result.prefill_s / floor
    if result.decode_step_ms is not None:
        context = n + result.output_len // 2
        floor = rl.roofline(rl.decode_work(m, b, context, weights, kv_bytes), ceilings, weights).step_s
        result.decode_of_roofline = result.decode_step_ms / 1e3 / floor


def _size(gb: float) -> str:
    return f"{gb:.2f} GB" if gb >= 0.1 else f"{gb * 1e3:.2f} MB"


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_results(config: EngineConfig, results: list[OneBatchResult]) -> str:
    head = results[0] if results else None
    lines = [f"one batch: {describe(config)}"]
    if head:
        lines.append(f"weights {_size(head.weights_gb)}, KV cache {head.kv_cache_tokens} tokens")
    roof = any(r.prefill_of_roofline is not None for r in results)
    shares = any(r.json_schema_share is not None for r in results)
    lines.append(f"{'batch':>6} {'input':>6} {'output':>6} {'prefill s':>10} {'prefill tok/s':>14} "
                 f"{'decode ms':>10} {'decode tok/s':>13} {'peak GB':>8}"
                 + (f" {'prefill/roofline':>17} {'decode/roofline':>16}" if roof else "")
                 + (f" {'JSON share':>11}" if shares else ""))
    for r in results:
        note = "" if r.tokens_match_warmup in (None, True) else "  (tokens differ from the warm-up pass)"
        ratios = (f" {_num(r.prefill_of_roofline, '>16.2f')}x {_num(r.decode_of_roofline, '>15.2f')}x"
                  if roof else "")
        lines.append(f"{r.batch_size:>6} {r.input_len:>6} {r.output_len:>6} {r.prefill_s:>10.4f} "
                     f"{r.prefill_tok_s:>14.1f} {_num(r.decode_step_ms, '>10.3f')} "
                     f"{_num(r.decode_tok_s, '>13.1f')} {_num(r.peak_memory_gb, '>8.2f')}{ratios}"
                     + (f" {_num(r.json_schema_share, '>11.2f')}" if shares else "") + note)
    return "\n".join(lines)


def environment(config: EngineConfig) -> dict[str, typing.Any]:
    device = torch.device(config.load.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": name, "torch": torch.__version__, "model": dataclasses.asdict(config.model),
            "dtype": str(config.load.torch_dtype(config.model)), "quantization": config.load.quantization,
            "disable_cuda_graph": config.runner.disable_cuda_graph, "describe": describe(config)}


def run_one_batch_benchmark(args: argparse.Namespace) -> int:
    """``moeserve bench one-batch``: one runner, one run per batch size."""
    page = args.page_size or default_page_size(args.device)
    need = max(args.batch_size) * (args.input_len + args.output_len + page)
    config = engine_config_from_args(args, max(args.batch_size), None if args.device == "cuda" else need)
    if args.roofline and args.device != "cuda":
        raise ValueError("--roofline measures the GPU's ceilings: it needs --device cuda")
    runner = ModelRunner(config)
    ceilings = None
    if args.roofline:
        from moeserve.bench.kernels import measure_ceilings

        ceilings = measure_ceilings()
        print(f"ceilings: copy {ceilings.copy_gbps:.0f} GB/s, bf16 {ceilings.bf16_tflops:.0f} TFLOP/s, "
              f"fp8 {ceilings.fp8_tflops:.0f} TFLOP/s", file=sys.stderr, flush=True)
    results = []
    for batch_size in args.batch_size:
        for share in args.json_schema_share or [None]:
            results.append(bench_one_batch(runner, batch_size, args.input_len, args.output_len,
                                           args.max_prefill_tokens, args.seed, json_schema_share=share))
            if ceilings is not None:
                attach_roofline(config, results[-1], ceilings)
            print(format_results(config, results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        if args.profile:
            prompts = random_prompts(batch_size, args.input_len, config.model.vocab_size, args.seed)
            print(profile_pass(runner, prompts, args.output_len, args.max_prefill_tokens), flush=True)
    print(format_results(config, results))
    if args.json:
        with open(args.json, "w") as f:
            extra = {"ceilings": dataclasses.asdict(ceilings)} if ceilings is not None else {}
            json.dump({**environment(config), **extra, "results": [dataclasses.asdict(r) for r in results]}, f,
                      indent=1)
    return 0
