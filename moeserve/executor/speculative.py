"""Speculative decoding's arithmetic: the distribution a request samples from, the draft of a
proposal, and the verdict on a chain of drafts.

A chain of ``S`` drafts ``d_1..d_S`` is verified in one pass of the model over the sequence's last
token and the drafts, which gives the target's distribution ``p_j`` at each of the ``S + 1``
positions. Greedy requests keep the drafts up to the first one that differs from the target's
argmax, then take the target's token there (or after the last draft): the output is exactly what
decoding one token at a time gives. Sampled requests use the standard rejection rule (Leviathan et
al. 2023; Chen et al. 2023): draft ``d_j``, drawn from the draft distribution ``q_j``, is kept with
probability ``min(1, p_j(d_j) / q_j(d_j))``; the first rejected one is replaced by a draw from
``max(0, p_j - q_j)`` renormalised, and when all are kept one more token is drawn from ``p_S``.
Every emitted token is then distributed exactly as the target's sampling distribution.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moeserve.core import SAMPLING_EPS
from moeserve.executor.sampler import SamplingInfo, apply_penalties, filtered_sorted_probs

_F32_MAX = torch.finfo(torch.float32).max


def target_probs(logits: Tensor, infos: list[SamplingInfo]) -> Tensor:
    """``[N, V]`` float32: for each row the distribution the sampler draws from (penalties,
    temperature, top-k, top-p and min-p applied, normalised), one-hot at the argmax for a greedy
    row. ``infos[i].output_ids`` must hold the tokens before row ``i``'s position (penalties)."""
    logits = apply_penalties(logits.float(), infos)
    out = torch.zeros_like(logits)
    for i, info in enumerate(infos):
        params = info.params
        if params.greedy:
            out[i, logits[i].argmax()] = 1.0
            continue
        row = (logits[i:i + 1] / max(params.temperature, SAMPLING_EPS)).clamp_(-_F32_MAX, _F32_MAX)
        vocab = row.shape[1]
        top_k = params.top_k if 0 < params.top_k < vocab else vocab
        probs, ids = filtered_sorted_probs(row, torch.tensor([[top_k]], device=row.device),
                                           torch.tensor([[params.top_p if params.top_p < 1.0 else float("inf")]],
                                                        device=row.device),
                                           torch.tensor([[params.min_p]], device=row.device))
        out[i].scatter_(0, ids[0], probs[0] / probs[0].sum())
    return out


def draw(probs: Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs [V]`` (normalised or not) with the request's generator."""
    u = torch.rand(1, generator=generator, device=generator.device if generator is not None else "cpu").item()
    cdf = probs.double().cumsum(0)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64,
                                                     device=cdf.device), right=True).item())
    return min(index, int((probs > 0).nonzero()[-1].item()))


def verify_greedy(target_ids: list[int], drafts: list[int]) -> list[int]:
    """The tokens a greedy chain emits: the drafts while they equal the target's argmax
    ``target_ids`` (``len(drafts) + 1`` of them), then the target's token."""
    out = []
    for j, draft in enumerate(drafts):
        if target_ids[j] != draft:
            break
        out.append(draft)
    return out + [target_ids[len(out)]]


def verify_sampled(p: Tensor, q: Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """The tokens a sampled chain emits by the rejection rule. ``p [S + 1, V]``: the target's
    distributions at the last token and each draft; ``q [S, V]``: the draft distributions the
    drafts were drawn from."""
    out = []
    for j, draft in enumerate(drafts):
        u = torch.rand(1, generator=generator, device=generator.device if generator is not None else "cpu").item()
        if u * float(q[j, draft]) < float(p[j, draft]):
            out.append(draft)
            continue
        residual = (p[j] - q[j]).clamp_(min=0)
        return out + [draw(residual if float(residual.sum()) > 0 else p[j], generator)]
    return out + [draw(p[len(drafts)], generator)]
