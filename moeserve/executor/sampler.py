"""Pick the next token of every row of a batch from its logits.

B = rows in the batch, V = vocabulary size. The pipeline, per row, follows what vLLM and SGLang
users expect:

1. penalties on float32 logits: ``repetition_penalty`` (HF/CTRL, prompt + output tokens), then
   ``frequency_penalty`` and ``presence_penalty`` (OpenAI, output tokens only);
2. ``logit_bias`` added, the stop tokens banned while ``min_tokens`` are not out, and every token
   the row's grammar forbids banned (``executor/grammar.py``);
3. logprobs from those logits, before temperature and filtering;
4. greedy rows (``params.greedy``) take the argmax;
5. other rows: temperature, top-k, top-p, min-p, then one draw by inverse CDF with a uniform from
   the row's own generator (or the default torch RNG), so a seeded request reproduces whatever
   else shares its batch.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import torch
from torch import Tensor

from moeserve.core import SAMPLING_EPS, SamplingParams, TokenLogprob
from moeserve.executor.grammar import Constraint, apply_grammars

logger = logging.getLogger(__name__)
_F32_MAX = torch.finfo(torch.float32).max
_F32_MIN = torch.finfo(torch.float32).min


@dataclass
class SamplingInfo:
    """What the sampler needs to know about one row; the scheduler builds it from a ``Req``."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_ids: list[int]
    output_ids: list[int]
    banned: list[int] = field(default_factory=list)  # the stop tokens, while min_tokens are not out
    constraint: Constraint | None = None  # the request's grammar matcher


@dataclass
class SampleOutput:
    """One entry per row: the chosen token and, where ``params.logprobs`` is set, its logprobs.

    ``errors`` maps the rows that could not be sampled (their ``next_ids`` entry is -1) to why.
    """

    next_ids: list[int]
    logprobs: list[TokenLogprob | None]
    errors: dict[int, str] = field(default_factory=dict)


class Sampler:
    """Stateless: every per-row choice comes from ``SamplingInfo``."""

    def sample_isolated(self, logits: Tensor, infos: list[SamplingInfo]) -> SampleOutput:
        """``sample``, but a row that makes sampling fail fails alone: the batch is sampled row by
        row and each failing row is reported in ``errors`` instead of raising."""
        try:
            return self.sample(logits, infos)
        except Exception:  # a per-request failure must not end the rank
            logger.exception("sampling a batch of %d rows failed; sampling row by row", len(infos))
        out = SampleOutput(next_ids=[], logprobs=[])
        for k, info in enumerate(infos):
            try:
                row = self.sample(logits[k:k + 1], [info])
                out.next_ids.append(row.next_ids[0])
                out.logprobs.append(row.logprobs[0])
            except Exception as exc:
                out.next_ids.append(-1)
                out.logprobs.append(None)
                out.errors[k] = f"sampling failed: {type(exc).__name__}: {exc}"
        return out

    def sample(self, logits: Tensor, infos: list[SamplingInfo]) -> SampleOutput:
        """Choose one token per row.

        logits: [B, V], any float dtype, any device. infos: B entries, in row order.
        """
        if logits.dim() != 2 or logits.shape[0] != len(infos):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(infos)} rows")
        if not infos:
            return SampleOutput(next_ids=[], logprobs=[])
        # .float() may return the caller's tensor; everything below is out-of-place.
        logits = apply_controls(apply_penalties(logits.float(), infos), infos)  # [B, V]
        next_ids = torch.empty(len(infos), dtype=torch.long, device=logits.device)
        greedy = [i for i, info in enumerate(infos) if info.params.greedy]
        sampled = [i for i, info in enumerate(infos) if not info.params.greedy]
        if greedy:
            _put_rows(next_ids, greedy, _take_rows(logits, greedy).argmax(dim=-1))
        if sampled:
            picked = _sample_rows(_take_rows(logits, sampled), [infos[i] for i in sampled])
            _put_rows(next_ids, sampled, picked)
        logprobs = gather_logprobs(logits, next_ids, infos)
        return SampleOutput(next_ids=next_ids.tolist(), logprobs=logprobs)


# ---------------------------------------------------------------------------------------------
# Penalties


def apply_penalties(logits: Tensor, infos: list[SamplingInfo]) -> Tensor:
    """Return penalized logits [B, V] float32; rows without penalties are returned unchanged.

    Does not modify ``logits``. Count tensors are built only for the rows that need them.
    """
    rows = [i for i, info in enumerate(infos) if has_penalty(info.params)]
    if not rows:
        return logits
    row_infos = [infos[i] for i in rows]
    sub = _take_rows(logits, rows)  # [R, V]
    sub = _repetition_penalty(sub, row_infos)
    sub = _frequency_presence_penalty(sub, row_infos)
    # a penalty can overflow float32 (a tiny repetition_penalty divides): keep every logit finite
    # so that softmax and the CDF below never see inf - inf
    sub = torch.nan_to_num(sub, nan=_F32_MIN, posinf=_F32_MAX, neginf=_F32_MIN)
    if len(rows) == len(infos):
        return sub
    return logits.index_copy(0, _index(rows, logits.device), sub)


