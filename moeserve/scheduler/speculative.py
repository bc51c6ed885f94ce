"""Speculative decoding with the checkpoint's MTP module (``--speculative-algorithm NEXTN``): a mode
of the scheduler's step, not a second engine.

Each request carries ``S`` draft tokens between steps. A decode step becomes a verify step: the
model runs over every running request's last token and its drafts at once (``ForwardMode.VERIFY``,
absorbed MLA with ``S + 1`` queries a sequence), the chain is judged (``executor/speculative.py``:
greedy or the rejection rule), the kept drafts and one more token are appended one at a time with
the stop conditions checked after each, and the KV of the rejected drafts is dropped (``kv_len``
stays behind them; the pages past what the next step needs go back). Then the MTP module runs over
the positions the verify judged (each position's hidden state from the verify pass, and the token
after it; as wide as the verify, placeholders past the accepted ones) and drafts the next chain from
the last accepted position, ``S`` times autoregressively. A prefill step does the same after the
prompt: the MTP module runs over the chunk's positions and, once the prompt is done, drafts. Every
sequence of a verify, of the MTP pass after it and of a draft step has the same number of tokens, so
on one GPU each of them replays a CUDA graph (``executor/cuda_graph.py``).

Position ``p`` of the MTP module reads the model's hidden state at ``p`` and the token at ``p + 1``,
and writes the MTP layer's KV at ``p``; a draft step's KV at later positions is provisional and is
written again once those positions are accepted.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moeserve.core import DPInfo, ForwardMode, Req, ScheduleBatch, ScheduledSeq, TokenLogprob
from moeserve.executor.sampler import SampleOutput, SamplingInfo, apply_penalties, gather_logprobs, has_penalty
from moeserve.executor.speculative import draw, target_probs, verify_greedy, verify_sampled

if TYPE_CHECKING:
    from moeserve.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class SpecDecoder:
    """Drafts of every running request (``drafts``, with the distributions sampled ones were drawn
    from), and the counts behind the mean accept length."""

    def __init__(self, sched: Scheduler, num_drafts: int) -> None:
        self.sched, self.num_drafts = sched, num_drafts
        self.drafts: dict[str, list[int]] = {}
        self.draft_probs: dict[str, torch.Tensor] = {}  # [S, V] for sampled requests
        # take every draft's argmax, whatever the request's sampling (a PD prefill server's drafts
        # travel without their distributions); a chain without them counts as from a point mass
        self.greedy_drafts = False
        self.verified = 0  # (request, verify step) pairs
        self.emitted = 0  # tokens those appended

    @property
    def accept_length(self) -> float:
        """Tokens a request gains per verify step, on average (1 = no draft ever kept)."""
        return self.emitted / self.verified if self.verified else 0.0

    def release(self, req: Req) -> None:
        self.drafts.pop(req.rid, None)
        self.draft_probs.pop(req.rid, None)

    # ---- a step -----------------------------------------------------------------------------
    def prepare(self, batch: ScheduleBatch | None) -> ScheduleBatch | None:
        """The step to agree on: a decode batch becomes the verify of every request's drafts."""
        if batch is None or batch.mode is not ForwardMode.DECODE:
            return batch
        return ScheduleBatch(ForwardMode.VERIFY, [self._verify_seq(s.req) for s in batch.seqs])

    def run(self, batch: ScheduleBatch | None, dp: DPInfo | None = None) -> list[Req]:
        """Run the step (``batch`` from ``prepare``; None: this rank idles while others work) and its
        draft passes; the requests with news for their client. Every rank runs the same passes:
        the model's, one of the MTP module over accepted positions, ``S - 1`` draft steps, each
        agreed (``agree_phase``) so that the idle ranks join their collectives."""
        logits, hidden = self.sched.runner.forward_with_hidden(batch, dp)
        changed: list[Req] = []
        pass_ = _MtpPass(ForwardMode.EXTEND, [], [], [], [])
        if batch is not None and batch.mode is ForwardMode.EXTEND:
            completes = [seq.completes_fill for seq in batch.seqs]  # (before the first token is appended)
            changed = self.sched.process(batch, logits)
            pass_ = self._prefill_inputs(batch, completes)
        elif batch is not None:  # VERIFY
            width = self.num_drafts + 1
            argmax = _plain_argmax(logits, [s.req for s in batch.seqs for _ in range(width)])
            verdict = self.sched.collectives.verdict_sync(self._judge_all(batch, logits, argmax))
            appended = [self._apply(seq.req, verdict, i) for i, seq in enumerate(batch.seqs)]
            changed = [seq.req for seq, n in zip(batch.seqs, appended) if n or seq.req.finished]
            pass_ = self._verify_inputs(batch, appended)
        prev = hidden[torch.tensor(pass_.rows, dtype=torch.long, device=hidden.device)]
        self._draft(pass_, prev)
        return changed

    def _verify_seq(self, req: Req) -> ScheduledSeq:
        drafts = self.drafts[req.rid]
        return ScheduledSeq(req, req.seq_len - 1, req.seq_len + len(drafts), tokens=[req.output_ids[-1], *drafts])

    # ---- judging a chain --------------------------------------------------------------------
    def _judge_all(self, batch: ScheduleBatch, logits: torch.Tensor, argmax: list[int | None]) -> Verdict:
        """What each chain of a verify step emits (``logits [B * (S + 1), V]``; ``argmax``, the rows'
        argmax where ``_plain_argmax`` took it); a chain that cannot be judged fails alone."""
        width, out = self.num_drafts + 1, Verdict([], [], {})
        for i, seq in enumerate(batch.seqs):
            req = seq.req
            drafts, q = self.drafts.pop(req.rid), self.draft_probs.pop(req.rid, None)
            rows = slice(i * width, (i + 1) * width)
            try:
                tokens, logprobs = self._judge(req, drafts, q, logits[rows], argmax[rows])
            except Exception as exc:
                logger.exception("verifying request %s failed", req.rid)
                tokens, logprobs = [], None
                out.errors[i] = f"speculative verification failed: {type(exc).__name__}: {exc}"
            out.tokens.append(tokens)
            out.logprobs.append(logprobs)
        return out

    def _judge(self, req: Req, drafts: list[int], q: torch.Tensor | None, logits: torch.Tensor,
               argmax: list[int | None]) -> tuple[list[int], list[TokenLogprob | None] | None]:
        """The tokens ``req``'s chain emits and their logprobs (None when not asked). ``q``: the
        distributions the drafts were drawn from (None: a point mass at each)."""
        if argmax[0] is not None:
            return verify_greedy(argmax, drafts), None
        infos = [_info(req, drafts[:j]) for j in range(len(drafts) + 1)]
        penalized = apply_penalties(logits.float(), infos)  # [S + 1, V]
        if req.params.greedy:
            tokens = verify_greedy(penalized.argmax(-1).tolist(), drafts)
        else:
            p = target_probs(logits, infos)
            if q is None:
                q = torch.nn.functional.one_hot(torch.tensor(drafts, dtype=torch.long), p.shape[-1]).to(p)
            tokens = verify_sampled(p, q, drafts, req.generator)
        return tokens, gather_logprobs(penalized[:len(tokens)], torch.tensor(tokens, device=logits.device),
                                       infos[:len(tokens)])

    def _apply(self, req: Req, verdict: Verdict, i: int) -> int:
        """Append chain ``i`` of ``verdict`` to ``req`` (or fail it); the number of tokens appended."""
        if i in verdict.errors:
            self.sched.fail(req, verdict.errors[i])
            return 0
        return self._append(req, verdict.tokens[i], verdict.logprobs[i])

    def _append(self, req: Req, tokens: list[int], logprobs: list | None) -> int:
        """Append ``tokens`` to ``req`` one at a time, stopping where it finishes; how many."""
        self.verified += 1
        for n, token in enumerate(tokens, start=1):
            req.output_ids.append(token)
            if logprobs is not None and logprobs[n - 1] is not None:
                req.output_logprobs.append(logprobs[n - 1])
            req.kv_len = req.seq_len - 1
            self.sched.check_finished(req)
            if req.finished:
                break
        self.emitted += n
        return n

    # ---- drafting ---------------------------------------------------------------------------
    def _prefill_inputs(self, batch: ScheduleBatch, completes: list[bool]) -> _MtpPass:
        """The MTP module's pass over a prefill chunk's positions (it needs their KV later), from
        the hidden-state rows of each; drafts for the requests whose prompt is done and decode on."""
        out, at = _MtpPass(ForwardMode.EXTEND, [], [], [], []), 0
        for seq, done in zip(batch.seqs, completes):
            n, req = seq.end - seq.start, seq.req
            if not req.finished and req.seq_len > seq.end:  # the token after the chunk is known
                out.add(ScheduledSeq(req, seq.start, seq.end, tokens=req.fill_slice(seq.start + 1, seq.end + 1)),
                        range(at, at + n), n - 1, done)
            at += n
        return out

    def _verify_inputs(self, verify: ScheduleBatch, appended: list[int]) -> _MtpPass:
        """Give back the pages of the rejected drafts past what the next step needs; the MTP
        module's pass over the positions the verify step judged, every request that goes on
        drafting from its last accepted one. The pass is as wide as the verify (the same shape for
        every sequence, so a CUDA graph runs it): past the accepted positions its input tokens are
        placeholders, and what it writes there is provisional like a draft step's KV, written again
        once those positions are accepted (their rows attend only to earlier positions)."""
        width = self.num_drafts + 1
        out = _MtpPass(ForwardMode.VERIFY, [], [], [], [])
        for i, (seq, n) in enumerate(zip(verify.seqs, appended)):
            req = seq.req
            if req.finished or n == 0:
                continue
            self._trim_pages(req)
            tokens = req.output_ids[-n:] + [req.output_ids[-1]] * (width - n)
            out.add(ScheduledSeq(req, seq.start, seq.start + width, tokens=tokens),
                    range(i * width, (i + 1) * width), n - 1, True)
        return out

    def _trim_pages(self, req: Req) -> None:
        pages = self.sched.pages
        keep = pages.pages_for(req.seq_len + self.num_drafts)
        if len(req.page_table) > keep:
            pages.free(req.page_table[keep:])
            del req.page_table[keep:]

    def _draft(self, pass_: _MtpPass, prev_hidden: torch.Tensor) -> None:
        """The MTP module over ``pass_`` (positions and their next tokens), then for the sequences
        that want them a chain of ``S`` drafts from each one's last position, each step one more
        position. Every pass is agreed with the other ranks, so all run the same passes (an idle
        one for nothing)."""
        sched, runner = self.sched, self.sched.runner
        first = ScheduleBatch(pass_.mode, pass_.seqs) if pass_.seqs else None
        anyone, dp = sched.collectives.agree_phase(first)
        if not anyone:
            return
        starts = list(itertools.accumulate((s.end - s.start for s in pass_.seqs), initial=0))
        # one row a sequence (a vocab-parallel head gathers the DP groups' rows by sequence counts)
        rows = torch.tensor([s + last for s, last in zip(starts, pass_.last)], dtype=torch.long,
                            device=prev_hidden.device)
        logits, hidden = runner.forward_mtp(first, prev_hidden, dp, rows=rows)
        keep = [i for i, w in enumerate(pass_.wants) if w]
        reqs = [pass_.seqs[i].req for i in keep]
        logits, hidden = logits[keep], hidden[rows[keep]] if keep else hidden[:0]
        chains: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        for step in range(self.num_drafts):
            if step:  # one more position: the last draft is its input token
                steps = ScheduleBatch(ForwardMode.DECODE, [ScheduledSeq(r, r.seq_len - 2 + step, r.seq_len - 1 + step,
                                                                         tokens=[c[-1]]) for r, c in zip(reqs, chains)])
                anyone, dp = sched.collectives.agree_phase(steps if reqs else None)
                if not anyone:
                    break
                logits, hidden = runner.forward_mtp(steps if reqs else None, hidden, dp)
            if not reqs:
                continue
            argmax = _plain_argmax(logits, reqs)
            others = [k for k, a in enumerate(argmax) if a is None]
            q = target_probs(logits[others], [_info(reqs[k], chains[k]) for k in others]) if others else None  # [B', V]
            for k, req in enumerate(reqs):
                if argmax[k] is not None:
                    chains[k].append(argmax[k])
                    continue
                row = q[others.index(k)]
                chains[k].append(int(row.argmax()) if req.params.greedy or self.greedy_drafts
                                 else draw(row, req.generator))
                probs[k].append(row)
            # ranks that share the batch draft on from the same tokens: the leader's
            chosen = sched.collectives.sample_sync(SampleOutput([c[-1] for c in chains], [None] * len(chains))).next_ids
            for chain, token in zip(chains, chosen):
                chain[-1] = token
        for req, chain, q in zip(reqs, chains, probs):
            self.drafts[req.rid] = chain
            if not req.params.greedy and not self.greedy_drafts:
                self.draft_probs[req.rid] = torch.stack(q)


