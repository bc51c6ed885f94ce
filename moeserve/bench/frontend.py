"""What the HTTP front end alone carries (``moeserve bench frontend``): the real API processes
(``--api-workers``), their tokenizer, detokenizer and streams, in front of a scripted engine that
gives every running request one token every ``--step-ms``, as a decode step of that length would.

No model runs, so the front end is the only thing that can fall behind: against the engine's
rate (streams / step) the table shows what clients received — output tokens a second over the
run, the steady rate (streams / mean inter-token latency) and the inter-token latency against the
step. The scripted leaders speak the ranks' protocol (``scheduler/io.py``) on the same
authenticated sockets, one per DP group (``--dp-size``), each sending every API worker one
message per step.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import zmq

from moeserve.config import EngineConfig, ServerConfig, build_engine_config
from moeserve.scheduler.channel import connect
from moeserve.scheduler.io import (
    AbortInput,
    Codec,
    EngineInput,
    GenerateInput,
    ShutdownInput,
    TokenBatch,
    TokenOutput,
)
from moeserve.scheduler.ranks import STOP_GRACE_S, RankAddresses, stop_ranks

MIN_TOKEN_ID = 10
VOCAB_SIZE = 1000  # the scripted tokens' ids: within the shipped model's vocabulary
SCRIPTED_CAPACITY = 1 << 30  # tokens the scripted engine claims to hold: it holds none


def scripted_leader(addrs: RankAddresses, dp: int, step_s: float, vocab_size: int, ready: Connection) -> None:
    """DP group ``dp``'s stand-in leader: every ``step_s``, one random token for each request it
    runs (the last one with ``finish_reason`` "length" at ``max_tokens``), one ``TokenBatch`` per
    API worker; aborts and a shutdown as a rank handles them."""
    ctx = zmq.Context()
    inputs = connect(ctx, zmq.PULL, addrs.inputs_of(dp), addrs.keys)
    outputs = [connect(ctx, zmq.PUSH, out, addrs.keys) for out in addrs.outputs]
    decode, encode = Codec(EngineInput), Codec(TokenBatch)
    running: dict[str, list[int]] = {}  # rid -> [worker, tokens left, prompt length]
    rng = random.Random(dp)
    ready.send(("ready", {"max_total_tokens": SCRIPTED_CAPACITY, "startup_s": {}}))
    next_step = time.perf_counter()
    while True:
        while inputs.poll(max(0.0, next_step - time.perf_counter()) * 1e3 if running else 50):
            msg = decode.decode(inputs.recv_multipart())
            if isinstance(msg, ShutdownInput):
                return
            if isinstance(msg, GenerateInput):
                running[msg.rid] = [msg.reply_to, msg.params.max_tokens, len(msg.prompt_ids)]
            elif isinstance(msg, AbortInput):
                running.pop(msg.rid, None)
        if not running:
            next_step = time.perf_counter()
            continue
        per_worker: dict[int, list[TokenOutput]] = {}
        for rid, state in list(running.items()):
            state[1] -= 1
            out = TokenOutput(rid, [rng.randrange(MIN_TOKEN_ID, vocab_size)], prompt_len=state[2])
            if state[1] <= 0:
                out.finish_reason = "length"
                del running[rid]
            per_worker.setdefault(state[0] if state[0] < len(outputs) else 0, []).append(out)
        for worker, batch in per_worker.items():
            outputs[worker].send(encode.encode(TokenBatch(batch)))
        next_step += step_s


class ScriptedRanks:
    """``RankProcesses``' interface over one scripted leader per DP group (no model, no collectives)."""

    def __init__(self, config: EngineConfig, addrs: RankAddresses, step_s: float, vocab_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self._ready: list[Connection] = []
        self._stop = weakref.finalize(self, stop_ranks, self.procs, self._ready, STOP_GRACE_S, os.getpid())
        for dp in range(config.parallel.attn_dp_size):
            mine, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=scripted_leader, args=(addrs, dp, step_s, vocab_size, theirs), daemon=True,
                               name=f"moeserve-scripted{dp}")
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self._ready.append(mine)

    def wait_ready(self, timeout: float = 120) -> dict:
        infos = []
        for conn in self._ready:
            if not conn.poll(timeout):
                raise RuntimeError(f"a scripted leader did not start within {timeout:.0f} s")
            infos.append(conn.recv()[1])
        return infos[0]

    def dead(self) -> str | None:
        return next((f"{p.name} exited (code {p.exitcode})" for p in self.procs if not p.is_alive()), None)

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        self._stop()