def has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _repetition_penalty(logits: Tensor, infos: list[SamplingInfo]) -> Tensor:
    """HF/CTRL: a token seen in prompt or output has a positive logit divided by the penalty, a
    negative one multiplied. logits: [R, V]."""
    penalties = [info.params.repetition_penalty for info in infos]
    if all(p == 1.0 for p in penalties):
        return logits
    # A row with penalty 1 contributes no ids: its counts would be built only to be ignored.
    ids = [i.prompt_ids + i.output_ids if p != 1.0 else [] for i, p in zip(infos, penalties)]
    seen = _token_counts(ids, logits.shape[1], logits.device) > 0  # [R, V]
    p = _column(penalties, logits.device)  # [R, 1]
    scaled = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, scaled, logits)


def _frequency_presence_penalty(logits: Tensor, infos: list[SamplingInfo]) -> Tensor:
    """OpenAI: ``logit -= frequency * count + presence * (count > 0)`` over output tokens only.
    logits: [R, V]."""
    freq = [info.params.frequency_penalty for info in infos]
    pres = [info.params.presence_penalty for info in infos]
    needed = [f != 0.0 or p != 0.0 for f, p in zip(freq, pres)]
    if not any(needed):
        return logits
    ids = [info.output_ids if n else [] for info, n in zip(infos, needed)]
    counts = _token_counts(ids, logits.shape[1], logits.device)  # [R, V]
    freq_t, pres_t = _column(freq, logits.device), _column(pres, logits.device)
    return logits - freq_t * counts - pres_t * (counts > 0).float()


def _token_counts(id_lists: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[R, V] float32: how often each token occurs in each row's id list, by one scatter_add."""
    lens = torch.tensor([len(ids) for ids in id_lists])
    flat = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.long)
    row = torch.repeat_interleave(torch.arange(len(id_lists)), lens)
    index = (row * vocab_size + flat).to(device, non_blocking=True)  # [N] into flat [R * V]
    counts = torch.zeros(len(id_lists) * vocab_size, dtype=torch.float32, device=device)
    counts.scatter_add_(0, index, torch.ones(index.shape[0], dtype=torch.float32, device=device))
    return counts.view(len(id_lists), vocab_size)


def apply_controls(logits: Tensor, infos: list[SamplingInfo]) -> Tensor:
    """``logit_bias``, the ``min_tokens`` ban and the grammars' masks, on a copy of ``logits``
    (``logits`` itself when no row has any)."""
    biased = [i for i, info in enumerate(infos) if info.params.logit_bias or info.banned]
    constrained = [info.constraint for info in infos]
    if not biased and not any(constrained):
        return logits
    logits = logits.clone()
    if biased:
        rows, ids, values = [], [], []
        for i in biased:
            for token, bias in (infos[i].params.logit_bias or {}).items():
                rows.append(i), ids.append(token), values.append(bias)
        if rows:
            logits.index_put_((_index(rows, logits.device), _index(ids, logits.device)),
                              torch.tensor(values, dtype=logits.dtype).to(logits.device), accumulate=True)
        rows = [i for i in biased for _ in infos[i].banned]
        ids = [t for i in biased for t in infos[i].banned]
        if rows:
            logits.index_put_((_index(rows, logits.device), _index(ids, logits.device)),
                              torch.tensor(float("-inf"), device=logits.device))
    if any(constrained):
        apply_grammars(logits, constrained)
    return logits


# ---------------------------------------------------------------------------------------------
# Filtering and drawing


