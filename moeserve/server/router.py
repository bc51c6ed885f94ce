"""The prefill/decode (PD) disaggregation router: one OpenAI-compatible address in front of prefill and
decode servers, shaped like SGLang's PD router (``--pd-disaggregation --prefill URL [PORT] --decode URL``).

Each generation request goes, with the same body, to one prefill and one decode server at once. The
router adds ``bootstrap_host``/``bootstrap_port`` (the prefill server's bootstrap server) and
``bootstrap_room`` (a random 63-bit id both servers know the request by): the decode server uses them to
fetch the KV cache the prefill server computes. The client gets the decode server's answer, streamed as
it comes; the prefill server's is only watched for failure. Text goes in and out as the client sent it:
the router never tokenizes, so it needs no model and imports nothing heavy.

A request whose prefill server never took it up (unreachable, or a 503) is sent once more, to another prefill
server, if nothing has reached the client yet. A worker that fails requests several times in a row is left
out for a cooldown by its circuit breaker (``Circuit``), whatever its health checks say.

Each leg runs in a task of its own and ends by being cancelled: its ``async with`` then closes the
connection, the worker sees the disconnect and aborts. Cancelling is synchronous, so a leg can be ended
from anywhere, a task the client's disconnect has cancelled included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from moeserve.server.http import (
    CLIENT_KEEP_ALIVE_S,
    SERVER_KEEP_ALIVE_S,
    APIKeyAuth,
    SignalledServer,
    error_body,
    error_json,
    listen,
    write_port_file,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")

POLICIES = ("round_robin", "least_load")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/generate")
DEFAULT_BOOTSTRAP_PORT = 8998
UNHEALTHY_AFTER_FAILURES = 2  # one lost health check is not enough to take a worker out
HEALTH_CHECK_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 10.0  # a worker that does not accept in this long is down, whatever the request timeout
MAX_CONNECTIONS = 4096  # each request holds two (one per leg) for as long as it runs
MAX_KEEPALIVE_CONNECTIONS = 1024


@dataclass(frozen=True)
class RouterConfig:
    """What the router is told; checked when made (a ValueError that names the field)."""

    prefill: tuple[tuple[str, int], ...]  # (URL, bootstrap port) of each prefill server
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "round_robin"
    health_check_interval_s: float = 5.0
    request_timeout_s: float = 600.0
    api_key: str | None = None  # what clients must send
    worker_api_key: str | None = None  # what the router sends the workers
    circuit_breaker_failures: int = 3  # a worker's own failures in a row that open its circuit
    circuit_breaker_cooldown_s: float = 10.0  # how long an open circuit keeps requests away

    def __post_init__(self) -> None:
        if not self.prefill:
            raise ValueError("prefill: give at least one prefill server")
        if not self.decode:
            raise ValueError("decode: give at least one decode server")
        _check_urls("prefill", [url for url, _ in self.prefill])
        _check_urls("decode", list(self.decode))
        for url, port in self.prefill:
            if not (isinstance(port, int) and 0 < port < 65536):
                raise ValueError(f"prefill: the bootstrap port of {url} must be in 1..65535, got {port!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.health_check_interval_s <= 0:
            raise ValueError(f"health_check_interval_s must be > 0, got {self.health_check_interval_s}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        failures = self.circuit_breaker_failures
        if isinstance(failures, bool) or not isinstance(failures, int) or failures < 1:
            raise ValueError(f"circuit_breaker_failures must be an integer >= 1, got {failures!r}")
        cooldown = self.circuit_breaker_cooldown_s
        if not 0 < cooldown < math.inf:  # NaN included
            raise ValueError(f"circuit_breaker_cooldown_s must be finite and > 0, got {cooldown}")


def _check_urls(field: str, urls: list[str]) -> None:
    for url in urls:
        try:
            parts = urlsplit(url)
            valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
        except ValueError:  # a port that is not a number in 0..65535
            valid = False
        if not valid:
            raise ValueError(f"{field}: {url!r} is not an http(s)://host[:port] URL")
    normalized = [url.rstrip("/") for url in urls]
    if len(set(normalized)) < len(normalized):
        raise ValueError(f"{field}: a server is listed twice")


@dataclass
class Circuit:
    """A worker's circuit breaker, fed with the verdict of each leg sent there: True (it served the leg), False
    (it failed, its own fault: see ``_Exchange``), None (no verdict: a 4xx, a cancelled leg).

    Closed, legs go through; ``threshold`` failures in a row open it. Open, ``pick`` skips the worker until
    ``open_until``. Half-open after that, one leg (the probe) may go: its success closes the circuit, its
    failure opens it for another cooldown, no verdict lets the next leg probe. While open or half-open only the
    probe decides: a leg sent before the circuit opened says nothing about the worker now. Times are
    ``time.monotonic()`` seconds, given by the caller."""

    threshold: int = 3
    cooldown_s: float = 10.0
    failures: int = 0  # the worker's failures in a row
    open_until: float | None = None  # None while closed
    probing: bool = False  # the half-open circuit's probe is in flight

    @property
    def closed(self) -> bool:
        return self.open_until is None

    def admits(self, now: float) -> bool:
        return self.open_until is None or (now >= self.open_until and not self.probing)

    def begin(self, now: float) -> bool:
        """A leg is sent to the worker (which ``admits`` it): True if it is the probe."""
        probe = self.open_until is not None and self.admits(now)
        self.probing = self.probing or probe
        return probe

    def settle(self, verdict: bool | None, probe: bool, now: float) -> None:
        if probe:
            self.probing = False
        elif self.open_until is not None:
            return
        if verdict is True:
            self.failures, self.open_until = 0, None
        elif verdict is False:
            self.failures += 1
            if probe or self.failures >= self.threshold:
                self.open_until = now + self.cooldown_s

    def wait_s(self, now: float) -> float:
        """How long until the worker may be sent a leg again, as far as the circuit knows: a probe in flight
        may take as long as a cooldown to decide."""
        if self.open_until is None:
            return 0.0
        return self.cooldown_s if self.probing else max(0.0, self.open_until - now)


@dataclass
class Worker:
    """One prefill or decode server as the router sees it."""

    role: str
    url: str
    bootstrap_port: int | None = None  # prefill servers only
    healthy: bool = True  # until the health checks say otherwise
    failures: int = 0  # health checks failed in a row
    in_flight: int = 0  # legs the router has open to it
    # kept apart from ``healthy``: /health may answer while generation fails, so a check never closes it
    circuit: Circuit = field(default_factory=Circuit)

    def record(self, ok: bool) -> None:
        """Unhealthy after ``UNHEALTHY_AFTER_FAILURES`` failed checks in a row, healthy again after one success."""
        self.failures = 0 if ok else self.failures + 1
        healthy = self.failures < UNHEALTHY_AFTER_FAILURES
        if healthy != self.healthy:
            logger.warning("%s worker %s is %s", self.role, self.url, "healthy again" if healthy else "down")
        self.healthy = healthy

    def available(self, now: float) -> bool:
        return self.healthy and self.circuit.admits(now)

    def hold(self, task: asyncio.Task) -> None:
        """Count ``task`` as in flight here until it ends, and give its verdict (its result) to the circuit
        then: from now, not from when it starts, for the next pick must see it (a probe included)."""
        self.in_flight += 1
        probe = self.circuit.begin(time.monotonic())
        task.add_done_callback(functools.partial(self._leg_ended, probe))

    def _leg_ended(self, probe: bool, task: asyncio.Task) -> None:
        self.in_flight -= 1
        verdict = None if task.cancelled() or task.exception() is not None else task.result()
        was_open_until = self.circuit.open_until
        self.circuit.settle(verdict, probe, time.monotonic())
        if self.circuit.open_until is None and was_open_until is not None:
            logger.info("%s worker %s: circuit closed again", self.role, self.url)
        elif self.circuit.open_until != was_open_until:
            logger.warning("%s worker %s: circuit open for %.1f s after %d failures in a row", self.role, self.url,
                           self.circuit.cooldown_s, self.circuit.failures)


def bootstrap_fields(prefill: Worker) -> dict[str, Any]:
    """What both servers need to find each other: the prefill server's bootstrap address and a fresh room."""
    return {"bootstrap_host": urlsplit(prefill.url).hostname, "bootstrap_port": prefill.bootstrap_port,
            "bootstrap_room": secrets.randbits(63)}


