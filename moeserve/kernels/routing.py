"""Router top-k: from router logits to the chosen experts and their weights."""

from __future__ import annotations

import torch

from moeserve.kernels.backend import use_triton


def select_experts(
    logits: torch.Tensor,
    top_k: int,
    method: str,
    n_group: int = 1,
    topk_group: int = 1,
    correction_bias: torch.Tensor | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` (fp32) -> ``(topk_weights [T, k] fp32, topk_ids [T, k] int64)``.

    Methods: ``noaux_tc`` (DeepSeek-V3: sigmoid scores; the bias steers the choice but not the
    weights; groups ranked by the sum of their two best biased scores), ``greedy`` (V2-Lite:
    softmax, plain top-k), ``group_limited_greedy`` (V2: softmax, groups ranked by their best score).
    """
    if use_triton(logits):
        from moeserve.kernels.triton import routing as triton_routing

        return triton_routing.select_experts(logits, top_k, method, n_group, topk_group, correction_bias,
                                             norm_topk_prob, routed_scaling_factor)
    return select_experts_ref(logits, top_k, method, n_group, topk_group, correction_bias,
                              norm_topk_prob, routed_scaling_factor)


def select_experts_ref(
    logits: torch.Tensor,
    top_k: int,
    method: str,
    n_group: int = 1,
    topk_group: int = 1,
    correction_bias: torch.Tensor | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch version of ``select_experts``."""
    if method == "noaux_tc":
        scores = logits.sigmoid()
        choice = scores + correction_bias if correction_bias is not None else scores
        group_rank = choice.view(choice.shape[0], n_group, choice.shape[1] // n_group).topk(2, dim=-1)[0].sum(-1)
        choice = _mask_groups(choice, group_rank, topk_group, float("-inf"))
        ids = choice.topk(top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * routed_scaling_factor, ids
    scores = logits.softmax(dim=-1)
    if method == "group_limited_greedy":
        group_rank = scores.view(scores.shape[0], n_group, scores.shape[1] // n_group).max(dim=-1).values
        scores = _mask_groups(scores, group_rank, topk_group, 0.0)
    elif method != "greedy":
        raise ValueError(f"unknown routing method {method!r}")
    weights, ids = scores.topk(top_k, dim=-1)
    # DeepSeek-V2 either renormalises the chosen weights or scales them, never both.
    if norm_topk_prob and top_k > 1:
        return weights / (weights.sum(-1, keepdim=True) + 1e-20), ids
    return weights * routed_scaling_factor, ids


def _mask_groups(scores: torch.Tensor, group_rank: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    """Keep the experts of the ``topk_group`` best groups; ``scores [T, E]``, ``group_rank [T, G]``."""
    n_tokens, n_group = group_rank.shape
    keep = torch.zeros_like(group_rank, dtype=torch.bool)
    keep.scatter_(1, group_rank.topk(topk_group, dim=-1)[1], True)
    keep = keep.unsqueeze(-1).expand(n_tokens, n_group, scores.shape[1] // n_group).reshape_as(scores)
    return scores.masked_fill(~keep, fill)
