"""The ``moeserve eplb`` commands: ``plan`` (a balanced placement from a recorded distribution),
``record`` (routed experts of prompts run offline), ``simulate`` and ``drift`` (modelled GPU
balancedness against deployment size, and as the traffic drifts from what EPLB planned on).
Registered by ``server/cli.py``; heavy imports happen inside the commands."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any

from moeserve.flags import add_config_flags, add_engine_flags, engine_settings

if TYPE_CHECKING:
    import torch


def cmd_plan(args: argparse.Namespace) -> int:
    from moeserve.eplb.algorithm import balancedness, rebalance_experts, trivial_phy2log
    from moeserve.eplb.files import load_distribution, save_placement

    try:
        dist = load_distribution(args.distribution)
    except OSError as exc:
        print(f"error: --distribution: {exc}", file=sys.stderr)
        return 2
    count, num_groups = dist.logical_count, dist.num_groups if args.num_groups is None else args.num_groups
    _check_eplb_plan_flags(args, dist.num_logical, num_groups)
    num_physical = dist.num_logical + args.redundant
    phy2log, _, logcnt = rebalance_experts(count, num_physical, num_groups, args.nnodes, args.ep_size)
    trivial = trivial_phy2log(dist.num_layers, dist.num_logical, num_physical)
    before, after = balancedness(trivial, count, args.ep_size), balancedness(phy2log, count, args.ep_size)
    policy = "hierarchical" if num_groups % args.nnodes == 0 else "global"
    print(f"expert distribution: {args.distribution}: {dist.num_layers} layers ({int((count.sum(1) > 0).sum())} "
          f"with load), {dist.num_logical} logical experts in {num_groups} groups, mode "
          f"{dist.meta.get('mode', '?')}, {dist.meta.get('passes', '?')} passes")
    print(f"placement: {num_physical} physical slots ({dist.num_logical} logical + {args.redundant} redundant) on "
          f"{args.ep_size} EP ranks ({num_physical // args.ep_size} per rank), {args.nnodes} node(s), {policy}")
    print(f"balancedness (mean / max GPU load, 1 = even): before {before:.4f} (trivial placement), after {after:.4f}")
    if args.per_layer:
        _print_eplb_layers(count, trivial, phy2log, logcnt, args.ep_size)
    meta = {"distribution": os.path.basename(args.distribution), "num_redundant": args.redundant,
            "num_nodes": args.nnodes, "num_groups": num_groups, "policy": policy,
            "balancedness_before": before, "balancedness_after": after}
    try:
        save_placement(args.out, phy2log, dist.num_logical, args.ep_size, meta=meta)
    except OSError as exc:
        print(f"error: --out: {exc}", file=sys.stderr)
        return 2
    print(f"wrote the placement to {args.out}")
    return 0


def _print_eplb_layers(count: torch.Tensor, trivial: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor,
                       ep_size: int) -> None:
    """Each layer's tokens, balancedness before and after, and its most replicated expert's count."""
    from moeserve.eplb.algorithm import layer_balancedness

    rows = zip(count.sum(1).tolist(), layer_balancedness(trivial, count, ep_size).tolist(),
               layer_balancedness(phy2log, count, ep_size).tolist(), logcnt.max(1).values.tolist())
    print(f"{'layer':>5} {'tokens':>12} {'before':>7} {'after':>7} {'max replicas':>12}")
    for layer, (tokens, before, after, most) in enumerate(rows):
        print(f"{layer:>5} {tokens:>12.0f} {before:>7.4f} {after:>7.4f} {most:>12}")


def _check_eplb_plan_flags(args: argparse.Namespace, num_logical: int, num_groups: int) -> None:
    """ValueErrors that name the flag, before the balancer's own checks."""
    num_physical = num_logical + args.redundant
    for flag, value in [("--ep-size", args.ep_size), ("--nnodes", args.nnodes), ("--num-groups", num_groups)]:
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if args.redundant < 0:
        raise ValueError(f"--redundant must be >= 0, got {args.redundant}")
    if num_physical % args.ep_size:
        raise ValueError(f"--ep-size {args.ep_size} does not divide the {num_physical} physical slots "
                         f"({num_logical} logical + --redundant {args.redundant})")
    if args.ep_size % args.nnodes:
        raise ValueError(f"--nnodes {args.nnodes} does not divide --ep-size {args.ep_size}")
    if num_logical % num_groups:
        raise ValueError(f"--num-groups {num_groups} does not split the {num_logical} logical experts")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distribution", required=True, metavar="FILE",
                   help="an expert distribution (.json or .pt) a server dumped")
    add_config_flags(p, {"ep_size", "nnodes"}, required={"ep_size"},
                     helps={"ep_size": "EP ranks (GPUs) the experts spread over",
                            "nnodes": "nodes; balancing is hierarchical (groups packed onto nodes) when the groups "
                                      "divide over them"})
    p.add_argument("--redundant", type=int, default=0, help="physical expert slots beyond one per logical expert "
                                                            "(default: 0)")
    p.add_argument("--num-groups", type=int, default=None, help="expert groups (default: the distribution's)")
    p.add_argument("--per-layer", action="store_true", help="also print each layer's balancedness")
    p.add_argument("--out", required=True, metavar="FILE", help="the placement to write (.json or .pt)")