class _Pool:
    """The servers of one role, and the policy that picks among the healthy ones."""

    def __init__(self, workers: list[Worker], policy: str) -> None:
        self.workers, self.policy = workers, policy
        self._next = 0

    @property
    def role(self) -> str:
        return self.workers[0].role

    def pick(self, exclude: Worker | None = None) -> Worker | None:
        """The next available worker (healthy, its circuit letting legs through) in turn, ``exclude`` apart;
        with least_load, the one with the fewest legs in flight, ties going in turn (so that a light load still
        spreads over all of them)."""
        n, now = len(self.workers), time.monotonic()
        turn = (self.workers[(self._next + i) % n] for i in range(n))
        available = [w for w in turn if w is not exclude and w.available(now)]
        if not available:
            return None
        chosen = min(available, key=lambda w: w.in_flight) if self.policy == "least_load" else available[0]
        self._next = (self.workers.index(chosen) + 1) % n
        return chosen

    def retry_after_s(self, health_check_interval_s: float) -> int:
        """When to ask again, none being available, in whole seconds (at least 1): the soonest a worker may be
        back, at its next health check if it is down, at the end of its cooldown if its circuit is open."""
        now = time.monotonic()
        waits = [max(0.0 if w.healthy else health_check_interval_s, w.circuit.wait_s(now)) for w in self.workers]
        return max(1, math.ceil(min(waits)))