@dataclass
class Verdict:
    """What a verify step appends to each of its sequences, in order: tokens, their logprobs (None
    when not asked), and the chains that failed, by index, with why. The ranks of an attention-TP
    group apply their leader's (``Collectives.verdict_sync``), whatever their own draws."""

    tokens: list[list[int]]
    logprobs: list[list[TokenLogprob | None] | None]
    errors: dict[int, str]


@dataclass
class _MtpPass:
    """The MTP module's first pass of a step: its sequences, the rows of the model's hidden states
    each reads, the index (within its own rows) of the position each drafts from, and whether it
    drafts (a prefill chunk that does not end its prompt only writes the MTP layer's KV)."""

    mode: ForwardMode
    seqs: list[ScheduledSeq]
    rows: list[int]  # of every sequence, in order
    last: list[int]
    wants: list[bool]

    def add(self, seq: ScheduledSeq, rows: range, last: int, wants: bool) -> None:
        self.seqs.append(seq)
        self.rows.extend(rows)
        self.last.append(last)
        self.wants.append(wants)


def _plain_argmax(logits: torch.Tensor, reqs: list[Req]) -> list[int | None]:
    """Each row's argmax where its request is greedy without penalties or logprobs (one host sync
    for them all), else None: those rows go through the sampler's arithmetic one by one."""
    plain = [r.params.greedy and not has_penalty(r.params) and r.params.logprobs is None for r in reqs]
    if not any(plain):
        return [None] * len(reqs)
    ids = logits.argmax(-1).tolist()
    return [i if p else None for i, p in zip(ids, plain)]


def _info(req: Req, extra: list[int]) -> SamplingInfo:
    """The sampler's view of ``req`` at a position ``extra`` tokens past its output (penalties)."""
    return SamplingInfo(req.params, req.generator, req.prompt_ids, req.output_ids + extra)
