"""The per-rank scheduler: admit requests, schedule a batch, run it, apply the results."""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections import Counter
from typing import Protocol

import torch

from moeserve.cache.prefix_cache import PrefixCache
from moeserve.config import EngineConfig
from moeserve.core import BootstrapInfo, DPInfo, FinishReason, Req, SamplingParams, ScheduleBatch, TokenLogprob
from moeserve.executor.grammar import GrammarBackend
from moeserve.executor.model_runner import ModelRunner
from moeserve.executor.sampler import SampleOutput, Sampler, SamplingInfo
from moeserve.scheduler.decode import DecodeManager
from moeserve.scheduler.prefill import PrefillManager
from moeserve.scheduler.requests import RequestTable, release_pages
from moeserve.scheduler.roles import MixedRole, Role
from moeserve.scheduler.speculative import SpecDecoder, Verdict
from moeserve.scheduler.validation import check_request

logger = logging.getLogger(__name__)


class Detokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class Collectives(ABC):
    """What a rank's scheduler decides together with the other ranks, each step. Every rank calls
    these in the same order (each is a collective on the rank processes), so the ranks run the same
    forward passes and their requests move alike."""

    @abstractmethod
    def agree(self, batch: ScheduleBatch | None) -> tuple[bool, DPInfo | None]:
        """(anyone has work, what every DP group runs): the ranks run a step together, an idle
        forward pass for a rank with nothing to run."""

    @abstractmethod
    def agree_phase(self, batch: ScheduleBatch | None) -> tuple[bool, DPInfo | None]:
        """``agree`` for a further forward pass within the step (speculative decoding's drafts)."""

    @abstractmethod
    def sample_sync(self, out: SampleOutput) -> SampleOutput:
        """The attention-TP leader's samples: ranks that share a batch append the same tokens."""

    @abstractmethod
    def verdict_sync(self, verdict: Verdict) -> Verdict:
        """The leader's verdict on a speculative verify step, as ``sample_sync``."""

    @abstractmethod
    def tp_min(self, values: list[int]) -> list[int]:
        """The elementwise minimum over the attention-TP group: its ranks move a request on only
        when all of them see it ready."""


class LocalCollectives(Collectives):
    """One process alone (the offline ``LLM``): no peers to agree with."""

    def agree(self, batch: ScheduleBatch | None) -> tuple[bool, DPInfo | None]:
        return batch is not None, None

    def agree_phase(self, batch: ScheduleBatch | None) -> tuple[bool, DPInfo | None]:
        return batch is not None, None

    def sample_sync(self, out: SampleOutput) -> SampleOutput:
        return out

    def verdict_sync(self, verdict: Verdict) -> Verdict:
        return verdict

    def tp_min(self, values: list[int]) -> list[int]:
        return values