class _Metrics:
    """One registry per router, so that several routers in one process (tests) do not collide."""

    def __init__(self, workers: list[Worker]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("moeserve_router:requests", "generation requests, by how they ended",
                                ["endpoint", "outcome"], registry=self.registry)
        healthy = Gauge("moeserve_router:worker_healthy", "1 while the worker passes its health checks",
                        ["role", "url"], registry=self.registry)
        in_flight = Gauge("moeserve_router:worker_in_flight", "requests the router has in flight at the worker",
                          ["role", "url"], registry=self.registry)
        circuit_open = Gauge("moeserve_router:worker_circuit_open",
                             "1 while the worker's circuit breaker is open or half-open (not closed)",
                             ["role", "url"], registry=self.registry)
        self.retries = Counter("moeserve_router:retries", "generation requests sent again to another prefill "
                               "worker after the first never took them up", ["endpoint"], registry=self.registry)
        for path in GENERATION_PATHS:
            self.retries.labels(path)  # a 0 rather than no series until the first retry
        for w in workers:
            healthy.labels(w.role, w.url).set_function(lambda w=w: float(w.healthy))
            in_flight.labels(w.role, w.url).set_function(lambda w=w: float(w.in_flight))
            circuit_open.labels(w.role, w.url).set_function(lambda w=w: float(not w.circuit.closed))

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True)
class _Failure:
    """A leg's error as the client gets it: the worker's own answer when it sent one."""

    outcome: str  # "prefill_error" or "decode_error"
    status: int
    body: bytes
    media_type: str = "application/json"
    unstarted: bool = False  # the worker never took the request up (unreachable, or busy): another may

    @classmethod
    def raised(cls, worker: Worker, exc: Exception) -> _Failure:
        status = 504 if isinstance(exc, httpx.TimeoutException) else 502
        message = f"{worker.role} worker {worker.url} failed: {type(exc).__name__}: {exc}"
        unstarted = isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout))
        body = json.dumps(error_body(status, message)).encode()
        return cls(f"{worker.role}_error", status, body, unstarted=unstarted)

    @classmethod
    def answered(cls, worker: Worker, response: httpx.Response, content: bytes) -> _Failure:
        if not content:
            message = f"{worker.role} worker {worker.url} answered {response.status_code}"
            content = json.dumps(error_body(response.status_code, message)).encode()
        media_type = response.headers.get("content-type", "application/json")
        # 503: the queue is full or the server not ready, so it refused the request before any work
        return cls(f"{worker.role}_error", response.status_code, content, media_type, response.status_code == 503)

    def response(self) -> Response:
        return Response(self.body, self.status, media_type=self.media_type)

    def event(self) -> bytes:
        """The error as the last events of a stream (its status line is long sent): the worker's envelope
        as it is, anything else wrapped in one."""
        try:
            payload = json.loads(self.body)
        except ValueError:
            payload = None
        if not (isinstance(payload, dict) and "error" in payload):
            payload = error_body(self.status, self.body.decode(errors="replace"))
        return b"data: " + json.dumps(payload).encode() + b"\n\ndata: [DONE]\n\n"


