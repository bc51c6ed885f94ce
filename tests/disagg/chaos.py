"""Disaggregated serving under faults, as real processes on loopback: what the fault tests share,
and the chaos run (``python -m tests.disagg.chaos --help``): many requests through the router at
high concurrency while clients disconnect at random, transfers fail by injection, and a prefill
server is killed and restarted; every request must end, complete ones with the single engine's
output, and no page may stay in use."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from moeserve import LLM, SamplingParams
from moeserve.models.tiny import make_tiny_model
from moeserve.server import procs
from tests.e2e.server_utils import descendants, metric, wait_for

SERVER = ["--max-total-tokens", "8192", "--page-size", "4", "--chunked-prefill-size", "16",
          "--served-model-name", "m"]
HEARTBEAT = ["--disaggregation-heartbeat-interval", "0.5", "--disaggregation-heartbeat-max-failures", "2"]
ROUTER = ["--health-check-interval-s", "0.5"]
FAILURE_PROB_ENV = "MOESERVE_TEST_DISAGG_FAILURE_PROB"


def tiny_model(folder: str) -> str:
    return make_tiny_model(os.path.join(folder, "v3"), preset="v3", seed=8, initializer_range=0.1)


def deployment(model_path: str, log_dir: str, num_prefill: int = 1, num_decode: int = 1,
               server_args: list[str] | None = None, router_args: list[str] | None = None,
               decode_env: dict[str, str] | None = None) -> list[procs.Proc]:
    """Prefill and decode servers (torch data path) with short heartbeats, and a router checking them
    twice a second; the router last."""
    common = ["--model-path", model_path, *SERVER, "--disaggregation-secret-file",
              os.path.join(log_dir, "secret"), *HEARTBEAT, *(server_args or [])]
    return procs.pd_deployment(common, [], [], "torch", log_dir, num_prefill, num_decode,
                               [*ROUTER, *(router_args or [])], decode_env)


def kill(p: procs.Proc) -> None:
    """SIGKILL a server and every process below it, as a crashed machine would leave it."""
    for pid in [*descendants(p.proc.pid), p.proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.proc.wait()


def bootstrap_port(p: procs.Proc) -> int:
    assert p.bootstrap_port is not None, f"{p.name} is not a prefill server"
    return p.bootstrap_port


def pages_used(p: procs.Proc) -> float:
    return metric(p.url, "moeserve:kv_pages_used")


# ---- requests --------------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """How one request ended: "ok" (its text), "error" (HTTP status or error event), "disconnected"."""

    kind: str
    text: str = ""
    status: int = 0
    message: str = ""
    ended: float = field(default_factory=time.monotonic)


async def complete(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Outcome:
    """``POST url`` a completion (streamed when ``body["stream"]``) and read how it ends."""
    try:
        if body.get("stream"):
            return await _streamed(http, url, body)
        r = await http.post(url, json=body)
    except httpx.HTTPError as exc:
        return Outcome("error", message=f"{type(exc).__name__}: {exc}")
    if r.status_code != 200:
        return Outcome("error", status=r.status_code, message=_message(r.text))
    return Outcome("ok", text=r.json()["choices"][0]["text"])


async def _streamed(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Outcome:
    async with http.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return Outcome("error", status=r.status_code, message=_message((await r.aread()).decode()))
        text = []
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return Outcome("error", status=event["error"].get("code") or 0, message=event["error"]["message"])
            text += [c["text"] for c in event["choices"]]
        return Outcome("ok", text="".join(text))


def _message(body: str) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:300]


def greedy(prompt: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": stream}


def references(model_path: str, cases: list[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """The single-process engine's greedy text of each (prompt, max_tokens)."""
    with LLM(model_path, dtype="auto", page_size=4, max_total_tokens=8192) as llm:
        outs = llm.generate([p for p, _ in cases], [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                                                    for _, n in cases], use_tqdm=False)
    return {case: out.text for case, out in zip(cases, outs)}


# ---- the chaos run ------------------------------------------------------------------------------------------
PROMPTS = ["The capital of", "Once upon a time there was a very long story about " * 4, "abc",
           "A list of numbers: " + " ".join(str(i) for i in range(60)), "What is 2+2?", "Hello " * 30]
MAX_TOKENS = (3, 9, 17)


@dataclass
class ChaosConfig:
    requests: int = 1000
    concurrency: int = 48
    disconnect_prob: float = 0.1
    failure_prob: float = 0.05
    request_timeout_s: float = 120.0
    seed: int = 0


async def _one(http: httpx.AsyncClient, router: str, case: tuple[str, int], stream: bool, leave_after: float | None,
               timeout_s: float) -> Outcome:
    work = asyncio.ensure_future(complete(http, f"{router}/v1/completions", greedy(*case, stream=stream)))
    if leave_after is not None:
        done, _ = await asyncio.wait({work}, timeout=leave_after)
        if not done:
            work.cancel()  # the client goes away: the connection closes under the request
            return Outcome("disconnected")
    try:
        return await asyncio.wait_for(work, timeout_s)
    except asyncio.TimeoutError:
        return Outcome("hung")


