"""Online expert rebalancing on one GPU, DeepSeek-V3 shapes: greedy output under CUDA graphs before and
after a chunked rebalance must be identical, and each pause between two steps is timed.

    python tools/eplb_gpu.py --num-layers 4 --redundant 32 --chunk 1 3 --json eplb_gpu.json

Redundant slots are emulated on one rank (EP 1: every slot is local), FP8 weights, random ("dummy")
weights that depend only on (layer, expert), so a moved expert's weights are the same bytes. The
rebalance plans from the load the decode just recorded; the pause is the device time of a chunk's
swap (copies into the slots and the map update) between two steps.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from moeserve.config import engine_config_for
from moeserve.core import SamplingParams
from moeserve.executor.model_runner import ModelRunner
from moeserve.planner import preset_config
from moeserve.scheduler.controls import ExpertControls
from moeserve.scheduler.io import ControlOutput, ExpertControlInput
from moeserve.scheduler.scheduler import Scheduler


def greedy(sched: Scheduler, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[list[list[int]], float]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    reqs = [sched.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    torch.cuda.synchronize()
    started = time.perf_counter()
    while not all(r.finished for r in reqs):
        sched.step()
    torch.cuda.synchronize()
    return [r.output_ids for r in reqs], time.perf_counter() - started


def rebalance(runner: ModelRunner) -> dict:
    answers: list[ControlOutput] = []
    controls = ExpertControls(runner.eplb, runner.config.eplb, answers.append)
    controls.add(ExpertControlInput(1, "rebalance"))
    controls.run(1)
    while not answers:
        runner.forward(None)  # idle passes: one chunk swapped in before each
    if not answers[0].ok:
        raise RuntimeError(answers[0].message)
    return answers[0].result


def run(args: argparse.Namespace, chunk: int) -> dict:
    model = preset_config("dsv3", args.num_layers)
    config = engine_config_for(model, load_format="dummy", device="cuda", quantization="fp8", page_size=64,
                               max_total_tokens=args.batch * (args.input_len + 2 * args.output_len + 64),
                               mem_fraction_static=args.mem_fraction, cuda_graph_max_bs=args.batch,
                               max_running_requests=args.batch, ep_num_redundant_experts=args.redundant,
                               enable_eplb=True, eplb_rebalance_num_iterations=10**9,
                               eplb_rebalance_layers_per_chunk=chunk, seed=args.seed)
    runner = ModelRunner(config)
    sched = Scheduler(config, runner)
    gen = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, model.vocab_size, (args.batch, args.input_len), generator=gen).tolist()
    before, t_before = greedy(sched, prompts, args.output_len, "before")
    old = runner.eplb.current.phy2log.clone()
    result = rebalance(runner)
    moved = int((runner.eplb.current.phy2log != old).sum())
    after, t_after = greedy(sched, prompts, args.output_len, "after")
    out = {"chunk_layers": chunk, "moe_layers": len(runner.eplb.moe_layers), "slots_per_layer": old.shape[1],
           "slots_moved": moved, "pauses_ms": [p * 1e3 for p in result["pauses_s"]],
           "max_pause_ms": max(result["pauses_s"]) * 1e3, "balancedness_before": result["balancedness_before"],
           "balancedness_after": result["balancedness_after"], "identical": before == after,
           "graphs": runner.graph_runner is not None, "decode_s_before": t_before, "decode_s_after": t_after}
    print(json.dumps(out))
    del sched, runner
    torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--redundant", type=int, default=32)
    p.add_argument("--chunk", type=int, nargs="+", default=[1, 3], help="layers per pause; one run each")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--mem-fraction", type=float, default=0.6, help="leave room for a chunk's staged experts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "args": vars(args),
               "runs": [run(args, c) for c in args.chunk]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if not all(r["identical"] for r in results["runs"]):
        raise SystemExit("greedy output changed across the rebalance")


if __name__ == "__main__":
    main()
