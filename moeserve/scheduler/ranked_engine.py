"""A synchronous driver of engine rank processes, for the offline ``LLM``."""

from __future__ import annotations

import contextlib
import itertools
import os
import weakref

import zmq
from tqdm import tqdm

from moeserve.config import EngineConfig
from moeserve.core import FinishReason, Req, ReqStatus, SamplingParams
from moeserve.scheduler.channel import ServerSide
from moeserve.scheduler.io import (
    Codec,
    ControlOutput,
    EngineOutput,
    EngineStats,
    ExpertAction,
    ExpertControlInput,
    GenerateInput,
    ShutdownInput,
    TokenOutput,
)
from moeserve.scheduler.ranks import RankAddresses, RankProcesses

POLL_MS = 500


class RankedEngine:
    """The rank processes of one engine and the sockets to them.

    It owns ``addrs`` (the private run directory), ``channel`` (the ZMQ context, its sockets and the
    ZAP handler) and ``ranks`` (the processes); each releases what it holds by itself when it is
    collected. ``close()``, this object's garbage collection or the interpreter's exit ends them in
    order (``shut_down``): the ranks are told to stop and waited for, then the sockets go, then
    the directory."""

    def __init__(self, config: EngineConfig) -> None:
        self.addrs = RankAddresses.derive(config.parallel)
        self.ctx = zmq.Context()
        self.channel = ServerSide(self.ctx, self.addrs.keys)
        self.inputs = [self.channel.bind(zmq.PUSH, a) for a in self.addrs.inputs]
        self.output = self.channel.bind(zmq.PULL, self.addrs.output)
        self.codec = Codec(EngineOutput)
        self.ranks = RankProcesses(config, self.addrs)
        self._close = weakref.finalize(self, shut_down, self.ranks, self.channel, self.addrs, self.inputs,
                                       self.codec.encode(ShutdownInput()), os.getpid())
        try:
            self.max_total_tokens = self.ranks.wait_ready()["max_total_tokens"]
        except Exception:
            self.close()
            raise
        self._ids = itertools.count()
        self._control_seq = itertools.count(1)
        self._answers: dict[int, ControlOutput] = {}

    def control(self, action: ExpertAction) -> ControlOutput:
        """Run ``action`` on every rank (``scheduler.controls``); rank 0's answer."""
        seq = next(self._control_seq)
        for sock in self.inputs:
            sock.send(self.codec.encode(ExpertControlInput(seq, action)))
        while seq not in self._answers:
            self._receive()
        return self._answers.pop(seq)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], use_tqdm: bool) -> list[Req]:
        """Send every prompt (DP groups in turn), wait for all to finish; requests in order."""
        reqs = {f"ranked-{next(self._ids)}": Req("", ids, p) for ids, p in zip(prompts, params)}
        for i, (rid, req) in enumerate(reqs.items()):
            req.rid = rid
            self.inputs[i % len(self.inputs)].send(self.codec.encode(GenerateInput(rid, req.prompt_ids, req.params)))
        pending = set(reqs)
        with tqdm(total=len(reqs), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                for out in self._receive():
                    if out.rid in pending and self._apply(reqs[out.rid], out):
                        pending.discard(out.rid)
                        bar.update(1)
        return list(reqs.values())

    def _receive(self) -> list[TokenOutput]:
        while not self.output.poll(POLL_MS):
            if (dead := self.ranks.dead()) is not None:
                raise RuntimeError(f"engine {dead}")
        msg = self.codec.decode(self.output.recv_multipart())
        if isinstance(msg, ControlOutput):
            self._answers[msg.seq] = msg
        return [] if msg is None or isinstance(msg, (EngineStats, ControlOutput)) else msg.outputs

    @staticmethod
    def _apply(req: Req, out: TokenOutput) -> bool:
        """Add a message to its request; True when the request is finished."""
        if out.error is not None:
            raise (ValueError if out.error_status < 500 else RuntimeError)(out.error)
        req.output_ids += out.new_ids
        req.cached_tokens = out.cached_tokens
        req.output_logprobs += out.new_logprobs
        if out.prompt_logprobs is not None:
            req.prompt_logprobs = out.prompt_logprobs
        if out.finish_reason is None:
            return False
        req.text = out.text or ""
        req.status, req.finish_reason = ReqStatus.FINISHED, FinishReason(out.finish_reason)
        return True

    def close(self) -> None:
        """``shut_down``; a second call does nothing."""
        self._close()


def shut_down(ranks: RankProcesses, channel: ServerSide, addrs: RankAddresses, inputs: list[zmq.Socket],
              goodbye: bytes, owner_pid: int) -> None:
    """``RankedEngine``'s end, over what it owns (its finalizer holds these, never the engine): ask
    every DP group's leader to stop (``goodbye``, a ``ShutdownInput``; never waiting on a socket),
    stop the ranks (bounded: ``RankProcesses.stop``), close the channel (bounded), remove the run
    directory. Nothing in a forked child, which inherits the finalizer but not the ranks."""
    if os.getpid() != owner_pid:
        return
    if ranks.dead() is None:
        for sock in inputs:
            with contextlib.suppress(zmq.ZMQError):
                sock.send(goodbye, flags=zmq.NOBLOCK)
    ranks.stop()
    channel.close()
    addrs.cleanup()