def serve_scripted(argv: list[str]) -> int:
    """``python -m moeserve.bench.frontend --step-ms S --api-workers N --dp-size D --port-file F``:
    the API processes of ``moeserve serve`` (the shipped model's tokenizer) over scripted leaders."""
    import functools
    import logging

    from moeserve.models.tiny_chat import embedded_model_path
    from moeserve.server.launch import serve

    p = argparse.ArgumentParser()
    for flag, kind in (("--step-ms", float), ("--api-workers", int), ("--dp-size", int), ("--port-file", str),
                       ("--vocab-size", int)):
        p.add_argument(flag, type=kind, required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    dp = args.dp_size
    # no model runs: the context bounds only the requests' validation
    engine = build_engine_config(embedded_model_path(), tp_size=dp, dp_size=dp, enable_dp_attention=dp > 1,
                                 context_length=1 << 20)
    server = ServerConfig(port=0, port_file=args.port_file, served_model_name="m", api_workers=args.api_workers)
    return serve(engine, server, ranks_factory=functools.partial(ScriptedRanks, step_s=args.step_ms / 1e3,
                                                                   vocab_size=args.vocab_size))


def add_frontend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256], help="concurrent streams, one run each")
    p.add_argument("--api-workers", type=int, nargs="+", default=[1], help="API worker processes, one run each")
    p.add_argument("--step-ms", type=float, default=10.0, help="the scripted decode step")
    p.add_argument("--output-len", type=int, default=200, help="tokens per request")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--dp-size", type=int, default=1, help="DP groups (one scripted leader each)")
    p.add_argument("--client-processes", type=int, default=1, help="as bench serving's")
    p.add_argument("--waves", type=int, default=2, help="requests per stream over the run")
    p.add_argument("--output-json", default=None)


def run_frontend_benchmark(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One run per (API workers, streams); prints and returns a row each."""
    from moeserve.bench.serving import add_serving_args, run_serving_benchmark
    from moeserve.server.procs import Launch, Proc, start_all, stop_all

    rows = []
    for workers in args.api_workers:
        for streams in args.streams:
            port_dir = tempfile.TemporaryDirectory(prefix="moeserve-frontend-")
            port_file = os.path.join(port_dir.name, "ports.json")
            log = open(os.path.join(port_dir.name, "server.log"), "w")  # noqa: SIM115 -- the server's, closed below
            popen = subprocess.Popen([sys.executable, "-m", "moeserve.bench.frontend", "--step-ms", str(args.step_ms),
                                      "--api-workers", str(workers), "--dp-size", str(args.dp_size),
                                      "--port-file", port_file, "--vocab-size", str(VOCAB_SIZE)],
                                     stdout=log, stderr=subprocess.STDOUT)
            (server,) = start_all([Launch(Proc(f"frontend-{workers}x{streams}", popen, 0, None), port_dir)])
            try:
                parser = argparse.ArgumentParser()
                add_serving_args(parser)
                summary = run_serving_benchmark(parser.parse_args([
                    "--base-url", server.url, "--model", "m", "--num-prompts", str(streams * args.waves),
                    "--max-concurrency", str(streams), "--random-input-len", str(args.input_len),
                    "--random-output-len", str(args.output_len), "--random-range-ratio", "1",
                    "--client-processes", str(min(args.client_processes, streams)), "--disable-tqdm"]))
            finally:
                stop_all([server])
                log.close()
            rows.append(_row(workers, streams, args.step_ms, summary))
    print(format_rows(rows))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


def _row(workers: int, streams: int, step_ms: float, summary: dict[str, Any]) -> dict[str, Any]:
    engine = streams / (step_ms / 1e3)
    itl_mean = summary["mean_itl_ms"] or float("nan")
    return {"api_workers": workers, "streams": streams, "step_ms": step_ms, "engine_tok_s": engine,
            "delivered_tok_s": summary["output_throughput"], "steady_tok_s": streams / (itl_mean / 1e3),
            "itl_median_ms": summary["median_itl_ms"], "itl_p99_ms": summary["p99_itl_ms"],
            "failed": summary["failed"]}


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = (f"{'workers':>7} {'streams':>7} {'engine tok/s':>12} {'delivered':>10} {'steady':>10} "
            f"{'steady/engine':>13} {'ITL med':>8} {'ITL p99':>8} {'failed':>6}")
    lines = [head]
    for r in rows:
        lines.append(f"{r['api_workers']:>7} {r['streams']:>7} {r['engine_tok_s']:>12,.0f} {r['delivered_tok_s']:>10,.0f} "
                     f"{r['steady_tok_s']:>10,.0f} {r['steady_tok_s'] / r['engine_tok_s']:>12.0%} "
                     f"{r['itl_median_ms']:>8.2f} {r['itl_p99_ms']:>8.2f} {r['failed']:>6}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(serve_scripted(sys.argv[1:]))
