"""The ``moeserve`` command; the only place that parses arguments."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-path", required=True, help="Hugging Face checkpoint folder")
    p.add_argument("--tokenizer-path", default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV cache size in tokens")
    p.add_argument("--mem-fraction-static", type=float, default=0.88)
    p.add_argument("--chunked-prefill-size", type=int, default=8192, help="prefill tokens per step; <= 0 disables")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--context-length", type=int, default=None)


_ENGINE_KEYS = ("tokenizer_path", "device", "dtype", "load_format", "page_size", "max_total_tokens",
                "mem_fraction_static", "chunked_prefill_size", "max_running_requests", "context_length")


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in _ENGINE_KEYS}


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


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from moeserve.models.tiny import make_tiny_model

    path = make_tiny_model(args.out, preset=args.preset, fp8=args.fp8, seed=args.seed)
    print(f"wrote a tiny {args.preset}{' fp8' if args.fp8 else ''} checkpoint to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moeserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline, in this process")
    _add_engine_flags(gen)
    gen.add_argument("--prompt", action="append", help="a text prompt; repeat for a batch")
    gen.add_argument("--token-ids", default=None, help="a prompt as comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None)
    gen.set_defaults(func=cmd_generate)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random DeepSeek checkpoint")
    tiny.add_argument("out")
    tiny.add_argument("--preset", default="v3", choices=["v3", "v2-lite", "v2"])
    tiny.add_argument("--fp8", action="store_true", help="store linear weights as block-scaled FP8")
    tiny.add_argument("--seed", type=int, default=0)
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