def cmd_record(args: argparse.Namespace) -> int:
    import tempfile

    from moeserve import LLM, SamplingParams
    from moeserve.eplb.files import load_distribution
    from moeserve.eplb.workload import prompt_ids, routing_from_per_token, save_recording
    from moeserve.models.tiny_chat import embedded_model_path

    _check_eplb_flags(args, ("--num-prompts", 1), ("--max-tokens", 1))
    if args.expert_distribution_recorder_mode not in (None, "per_token"):
        raise ValueError("--expert-distribution-recorder-mode: eplb record records per_token")
    prompts = _record_prompts(args.dataset, args.num_prompts, args.seed)
    settings = {**engine_settings(args), "expert_distribution_recorder_mode": "per_token"}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=args.ignore_eos)
    with tempfile.TemporaryDirectory() as scratch:
        settings["expert_distribution_recorder_dir"] = args.expert_distribution_recorder_dir or scratch
        with LLM(args.model_path or embedded_model_path(), **settings) as llm:
            ids = [prompt_ids(llm.tokenizer, p, not args.no_chat_template) for p in prompts]
            llm.start_expert_distribution_record()
            llm.generate(ids, params)
            dist = load_distribution(llm.dump_expert_distribution_record()["path"])
    routing = routing_from_per_token(dist.meta.get("per_token", []), dist.num_logical, dist.num_groups)
    info = save_recording(args.out, routing, model=dist.meta.get("model", ""), dataset=args.dataset,
                          num_prompts=len(prompts), max_tokens=args.max_tokens, num_layers=dist.num_layers)
    phases = ", ".join(f"{name} {p['tokens']} tokens in {p['passes']} passes" for name, p in info["phases"].items())
    print(f"recorded {len(prompts)} prompts of {args.dataset}: {phases}; {routing.num_layers} MoE layers "
          f"{list(routing.layer_ids)}, {routing.num_logical} experts, top {routing.top_k}; wrote {args.out}")
    return 0


def _record_prompts(dataset: str, num_prompts: int | None, seed: int) -> list:
    """The prompts of ``--dataset``: the shipped chat model's tasks, or a text / JSONL file."""
    import random

    from moeserve.eplb.workload import read_prompts
    from moeserve.models.tiny_chat import make_example

    tasks = {"builtin": 0.5, "builtin:addition": 1.0, "builtin:reversal": 0.0}  # the share of additions
    if dataset in tasks:
        rng = random.Random(seed)
        return [make_example(rng, addition_share=tasks[dataset])[0] for _ in range(num_prompts or 64)]
    if dataset.startswith("builtin"):
        raise ValueError(f"--dataset: {dataset!r}: expected builtin, builtin:addition, builtin:reversal or a file")
    try:
        prompts = read_prompts(dataset)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--dataset: {exc}") from None
    if not prompts:
        raise ValueError(f"--dataset: {dataset} holds no prompt")
    return prompts[:num_prompts] if num_prompts else prompts


