"""The ``moeserve`` command; the only place that parses arguments."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from moeserve.flags import add_config_flags, add_engine_flags, engine_settings


def cmd_generate(args: argparse.Namespace) -> int:
    from moeserve import LLM, SamplingParams

    llm = LLM(args.model_path, **engine_settings(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=args.stop or [])
    prompts = args.prompt or []
    if args.token_ids:
        prompts.append([int(t) for t in args.token_ids.split(",")])
    if not prompts:
        print("error: give --prompt or --token-ids", file=sys.stderr)
        return 2
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        print(f"prompt: {prompt!r}")
        print(f"output: {out.text!r}  ({len(out.token_ids)} tokens, finish: {out.finish_reason})")
        print(f"token ids: {out.token_ids}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from moeserve.scheduler.ranks import prestart_ranks

    prestart_ranks(args.device)  # the ranks' imports, beside this process's own
    import logging

    from moeserve.config import ServerConfig, build_engine_config, config_flags
    from moeserve.models.tiny_chat import embedded_model_path
    from moeserve.server.launch import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    model_path = args.model_path or embedded_model_path()
    engine = build_engine_config(model_path, **engine_settings(args))
    name = args.served_model_name or (os.path.basename(os.path.normpath(model_path)) if args.model_path else "tiny-chat")
    server = ServerConfig(**{**{n: getattr(args, n) for n, *_ in config_flags((ServerConfig,))},
                             "served_model_name": name})
    return serve(engine, server)


def cmd_bench_serving(args: argparse.Namespace) -> int:
    from moeserve.bench.serving import run_serving_benchmark

    summary = run_serving_benchmark(args)
    return 0 if summary.get("completed", 0) > 0 else 1


def cmd_bench_one_batch(args: argparse.Namespace) -> int:
    from moeserve.bench.one_batch import run_one_batch_benchmark

    return run_one_batch_benchmark(args)


def cmd_bench_rank(args: argparse.Namespace) -> int:
    from moeserve.bench.rank import run_rank_benchmark

    return run_rank_benchmark(args)


def cmd_bench_deployment(args: argparse.Namespace) -> int:
    from moeserve.bench.rank import run_deployment_benchmark

    return run_deployment_benchmark(args)


def cmd_bench_compare_hf(args: argparse.Namespace) -> int:
    from moeserve.bench.compare_hf import run_compare_hf

    return run_compare_hf(args)


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    from moeserve.bench.kernels import run_kernel_benchmarks

    print(run_kernel_benchmarks(args.only, args.json))
    return 0


def cmd_bench_transfer(args: argparse.Namespace) -> int:
    from moeserve.bench.transfer import run_transfer_benchmark

    print(run_transfer_benchmark(args))
    return 0


def cmd_bench_pd(args: argparse.Namespace) -> int:
    from moeserve.bench.pd import run_pd_benchmark

    return run_pd_benchmark(args)


def cmd_bench_frontend(args: argparse.Namespace) -> int:
    from moeserve.bench.frontend import run_frontend_benchmark

    rows = run_frontend_benchmark(args)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def cmd_bench_dispatch(args: argparse.Namespace) -> int:
    from moeserve.bench.dispatch import run_dispatch_benchmark

    print(run_dispatch_benchmark(args))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from moeserve.server.demo import run_demo, run_pd_demo

    return run_pd_demo() if args.pd else run_demo()


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from moeserve.models.tiny import make_tiny_model

    path = make_tiny_model(args.out, preset=args.preset, fp8=args.fp8, seed=args.seed, mtp=args.mtp)
    print(f"wrote a tiny {args.preset}{' fp8' if args.fp8 else ''}{' MTP' if args.mtp else ''} checkpoint to {path}")
    return 0


def _command(sub: Any, name: str, help: str, add_args: Any, func: Any) -> None:
    """A subcommand whose flags ``add_args`` adds and which ``func`` runs."""
    p = sub.add_parser(name, help=help)
    add_args(p)
    p.set_defaults(func=func)


def _add_kernel_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default=None, help="run the cases whose name contains this")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeserve", description="A serving engine for DeepSeek-V3-class MoE models.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline, in this process")
    add_engine_flags(gen)
    gen.add_argument("--prompt", action="append", help="a text prompt; repeat for a batch")
    gen.add_argument("--token-ids", default=None, help="a prompt as comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_engine_flags(srv, model_required=False)
    from moeserve.config import ServerConfig

    add_config_flags(srv, classes=(ServerConfig,))
    srv.set_defaults(func=cmd_serve)

    from moeserve.bench.compare_hf import add_compare_hf_args
    from moeserve.bench.dispatch import add_dispatch_args
    from moeserve.bench.one_batch import add_one_batch_args
    from moeserve.bench.frontend import add_frontend_args
    from moeserve.bench.pd import add_pd_bench_args
    from moeserve.bench.rank import add_deployment_args, add_rank_args
    from moeserve.bench.serving import add_serving_args
    from moeserve.bench.transfer import add_transfer_args
    from moeserve.planner import add_plan_args, run_plan
    from moeserve.server import eplb_commands
    from moeserve.server.router import add_router_args, run_router

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    _command(bench, "serving", "load a running server with requests and measure latency", add_serving_args,
             cmd_bench_serving)
    _command(bench, "one-batch", "prefill and decode of one batch straight on the engine", add_one_batch_args,
             cmd_bench_one_batch)
    _command(bench, "compare-hf", "moeserve beside transformers on the same weights and device", add_compare_hf_args,
             cmd_bench_compare_hf)
    _command(bench, "kernels", "kernel microbenchmarks against the measured copy and matmul ceilings",
             _add_kernel_bench_args, cmd_bench_kernels)
    _command(bench, "transfer", "KV transfer bandwidth of each backend between two processes", add_transfer_args,
             cmd_bench_transfer)
    _command(bench, "pd", "a monolithic server and a PD deployment under the same load, side by side",
             add_pd_bench_args, cmd_bench_pd)
    _command(bench, "frontend", "the API processes alone in front of a scripted engine: streams they carry at a "
             "step rate", add_frontend_args, cmd_bench_frontend)
    _command(bench, "dispatch", "EP dispatch/combine bandwidth and latency over several GPUs", add_dispatch_args,
             cmd_bench_dispatch)
    _command(bench, "rank", "one rank of a DP-attention + EP deployment emulated on this device, its step projected "
             "with a network model", add_rank_args, cmd_bench_rank)
    _command(bench, "deployment", "both roles of a reference deployment emulated a rank each, beside its figures",
             add_deployment_args, cmd_bench_deployment)
    eplb = sub.add_parser("eplb", help="expert-parallel load balancing from recorded expert load").add_subparsers(
        dest="eplb", required=True)
    _command(eplb, "plan", "a balanced expert placement (--init-expert-location) from an expert distribution",
             eplb_commands.add_plan_args, eplb_commands.cmd_plan)
    _command(eplb, "record", "record the routed experts of prompts run offline (per token, for eplb simulate)",
             eplb_commands.add_record_args, eplb_commands.cmd_record)
    _command(eplb, "simulate", "modelled GPU balancedness of a workload against EP size, with and without EPLB",
             eplb_commands.add_simulate_args, eplb_commands.cmd_simulate)
    _command(eplb, "drift", "modelled balancedness as traffic drifts from the workload EPLB planned on",
             eplb_commands.add_drift_args, eplb_commands.cmd_drift)
    _command(sub, "router", "the prefill/decode disaggregation router in front of PD servers", add_router_args,
             run_router)
    _command(sub, "plan", "per-rank memory of a deployment layout; the memory-optimal dense TP", add_plan_args,
             run_plan)

    demo = sub.add_parser("demo", help="serve the shipped chat model, chat with it, benchmark it, stop")
    demo.add_argument("--pd", action="store_true", help="prefill and decode servers behind the PD router instead")
    demo.set_defaults(func=cmd_demo)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random DeepSeek checkpoint")
    tiny.add_argument("out")
    tiny.add_argument("--preset", default="v3", choices=["v3", "v32", "v2-lite", "v2"])
    tiny.add_argument("--fp8", action="store_true", help="store linear weights as block-scaled FP8")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--mtp", action="store_true",
                      help="also write a multi-token-prediction module as DeepSeek-V3 ships it (speculative decoding)")
    tiny.set_defaults(func=cmd_make_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
