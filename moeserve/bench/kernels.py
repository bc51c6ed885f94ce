"""Kernel microbenchmarks: each case timed on the GPU against the ceilings measured in the same run.

``moeserve bench kernels [--only SUBSTR] [--json PATH]``. The ceilings are a large
device-to-device copy (bytes read + written), a large bf16 matmul and an fp8 matmul through
torch (cuBLAS); each case reports its achieved TFLOP/s and GB/s, the fraction of the ceiling it
is bound by, and, where the case has one, the time of its baseline (a torch version) beside it.
Times are the device's (calls queued behind a spin kernel, as a CUDA graph replays them); the
"eager ms" column adds the host's launch cost, as an eager caller sees it.
Cases live in ``moeserve/bench/kernel_cases/*.py``, each module exporting ``cases()``.
"""

from __future__ import annotations

import importlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

CASE_MODULES = ("elementwise", "gemm", "mla")


@dataclass
class KernelCase:
    """One timed call: ``run()`` launches the kernel; ``flops`` and ``bytes`` are the least work and
    the least device-memory traffic the call needs (each input read once, each output written once)."""

    name: str
    run: Callable[[], object]
    flops: float = 0.0
    bytes: float = 0.0
    baseline: Callable[[], object] | None = None
    baseline_name: str = "torch"
    notes: str = ""


@dataclass
class Ceilings:
    copy_gbps: float
    bf16_tflops: float
    fp8_tflops: float


@dataclass
class CaseResult:
    name: str
    ms: float
    tflops: float
    gbps: float
    bound: str  # "compute" or "memory": the larger of the two floors
    of_ceiling: float  # achieved rate / the measured ceiling of the binding resource
    baseline_ms: float | None = None
    baseline_name: str = ""
    eager_ms: float | None = None  # one call with the device waiting for the host's launches
    notes: str = ""
    extra: dict = field(default_factory=dict)


