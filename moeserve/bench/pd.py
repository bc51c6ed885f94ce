"""``moeserve bench pd``: one workload against a monolithic server and against a disaggregated
deployment (prefill servers + decode servers + the router) with the same ranks in all, one after
the other in one run; TTFT and ITL percentiles side by side, as JSON and a plot.

The default workload (``--dataset mixed``) is the case disaggregation is for: long prompts that
arrive while other requests decode. In one server every prefill stalls the running decodes (ITL
spikes); in PD the decode server never prefills.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import tempfile
from typing import Any

from moeserve.bench.serving import STAT_NAMES, add_workload_args, run_serving_benchmark
from moeserve.server import procs

METRICS = {"ttft": "TTFT", "itl": "ITL", "e2e_latency": "E2E"}


def add_pd_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", default=None, help="default: the shipped tiny chat model")
    p.add_argument("--server-args", default="", help="flags for every server (both setups), one string")
    p.add_argument("--monolithic-args", default="", help="flags of the monolithic server only")
    p.add_argument("--prefill-args", default="", help="flags of the prefill server(s) only")
    p.add_argument("--decode-args", default="", help="flags of the decode server(s) only")
    p.add_argument("--transfer-backend", default="torch", choices=["nixl", "mooncake", "torch"])
    p.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    add_workload_args(p)
    p.set_defaults(dataset="mixed")


def _model_args(args: argparse.Namespace) -> list[str]:
    return (["--model-path", args.model_path] if args.model_path else []) + shlex.split(args.server_args)


def _bench(args: argparse.Namespace, url: str, name: str, log_dir: str) -> dict[str, Any]:
    run = argparse.Namespace(**vars(args), base_url=url, model=None, api_key=None)
    run.output_json = os.path.join(log_dir, f"{name}.json")  # every request's record, beside the logs
    run.plot = None
    print(f"\n--- {name} ---", flush=True)
    return run_serving_benchmark(run)


def run_pd_benchmark(args: argparse.Namespace) -> int:
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="moeserve-bench-pd-")
    os.makedirs(log_dir, exist_ok=True)
    model = _model_args(args)
    with procs.running([procs.start("monolithic", ["serve", *model, *shlex.split(args.monolithic_args)],
                                    log_dir)]) as (mono,):
        monolithic = _bench(args, mono.url, "monolithic", log_dir)
    deployment = procs.pd_deployment(model, shlex.split(args.prefill_args), shlex.split(args.decode_args),
                                     args.transfer_backend, log_dir)
    with procs.running(deployment):
        disaggregated = _bench(args, deployment[-1].url, "disaggregated", log_dir)
    results = {"monolithic": monolithic, "disaggregated": disaggregated}
    print("\n" + format_side_by_side(results))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k != "func"}, "results": results}, f,
                      indent=2, default=str)
    if args.plot:
        plot_side_by_side(args.plot, results)
    return 0 if all(r["completed"] > 0 and r["failed"] == 0 for r in results.values()) else 1


def format_side_by_side(results: dict[str, dict[str, Any]]) -> str:
    names = list(results)
    lines = [f"{'(ms)':<16}" + "".join(f"{n:>16}" for n in names)]
    for metric, label in METRICS.items():
        for stat in STAT_NAMES:
            cells = [results[n].get(f"{stat}_{metric}_ms") for n in names]
            lines.append(f"{label + ' ' + stat:<16}" + "".join("-".rjust(16) if v is None else f"{v:>16.2f}"
                                                               for v in cells))
    for key in ("output_throughput", "input_throughput", "completed", "failed"):
        lines.append(f"{key:<16}" + "".join(f"{results[n][key]:>16.2f}" for n in names))
    return "\n".join(lines)


def plot_side_by_side(path: str, results: dict[str, dict[str, Any]],
                      title: str = "monolithic vs prefill/decode disaggregation, same workload") -> None:
    """TTFT and ITL percentiles of both setups, grouped bars, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    stats = ("median", "p90", "p99")
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    for ax, metric in zip(fig.subplots(1, 2), ("ttft", "itl")):
        width = 0.8 / len(results)
        for k, (name, summary) in enumerate(results.items()):
            values = [summary.get(f"{s}_{metric}_ms") or 0.0 for s in stats]
            ax.bar([i + k * width for i in range(len(stats))], values, width, label=name)
        ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(stats))], stats)
        ax.set(title=METRICS[metric], ylabel="ms")
        ax.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