class Scheduler:
    """One rank's scheduler, composed of small parts that each release what they hold of an
    aborted request: the request table, the page allocator, a prefill manager (admission and
    chunking), a decode manager (running batch, retraction) and a role (where a request goes
    next). ``step`` drives the offline ``LLM`` and the rank processes alike; what differs is
    only the ``collectives`` it agrees with the other ranks through (the rank loop's)."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, tokenizer: Detokenizer | None = None,
                 role: Role | None = None, collectives: Collectives | None = None) -> None:
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.collectives = collectives or LocalCollectives()
        # the model's eos ids and the tokenizer's, which some checkpoints name differently
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_ids = frozenset(config.model.eos_token_ids) | ({tokenizer_eos} - {None})
        self._init_parts()
        self._init_role(role or MixedRole())
        self.sampler = Sampler()
        hf = getattr(tokenizer, "hf", None)
        self.grammar = None if hf is None else GrammarBackend(config.scheduler.grammar_backend, hf,
                                                               config.model.vocab_size, self.eos_token_ids)
        self.ran_forward = False  # whether the last step ran a forward pass (an idle one too)

    def _init_parts(self) -> None:
        self.requests = RequestTable()
        self.ended_early: Counter[str] = Counter()  # aborted or failed requests, by stage (``stage``)
        self.pages = self.runner.new_page_pool()
        self.prefill = PrefillManager(self.config.scheduler, self.pages)
        self.decode = DecodeManager(self.pages, self.prefill)
        self.spec: SpecDecoder | None = None
        if self.config.spec.enabled:
            self.spec = SpecDecoder(self, self.config.spec.num_drafts)
            # a verify step writes the drafts' KV, and the next chain's draft steps the MTP layer's
            self.prefill.lookahead, self.decode.lookahead = self.spec.num_drafts, 2 * self.spec.num_drafts

    def _init_role(self, role: Role) -> None:
        self.role = role
        role.bind(self)
        if role.caches_prefixes and not self.config.cache.disable_radix_cache:
            self.pages.attach(PrefixCache(self.pages))

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                    bootstrap: BootstrapInfo | None = None) -> Req:
        """Queue a request; raises ValueError naming the problem when it can never run.

        ``bootstrap`` tells a PD role where the other side of the request is."""
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        self._validate(prompt_ids, params)
        req = Req(rid, list(prompt_ids), params, bootstrap=bootstrap)
        self.role.validate(req)
        if params.constrained:
            req.constraint = self.grammar.constraint(params)
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        self.requests.add(req)
        self.role.admit(req)
        return req

    def _validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_ids, params, self.config, self.runner.max_total_tokens, self.tokenizer is not None)

    def sampling_info(self, req: Req) -> SamplingInfo:
        """The sampler's view of ``req``: its stop tokens banned while ``min_tokens`` are not out, its
        grammar's matcher having taken every output token (a first one from a prefill server too)."""
        params = req.params
        banned = []
        if len(req.output_ids) < params.min_tokens:
            banned = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids))
        if req.constraint is not None:
            req.constraint.catch_up(req.output_ids)
        return SamplingInfo(params, req.generator, req.prompt_ids, req.output_ids, banned, req.constraint)

    def abort(self, rid: str, message: str = "aborted") -> Req | None:
        """End a request wherever it is and free its pages; None if it is unknown or done."""
        req = self.requests.pop(rid)
        if req is None:
            return None
        self.ended_early[self.stage(req)] += 1
        self.prefill.release(req) or self.decode.release(req)
        if self.spec is not None:
            self.spec.release(req)
        if not self.role.release(req):
            release_pages(self.pages, req)
        req.finish(FinishReason.ABORT, message)
        return req

    def stage(self, req: Req) -> str:
        """Where ``req`` is: a queue of the role (PD), else prefilling (a chunk of it is cached),
        decoding, retracted (waiting to prefill again) or waiting."""
        if (stage := self.role.stage(req)) is not None:
            return stage
        if req in self.decode.running:
            return "decoding"
        if req is self.prefill.chunked:
            return "prefilling"
        return "retracted" if req.num_retractions else "waiting"

    def flush_prefix_cache(self) -> int:
        """Free every page the prefix cache holds (SGLang's ``/flush_cache``); refused (ValueError)
        while a request is here, whose pages it may share. Returns the pages freed."""
        if self.num_requests:
            raise ValueError(f"the cache was not flushed: {self.num_requests} requests are running or waiting")
        cache = self.prefix_cache
        if cache is None:
            return 0
        freed = cache.num_cached_pages
        cache.reset()
        return freed

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache the page pool evicts from (None: this role or the config has none)."""
        return self.pages.cache

    @property
    def has_work(self) -> bool:
        """Compute to do: prompts to prefill or requests to decode."""
        return len(self.prefill) + len(self.decode) > 0

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Expire overdue queued requests, poll the role, schedule, agree with the peers, run, apply:
        the requests with news for their client (a new token, a finish)."""
        changed = self._expire_queued() + self.role.poll()
        batch = self.schedule()
        if self.spec is not None:
            batch = self.spec.prepare(batch)  # a decode step verifies drafts
        anyone, dp = self.collectives.agree(batch)
        self.ran_forward = anyone
        if anyone and self.spec is not None:
            changed += self.spec.run(batch, dp)
        elif anyone:
            wants_prompt = batch is not None and not batch.mode.is_decode and any(
                s.req.params.prompt_logprobs is not None for s in batch.seqs)
            logits = self.runner.forward(batch, all_logits=wants_prompt, dp=dp)
            if wants_prompt:
                logits = self._take_prompt_logprobs(batch, logits)
            if batch is not None:
                changed += self.process(batch, logits)
        self.role.end_step()
        return changed

    def _expire_queued(self) -> list[Req]:
        """Fail (503) the waiting requests never scheduled in ``queue_timeout`` seconds. The ranks of
        an attention-TP group hold the same queue but read their own clocks: a request expires only
        when every one of them sees it overdue (``tp_min``), so they go on scheduling alike."""
        timeout = self.config.scheduler.queue_timeout
        if timeout is None or not self.prefill.waiting:
            return []
        waiting = list(self.prefill.waiting)
        overdue = self.collectives.tp_min(self.prefill.overdue(timeout))
        expired = [req for req, late in zip(waiting, overdue) if late]
        for req in expired:
            self.fail(req, f"the request waited more than {timeout} s in the queue (--queue-timeout)", status=503)
        return expired

    def schedule(self) -> ScheduleBatch | None:
        """Prefill when there is prompt work that fits, else decode everything running."""
        return self.prefill.next_batch(len(self.decode)) or self.decode.next_batch()

    def process(self, batch: ScheduleBatch, logits: torch.Tensor) -> list[Req]:
        """Apply a batch's logits: sample, append, check stops, free what finished.

        A request whose sampling or stop check fails ends alone with ``FinishReason.ERROR``; the
        rest of the batch, and the rank, go on.
        """
        for seq in batch.seqs:
            seq.req.kv_len = seq.end
            if not batch.mode.is_decode:
                self.role.after_chunk(seq.req, seq.start, seq.end)
        done = [(i, s.req) for i, s in enumerate(batch.seqs) if s.completes_fill]
        if not done:
            return []
        infos = [self.sampling_info(r) for _, r in done]
        sampled = self.collectives.sample_sync(self.sampler.sample_isolated(logits[[i for i, _ in done]], infos))
        for k, (_, req) in enumerate(done):
            if k in sampled.errors:
                self.fail(req, sampled.errors[k])
                continue
            req.output_ids.append(sampled.next_ids[k])
            if req.constraint is not None:
                req.constraint.catch_up(req.output_ids)
                if req.constraint.refused is not None:
                    self.fail(req, f"the request's grammar refused token {req.constraint.refused}")
                    continue
            if sampled.logprobs is not None and sampled.logprobs[k] is not None:
                req.output_logprobs.append(sampled.logprobs[k])
            decodes_on = batch.mode.is_decode or self.role.after_prefill(req)
            try:
                if decodes_on:
                    self.check_finished(req)
            except Exception as exc:  # detokenizing for a stop string, say
                logger.exception("request %s failed after sampling", req.rid)
                self.fail(req, f"{type(exc).__name__}: {exc}")
        return [req for _, req in done]

    def _take_prompt_logprobs(self, batch: ScheduleBatch, logits: torch.Tensor) -> torch.Tensor:
        """From the logits of every new token ``[T, V]``: the prompt logprobs of the sequences that
        ask for them (the logits at position ``p`` give token ``p + 1``'s), each position once
        however often it is prefilled (retraction); the logits of each sequence's last token."""
        ends = torch.tensor([s.end - s.start for s in batch.seqs]).cumsum(0)
        offset = 0
        for seq, end in zip(batch.seqs, ends.tolist()):
            req, rows = seq.req, slice(offset, end)
            offset = end
            top = req.params.prompt_logprobs
            if top is None:
                continue
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)  # the first token has no context
            first = len(req.prompt_logprobs) - 1  # the first position whose next token has none yet
            targets = [(p - seq.start, p + 1) for p in range(max(seq.start, first), seq.end)
                       if p + 1 < len(req.prompt_ids)]
            if not targets:
                continue
            picked = logits[rows][[i for i, _ in targets]]
            ids = [req.prompt_ids[p] for _, p in targets]
            logprobs = torch.log_softmax(picked.float(), dim=-1)
            chosen = logprobs.gather(1, torch.tensor(ids, device=logprobs.device)[:, None]).squeeze(1).tolist()
            best_v, best_i = logprobs.topk(max(top, 1), dim=-1) if top else (None, None)
            for k, (token, value) in enumerate(zip(ids, chosen)):
                alts = list(zip(best_i[k].tolist(), best_v[k].tolist())) if top else []
                req.prompt_logprobs.append(TokenLogprob(token, value, alts))
        return logits[(ends - 1).to(logits.device)]

    def fail(self, req: Req, message: str, status: int = 500) -> None:
        """End a request that the engine could not run, wherever it is; its pages are freed.
        ``status`` is the HTTP status its client gets (503: the engine was too busy to start it)."""
        if self.abort(req.rid) is not None:
            req.finish(FinishReason.ERROR, message)
            req.error_status = status

    def check_finished(self, req: Req) -> None:
        """Finish ``req`` if its last token is a stop token, its text holds a stop string, or it
        reached ``max_tokens`` or the context length."""
        params, token = req.params, req.output_ids[-1]
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            self.finish(req, FinishReason.STOP, self.detokenize(req, req.output_ids[:-1]))
        elif req.constraint is not None and req.constraint.terminated:  # its grammar is done
            self.finish(req, FinishReason.STOP, self.detokenize(req, req.output_ids))
        elif params.stop and (text := self._text_before_stop(req)) is not None:
            self.finish(req, FinishReason.STOP, text)
        elif len(req.output_ids) >= params.max_tokens or req.seq_len >= self.config.context_length:
            self.finish(req, FinishReason.LENGTH, self.detokenize(req, req.output_ids))

    def detokenize(self, req: Req, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, req.params.skip_special_tokens) if self.tokenizer else ""

    def _text_before_stop(self, req: Req) -> str | None:
        """The output text up to the first stop string, or None if no stop string appeared."""
        text = self.detokenize(req, req.output_ids)
        hits = [i for i in (text.find(s) for s in req.params.stop) if i >= 0]
        return text[:min(hits)] if hits else None

    def finish(self, req: Req, reason: FinishReason, text: str) -> None:
        """End ``req`` with ``reason`` and its final ``text``; its pages are freed."""
        self.decode.release(req)
        release_pages(self.pages, req, cache=True)
        self.requests.pop(req.rid)
        req.text = text
        req.finish(reason)


def with_dispatch_cap(config: EngineConfig, attn_tp_size: int) -> EngineConfig:
    """With low-latency dispatch only, no rank may hold more tokens than its fixed buffers: cap
    the batch (prefill chunks and running requests) so the scheduler splits work instead. A DP
    group's batch spreads over its ``attn_tp_size`` ranks."""
    par = config.parallel
    if par.moe_a2a_backend == "none" or par.deepep_mode != "low_latency":
        return config
    cap = par.max_dispatch_tokens_per_rank * attn_tp_size
    sched = config.scheduler
    capped = dataclasses.replace(
        sched, chunked_prefill_size=min(sched.chunked_prefill_size if sched.chunked_prefill_size > 0 else cap, cap),
        max_prefill_tokens=min(sched.max_prefill_tokens, cap),
        # a verify step holds every request's drafts too
        max_running_requests=min(sched.max_running_requests, max(cap // (config.spec.num_drafts + 1), 1)))
    return dataclasses.replace(config, scheduler=capped)