def time_ms(fn: Callable[[], object], warmup: int = 5, iters: int = 30, *, queued: bool = True) -> float:
    """Median time of one ``fn()`` in milliseconds, by CUDA events after ``warmup`` calls.

    ``queued`` (the default) times the device's work: each timed call is put behind a spin
    kernel long enough that the host has issued the start event, every launch of ``fn`` and the
    end event before the device reaches them, so the events see the kernels back to back, as a
    CUDA graph replays them (how the engine runs decode). ``queued=False`` lets the device wait
    for the host between launches, so the time includes the host's launch cost: what an eager
    caller sees. For a call of a few hundred microseconds the two differ by up to ~40% on an
    H200 host (Triton launches cost 20-80 us each of host time).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    spin_cycles = _spin_cycles(fn) if queued else 0
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if spin_cycles:
            torch.cuda._sleep(spin_cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _spin_cycles(fn: Callable[[], object], clock_ghz: float = 2.0) -> int:
    """Spin-kernel length (device clock cycles) that outlasts the host's issue of ``fn``: four
    times its measured host time, at least 0.5 ms at ``clock_ghz`` (above the H200's boost
    clock, so the spin is never shorter than intended)."""
    torch.cuda._sleep(int(20e6))  # keep the device busy so the host time below is issue time only
    start = time.perf_counter()
    fn()
    host_us = (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize()
    return int(max(500.0, 4 * host_us) * clock_ghz * 1e3)


def graph_ms(fn: Callable[[], object], iters: int = 30, repeat: int = 1) -> float | None:
    """Median time of one ``fn()`` replayed from a CUDA graph of ``repeat`` calls, or None when
    ``fn`` cannot be captured (it synchronises with the host, say)."""
    fn()  # compile and allocate before capturing
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(repeat):
                fn()
    except RuntimeError:
        return None
    return time_ms(graph.replay, iters=iters) / repeat


def measure_ceilings() -> Ceilings:
    """Copy bandwidth (4 GiB buffers) and matmul rates (8192³) on random data."""
    copy = copy_gbps(2**30)  # 4 GiB of fp32
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    bf16_ms = time_ms(lambda: a @ b, iters=20)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    fp8_ms = time_ms(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), iters=20)
    flops = 2 * n**3
    return Ceilings(copy_gbps=copy, bf16_tflops=flops / bf16_ms / 1e9,
                    fp8_tflops=flops / fp8_ms / 1e9)


def copy_gbps(numel: int, iters: int = 20) -> float:
    """Device-to-device copy bandwidth of ``numel`` fp32 values, bytes read plus written."""
    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    return 2 * numel * 4 / time_ms(lambda: dst.copy_(src), iters=iters) / 1e6


def share_of_ceiling(flops: float, nbytes: float, ms: float, ceil: Ceilings, fp8: bool = False) -> tuple[str, float]:
    """``("compute" | "memory", achieved rate / that ceiling)`` for work of ``flops`` and ``nbytes``
    done in ``ms``: the resource whose floor (the work at the ceiling's rate) is larger binds."""
    rate = ceil.fp8_tflops if fp8 else ceil.bf16_tflops
    if flops / rate / 1e9 >= nbytes / ceil.copy_gbps / 1e6:
        return "compute", flops / ms / 1e9 / rate
    return "memory", nbytes / ms / 1e6 / ceil.copy_gbps


def run_case(case: KernelCase, ceil: Ceilings) -> CaseResult:
    ms = time_ms(case.run)
    tflops = case.flops / ms / 1e9
    gbps = case.bytes / ms / 1e6
    bound, frac = share_of_ceiling(case.flops, case.bytes, ms, ceil, fp8="fp8" in case.name)
    base = time_ms(case.baseline) if case.baseline is not None else None
    eager = time_ms(case.run, queued=False)
    return CaseResult(case.name, ms, tflops, gbps, bound, frac, base, case.baseline_name if base else "", eager,
                      case.notes)


def collect_cases(only: str | None = None) -> list[KernelCase]:
    found = []
    for mod in CASE_MODULES:
        for case in importlib.import_module(f"moeserve.bench.kernel_cases.{mod}").cases():
            if only is None or only in case.name:
                found.append(case)
    return found


def format_table(ceil: Ceilings, results: list[CaseResult]) -> str:
    lines = [f"ceilings: copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.bf16_tflops:.0f} TFLOP/s, "
             f"fp8 matmul {ceil.fp8_tflops:.0f} TFLOP/s",
             f"{'case':58s} {'ms':>9s} {'eager ms':>9s} {'TFLOP/s':>8s} {'GB/s':>7s} {'bound':>7s} {'%ceil':>6s} "
             f"{'base ms':>9s} {'speedup':>7s}"]
    for r in results:
        base = f"{r.baseline_ms:9.3f}" if r.baseline_ms else " " * 9
        speed = f"{r.baseline_ms / r.ms:6.2f}x" if r.baseline_ms else ""
        lines.append(f"{r.name:58s} {r.ms:9.4f} {r.eager_ms or 0:9.4f} {r.tflops:8.1f} {r.gbps:7.0f} {r.bound:>7s} "
                     f"{100 * r.of_ceiling:5.1f}% {base} {speed}")
    return "\n".join(lines)


def run_kernel_benchmarks(only: str | None = None, json_path: str | None = None) -> str:
    if not torch.cuda.is_available():
        raise SystemExit("bench kernels needs a CUDA device")
    ceil = measure_ceilings()
    results = []
    for case in collect_cases(only):
        results.append(run_case(case, ceil))
        print(format_table(ceil, results[-1:]).splitlines()[-1], flush=True)
        torch.cuda.empty_cache()
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"ceilings": asdict(ceil), "results": [asdict(r) for r in results],
                       "device": torch.cuda.get_device_name()}, f, indent=1)
    return format_table(ceil, results)