class Router:
    """The router's state: its workers, the shared HTTP client, the metrics, and every task it runs."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.prefill = _Pool([Worker("prefill", url.rstrip("/"), port, circuit=_circuit(config))
                              for url, port in config.prefill], config.policy)
        self.decode = _Pool([Worker("decode", url.rstrip("/"), circuit=_circuit(config)) for url in config.decode],
                            config.policy)
        self.metrics = _Metrics(self.prefill.workers + self.decode.workers)
        timeout = config.request_timeout_s
        # trust_env=False: an HTTP(S)_PROXY meant for the outside world must not sit between router and workers
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout, connect=min(CONNECT_TIMEOUT_S, timeout)), trust_env=False,
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_KEEPALIVE_CONNECTIONS,
                                keepalive_expiry=CLIENT_KEEP_ALIVE_S))
        self.auth = {"authorization": f"Bearer {config.worker_api_key}"} if config.worker_api_key else {}
        self._tasks: set[asyncio.Task] = set()

    @property
    def ready(self) -> bool:
        return any(w.healthy for w in self.prefill.workers) and any(w.healthy for w in self.decode.workers)

    def start(self) -> None:
        for worker in self.prefill.workers + self.decode.workers:
            self.spawn(self._watch(worker))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.http.aclose()

    def spawn(self, work: Coroutine[Any, Any, Any], worker: Worker | None = None) -> asyncio.Task:
        """A task the router holds (the event loop holds tasks only weakly) and cancels at shutdown; it counts
        as in flight at ``worker`` until it ends, and its result is its verdict on ``worker`` (``Circuit``)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if worker is not None:
            worker.hold(task)
        return task

    def post(self, worker: Worker, path: str, body: bytes) -> AbstractAsyncContextManager[httpx.Response]:
        headers = {"content-type": "application/json", **self.auth}
        return self.http.stream("POST", worker.url + path, content=body, headers=headers)

    async def _watch(self, worker: Worker) -> None:
        """Check one worker every interval; each has its own loop, so one slow to answer delays no other's verdict."""
        while True:
            worker.record(await self._passes_health_check(worker))
            await asyncio.sleep(self.config.health_check_interval_s)

    async def _passes_health_check(self, worker: Worker) -> bool:
        try:
            response = await self.http.get(worker.url + "/health", headers=self.auth, timeout=HEALTH_CHECK_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return response.is_success

    async def route(self, request: Request, path: str) -> Response:
        """Send one generation request to a prefill and a decode worker at once; answer with the decode's."""
        try:
            body = _json_object(await request.body())
        except (ValueError, TypeError) as exc:
            return self._refuse(path, "invalid", 400, str(exc))
        prefill, decode = self.prefill.pick(), self.decode.pick()
        if prefill is None or decode is None:
            self.metrics.requests.labels(path, "unavailable").inc()
            return self._unavailable(self.prefill if prefill is None else self.decode)
        exchange = _Exchange(self, path, body, prefill, decode)
        answer = await _unless_disconnected(request, exchange.answer())
        if answer is None:
            exchange.close("disconnected")
            return error_json(499, "client disconnected")
        return answer

    def _refuse(self, path: str, outcome: str, status: int, message: str) -> JSONResponse:
        self.metrics.requests.labels(path, outcome).inc()
        return error_json(status, message)

    def _unavailable(self, pool: _Pool) -> JSONResponse:
        """A 503 for want of a worker of ``pool``'s role, saying when one may be back."""
        if any(w.healthy for w in pool.workers):
            message = f"no {pool.role} worker available: each healthy one has its circuit open after failures"
        else:
            message = f"no healthy {pool.role} worker"
        retry_after = pool.retry_after_s(self.config.health_check_interval_s)
        return error_json(503, message, headers={"Retry-After": str(retry_after)})

    async def ask_decode(self, path: str) -> Response:
        """The first healthy decode worker's answer to ``GET path`` (the model list, the model info):
        the decode servers are the ones that answer clients."""
        decode = next((w for w in self.decode.workers if w.healthy), None)
        if decode is None:
            return self._unavailable(self.decode)
        try:
            response = await self.http.get(decode.url + path, headers=self.auth)
        except httpx.HTTPError as exc:
            return _Failure.raised(decode, exc).response()
        return Response(response.content, response.status_code, media_type=response.headers.get("content-type"))


def _circuit(config: RouterConfig) -> Circuit:
    return Circuit(config.circuit_breaker_failures, config.circuit_breaker_cooldown_s)


def _verdict(status: int) -> bool | None:
    """A worker's answer as a verdict on it: a 4xx is the client's doing."""
    return None if 400 <= status < 500 else status < 500


def _json_object(raw: bytes) -> dict[str, Any]:
    """Raises ValueError or TypeError saying what is wrong with the body."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # UnicodeDecodeError included
        raise ValueError(f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise TypeError("the request body must be a JSON object")
    return body


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None if the client leaves first (``work`` is then cancelled): uvicorn does not
    cancel a handler whose client has gone, and both workers would run the request for nobody."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()  # before any streaming response starts: it listens for the disconnect itself
        left = not task.done()
        task.cancel()
    return None if left else task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Exchange:
    """One request's two legs and what they report, in order, on one queue: the decode leg its head, chunks
    and end; either leg its failure. Whoever answers the client reads the queue, so a failure of either
    leg reaches it whatever it is waiting for, without racing the legs against each other.

    The queue is unbounded: decode output is a few bytes per token, and reading it on whatever the client
    does lets the decode server finish (and free its KV cache) at its own pace. Each attempt (see ``_retry``)
    has legs and a queue of its own, so nothing a cancelled leg left behind is read.

    Each leg returns its verdict on its worker for the circuit breaker: False for the worker's own failures
    (no connection, a timeout, a stream cut short, a 5xx), None for a 4xx or when cancelled (the client left,
    the other leg failed, the request is retried), True otherwise."""

    def __init__(self, router: Router, path: str, body: dict[str, Any], prefill: Worker, decode: Worker) -> None:
        self.router, self.path, self.body = router, path, body
        self.outcome: str | None = None
        self.retried = False
        self._send(prefill, decode)

    def _send(self, prefill: Worker, decode: Worker) -> None:
        """Both legs, with a fresh room: a room names one attempt, so the decode worker never takes one for the
        other."""
        self.prefill = prefill
        sent = json.dumps({**self.body, **bootstrap_fields(prefill)}).encode()  # ours win over any the client sent
        self.events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self.prefill_leg = self.router.spawn(self._prefill(prefill, sent, self.events), prefill)
        self.decode_leg = self.router.spawn(self._decode(decode, sent, self.events), decode)

    async def _prefill(self, worker: Worker, body: bytes, events: asyncio.Queue) -> bool | None:
        """Read the prefill worker's whole answer (it must not see a disconnect while it works) and report it
        only if it is an error."""
        try:
            async with self.router.post(worker, self.path, body) as response:
                content = await response.aread()
        except Exception as exc:  # noqa: BLE001 -- whatever it is, the client must get a 502 rather than wait forever
            self._report(events, _Failure.raised(worker, exc))
            return None if isinstance(exc, httpx.PoolTimeout) else False  # a full pool is the router's doing
        if not response.is_success:
            self._report(events, _Failure.answered(worker, response, content))
        return _verdict(response.status_code)

    async def _decode(self, worker: Worker, body: bytes, events: asyncio.Queue) -> bool | None:
        try:
            async with self.router.post(worker, self.path, body) as response:
                events.put_nowait(("head", response))
                async for chunk in response.aiter_bytes():
                    events.put_nowait(("chunk", chunk))
        except Exception as exc:  # noqa: BLE001 -- as in _prefill (a stream cut short included)
            self._report(events, _Failure.raised(worker, exc))
            return None if isinstance(exc, httpx.PoolTimeout) else False
        events.put_nowait(("end", None))
        return _verdict(response.status_code)

    def _report(self, events: asyncio.Queue, failure: _Failure) -> None:
        late = " (after the request had ended)" if self.outcome is not None else ""
        level = logging.WARNING if failure.status >= 500 else logging.INFO  # a 4xx is the client's doing
        logger.log(level, "%s %s: %d %s%s", self.path, failure.outcome, failure.status,
                   failure.body[:200].decode(errors="replace"), late)
        events.put_nowait(("failed", failure))

    async def answer(self) -> Response:
        """A relay of the decode worker's stream from its first chunk; its whole answer when that is not a
        stream (or an error); or the error of the first leg to fail, unless the request could be sent again."""
        result = await self._attempt()
        if isinstance(result, _Failure) and self._retry(result):
            result = await self._attempt()
        if isinstance(result, _Failure):
            self.close(result.outcome)
            return result.response()
        return result

    async def _attempt(self) -> Response | _Failure:
        """Read the events up to what the client gets first. A stream's head waits for its first chunk: a decode
        server sends the head before the first token, which needs the prefill, so a prefill that never started
        is known by then and the request may still go elsewhere (see ``_retry``)."""
        kind, item = await self.events.get()
        if kind == "failed":
            return item
        head: httpx.Response = item
        streams = head.is_success and head.headers.get("content-type", "").startswith("text/event-stream")
        parts = []
        while (event := await self.events.get())[0] == "chunk":
            if streams:
                return _Relay(self, head, event[1])
            parts.append(event[1])
        if event[0] == "failed":
            return event[1]
        self.close("ok" if head.is_success else "decode_error")
        return Response(b"".join(parts), head.status_code, media_type=head.headers.get("content-type"))

    def _retry(self, failure: _Failure) -> bool:
        """Send the request again, once, when its prefill worker never took it up: nothing has reached the
        client yet. The decode worker was told that prefill's bootstrap address, so its leg goes too, and the
        retry is routed as a new request would be, that prefill worker excepted."""
        if self.retried or not failure.unstarted or failure.outcome != "prefill_error":
            return False
        prefill, decode = self.router.prefill.pick(exclude=self.prefill), self.router.decode.pick()
        if prefill is None or decode is None:
            return False
        self.retried = True
        self.prefill_leg.cancel()  # it has ended: a no-op, but the attempt's legs go together
        self.decode_leg.cancel()
        self.router.metrics.retries.labels(self.path).inc()
        logger.info("%s: %s never took the request up; sending it to prefill worker %s and decode worker %s",
                    self.path, self.prefill.url, prefill.url, decode.url)
        self._send(prefill, decode)
        return True

    async def relay(self, first: bytes) -> AsyncIterator[bytes]:
        yield first
        while (event := await self.events.get())[0] == "chunk":
            yield event[1]
        if event[0] == "failed":
            self.close(event[1].outcome)
            yield event[1].event()
        else:
            self.close("ok")

    def close(self, outcome: str) -> None:
        """End the exchange; only the first call counts. The decode leg is cancelled (a no-op once it has
        ended); so is the prefill leg, unless the request succeeded: the prefill worker is then finishing a
        job whose KV cache the decode worker has already used, and cutting it off would only log an abort."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        self.decode_leg.cancel()
        if outcome != "ok":
            self.prefill_leg.cancel()
        self.router.metrics.requests.labels(self.path, outcome).inc()


class _Relay(StreamingResponse):
    """Streams the decode worker's bytes as they arrive, from ``first`` on. Closes the exchange however the
    stream ends, even when the client left before the first byte (Starlette then never starts the body
    iterator)."""

    def __init__(self, exchange: _Exchange, head: httpx.Response, first: bytes) -> None:
        super().__init__(exchange.relay(first), head.status_code, media_type=head.headers["content-type"])
        self.exchange = exchange

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.exchange.close("disconnected")  # a no-op when the stream ended on its own


def build_router_app(config: RouterConfig) -> FastAPI:
    """The router as an ASGI app; its lifespan runs the health checks. ``app.state.router`` is its state."""
    router = Router(config)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="moeserve router", version="0.1.0", lifespan=lifespan)
    app.state.router = router
    _install_error_handlers(app)
    if config.api_key:
        app.add_middleware(APIKeyAuth, api_key=config.api_key)
    _add_routes(app, router)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def httperror_json(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_json(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))  # 404, 405 …

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_json(500, f"internal error: {type(exc).__name__}")