async def _load(cfg: ChaosConfig, router: str, cases: list[tuple[str, int]], progress: list[int]) -> list[Any]:
    rng = random.Random(cfg.seed)
    plan = [(rng.choice(cases), rng.random() < 0.5, rng.uniform(0.05, 1.5) if rng.random() < cfg.disconnect_prob
             else None) for _ in range(cfg.requests)]
    gate = asyncio.Semaphore(cfg.concurrency)
    limits = httpx.Limits(max_connections=cfg.concurrency * 2, max_keepalive_connections=cfg.concurrency)
    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits, trust_env=False) as http:
        async def run(case: tuple[str, int], stream: bool, leave: float | None) -> tuple[tuple[str, int], Outcome]:
            async with gate:
                out = await _one(http, router, case, stream, leave, cfg.request_timeout_s)
                progress[0] += 1
                return case, out

        return await asyncio.gather(*(run(*p) for p in plan))


def run_chaos(model_path: str, log_dir: str, cfg: ChaosConfig) -> dict[str, Any]:
    """Two prefill servers, one decode server (failure injection at ``failure_prob``) and the router; the
    first prefill server is killed after a third of the requests and restarted after two thirds. Returns a
    summary (counts by outcome and error cause, mismatches, pages left, health afterwards)."""
    cases = [(p, n) for p in PROMPTS for n in MAX_TOKENS]
    want = references(model_path, cases)
    started = time.monotonic()
    servers = deployment(model_path, log_dir, num_prefill=2, router_args=["--circuit-breaker-failures", "50"],
                         decode_env={FAILURE_PROB_ENV: str(cfg.failure_prob)})
    events: dict[str, float] = {}
    with procs.running(servers):
        progress = [0]

        async def main() -> list[Any]:
            load = asyncio.ensure_future(_load(cfg, servers[-1].url, cases, progress))
            await _when(lambda: progress[0] >= cfg.requests // 3)
            await asyncio.to_thread(kill, servers[0])
            events["killed_at_request"] = progress[0]
            await _when(lambda: progress[0] >= 2 * cfg.requests // 3)
            servers[0] = await asyncio.to_thread(procs.restart, servers[0])
            events["restarted_at_request"] = progress[0]
            return await load

        results = asyncio.run(main())
        load_s = time.monotonic() - started
        return _summary(results, want, servers, events, load_s, cfg)


async def _when(condition) -> None:
    while not condition():
        await asyncio.sleep(0.05)


def _summary(results: list[Any], want: dict, servers: list[procs.Proc], events: dict, seconds: float,
             cfg: ChaosConfig) -> dict[str, Any]:
    outcomes = Counter(out.kind for _, out in results)
    causes = Counter(_cause(out) for _, out in results if out.kind == "error")
    mismatched = [(case, out.text) for case, out in results if out.kind == "ok" and out.text != want[case]]
    drained = all(wait_for(lambda s=s: pages_used(s) == 0, timeout=30) for s in servers[:-1])
    return {"requests": cfg.requests, "concurrency": cfg.concurrency, "disconnect_prob": cfg.disconnect_prob,
            "failure_prob": cfg.failure_prob, "seconds": round(seconds, 1), "outcomes": dict(outcomes),
            "errors_by_cause": dict(causes), "mismatched": len(mismatched), **events,
            "pages_used_after": {s.name: pages_used(s) for s in servers[:-1]}, "drained": drained,
            "health_generate": {s.name: httpx.get(f"{s.url}/health_generate", timeout=30).status_code
                                for s in servers[:-1]}}


def _cause(out: Outcome) -> str:
    """An error message reduced to its cause, for counting."""
    m = out.message
    for needle, cause in (("injected failure", "injected transfer failure"),
                          ("health checks", "prefill server dead (heartbeat)"),
                          ("restarted", "prefill server restarted"),
                          ("prefill worker", "prefill leg failed (router)"),
                          ("decode worker", "decode leg failed (router)"),
                          ("no healthy", "no healthy worker (503)"), ("circuit", "circuit open (503)"),
                          ("aborted", "aborted on the other side"), ("timeout", "timeout")):
        if needle in m:
            return cause
    return f"other: {m[:80]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--failure-prob", type=float, default=0.05)
    parser.add_argument("--disconnect-prob", type=float, default=0.1)
    parser.add_argument("--out", help="write the summary here as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        summary = run_chaos(tiny_model(folder), folder, ChaosConfig(args.requests, args.concurrency,
                                                                    args.disconnect_prob, args.failure_prob))
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
