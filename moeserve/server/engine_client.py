"""The API process's side of the engine: submit requests, receive their tokens, detokenize."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from moeserve.core import BootstrapInfo, SamplingParams, TokenLogprob
from moeserve.models.tokenizer import IncrementalDetokenizer, Tokenizer
from moeserve.scheduler.channel import ServerSide
from moeserve.scheduler.io import (
    AbortInput,
    Codec,
    ControlOutput,
    EngineInput,
    EngineOutput,
    EngineStats,
    ExpertAction,
    ExpertControlInput,
    GenerateInput,
    ShutdownInput,
    TokenBatch,
    TokenOutput,
)
from moeserve.scheduler.ranks import RankAddresses
from moeserve.server.metrics import Metrics
from moeserve.server.prefix_routing import CacheAwareRouter

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """A request ended without a result. ``status``: 400 when the engine refused it (bad input),
    500 when the engine failed while running it, 503 when the engine is gone or the request waited
    past ``--queue-timeout``."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status

    @property
    def kind(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"


class Ticket:
    """Queue places an HTTP request holds from the moment it is admitted: one per engine request
    it will make, each given back when that request gets its first token or ends. ``release``
    gives back whatever is left; it is safe to call more than once."""

    def __init__(self, client: EngineClient, places: int) -> None:
        self.client, self.places = client, places
        client.queued += places

    def done_one(self) -> None:
        if self.places > 0:
            self.places -= 1
            self.client.queued -= 1

    def release(self) -> None:
        self.client.queued -= self.places
        self.places = 0


@dataclass
class Chunk:
    """What a handler streams: new text and token ids; ``finish_reason`` on the last chunk."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first chunk, when asked for


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
    """Talks to the engine ranks over authenticated ZMQ sockets this process binds: one PUSH per
    data-parallel group (its leader pulls) and one PULL that every leader pushes tokens to.

    It is also the DP controller: each request goes to one DP group, by round robin, to the
    group with the fewest outstanding tokens (prompt + tokens still to generate), or, with
    ``cache_aware``, to the group whose prefix cache likely holds its prompt (``prefix_routing``).

    Its context and sockets belong to ``channel`` (a ``ServerSide``), which releases them, with
    bounded waits, when it is garbage-collected or the interpreter exits; ``close()`` does it now.

    With several API workers (``--api-workers``) each has its own client: ``worker`` is its index,
    which the ranks send its requests' tokens back by, and ``next_control`` numbers its controls
    from the counter all workers share. Its DP choices see only its own requests.
    """

    def __init__(self, tokenizer: Tokenizer | None, metrics: Metrics, addrs: RankAddresses,
                 load_balance_method: str = "round_robin", route_by_room: bool = False, worker: int = 0,
                 next_control: Callable[[], int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.ctx = zmq.asyncio.Context()
        self.channel = ServerSide(self.ctx, addrs.keys)
        self._to_engine = [self.channel.bind(zmq.PUSH, a) for a in addrs.inputs]
        self._from_engine = self.channel.bind(zmq.PULL, addrs.output)
        self.codec = Codec(EngineOutput)
        self._input_check = Codec(EngineInput)  # what the ranks will accept, checked before sending
        self.load_balance_method = load_balance_method
        self.route_by_room = route_by_room  # a prefill server: the room picks the DP group, as the decode side assumes
        self.worker = worker
        self._next_dp = worker % len(self._to_engine)  # the workers' round robins start apart
        self._prefix_router = None  # with one DP group there is nothing to choose, so no tree to keep
        if load_balance_method == "cache_aware" and len(self._to_engine) > 1:
            self._prefix_router = CacheAwareRouter(len(self._to_engine))
        self._requests: dict[str, _Request] = {}
        self.queued = 0  # admitted requests without a first token yet (``Ticket``)
        self.stats: dict[int, EngineStats] = {}
        self.dead: str | None = None
        self._reader: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._controls: dict[int, asyncio.Future[ControlOutput]] = {}  # seq -> its answer
        self._next_control = next_control or itertools.count(1).__next__

    def _pick_dp(self, prompt_ids: list[int], bootstrap: BootstrapInfo | None = None) -> int:
        """The DP group for a new request with prompt ``prompt_ids``."""
        n = len(self._to_engine)
        if self.route_by_room and bootstrap is not None:
            dp = bootstrap.room % n if bootstrap.prefill_dp_rank is None else bootstrap.prefill_dp_rank
            if dp >= n:
                raise EngineError(f"prefill_dp_rank {dp} is not in [0, {n})", 400)
            return dp
        if self.load_balance_method == "round_robin":
            self._next_dp = (self._next_dp + 1) % n
            return (self._next_dp - 1) % n
        load = self._outstanding_tokens()
        if self._prefix_router is not None:
            return self._prefix_router.pick(prompt_ids, load)
        return min(range(n), key=lambda d: (load[d], d))

    def _outstanding_tokens(self) -> list[int]:
        """Per DP group: prompt + tokens still to generate of its requests in flight."""
        load = [0] * len(self._to_engine)
        for req in self._requests.values():
            load[req.dp] += req.cost - req.num_tokens
        return load

    def admit(self, places: int) -> Ticket:
        return Ticket(self, places)

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())
        self._reader.add_done_callback(self._reader_ended)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, ticket: Ticket | None = None,
                       bootstrap: BootstrapInfo | None = None) -> AsyncIterator[Chunk]:
        """Stream one request's chunks; aborts it in the engine if the consumer stops early."""
        ticket = ticket or self.admit(1)
        rid = uuid.uuid4().hex
        cost = len(prompt_ids) + params.max_tokens
        try:
            message = self._encode_input(GenerateInput(rid, prompt_ids, params, bootstrap, self.worker))
            dp = self._pick_dp(prompt_ids, bootstrap)
        except EngineError:
            ticket.done_one()
            raise
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens) if self.tokenizer else None
        req = self._requests[rid] = _Request(rid, params, detok, dp, cost)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        finished, queued = False, True
        try:
            await self._to_engine[req.dp].send(message)
            while not finished:
                out: TokenOutput = await req.queue.get()
                if queued:  # its first answer: no longer waiting in the queue
                    ticket.done_one()
                    queued = False
                if out.error is not None:
                    finished = True  # the engine has forgotten it already
                    raise EngineError(out.error, out.error_status)
                chunk = self._to_chunk(req, out)
                finished = chunk.finish_reason is not None
                yield chunk
        finally:
            if queued:
                ticket.done_one()
            self._requests.pop(rid, None)
            if not finished and not self.dead:
                self.metrics.finished("abort")
                self._abort_soon(rid, req.dp)

    def _encode_input(self, msg: GenerateInput) -> bytes:
        """The message as the ranks will decode it; a request they would drop is refused here."""
        if self.dead:
            raise EngineError(self.dead, 503)
        try:
            data = self.codec.encode(msg)
        except (OverflowError, TypeError) as exc:
            raise EngineError(f"the request cannot be encoded: {exc}", 400) from exc
        if self._input_check.decode([data]) is None:
            raise EngineError(f"the request does not match the engine's schema: {self._input_check.last_error}", 400)
        return data

    def _abort_soon(self, rid: str, dp: int) -> None:
        """Send the abort from a task of its own: this request's task may be mid-cancellation,
        where any await of its own would be cancelled again before the message leaves."""
        task = asyncio.get_running_loop().create_task(self._send(AbortInput(rid), dp))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send(self, msg: object, dp: int, flags: int = 0) -> None:
        with contextlib.suppress(zmq.ZMQError):  # zmq.Again (NOBLOCK, no peer) included
            await self._to_engine[dp].send(self.codec.encode(msg), flags)

    def _to_chunk(self, req: _Request, out: TokenOutput) -> Chunk:
        self._record_timing(req, len(out.new_ids), out.finish_reason)
        req.num_tokens += len(out.new_ids)
        text = self._text_delta(req, out)
        return Chunk(text, out.new_ids, out.new_logprobs, out.finish_reason, out.prompt_len, out.cached_tokens,
                     out.prompt_logprobs)

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
        """Route every output to its request. A malformed message is dropped and counted; nothing
        a message holds can end this loop."""
        while True:
            msg = self.codec.decode(await self._from_engine.recv_multipart())
            if msg is None:
                self.metrics.rejected_messages.inc()
                logger.warning("dropped a malformed message from the engine channel: %s", self.codec.last_error)
                continue
            try:
                self._route(msg)
            except Exception:
                self.metrics.rejected_messages.inc()
                logger.exception("dropped an engine message that could not be routed")

    async def control(self, action: ExpertAction, timeout_s: float) -> ControlOutput:
        """Run ``action`` on every rank (``scheduler.controls``) and wait for rank 0's answer."""
        if self.dead:
            raise EngineError(self.dead, 503)
        seq = self._next_control()
        answer = self._controls[seq] = asyncio.get_running_loop().create_future()
        try:
            for dp in range(len(self._to_engine)):
                await self._send(ExpertControlInput(seq, action, self.worker), dp)
            return await asyncio.wait_for(answer, timeout_s)
        except asyncio.TimeoutError:
            raise EngineError(f"the engine did not answer {action} within {timeout_s:.0f} s", 504) from None
        finally:
            self._controls.pop(seq, None)

    def _route(self, msg: TokenBatch | EngineStats | ControlOutput) -> None:
        if isinstance(msg, ControlOutput):
            answer = self._controls.get(msg.seq)
            if answer is not None and not answer.done():
                answer.set_result(msg)
            return
        if isinstance(msg, EngineStats):
            if 0 <= msg.dp_rank < len(self._to_engine):
                self.stats[msg.dp_rank] = msg
                self.metrics.update_engine(list(self.stats.values()))
            return
        for out in msg.outputs:
            req = self._requests.get(out.rid)
            if req is not None:
                req.queue.put_nowait(out)

    def _reader_ended(self, task: asyncio.Task) -> None:
        """The reader must live as long as the server: if it ever ends, fail loudly, not silently."""
        if not task.cancelled() and not self.dead:
            reason = f"the engine channel reader stopped: {task.exception()!r}"
            logger.error(reason)
            self.fail_all(reason)

    def fail_all(self, reason: str) -> None:
        """The engine died: end every waiting request with an error."""
        self.dead = reason
        for req in list(self._requests.values()):
            req.queue.put_nowait(TokenOutput(req.rid, [], finish_reason="error", error=reason, error_status=503))

    async def shutdown(self) -> None:
        if not self.dead:  # without waiting: a PUSH socket with no peer (ranks another API worker
            for dp in range(len(self._to_engine)):  # already shut down) would wait forever
                await self._send(ShutdownInput(), dp, zmq.NOBLOCK)
        if self._reader is not None:
            self._reader.cancel()

    def close(self) -> None:
        """Close the sockets (a ``ShutdownInput`` just sent gets 100 ms to leave) and end the context."""
        for sock in self._to_engine:
            sock.close(linger=100)
        self.channel.close()
