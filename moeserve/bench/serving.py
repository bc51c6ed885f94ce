"""Online serving benchmark for an OpenAI-compatible server (``moeserve bench serving``).

Like SGLang's ``bench_serving`` and vLLM's ``benchmark_serving``: random token-id prompts arrive
as a seeded Poisson process, each is streamed from ``/v1/completions``, and time to first token
(TTFT), inter-token latency (ITL) and end-to-end latency (E2E) are summarised in milliseconds.
Only this client is measured; the server may be moeserve or any engine speaking the same API.

Datasets: ``random``; ``mixed`` (some long prompts that arrive while the others decode); and
``generated-shared-prefix`` (groups of prompts that share a system prefix, interleaved), for prefix
caching, whose effect shows as the prompt tokens the server reports cached
(``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import multiprocessing
import random
import statistics
import sys
import textwrap
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

__all__ = ["add_serving_args", "add_workload_args", "arrival_offsets", "latency_stats", "percentile",
           "run_serving_benchmark", "sample_random_requests", "sample_shared_prefix_requests"]

SHARED_PREFIX = "generated-shared-prefix"
DATASETS = ("random", "mixed", SHARED_PREFIX)
FALLBACK_VOCAB_SIZE = 256
MIN_TOKEN_ID = 10  # low ids are usually special tokens (BOS/EOS/pad); keep them out of prompts
STAT_NAMES = ("mean", "median", "p90", "p99", "std")
# Read is the gap between bytes, not a total: a queued request may wait long for its first token.
# The pool never waits because the semaphore / connection limit already bound what is in flight.
_TIMEOUT = httpx.Timeout(connect=30.0, read=600.0, write=30.0, pool=None)
_MAX_ERROR_CHARS = 500
# What one request can fail with: transport and protocol errors, then a malformed stream
# (bad JSON is a ValueError; a chunk of the wrong shape a Key/Type/AttributeError).
_REQUEST_ERRORS = (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError)


def add_serving_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench serving`` flags to ``parser``."""
    p = parser
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:30000")
    p.add_argument("--model", default=None, help="model name to send (default: first id from GET /v1/models)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    add_workload_args(p)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The flags that say what load to send (every ``bench serving`` flag but where to)."""
    p.add_argument("--num-prompts", type=int, default=100,
                   help=f"requests to send (ignored by --dataset {SHARED_PREFIX}, which sends groups x prompts "
                        "per group, as SGLang's does)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (default inf: send all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    p.add_argument("--dataset", default="random", choices=DATASETS)
    p.add_argument("--random-input-len", type=int, default=1024, help="longest prompt, in tokens")
    p.add_argument("--random-output-len", type=int, default=128, help="longest output (max_tokens)")
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths are uniform in [ratio * len, len]")
    p.add_argument("--mixed-long-fraction", type=float, default=0.25,
                   help="--dataset mixed: the share of long-prompt requests among the random ones")
    p.add_argument("--mixed-long-input-len", type=int, default=None,
                   help="--dataset mixed: their prompt length (default 8 x --random-input-len); they ask for "
                        "4 tokens, so they are nearly all prefill, arriving among requests that decode")
    p.add_argument("--gsp-num-groups", type=int, default=8,
                   help=f"--dataset {SHARED_PREFIX}: groups, each with its own shared system prefix")
    p.add_argument("--gsp-prompts-per-group", type=int, default=16, help=f"--dataset {SHARED_PREFIX}")
    p.add_argument("--gsp-system-prompt-len", type=int, default=2048,
                   help=f"--dataset {SHARED_PREFIX}: the prefix every prompt of a group shares, in tokens")
    p.add_argument("--gsp-question-len", type=int, default=128,
                   help=f"--dataset {SHARED_PREFIX}: each prompt's own tokens after the prefix")
    p.add_argument("--gsp-output-len", type=int, default=256, help=f"--dataset {SHARED_PREFIX}: max_tokens")
    p.add_argument("--seed", type=int, default=1, help="seeds the prompts and the arrival times")
    p.add_argument("--output-json", default=None, help="write summary and per-request records here")
    p.add_argument("--plot", default=None, help="save latency distributions to this PNG")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--client-processes", type=int, default=1,
                   help="split the requests (and --max-concurrency) over this many client processes: one Python "
                        "process reads some 10-20k streamed chunks a second, below a decode node's output")


@dataclass(frozen=True)
class ServingBenchConfig:
    """Validated settings of one benchmark run (one field per flag)."""

    base_url: str
    model: str | None
    api_key: str | None
    num_prompts: int
    request_rate: float
    max_concurrency: int | None
    dataset: str
    random_input_len: int
    random_output_len: int
    random_range_ratio: float
    mixed_long_fraction: float
    mixed_long_input_len: int | None
    gsp_num_groups: int
    gsp_prompts_per_group: int
    gsp_system_prompt_len: int
    gsp_question_len: int
    gsp_output_len: int
    seed: int
    output_json: str | None
    plot: str | None
    disable_tqdm: bool
    client_processes: int = 1

    def __post_init__(self) -> None:
        checks = {
            "num_prompts must be >= 1": self.num_prompts >= 1,
            "request_rate must be > 0": self.request_rate > 0,
            "max_concurrency must be >= 1": self.max_concurrency is None or self.max_concurrency >= 1,
            "client_processes must be >= 1": self.client_processes >= 1,
            "max_concurrency must be >= client_processes":
                self.max_concurrency is None or self.max_concurrency >= self.client_processes,
            f"dataset must be one of {DATASETS}": self.dataset in DATASETS,
            "random_input_len and random_output_len must be >= 1":
                min(self.random_input_len, self.random_output_len) >= 1,
            "random_range_ratio must be in [0, 1]": 0.0 <= self.random_range_ratio <= 1.0,
            "mixed_long_fraction must be in [0, 1]": 0.0 <= self.mixed_long_fraction <= 1.0,
            "mixed_long_input_len must be >= 1": self.mixed_long_input_len is None or self.mixed_long_input_len >= 1,
            **{f"{name} must be >= 1": getattr(self, name) >= 1
               for name in ("gsp_num_groups", "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len",
                            "gsp_output_len")},
        }
        for message, ok in checks.items():
            if not ok:
                raise ValueError(message)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServingBenchConfig:
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
        values["base_url"] = values["base_url"].rstrip("/")
        return cls(**values)

    @property
    def num_requests(self) -> int:
        """How many requests the run sends: ``num_prompts``, but every prompt of every group for the
        shared-prefix dataset, which ignores ``num_prompts`` (as SGLang's does)."""
        if self.dataset == SHARED_PREFIX:
            return self.gsp_num_groups * self.gsp_prompts_per_group
        return self.num_prompts

    def to_json(self, model: str) -> dict[str, Any]:
        """Settings for the report: the resolved model, no API key, and strict JSON (inf rate -> null)."""
        out = dataclasses.asdict(self)
        del out["api_key"]
        out["model"] = model
        out["num_requests"] = self.num_requests
        out["request_rate"] = None if math.isinf(self.request_rate) else self.request_rate
        return out


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send: token ids and the number of tokens to ask for."""

    prompt: list[int]
    output_len: int


@dataclass
class RequestResult:
    """What one streamed request measured; times in seconds."""

    prompt_len: int
    success: bool = False
    error: str = ""
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start: float = 0.0  # when it was sent, from the start of the benchmark
    cached_tokens: int | None = None  # prompt tokens the server says it had cached; None: not reported

    def to_json(self, index: int) -> dict[str, Any]:
        return {"index": index, "success": self.success, "error": self.error,
                "prompt_len": self.prompt_len, "output_len": self.output_len, "cached_tokens": self.cached_tokens,
                "start_s": self.start, "ttft_ms": 1e3 * self.ttft,
                "itl_ms": [1e3 * x for x in self.itl], "e2e_latency_ms": 1e3 * self.latency}


# ---------------------------------------------------------------- workload


def sample_random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                           vocab_size: int, rng: random.Random) -> list[BenchRequest]:
    """Prompts of ids uniform in [MIN_TOKEN_ID, vocab_size); lengths uniform in [ratio * len, len]."""

    def length(full: int) -> int:
        return rng.randint(max(int(full * range_ratio), 1), full)

    ids = range(MIN_TOKEN_ID, vocab_size)
    return [BenchRequest(rng.choices(ids, k=length(input_len)), length(output_len)) for _ in range(num_prompts)]


MIXED_LONG_OUTPUT_LEN = 4


def sample_mixed_requests(cfg: ServingBenchConfig, vocab_size: int, rng: random.Random) -> list[BenchRequest]:
    """``random`` requests, of which a ``mixed_long_fraction`` share (at random positions) instead
    has a long prompt and a short output: prefills that arrive while the others decode."""
    reqs = sample_random_requests(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                                  cfg.random_range_ratio, vocab_size, rng)
    long_len = cfg.mixed_long_input_len or 8 * cfg.random_input_len
    ids = range(MIN_TOKEN_ID, vocab_size)
    for i in range(len(reqs)):
        if rng.random() < cfg.mixed_long_fraction:
            reqs[i] = BenchRequest(rng.choices(ids, k=long_len), MIXED_LONG_OUTPUT_LEN)
    return reqs


def sample_shared_prefix_requests(num_groups: int, prompts_per_group: int, system_prompt_len: int,
                                  question_len: int, output_len: int, vocab_size: int,
                                  rng: random.Random) -> list[BenchRequest]:
    """``num_groups`` random system prefixes, each followed by ``prompts_per_group`` random questions;
    ids uniform in [MIN_TOKEN_ID, vocab_size), lengths fixed. The groups are shuffled together, so a
    server sees them interleaved rather than one group after the other."""
    ids = range(MIN_TOKEN_ID, vocab_size)
    reqs = []
    for _ in range(num_groups):
        prefix = rng.choices(ids, k=system_prompt_len)
        reqs += [BenchRequest(prefix + rng.choices(ids, k=question_len), output_len)
                 for _ in range(prompts_per_group)]
    rng.shuffle(reqs)
    return reqs


def sample_requests(cfg: ServingBenchConfig, vocab_size: int, rng: random.Random) -> list[BenchRequest]:
    """The prompts of ``cfg.dataset``, in the order they are sent."""
    if cfg.dataset == "mixed":
        return sample_mixed_requests(cfg, vocab_size, rng)
    if cfg.dataset == SHARED_PREFIX:
        return sample_shared_prefix_requests(cfg.gsp_num_groups, cfg.gsp_prompts_per_group, cfg.gsp_system_prompt_len,
                                             cfg.gsp_question_len, cfg.gsp_output_len, vocab_size, rng)
    return sample_random_requests(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                                  cfg.random_range_ratio, vocab_size, rng)


def arrival_offsets(num_requests: int, rate: float, rng: random.Random) -> list[float]:
    """Send times in seconds from the start: a Poisson process of ``rate`` req/s, the first at 0."""
    if math.isinf(rate):
        return [0.0] * num_requests
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


# ---------------------------------------------------------------- server queries


async def fetch_model_id(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model the server lists; the benchmark cannot name one without it."""
    resp = await client.get(f"{base_url}/v1/models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def fetch_vocab_size(client: httpx.AsyncClient, base_url: str) -> int:
    """``vocab_size`` from ``/get_model_info`` (an SGLang/moeserve extension); a small default elsewhere."""
    try:
        resp = await client.get(f"{base_url}/get_model_info")
        resp.raise_for_status()
        vocab_size = int(resp.json()["vocab_size"])
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        print(f"warning: no vocab_size from /get_model_info ({exc!r}); drawing ids below "
              f"{FALLBACK_VOCAB_SIZE}", file=sys.stderr)
        return FALLBACK_VOCAB_SIZE
    return vocab_size if vocab_size > MIN_TOKEN_ID else FALLBACK_VOCAB_SIZE


SPEC_METRICS = ("moeserve:spec_verify_seqs", "moeserve:spec_emitted_tokens")


async def fetch_spec_counts(client: httpx.AsyncClient, base_url: str) -> tuple[float, float] | None:
    """The server's speculative-decoding counters from ``/metrics`` (a moeserve server's verify steps
    and the tokens they appended), or None where the server has none."""
    try:
        resp = await client.get(f"{base_url}/metrics")
        resp.raise_for_status()
    except httpx.HTTPError:
        return None
    values = {}
    for line in resp.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in SPEC_METRICS:
            try:
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                return None
    return tuple(values[n] for n in SPEC_METRICS) if len(values) == len(SPEC_METRICS) else None


def accept_length(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """Tokens a request gained per verify step during the run (None without speculative decoding)."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return (after[1] - before[1]) / (after[0] - before[0])


# ---------------------------------------------------------------- one request


def _payload(model: str, req: BenchRequest) -> dict[str, Any]:
    # ignore_eos makes the output length the requested one, so runs are comparable across models.
    return {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}


def _sse_data(line: str) -> str | None:
    """The payload of a server-sent ``data:`` line; None for blank lines, comments and other fields."""
    if not line.startswith("data:"):
        return None
    return line[len("data:"):].strip()


def _has_content(chunk: dict[str, Any]) -> bool:
    """Whether a stream chunk carries generated text or token ids (the usage chunk does not)."""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("text") or choice.get("token_ids") or delta.get("content"):
            return True
    return False


def _cached_tokens(usage: dict[str, Any] | None) -> int | None:
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens``; None where the server leaves it out
    (servers report it only when asked to, e.g. SGLang's ``--enable-cache-report``)."""
    details = (usage or {}).get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    return None if cached is None else int(cached)


async def _read_stream(resp: httpx.Response, result: RequestResult, sent: float) -> None:
    """Time the content chunks of one SSE stream into ``result``."""
    last, n_chunks, usage = sent, 0, None
    async for line in resp.aiter_lines():
        data = _sse_data(line)
        if not data:
            continue
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = f"stream error: {json.dumps(chunk['error'])[:_MAX_ERROR_CHARS]}"
            return
        usage = chunk.get("usage") or usage
        if not _has_content(chunk):
            continue
        now = time.perf_counter()
        if n_chunks == 0:
            result.ttft = now - sent
        else:
            result.itl.append(now - last)
        last, n_chunks = now, n_chunks + 1
    # A chunk may carry several tokens; the server's own count is exact when it sends one.
    result.output_len = int((usage or {}).get("completion_tokens", n_chunks))
    result.cached_tokens = _cached_tokens(usage)
    result.success = n_chunks > 0
    result.error = "" if result.success else "stream ended without any output"


async def send_request(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
                       epoch: float) -> RequestResult:
    """Stream one completion and measure it; never raises, a failure is recorded in the result."""
    result = RequestResult(prompt_len=len(req.prompt))
    sent = time.perf_counter()
    result.start = sent - epoch
    try:
        async with client.stream("POST", url, json=_payload(model, req)) as resp:
            if resp.status_code == 200:
                await _read_stream(resp, result, sent)
            else:
                body = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {body[:_MAX_ERROR_CHARS]}"
    except _REQUEST_ERRORS as exc:  # one broken request must not end the whole benchmark
        result.success, result.error = False, f"{type(exc).__name__}: {exc}"
    result.latency = time.perf_counter() - sent
    return result


# ---------------------------------------------------------------- the run


async def _run_requests(client: httpx.AsyncClient, url: str, model: str, requests: list[BenchRequest],
                        offsets: list[float], epoch: float, concurrency: int | None,
                        pbar: tqdm | None) -> list[RequestResult]:
    """Send ``requests`` at ``epoch + offsets`` (``time.perf_counter``), at most ``concurrency`` in
    flight; results in request order."""
    limit = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()

    async def one(req: BenchRequest) -> RequestResult:
        async with limit:  # an arrival that finds the limit reached waits here, untimed
            result = await send_request(client, url, model, req, epoch)
        if pbar is not None:
            pbar.update(1)
        return result

    tasks = []
    for req, offset in zip(requests, offsets, strict=True):
        # Sleep to an absolute time so that loop overhead does not accumulate into the schedule.
        await asyncio.sleep(max(0.0, epoch + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(one(req)))
    return list(await asyncio.gather(*tasks))


def _http_client(cfg: ServingBenchConfig, in_flight: int) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    # Enough connections for every request that may be in flight, so none queues inside httpx.
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    return httpx.AsyncClient(headers=headers, limits=limits, timeout=_TIMEOUT)


def _client_share(cfg: ServingBenchConfig, model: str, requests: list[BenchRequest], offsets: list[float],
                  epoch: float, concurrency: int | None) -> tuple[list[RequestResult], float]:
    """One client process's part of the run (``--client-processes``): its results and when it ended."""

    async def run() -> list[RequestResult]:
        async with _http_client(cfg, concurrency or len(requests)) as client:
            return await _run_requests(client, f"{cfg.base_url}/v1/completions", model, requests, offsets, epoch,
                                       concurrency, None)

    results = asyncio.run(run())
    return results, time.perf_counter()


async def _run_all(client: httpx.AsyncClient, cfg: ServingBenchConfig, model: str,
                   requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    """Send ``requests`` at their arrival times, from this process or from ``cfg.client_processes``
    (request ``i`` from process ``i % P``, each with its share of ``--max-concurrency``, all timed
    from one epoch: ``perf_counter`` is the system's monotonic clock on Linux, the same in every
    process); results in request order and the duration."""
    offsets = arrival_offsets(len(requests), cfg.request_rate, random.Random(f"arrivals-{cfg.seed}"))
    n = cfg.client_processes
    if n == 1:
        with tqdm(total=len(requests), disable=cfg.disable_tqdm, desc="requests") as pbar:
            epoch = time.perf_counter()
            results = await _run_requests(client, f"{cfg.base_url}/v1/completions", model, requests, offsets,
                                          epoch, cfg.max_concurrency, pbar)
            return results, time.perf_counter() - epoch
    shares = [cfg.max_concurrency // n + (i < cfg.max_concurrency % n) if cfg.max_concurrency else None
              for i in range(n)]
    epoch = time.perf_counter() + 3.0  # the processes start (import httpx …) before it
    loop = asyncio.get_running_loop()
    with ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = await asyncio.gather(*(loop.run_in_executor(pool, _client_share, cfg, model, requests[i::n],
                                                            offsets[i::n], epoch, shares[i]) for i in range(n)))
    results: list[RequestResult] = [None] * len(requests)  # type: ignore[list-item]
    for i, (part, _) in enumerate(parts):
        results[i::n] = part
    return results, max(end for _, end in parts) - epoch


async def _benchmark(cfg: ServingBenchConfig) -> tuple[str, list[RequestResult], float, float | None]:
    """Resolve the model and vocabulary, build the prompts, run them; returns (model, results,
    duration, the server's mean speculative accept length over the run or None)."""
    async with _http_client(cfg, cfg.max_concurrency or cfg.num_requests) as client:
        model = cfg.model or await fetch_model_id(client, cfg.base_url)
        vocab_size = await fetch_vocab_size(client, cfg.base_url)
        requests = sample_requests(cfg, vocab_size, random.Random(cfg.seed))
        before = await fetch_spec_counts(client, cfg.base_url)
        results, duration = await _run_all(client, cfg, model, requests)
        spec = accept_length(before, await fetch_spec_counts(client, cfg.base_url)) if before is not None else None
    return model, results, duration, spec


def run_serving_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark that ``args`` (from :func:`add_serving_args`) describe; returns the summary."""
    cfg = ServingBenchConfig.from_args(args)
    if cfg.num_requests != cfg.num_prompts:
        print(f"note: --dataset {cfg.dataset} sends {cfg.num_requests} requests ({cfg.gsp_num_groups} groups x "
              f"{cfg.gsp_prompts_per_group}); --num-prompts {cfg.num_prompts} is ignored", file=sys.stderr)
    model, results, duration, spec_accept_length = asyncio.run(_benchmark(cfg))
    summary = summarize(results, duration)
    summary["spec_accept_length"] = spec_accept_length
    print(format_table(summary, title=_title(cfg, model)))
    _warn_failures(results)
    if cfg.output_json:
        write_json(cfg.output_json, cfg.to_json(model), summary, results)
    if cfg.plot:
        plot_latencies(cfg.plot, results, _title(cfg, model))
    return summary


# ---------------------------------------------------------------- statistics


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of non-empty sorted values, interpolating linearly between
    order statistics (numpy's default), so numbers match SGLang's and vLLM's reports."""
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def latency_stats(values: Sequence[float]) -> dict[str, float | None]:
    """Mean, median (p50), p90, p99 and population std of ``values``; all None when there are none."""
    if not values:
        return dict.fromkeys(STAT_NAMES)
    xs = sorted(values)
    mean = statistics.fmean(xs)
    return {"mean": mean, "median": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99), "std": statistics.pstdev(xs, mean)}


def _latency_series(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """TTFT, ITL and E2E samples in ms over the successful requests, keyed by summary name."""
    ok = [r for r in results if r.success]
    return {"ttft": [1e3 * r.ttft for r in ok], "itl": [1e3 * x for r in ok for x in r.itl],
            "e2e_latency": [1e3 * r.latency for r in ok]}


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """Counts, throughputs (per second of ``duration``) and latency stats as ``{stat}_{metric}_ms``.

    Cached tokens count as 0 in requests whose server did not report them; both cache figures are
    None when no successful request reported them."""
    ok = [r for r in results if r.success]
    n_in, n_out = sum(r.prompt_len for r in ok), sum(r.output_len for r in ok)
    reported = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    n_cached = sum(reported) if reported else None
    seconds = max(duration, 1e-9)
    summary: dict[str, Any] = {
        "duration_s": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "total_cached_tokens": n_cached, "cache_hit_rate": None if n_cached is None else n_cached / n_in,
        "request_throughput": len(ok) / seconds, "input_throughput": n_in / seconds,
        "output_throughput": n_out / seconds, "total_token_throughput": (n_in + n_out) / seconds,
        # Average requests in flight (Little's law), to check the offered load was what was meant.
        "concurrency": sum(r.latency for r in ok) / seconds,
    }
    for metric, values in _latency_series(results).items():
        for stat, value in latency_stats(values).items():
            summary[f"{stat}_{metric}_ms"] = value
    return summary


# ---------------------------------------------------------------- reports

_TABLE_ROWS = (
    ("Successful requests", "completed", "d"), ("Failed requests", "failed", "d"),
    ("Benchmark duration (s)", "duration_s", ".2f"), ("Total input tokens", "total_input_tokens", "d"),
    ("Total output tokens", "total_output_tokens", "d"), ("Cached input tokens", "total_cached_tokens", "d"),
    ("Cache hit rate (cached / input tokens)", "cache_hit_rate", ".2%"),
    ("Request throughput (req/s)", "request_throughput", ".2f"),
    ("Input token throughput (tok/s)", "input_throughput", ".2f"),
    ("Output token throughput (tok/s)", "output_throughput", ".2f"),
    ("Total token throughput (tok/s)", "total_token_throughput", ".2f"), ("Concurrency", "concurrency", ".2f"),
    ("Mean accept length (speculative)", "spec_accept_length", ".2f"),
)
_METRIC_LABELS = {"ttft": "TTFT", "itl": "ITL", "e2e_latency": "E2E"}


def _title(cfg: ServingBenchConfig, model: str) -> str:
    concurrency = cfg.max_concurrency or "unlimited"
    if cfg.dataset == SHARED_PREFIX:
        lengths = (f"{cfg.gsp_num_groups} groups x {cfg.gsp_prompts_per_group} prompts, input "
                   f"{cfg.gsp_system_prompt_len} shared + {cfg.gsp_question_len} own / output "
                   f"{cfg.gsp_output_len} tokens")
    else:
        lengths = (f"input {cfg.random_input_len} / output {cfg.random_output_len} tokens "
                   f"(range ratio {cfg.random_range_ratio:g})")
    return (f"{model}: {cfg.num_requests} prompts, rate {cfg.request_rate:g} req/s, max concurrency "
            f"{concurrency}, {lengths}")


def _cell(value: float | None, width: int, fmt: str) -> str:
    """``value`` right-aligned in ``width`` columns; ``-`` for a figure there is none of."""
    return "-".rjust(width) if value is None else f"{value:>{width}{fmt}}"


def format_table(summary: dict[str, Any], title: str) -> str:
    """The summary as aligned text: counts and throughputs, then one row of stats per latency metric."""
    width = 60  # a 10-wide label and five 10-wide stat columns
    lines = [" Serving Benchmark Result ".center(width, "="), textwrap.fill(title, width)]
    lines += [f"{label + ':':<44}{_cell(summary[key], 16, fmt)}" for label, key, fmt in _TABLE_ROWS]
    lines += ["-" * width, f"{'(ms)':<10}" + "".join(f"{s:>10}" for s in STAT_NAMES)]
    for metric, label in _METRIC_LABELS.items():
        cells = (summary[f"{stat}_{metric}_ms"] for stat in STAT_NAMES)
        lines.append(f"{label:<10}" + "".join(_cell(v, 10, ".2f") for v in cells))
    lines.append("=" * width)
    return "\n".join(lines)


def _warn_failures(results: Sequence[RequestResult]) -> None:
    failed = [r for r in results if not r.success]
    if failed:
        print(f"warning: {len(failed)} of {len(results)} requests failed; first error: {failed[0].error}",
              file=sys.stderr)


def write_json(path: str, config: dict[str, Any], summary: dict[str, Any],
               results: Sequence[RequestResult]) -> None:
    """Write ``{"config", "summary", "requests"}`` as strict JSON (no NaN or Infinity)."""
    report = {"config": config, "summary": summary, "requests": [r.to_json(i) for i, r in enumerate(results)]}
    with open(path, "w") as f:
        json.dump(report, f, indent=2, allow_nan=False)


def plot_latencies(path: str, results: Sequence[RequestResult], title: str) -> None:
    """Save histograms of TTFT, ITL and E2E (ms), with the median and p99 marked, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional: only needed for --plot
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.5), layout="constrained")
    FigureCanvasAgg(fig)  # no pyplot: no global figure state and no display backend
    series = _latency_series(results)
    for ax, (metric, values) in zip(fig.subplots(1, 3), series.items(), strict=True):
        label = _METRIC_LABELS[metric]
        ax.set(title=f"{label} ({len(values)} samples)", xlabel=f"{label} (ms)", ylabel="count")
        if not values:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.hist(values, bins=min(50, max(10, len(values) // 5)), color="tab:blue", alpha=0.8)
        stats = latency_stats(values)
        ax.axvline(stats["median"], color="tab:orange", linestyle="--", label=f"median {stats['median']:.1f}")
        ax.axvline(stats["p99"], color="tab:red", linestyle=":", label=f"p99 {stats['p99']:.1f}")
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=100)