def _add_routes(app: FastAPI, router: Router) -> None:
    for path in GENERATION_PATHS:
        app.add_api_route(path, _generation_route(router, path), methods=["POST"])

    @app.get("/v1/models")
    async def models() -> Response:
        return await router.ask_decode("/v1/models")

    @app.get("/get_model_info")
    async def model_info() -> Response:
        return await router.ask_decode("/get_model_info")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if router.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _generation_route(router: Router, path: str) -> Callable[[Request], Awaitable[Response]]:
    async def generation(request: Request) -> Response:
        return await router.route(request, path)

    return generation


class _PrefillAction(argparse.Action):
    """``--prefill URL [BOOTSTRAP_PORT]``, repeatable: argparse has no nargs for "one or two"."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if len(values) > 2:
            raise argparse.ArgumentError(self, f"takes a URL and at most one bootstrap port, got {values}")
        try:
            port = int(values[1]) if len(values) == 2 else DEFAULT_BOOTSTRAP_PORT
        except ValueError:
            raise argparse.ArgumentError(self, f"the bootstrap port must be a number, got {values[1]!r}") from None
        setattr(namespace, self.dest, [*(getattr(namespace, self.dest) or []), (values[0], port)])


def add_router_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pd-disaggregation", action="store_true",
                        help="route each request to a prefill and a decode server (the only mode there is)")
    parser.add_argument("--prefill", action=_PrefillAction, nargs="+", metavar=("URL", "BOOTSTRAP_PORT"),
                        help=f"a prefill server and its bootstrap port (default {DEFAULT_BOOTSTRAP_PORT}); repeat")
    parser.add_argument("--decode", action="append", metavar="URL", help="a decode server; repeat")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: a free port, reported in --port-file")
    parser.add_argument("--port-file", default=None,
                        help='once listening, write {"port": ...} here as JSON (the port really bound)')
    parser.add_argument("--policy", default="round_robin", choices=POLICIES,
                        help="least_load: the server with the fewest requests the router has in flight there")
    parser.add_argument("--health-check-interval-s", type=float, default=5.0,
                        help=f"GET /health of each server this often; down after {UNHEALTHY_AFTER_FAILURES} "
                             "failures in a row, up again after one success")
    parser.add_argument("--request-timeout-s", type=float, default=600.0,
                        help="give up on a server that sends nothing for this long")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' of clients")
    parser.add_argument("--worker-api-key", default=None, help="the key the servers require, if any")
    parser.add_argument("--circuit-breaker-failures", type=int, default=3,
                        help="leave a server out after this many failures of its own in a row (no connection, "
                             "a timeout, a 5xx answer; not a 4xx), whatever its health checks say")
    parser.add_argument("--circuit-breaker-cooldown-s", type=float, default=10.0,
                        help="for this long; then one request may try it: its success puts the server back, "
                             "its failure leaves it out for another cooldown")


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    if not args.pd_disaggregation:
        raise ValueError("the router only routes prefill/decode disaggregation: pass --pd-disaggregation")
    return RouterConfig(prefill=tuple(args.prefill or ()), decode=tuple(args.decode or ()), host=args.host,
                        port=args.port, policy=args.policy, health_check_interval_s=args.health_check_interval_s,
                        request_timeout_s=args.request_timeout_s, api_key=args.api_key,
                        worker_api_key=args.worker_api_key, circuit_breaker_failures=args.circuit_breaker_failures,
                        circuit_breaker_cooldown_s=args.circuit_breaker_cooldown_s)


def run_router(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM, then exit 0. Raises ValueError on a bad setting."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = config_from_args(args)
    prefill = ", ".join(f"{url} (bootstrap {port})" for url, port in config.prefill)
    logger.info("routing to prefill %s and decode %s (%s)", prefill, ", ".join(config.decode), config.policy)
    listener = listen(config.host, config.port)
    uv = uvicorn.Config(build_router_app(config), host=config.host, port=config.port, log_level="info",
                        timeout_graceful_shutdown=5, timeout_keep_alive=SERVER_KEEP_ALIVE_S)
    if args.port_file:
        write_port_file(args.port_file, {"port": listener.getsockname()[1]})
    try:
        SignalledServer(uv).run(sockets=[listener])
    finally:
        listener.close()
    return 0