def cmd_simulate(args: argparse.Namespace) -> int:
    import time

    from moeserve.eplb import simulator

    _check_eplb_sim_flags(args, args.distribution, args.placement_from)
    started = time.perf_counter()
    with simulator.torch_threads(args.threads):
        routing = _eplb_source("--distribution", args.distribution, args)
        counts = None
        if args.placement_from:
            counts = _eplb_source("--placement-from", args.placement_from, args, like=routing).counts()
        report = simulator.simulate(routing, args.ep_size, args.redundant, tokens_per_gpu=args.tokens_per_gpu,
                                    gpus_per_node=args.gpus_per_node, placement_counts=counts,
                                    rebalance_every=args.rebalance_every, num_batches=args.num_batches)
    _require_results(report)
    report.update(distribution=args.distribution, placement_from=args.placement_from, phase=args.phase,
                  elapsed_s=time.perf_counter() - started)
    print(f"{args.distribution}: {routing.num_tokens} tokens ({args.phase}), {routing.num_layers} MoE layers, "
          f"{routing.num_logical} experts, top {routing.top_k}, {routing.num_groups} groups; batches of "
          f"{args.tokens_per_gpu} tokens per GPU (simulated)")
    print(simulator.format_simulation(report, args.per_layer))
    print(f"simulated in {report['elapsed_s']:.1f} s")
    _write_eplb_outputs(args, report, simulator.plot_simulation)
    return 0


def cmd_drift(args: argparse.Namespace) -> int:
    import time

    from moeserve.eplb import simulator

    _check_eplb_sim_flags(args, args.source_from, args.source_to)
    if any(not 0 <= w <= 1 for w in args.steps):
        raise ValueError(f"--steps: each w must be in [0, 1], got {args.steps}")
    started = time.perf_counter()
    with simulator.torch_threads(args.threads):
        a = _eplb_source("--from", args.source_from, args)
        b = _eplb_source("--to", args.source_to, args, like=a)
        report = simulator.drift(a, b, args.steps, args.ep_size, args.redundant,
                                 rebalance_every=args.rebalance_every, tokens_per_gpu=args.tokens_per_gpu,
                                 gpus_per_node=args.gpus_per_node, num_tokens=args.num_tokens,
                                 num_batches=args.num_batches, seed=args.seed)
    _require_results(report)
    report.update(phase=args.phase, elapsed_s=time.perf_counter() - started)
    print(f"drift (simulated): placement planned on {args.source_from}, traffic mix:A,B,w with B = {args.source_to}")
    print(simulator.format_drift(report))
    print(f"simulated in {report['elapsed_s']:.1f} s")
    _write_eplb_outputs(args, report, simulator.plot_drift)
    return 0


def _eplb_source(flag: str, spec: str, args: argparse.Namespace, like: Any = None) -> Any:
    """The routing a source flag names, of ``--phase``; the same sizes as ``like`` when given."""
    from moeserve.eplb.workload import SourceOptions, load_source

    options = SourceOptions(args.num_experts, args.top_k, args.num_layers, args.num_groups, args.num_tokens,
                            args.seed)
    try:
        routing = load_source(spec, options).only(args.phase)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag}: {exc}") from None
    if not routing.num_tokens:
        raise ValueError(f"{flag}: {spec} holds no {args.phase} tokens")
    if like is not None and (routing.num_layers, routing.num_logical) != (like.num_layers, like.num_logical):
        raise ValueError(f"{flag}: {spec} has {routing.num_layers} MoE layers of {routing.num_logical} experts, "
                         f"the other source {like.num_layers} of {like.num_logical}")
    return routing


def _check_eplb_flags(args: argparse.Namespace, *minimums: tuple[str, int]) -> None:
    """ValueErrors naming the flag whose value (one or a list) is below its minimum."""
    for flag, minimum in minimums:
        value = getattr(args, flag[2:].replace("-", "_"))
        for v in value if isinstance(value, list) else [value]:
            if v is not None and v < minimum:
                raise ValueError(f"{flag} must be >= {minimum}, got {v}")


def _check_eplb_sim_flags(args: argparse.Namespace, *specs: str | None) -> None:
    _check_eplb_flags(args, ("--ep-size", 1), ("--redundant", 0), ("--tokens-per-gpu", 1), ("--gpus-per-node", 1),
                      ("--threads", 1),
                      ("--rebalance-every", 1), ("--num-batches", 1), ("--num-tokens", 1), ("--num-experts", 1),
                      ("--num-layers", 1), ("--num-groups", 1), ("--top-k", 1))
    if any(spec and "zipf:" in spec for spec in specs):
        if args.num_experts % args.num_groups:
            raise ValueError(f"--num-groups {args.num_groups} does not split --num-experts {args.num_experts}")
        if args.top_k is not None and args.top_k > args.num_experts:
            raise ValueError(f"--top-k {args.top_k} is more than --num-experts {args.num_experts}")


def _require_results(report: dict) -> None:
    if not report["results"]:
        reasons = "; ".join(f"EP {s['ep_size']}: {s['reason']}" for s in report["skipped"])
        raise ValueError(f"--ep-size: no deployment fits ({reasons})")


