"""Speculative decoding with the shipped model's MTP module against plain decoding, in one run:
mean accept length, output tokens/s and whether the greedy outputs are identical.

    python tools/spec_bench.py [--prompts 200] [--steps 1 2 3] [--device cpu] [--json out.json]

The prompts are the tiny chat task's held-out prompts (``moeserve.models.tiny_chat``), all
submitted at once, greedy; each setup runs once to warm up, then ``--repeats`` times: the median
time counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from moeserve import LLM, SamplingParams
from moeserve.models.tiny_chat import embedded_model_path, held_out_prompts


def run(prompts: list[str], device: str, repeats: int, **spec: int | str) -> dict:
    llm = LLM(embedded_model_path(), device=device, **spec)
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
           for p in prompts]
    params = SamplingParams(max_tokens=12, temperature=0)
    llm.generate(ids, params, use_tqdm=False)  # warm-up
    if llm.scheduler.spec is not None:
        llm.scheduler.spec.verified = llm.scheduler.spec.emitted = 0
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(ids, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = sum(len(o.token_ids) for o in outs)
    spec_part = llm.scheduler.spec
    return {"tokens": [o.token_ids for o in outs], "seconds": seconds, "output_tokens_per_s": tokens / seconds,
            "accept_length": spec_part.accept_length if spec_part is not None else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=200)
    p.add_argument("--steps", type=int, nargs="*", default=[1, 2, 3])
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    prompts = [q for q, _ in held_out_prompts(args.prompts, seed=0)]
    plain = run(prompts, args.device, args.repeats)
    rows = {"plain": plain}
    for s in args.steps:
        rows[f"NEXTN, {s} step{'s' * (s > 1)}"] = run(prompts, args.device, args.repeats, speculative_algorithm="NEXTN",
                                                      speculative_num_steps=s)
    print(f"{'':<18}{'accept length':>14}{'tokens/s':>10}{'identical':>10}")
    for name, r in rows.items():
        accept = "-" if r["accept_length"] is None else f"{r['accept_length']:.3f}"
        print(f"{name:<18}{accept:>14}{r['output_tokens_per_s']:>10.0f}{str(r['tokens'] == plain['tokens']):>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "date": time.strftime("%Y-%m-%d"),
                       "results": {k: {**v, "tokens": None, "identical": v["tokens"] == plain["tokens"]}
                                   for k, v in rows.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
