"""Ready means warm: one server started with ``--skip-server-warmup`` and one without, each with an
empty ``--triton-cache-dir`` of its own (so neither finds the other's kernels), each sent two waves of
concurrent requests (``moeserve bench serving``, all at once); per server the start-up phases its
ranks logged, how long ``/health`` took to say 200, each wave's median time to first token and the
Triton kernels compiled after the server said ready (files the waves added to its cache).

    python tools/warm_gpu.py --server-args "--model-path M --load-format dummy ..." --num-prompts 64 \\
        --random-input-len 128 --random-output-len 16 --output-json warm.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import tempfile
import time

from moeserve.bench.serving import add_workload_args, run_serving_benchmark
from moeserve.server import procs

SETUPS = {"skip warm-up": ["--skip-server-warmup"], "warm-up": []}
WAVES = 2


def kernels_in(cache_dir: str) -> int:
    """Compiled kernels in a Triton cache: one ``.json`` of metadata each (its groups' files aside)."""
    return sum(name.endswith(".json") and not name.startswith("__grp__")
               for _, _, names in os.walk(cache_dir) for name in names)


def startup_lines(log_path: str) -> list[str]:
    """The ranks' ``start-up: ...`` lines and the API process's ``engine ready ...`` line."""
    with open(log_path) as f:
        return [line.rstrip() for line in f if re.search(r"start-up: |engine ready", line)]


def run_setup(name: str, flags: list[str], args: argparse.Namespace, log_dir: str) -> dict:
    tag = name.replace(" ", "_").replace("-", "")
    cache_dir = tempfile.mkdtemp(prefix=f"triton-{tag}-")
    started = time.monotonic()
    server = procs.start(tag, ["serve", *shlex.split(args.server_args), *flags, "--triton-cache-dir", cache_dir],
                         log_dir)
    result: dict = {"healthy_after_s": time.monotonic() - started, "kernels_at_ready": kernels_in(cache_dir),
                    "waves": []}
    with procs.running([server]):
        for wave in range(WAVES):
            print(f"\n--- {name}: wave {wave + 1} ---", flush=True)
            run = argparse.Namespace(**{**vars(args), "base_url": server.url, "model": None, "api_key": None,
                                        "seed": args.seed + wave, "output_json": None, "plot": None})
            summary = run_serving_benchmark(run)
            result["waves"].append({"median_ttft_ms": summary["median_ttft_ms"], "p99_ttft_ms": summary["p99_ttft_ms"],
                                    "completed": summary["completed"], "failed": summary["failed"],
                                    "kernels_compiled_since_ready": kernels_in(cache_dir) - result["kernels_at_ready"]})
    result["startup"] = startup_lines(server.log_path)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-args", default="", help="flags of both servers, one string")
    p.add_argument("--log-dir", default=None)
    add_workload_args(p)
    args = p.parse_args()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="moeserve-warm-")
    os.makedirs(log_dir, exist_ok=True)
    results = {name: run_setup(name, flags, args, log_dir) for name, flags in SETUPS.items()}
    print()
    for name, r in results.items():
        print(f"=== {name}: /health 200 after {r['healthy_after_s']:.1f} s, {r['kernels_at_ready']} kernels "
              f"compiled by then")
        for line in r["startup"]:
            print(f"    {line}")
        for i, w in enumerate(r["waves"], start=1):
            print(f"    wave {i}: median TTFT {w['median_ttft_ms']:.0f} ms (p99 {w['p99_ttft_ms']:.0f} ms), "
                  f"{w['completed']} completed, {w['failed']} failed, {w['kernels_compiled_since_ready']} kernels "
                  "compiled since ready")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2, default=str)
    return 0 if all(w["completed"] and not w["failed"] for r in results.values() for w in r["waves"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