def _write_eplb_outputs(args: argparse.Namespace, report: dict, plot: Any) -> None:
    import json

    try:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1)
            print(f"wrote {args.json}")
    except OSError as exc:
        raise ValueError(f"--json: {exc}") from None
    try:
        if args.plot:
            plot(report, args.plot)
            print(f"wrote {args.plot}")
    except OSError as exc:
        raise ValueError(f"--plot: {exc}") from None


def add_record_args(p: argparse.ArgumentParser) -> None:
    add_engine_flags(p, model_required=False)
    p.add_argument("--dataset", required=True, help="builtin (the shipped model's two tasks), builtin:addition, "
                                                    "builtin:reversal, or a file of prompts (.jsonl: one JSON "
                                                    "string or {prompt | messages} a line; else one a line)")
    p.add_argument("--out", required=True, metavar="DIR", help="the recorded workload's directory")
    p.add_argument("--num-prompts", type=int, default=None, help="prompts (default: 64 builtin, all of a file)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt, greedy (default: 16)")
    p.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens for every prompt")
    p.add_argument("--no-chat-template", action="store_true", help="send a file's text prompts as they are")
    p.add_argument("--seed", type=int, default=0, help="of the builtin prompts (default: 0)")


def _add_source_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sources: a recorded DIR, a dumped distribution file, zipf:S[:SEED], mix:A,B,w")
    g.add_argument("--phase", default="all", choices=["all", "prefill", "decode"], help="tokens of one phase only")
    g.add_argument("--num-tokens", type=int, default=None, help="tokens to draw (default: 100000 for zipf, as "
                                                                "recorded for a dump); a recording is cut or wrapped")
    g.add_argument("--num-experts", type=int, default=256, help="zipf: logical experts (default: 256)")
    g.add_argument("--top-k", type=int, default=None, help="experts per token (default: 8 for zipf; a counts-only "
                                                           "dump needs it)")
    g.add_argument("--num-layers", type=int, default=58, help="zipf: MoE layers (default: 58)")
    g.add_argument("--num-groups", type=int, default=8, help="zipf: expert groups (default: 8)")
    g.add_argument("--seed", type=int, default=0, help="of drawn tokens and mixes (default: 0)")


def _add_deployment_args(p: argparse.ArgumentParser, ep_sizes: list[int], redundant: list[int]) -> None:
    p.add_argument("--ep-size", type=int, nargs="+", default=ep_sizes, help=f"EP sizes (default: {ep_sizes})")
    p.add_argument("--redundant", type=int, nargs="+", default=redundant,
                   help=f"redundant expert slots, one line each (default: {redundant})")
    p.add_argument("--gpus-per-node", "--nnodes-per", dest="gpus_per_node", type=int, default=8,
                   help="GPUs per node: EPLB plans for EP size / this nodes (default: 8)")
    p.add_argument("--tokens-per-gpu", type=int, default=128, help="a batch is this x EP size tokens (default: 128)")
    p.add_argument("--num-batches", type=int, default=None, help="batches (default: enough to cover the tokens once)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1: the work is many small "
                                                          "tensor operations, which busy cores slow down more "
                                                          "than extra threads speed up)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report here")
    p.add_argument("--plot", default=None, metavar="PNG", help="plot balancedness here")


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distribution", required=True, metavar="SRC", help="the routing to replay")
    p.add_argument("--placement-from", default=None, metavar="SRC", help="plan EPLB on this source's counts "
                                                                         "(default: the replayed one's)")
    p.add_argument("--rebalance-every", type=int, default=None, metavar="N",
                   help="also EPLB online: replanned every N batches on the window before (from trivial)")
    p.add_argument("--per-layer", action="store_true", help="also print each layer's figures")
    _add_deployment_args(p, [8, 16, 32, 72, 144, 288], [0, 32])
    _add_source_args(p)


def add_drift_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="source_from", required=True, metavar="A", help="the source EPLB plans on")
    p.add_argument("--to", dest="source_to", required=True, metavar="B", help="the source the traffic drifts to")
    p.add_argument("--steps", type=float, nargs="+", default=[0, 0.25, 0.5, 0.75, 1],
                   help="shares w of traffic from B (default: 0 0.25 0.5 0.75 1)")
    p.add_argument("--rebalance-every", type=int, default=10, metavar="N",
                   help="online EPLB replans every N batches, from the placement on A (default: 10)")
    _add_deployment_args(p, [32, 72], [32])
    _add_source_args(p)
