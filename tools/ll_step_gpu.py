"""A decode step on one GPU with each low-latency dispatch backend, DeepSeek-V3 shapes: no dispatch
(every expert local), the peer dispatcher (``symm_mem``, an EP group of one: its buffers are its
own) and the torch dispatcher (``torch``, whose ``[E, C, D]`` all-to-all is a copy at EP 1), all
replayed from CUDA graphs, side by side in one run.

    python3 tools/ll_step_gpu.py --num-layers 4 --batch 128 --context 512 --json ll_step.json

Random FP8 weights; the same prompts for each backend; the step's wall time (median of
``--iters`` replays, synchronised), and how many of the batch's greedy tokens agree between the
runs over ``--steps`` decode steps (random weights make near-ties of the top logits common, so
kernels that round differently part ways; the tokens feed back, so a parting stays).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moeserve.config import engine_config_for
from moeserve.core import ForwardMode, Req, SamplingParams, ScheduleBatch, ScheduledSeq
from moeserve.executor.model_runner import ModelRunner
from moeserve.planner import preset_config

BACKENDS = {"none": {}, "symm_mem": {"moe_a2a_backend": "symm_mem", "deepep_mode": "low_latency"},
            "torch": {"moe_a2a_backend": "torch", "deepep_mode": "low_latency"}}


def run(args: argparse.Namespace, name: str) -> dict:
    model = preset_config("dsv3", args.num_layers)
    config = engine_config_for(model, load_format="dummy", device="cuda", quantization="fp8", page_size=64,
                               max_total_tokens=args.batch * (args.context + args.steps + args.iters + 64),
                               cuda_graph_max_bs=args.batch, max_running_requests=args.batch,
                               max_dispatch_tokens_per_rank=args.batch, seed=0, **BACKENDS[name])
    runner = ModelRunner(config)
    pool = runner.new_page_pool()
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for i in range(args.batch):
        ids = torch.randint(0, model.vocab_size, (args.context,), generator=gen).tolist()
        req = Req(str(i), ids, SamplingParams(max_tokens=1))
        req.page_table = pool.alloc(pool.pages_for(args.context + args.steps + args.iters + 1))
        reqs.append(req)
    for req in reqs:  # prefill one at a time, in chunks low-latency dispatch's buffers hold
        for start in range(0, args.context - 1, args.batch):
            end = min(start + args.batch, args.context - 1)
            runner.forward(ScheduleBatch(ForwardMode.EXTEND, [ScheduledSeq(req, start, end)]))
            req.kv_len = end
    tokens = []
    for _ in range(args.steps + args.iters):
        logits = runner.forward(ScheduleBatch(ForwardMode.DECODE, [ScheduledSeq(r, r.kv_len, r.kv_len + 1)
                                                                    for r in reqs]))
        nxt = logits.argmax(-1).tolist()
        tokens.append(nxt)
        for r, t in zip(reqs, nxt):
            r.kv_len += 1
            r.prompt_ids.append(t)
    times = []
    batch = ScheduleBatch(ForwardMode.DECODE, [ScheduledSeq(r, r.kv_len - 1, r.kv_len) for r in reqs])
    for _ in range(args.iters):  # the last step again: a replay with the same shapes
        torch.cuda.synchronize()
        start = time.perf_counter()
        runner.forward(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    out = {"backend": name, "graphs": runner.graph_runner is not None, "step_ms": statistics.median(times) * 1e3,
           "tokens": tokens[:args.steps]}
    del runner
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=8, help="greedy decode steps compared across backends")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    runs = [run(args, name) for name in BACKENDS]
    for r in runs:  # greedy tokens agreeing with each run: in the first step, and in all (they feed back)
        r["first_step_agreeing"], r["tokens_agreeing"] = {}, {}
        for other in runs:
            pairs = [(a, b) for x, y in zip(r["tokens"], other["tokens"]) for a, b in zip(x, y)]
            r["first_step_agreeing"][other["backend"]] = sum(a == b for a, b in pairs[:args.batch])
            r["tokens_agreeing"][other["backend"]] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
        print(json.dumps({k: v for k, v in r.items() if k != "tokens"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                       "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs]}, f, indent=2)


if __name__ == "__main__":
    main()
