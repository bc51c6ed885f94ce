"""The per-rank event loop: admit requests, schedule a batch, run it, apply the results."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from moeserve.config import EngineConfig
from moeserve.core import FinishReason, Req, SamplingParams, ScheduleBatch
from moeserve.executor.model_runner import ModelRunner
from moeserve.executor.sampler import SampleOutput, Sampler, SamplingInfo
from moeserve.scheduler.policy import BatchPolicy, Queues
from moeserve.scheduler.validation import check_request

logger = logging.getLogger(__name__)


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Scheduler:
    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer: Detokenizer | None = None) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        # the model's eos ids and the tokenizer's, which some checkpoints name differently
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset(config.model.eos_token_ids) | ({tokenizer_eos} - {None})
        self._init_queues()
        self._init_policy()
        self.sampler = Sampler()
        # ranks that share a batch must append the same tokens: the event loop replaces this with
        # a broadcast from the group's first rank
        self.sample_sync: Callable[[SampleOutput], SampleOutput] = lambda out: out

    def _init_queues(self) -> None:
        self.queues = Queues()
        self.requests: dict[str, Req] = {}
        self._arrivals = itertools.count()

    def _init_policy(self) -> None:
        self.pages = self.runner.page_pool
        self.policy = BatchPolicy(self.config.scheduler, self.pages)

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> Req:
        """Queue a request; raises ValueError naming the problem when it can never run."""
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        self._validate(prompt_ids, params)
        req = Req(rid, list(prompt_ids), params, arrival=next(self._arrivals))
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        self.requests[rid] = req
        self.queues.waiting.append(req)
        return req

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_ids, params, self.config, self.runner.max_total_tokens, self.tokenizer is not None)

    def abort(self, rid: str, message: str = "aborted") -> Req | None:
        """End a request wherever it is and free its pages; None if it is unknown or done."""
        req = self.requests.pop(rid, None)
        if req is None:
            return None
        q = self.queues
        if req is q.chunked:
            q.chunked = None
        elif req in q.running:
            q.running.remove(req)
        elif req in q.waiting:
            q.waiting.remove(req)
        self.policy.release(req)
        req.finish(FinishReason.ABORT, message)
        return req

    @property
    def has_work(self) -> bool:
        return len(self.queues) > 0

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one batch; return the requests that got a new token (finished ones included)."""
        batch = self.schedule()
        if batch is None:
            return []
        return self.process(batch, self.runner.forward(batch))

    def schedule(self) -> ScheduleBatch | None:
        return self.policy.next_batch(self.queues)

    def process(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[Req]:
        """Apply a batch's logits: sample, append, check stops, free what finished.

        A request whose sampling or stop check fails ends alone with ``FinishReason.ERROR``; the
        rest of the batch, and the rank, go on.
        """
        for seq in batch.seqs:
            seq.req.kv_len = seq.end
        done = [(i, s.req) for i, s in enumerate(batch.seqs) if s.completes_fill]
        if not done:
            return []
        infos = [SamplingInfo(r.params, r.generator, r.prompt_ids, r.output_ids) for _, r in done]
        sampled = self.sample_sync(self.sampler.sample_isolated(logits[[i for i, _ in done]], infos))
        for k, (_, req) in enumerate(done):
            if k in sampled.errors:
                self.fail(req, sampled.errors[k])
                continue
            req.output_ids.append(sampled.next_ids[k])
            if sampled.logprobs is not None and sampled.logprobs[k] is not None:
                req.output_logprobs.append(sampled.logprobs[k])
            if not batch.mode.is_decode:
                self.queues.running.append(req)  # prefill done: decode from the next step on
            try:
                self._check_finished(req)
            except Exception as exc:  # detokenizing for a stop string, say
                logger.exception("request %s failed after sampling", req.rid)
                self.fail(req, f"{type(exc).__name__}: {exc}")
        return [req for _, req in done]

    def fail(self, req: Req, message: str) -> None:
        """End a request that the engine could not run, wherever it is; its pages are freed."""
        if self.abort(req.rid) is not None:
            req.finish(FinishReason.ERROR, message)

    def _check_finished(self, req: Req) -> None:
        params, token = req.params, req.output_ids[-1]
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            self._finish(req, FinishReason.STOP, self._decode(req, req.output_ids[:-1]))
        elif params.stop and (text := self._text_before_stop(req)) is not None:
            self._finish(req, FinishReason.STOP, text)
        elif len(req.output_ids) >= params.max_tokens or req.seq_len >= self.config.context_length:
            self._finish(req, FinishReason.LENGTH, self._decode(req, req.output_ids))

    def _decode(self, req: Req, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, req.params.skip_special_tokens) if self.tokenizer else ""

    def _text_before_stop(self, req: Req) -> str | None:
        """The output text up to the first stop string, or None if no stop string appeared."""
        text = self._decode(req, req.output_ids)
        hits = [i for i in (text.find(s) for s in req.params.stop) if i >= 0]
        return text[:min(hits)] if hits else None

    def _finish(self, req: Req, reason: FinishReason, text: str) -> None:
        if req in self.queues.running:
            self.queues.running.remove(req)
        self.policy.release(req)
        self.requests.pop(req.rid, None)
        req.text = text
        req.finish(reason)