def _sample_rows(logits: Tensor, infos: list[SamplingInfo]) -> Tensor:
    """Draw one token per row. logits: [S, V] penalized float32 -> [S] int64."""
    device = logits.device
    params = [info.params for info in infos]
    vocab_size = logits.shape[1]
    # no row here is greedy, so temperature >= SAMPLING_EPS; the clamp guards the division anyway
    temperature = _column([max(p.temperature, SAMPLING_EPS) for p in params], device)  # [S, 1]
    top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_k_t = _column(top_k, device, torch.long)  # [S, 1]
    # top_p == 1 means off; +inf keeps float rounding of the cumsum from dropping the tail.
    top_p = _column([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device)
    min_p = _column([p.min_p for p in params], device)
    scaled = (logits / temperature).clamp_(_F32_MIN, _F32_MAX)  # a huge logit / a small temperature
    probs, token_ids = filtered_sorted_probs(scaled, top_k_t, top_p, min_p)
    uniforms = draw_uniforms([info.generator for info in infos]).to(device, non_blocking=True)
    return inverse_cdf(probs, token_ids, uniforms)


def filtered_sorted_probs(
    logits: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor
) -> tuple[Tensor, Tensor]:
    """Apply top-k, top-p and min-p, in that order, to temperature-scaled logits.

    logits: [S, V] float32; top_k: [S, 1] int64 in [1, V]; top_p: [S, 1] (inf = off);
    min_p: [S, 1] (0 = off). Returns ``(probs, token_ids)``, both [S, V] in descending-logit
    order: probs unnormalized with filtered tokens at 0 (kept tokens form a prefix), token_ids
    the vocabulary id at each position.

    top-k keeps every token tied with the k-th largest logit (as vLLM and HF do); top-p keeps a
    token while the mass before it, renormalized after top-k, is < top_p, so the top token always
    stays; min-p drops tokens with prob < min_p * max prob.
    """
    sorted_logits, token_ids = logits.sort(dim=-1, descending=True, stable=True)  # [S, V]
    kth = sorted_logits.gather(1, top_k - 1)  # [S, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [S, V]
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p) | (probs < min_p * probs[:, :1])
    drop[:, 0] = False  # the top token stays whatever the filters say (a top_p that rounds to 0)
    return probs.masked_fill(drop, 0.0), token_ids


def inverse_cdf(probs: Tensor, token_ids: Tensor, uniforms: Tensor) -> Tensor:
    """Pick, per row, the token whose CDF interval holds ``uniform * total mass``.

    probs: [S, V] unnormalized, non-increasing along V; token_ids: [S, V] int64; uniforms: [S] in
    [0, 1). Returns [S] int64.
    """
    cdf = probs.cumsum(dim=-1)  # [S, V]
    target = uniforms.unsqueeze(1) * cdf[:, -1:]  # [S, 1]
    pos = torch.searchsorted(cdf, target, right=True)  # [S, 1] first position with cdf > target
    # Rounding can put target at or past the last cdf step; the last nonzero prob is the safe end.
    last = ((probs > 0).sum(dim=-1, keepdim=True) - 1).clamp_(min=0)
    return token_ids.gather(1, torch.minimum(pos, last)).squeeze(1)


def draw_uniforms(generators: list[torch.Generator | None]) -> Tensor:
    """[S] float32 on CPU: one uniform per row, from its own generator where it has one, so a
    seeded row's draw does not depend on its companions; the others share the default RNG."""
    uniforms = torch.empty(len(generators), dtype=torch.float32)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        uniforms[unseeded] = torch.rand(len(unseeded))
    for i, g in enumerate(generators):
        if g is not None:
            uniforms[i] = torch.rand(1, generator=g, device=g.device).item()
    return uniforms


# ---------------------------------------------------------------------------------------------
# Logprobs


def gather_logprobs(
    logits: Tensor, next_ids: Tensor, infos: list[SamplingInfo]
) -> list[TokenLogprob | None]:
    """Logprobs of the chosen tokens and the top-k alternatives, for rows that ask for them.

    logits: [B, V] penalized float32, before temperature; next_ids: [B] int64. Returns B
    entries, None where ``params.logprobs`` is None; alternatives are sorted descending.
    """
    rows = [i for i, info in enumerate(infos) if info.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(infos)
    if not rows:
        return out
    logprobs = torch.log_softmax(_take_rows(logits, rows), dim=-1)  # [L, V]
    chosen_ids = _take_rows(next_ids, rows)  # [L]
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1)  # [L]
    k = min(max(infos[i].params.logprobs or 0 for i in rows), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(k, dim=-1)  # [L, k], sorted descending
    ids, values = chosen_ids.tolist(), chosen.tolist()
    all_top_ids, all_top_values = top_ids.tolist(), top_values.tolist()
    for j, i in enumerate(rows):
        n = infos[i].params.logprobs or 0
        top = list(zip(all_top_ids[j][:n], all_top_values[j][:n]))
        out[i] = TokenLogprob(token_id=ids[j], logprob=values[j], top=top)
    return out


# ---------------------------------------------------------------------------------------------
# Small helpers


def _index(rows: list[int], device: torch.device) -> Tensor:
    return torch.tensor(rows, dtype=torch.long).to(device, non_blocking=True)


def _take_rows(x: Tensor, rows: list[int]) -> Tensor:
    """Rows ``rows`` (sorted, unique) of ``x``; ``x`` itself when they are all of them."""
    if len(rows) == x.shape[0]:
        return x
    return x.index_select(0, _index(rows, x.device))


def _put_rows(dst: Tensor, rows: list[int], src: Tensor) -> None:
    dst.index_copy_(0, _index(rows, dst.device), src)


def _column(
    values: list[float] | list[int], device: torch.device, dtype: torch.dtype = torch.float32
) -> Tensor:
    """[len(values), 1] tensor on ``device``, for broadcasting a per-row parameter over V."""
    return torch.tensor(values, dtype=dtype).unsqueeze(1).to(device, non_blocking=True)
