"""The prefix cache against recomputing: one shared-prefix workload (``moeserve bench serving
--dataset generated-shared-prefix``) sent to the same server with the cache on and then with
``--disable-radix-cache``, one after the other in one run; TTFT, ITL, throughput and the cache hit
rate side by side, as JSON and a plot. Before its measured run each server gets a warm-up load of
the same shape and rate (4 groups x 16 other prompts): Triton kernels compile on first use, one
variant per new launch shape (attention over a cached prefix, GEMMs of new row counts), and those
stalls of a second or more would otherwise land in the measured figures.

    python tools/prefix_cache_gpu.py --server-args "--model-path M --load-format dummy ..." \\
        --gsp-num-groups 8 --gsp-prompts-per-group 32 --output-json prefix_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import tempfile

from moeserve.bench.pd import format_side_by_side, plot_side_by_side
from moeserve.bench.serving import add_workload_args, run_serving_benchmark
from moeserve.server import procs

SETUPS = {"cache on": [], "cache off": ["--disable-radix-cache"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server-args", default="", help="flags of the server (both runs), one string")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--no-warm-up", action="store_true", help="measure from the first request (the server still "
                                                              "runs its own warm-up passes unless told not to)")
    add_workload_args(p)
    p.set_defaults(dataset="generated-shared-prefix")
    args = p.parse_args()
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="moeserve-prefix-cache-")
    os.makedirs(log_dir, exist_ok=True)
    results = {}
    for name, flags in SETUPS.items():
        tag = name.replace(" ", "_")
        server = procs.start(tag, ["serve", *shlex.split(args.server_args), *flags], log_dir)
        with procs.running([server]):
            run = argparse.Namespace(**vars(args), base_url=server.url, model=None, api_key=None)
            warm_up = argparse.Namespace(**{**vars(run), "seed": args.seed + 1000, "gsp_num_groups": 4,
                                            "gsp_prompts_per_group": 16, "output_json": None, "plot": None,
                                            "disable_tqdm": True})
            if not args.no_warm_up:
                print(f"\n--- {name}: warm-up ---", flush=True)
                run_serving_benchmark(warm_up)
            run.output_json, run.plot = os.path.join(log_dir, f"{tag}.json"), None
            print(f"\n--- {name} ---", flush=True)
            results[name] = run_serving_benchmark(run)
    print("\n" + format_side_by_side(results))
    for name, r in results.items():
        print(f"{name}: cache hit rate {r.get('cache_hit_rate')}, cached tokens {r.get('total_cached_tokens')}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=2, default=str)
    if args.plot:
        plot_side_by_side(args.plot, results, "prefix cache on vs off, same shared-prefix workload")
    return 0 if all(r["completed"] > 0 and r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
