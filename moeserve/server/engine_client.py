"""The API process's side of the engine: submit requests, receive their tokens, detokenize."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from moeserve.core import SamplingParams, TokenLogprob
from moeserve.models.tokenizer import IncrementalDetokenizer, Tokenizer
from moeserve.scheduler.io import AbortInput, EngineStats, GenerateInput, ShutdownInput, TokenOutput
from moeserve.scheduler.ranks import RankAddresses
from moeserve.server.metrics import Metrics


class EngineError(RuntimeError):
    """The engine refused a request (bad input) or is gone."""


@dataclass
class Chunk:
    """What a handler streams: new text and token ids; ``finish_reason`` on the last chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    prompt_tokens: int = 0


@dataclass
class _Request:
    rid: str
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    dp: int = 0
    cost: int = 0
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    created: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    emitted: str = ""
    num_tokens: int = 0


class EngineClient:
    """Talks to the engine ranks over ZMQ sockets this process binds: one PUSH per data-parallel
    group (its leader pulls) and one PULL that every leader pushes tokens to.

    It is also the DP controller: each request goes to one DP group, by round robin or to the
    group with the fewest outstanding tokens (prompt + tokens still to generate).
    """

    def __init__(self, tokenizer: Tokenizer | None, metrics: Metrics, addrs: RankAddresses,
                 load_balance_method: str = "round_robin", bind_all_interfaces: bool = False) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.ctx = zmq.asyncio.Context()
        self._to_engine = [self._bind(zmq.PUSH, a, bind_all_interfaces) for a in addrs.inputs]
        self._from_engine = self._bind(zmq.PULL, addrs.output, bind_all_interfaces)
        self.load_balance_method = load_balance_method
        self._next_dp = 0
        self._requests: dict[str, _Request] = {}
        self.stats: dict[int, EngineStats] = {}
        self.dead: str | None = None
        self._reader: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    def _bind(self, kind: int, addr: str, all_interfaces: bool) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(kind)
        sock.bind(f"tcp://*:{addr.rsplit(':', 1)[1]}" if all_interfaces else addr)
        return sock

    def _pick_dp(self, cost: int) -> int:
        """The DP group for a new request costing ``cost`` tokens."""
        n = len(self._to_engine)
        if self.load_balance_method == "shortest_queue":
            load = [0] * n
            for req in self._requests.values():
                load[req.dp] += req.cost - req.num_tokens
            return min(range(n), key=lambda d: (load[d], d))
        self._next_dp = (self._next_dp + 1) % n
        return (self._next_dp - 1) % n

    @property
    def num_queued(self) -> int:
        """Requests sent to the engine that have not produced a token yet."""
        return sum(1 for r in self._requests.values() if r.num_tokens == 0)

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Chunk]:
        """Stream one request's chunks; aborts it in the engine if the consumer stops early."""
        if self.dead:
            raise EngineError(self.dead)
        rid = uuid.uuid4().hex
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens) if self.tokenizer else None
        cost = len(prompt_ids) + params.max_tokens
        req = self._requests[rid] = _Request(rid, params, detok, self._pick_dp(cost), cost)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        await self._to_engine[req.dp].send_pyobj(GenerateInput(rid, prompt_ids, params))
        finished = False
        try:
            while not finished:
                out: TokenOutput = await req.queue.get()
                if out.error is not None:
                    raise EngineError(out.error)
                chunk = self._to_chunk(req, out)
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            self._requests.pop(rid, None)
            if not finished and not self.dead:
                self.metrics.finished("abort")
                self._abort_soon(rid, req.dp)

    def _abort_soon(self, rid: str, dp: int) -> None:
        """Send the abort from a task of its own: this request's task may be mid-cancellation,
        where any await of its own would be cancelled again before the message leaves."""
        task = asyncio.get_running_loop().create_task(self._send(AbortInput(rid), dp))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send(self, msg: object, dp: int) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await self._to_engine[dp].send_pyobj(msg)

    def _to_chunk(self, req: _Request, out: TokenOutput) -> Chunk:
        self._record_timing(req, len(out.new_ids), out.finish_reason)
        req.num_tokens += len(out.new_ids)
        text = self._text_delta(req, out)
        return Chunk(text, out.new_ids, out.new_logprobs, out.finish_reason, out.prompt_len)

    def _text_delta(self, req: _Request, out: TokenOutput) -> str:
        if req.detok is None:
            return ""
        if out.finish_reason is not None and out.text is not None and out.text.startswith(req.emitted):
            delta = out.text[len(req.emitted):]  # the engine's text is final (cut at a stop string)
        else:
            pending = req.detok.step(out.new_ids)
            delta = pending if out.finish_reason is None else pending + req.detok.flush()
            if out.finish_reason is None:
                delta = self._hold_back_stop_prefix(req, delta)
        req.emitted += delta
        return delta

    def _hold_back_stop_prefix(self, req: _Request, delta: str) -> str:
        """Keep the last ``len(stop) - 1`` characters unsent: they may start a stop string."""
        hold = max((len(s) for s in req.params.stop), default=1) - 1
        if hold <= 0:
            return delta
        available = req.detok.output_text
        return available[len(req.emitted):max(len(available) - hold, len(req.emitted))]

    def _record_timing(self, req: _Request, n_new: int, finish_reason: str | None) -> None:
        now = time.monotonic()
        if n_new:
            if req.last_token is None:
                self.metrics.ttft.observe(now - req.created)
            else:
                self.metrics.itl.observe((now - req.last_token) / n_new)
            req.last_token = now
            self.metrics.generation_tokens.inc(n_new)
        if finish_reason is not None:
            self.metrics.e2e.observe(now - req.created)
            self.metrics.finished(finish_reason)

    async def _read_loop(self) -> None:
        while True:
            msg = await self._from_engine.recv_pyobj()
            if isinstance(msg, EngineStats):
                self.stats[msg.dp_rank] = msg
                self.metrics.update_engine(list(self.stats.values()))
                continue
            for out in msg:
                req = self._requests.get(out.rid)
                if req is not None:
                    req.queue.put_nowait(out)

    def fail_all(self, reason: str) -> None:
        """The engine died: end every waiting request with an error."""
        self.dead = reason
        for req in list(self._requests.values()):
            req.queue.put_nowait(TokenOutput(req.rid, [], finish_reason="error", error=reason))

    async def shutdown(self) -> None:
        if not self.dead:  # a PUSH socket with no peer would wait forever
            for dp in range(len(self._to_engine)):
                await self._send(ShutdownInput(), dp)
        if self._reader is not None:
            self._reader.cancel()

    def close(self) -> None:
        for sock in self._to_engine:
            sock.close(linger=100)
        self._from_engine.close(linger=0)
        self.ctx.term()
