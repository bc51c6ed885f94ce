"""The engine process: receive requests over ZMQ, step the scheduler, send tokens back."""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection

import zmq

from moeserve.config import EngineConfig
from moeserve.core import Req
from moeserve.executor.model_runner import ModelRunner
from moeserve.models.tokenizer import load_tokenizer
from moeserve.scheduler.io import AbortInput, EngineStats, GenerateInput, ShutdownInput, TokenOutput
from moeserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 100
STATS_INTERVAL_S = 0.05


class EngineLoop:
    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str) -> None:
        tokenizer = load_tokenizer(config.load.tokenizer_path or config.load.model_path)
        eos = set(config.model.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.runner = ModelRunner(config)
        self.scheduler = Scheduler(config, self.runner, tokenizer, tuple(sorted(eos)))
        self._init_sockets(input_addr, output_addr)
        self._sent: dict[str, int] = {}  # rid -> output tokens already sent
        self._steps = 0
        self._last_stats = 0.0
        self._parent = os.getppid()

    def _init_sockets(self, input_addr: str, output_addr: str) -> None:
        ctx = zmq.Context.instance()
        self.inputs = ctx.socket(zmq.PULL)
        self.inputs.connect(input_addr)
        self.outputs = ctx.socket(zmq.PUSH)
        self.outputs.connect(output_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.inputs, zmq.POLLIN)

    def run(self) -> None:
        while self._receive(block=not self.scheduler.has_work):
            if self.scheduler.has_work:
                self._send_outputs(self.scheduler.step())
                self._steps += 1
            self._send_stats()
            if os.getppid() != self._parent:
                logger.error("the API process is gone; the engine exits")
                return

    def _receive(self, block: bool) -> bool:
        """Handle every waiting message; False when told to shut down."""
        timeout = IDLE_POLL_MS if block else 0
        while self.poller.poll(timeout):
            msg = self.inputs.recv_pyobj()
            if isinstance(msg, ShutdownInput):
                return False
            self._handle(msg)
            timeout = 0
        return True

    def _handle(self, msg: GenerateInput | AbortInput) -> None:
        if isinstance(msg, AbortInput):
            req = self.scheduler.abort(msg.rid)
            if req is not None:
                self._send_outputs([req])
            return
        try:
            self.scheduler.add_request(msg.rid, msg.prompt_ids, msg.params)
            self._sent[msg.rid] = 0
        except ValueError as exc:
            self.outputs.send_pyobj([TokenOutput(msg.rid, [], finish_reason="error", error=str(exc))])

    def _send_outputs(self, reqs: list[Req]) -> None:
        batch = [self._delta(req) for req in reqs]
        if batch:
            self.outputs.send_pyobj(batch)

    def _delta(self, req: Req) -> TokenOutput:
        sent = self._sent.get(req.rid, 0)
        out = TokenOutput(req.rid, req.output_ids[sent:], prompt_len=len(req.prompt_ids))
        if req.params.logprobs is not None:
            out.new_logprobs = req.output_logprobs[sent:]
        if req.finished:
            self._sent.pop(req.rid, None)
            out.finish_reason, out.text = req.finish_reason.value, req.text
        else:
            self._sent[req.rid] = len(req.output_ids)
        return out

    def _send_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < STATS_INTERVAL_S:
            return
        self._last_stats = now
        q, pages = self.scheduler.queues, self.runner.page_pool
        self.outputs.send_pyobj(EngineStats(
            num_running=len(q.running) + (q.chunked is not None), num_waiting=len(q.waiting),
            pages_used=pages.num_used, pages_total=pages.capacity, page_size=pages.page_size,
            retracted=self.scheduler.policy.retracted, generation_steps=self._steps,
        ))


def run_engine(config: EngineConfig, input_addr: str, output_addr: str, ready: Connection) -> None:
    """Entry point of the engine process; reports ``("ready", info)`` or ``("error", text)``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; the API process decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        loop = EngineLoop(config, input_addr, output_addr)
    except Exception:  # noqa: BLE001 - the launcher shows the reason to the user
        ready.send(("error", traceback.format_exc()))
        return
    ready.send(("ready", {"max_total_tokens": loop.runner.max_total_tokens}))
    ready.close()
    loop.run()
