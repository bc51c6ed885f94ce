"""Fused router top-k in Triton for DeepSeek-V3's ``noaux_tc`` (reference in ``kernels/routing.py``).

One program routes one token: sigmoid scores of its ``E`` logits held as ``[n_group, E/n_group]``,
the bias added for the choice, groups ranked by the sum of their two best biased scores, the
``topk_group`` best groups kept, then ``top_k`` rounds of argmax-and-mask over the kept experts.
Other methods run the torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from moeserve.kernels.routing import select_experts_ref

CONFIG_KEYS = ("num_warps",)


@triton.jit
def _sigmoid(x, EXACT: tl.constexpr):
    if EXACT:
        # libdevice expf and a correctly rounded division reproduce torch's sigmoid bit for bit,
        # so near-ties break as in the reference
        one = tl.full(x.shape, 1.0, tl.float32)
        return tl.math.div_rn(one, one + libdevice.exp(-x))
    return tl.sigmoid(x)  # the interpreter (CPU tensors) has no libdevice


@triton.jit
def _noaux_tc_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    logits_stride, group_size, routed_scaling_factor,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, EXACT_SIGMOID: tl.constexpr,
    BLOCK_GROUP: tl.constexpr, BLOCK_EXPERT: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = logits_ptr + tl.program_id(0).to(tl.int64) * logits_stride
    group = tl.arange(0, BLOCK_GROUP)
    member = tl.arange(0, BLOCK_EXPERT)
    valid = (group < N_GROUP)[:, None] & (member < group_size)[None, :]
    expert = group[:, None] * group_size + member[None, :]  # [G, E/G]
    choice = _sigmoid(tl.load(row + expert, mask=valid, other=0.0).to(tl.float32), EXACT_SIGMOID)
    if HAS_BIAS:
        choice += tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))

    # rank groups by their two best biased scores (masking one copy of the best keeps ties)
    best, best_at = tl.max(choice, axis=1, return_indices=True)  # [G]
    second = tl.max(tl.where(member[None, :] == best_at[:, None], float("-inf"), choice), axis=1)
    rank = tl.where(group < N_GROUP, best + second, float("-inf"))
    keep = group < 0
    for _ in tl.static_range(TOPK_GROUP):
        pick = tl.argmax(rank, axis=0)
        keep |= group == pick
        rank = tl.where(group == pick, float("-inf"), rank)
    choice = tl.where(keep[:, None], choice, float("-inf"))

    # top_k rounds of argmax-and-mask over the flattened tile; ids come out best first, like
    # torch.topk's (a flat position p is expert (p // BLOCK_EXPERT) * group_size + p % BLOCK_EXPERT)
    choice = tl.reshape(choice, [BLOCK_GROUP * BLOCK_EXPERT])
    pos = tl.arange(0, BLOCK_GROUP * BLOCK_EXPERT)
    slot = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for i in tl.static_range(TOP_K):
        p = tl.argmax(choice, axis=0)
        choice = tl.where(pos == p, float("-inf"), choice)
        ids = tl.where(slot == i, (p // BLOCK_EXPERT) * group_size + p % BLOCK_EXPERT, ids)
    # the weights are the unbiased scores of the chosen experts, recomputed from their logits
    out_mask = slot < TOP_K
    weights = _sigmoid(tl.load(row + ids, mask=out_mask, other=0.0).to(tl.float32), EXACT_SIGMOID)
    weights = tl.where(out_mask, weights, 0.0)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    out = tl.program_id(0).to(tl.int64) * TOP_K + slot
    tl.store(weights_ptr + out, weights * routed_scaling_factor, mask=out_mask)
    tl.store(ids_ptr + out, ids.to(tl.int64), mask=out_mask)


def select_experts(
    logits: torch.Tensor,
    top_k: int,
    method: str,
    n_group: int = 1,
    topk_group: int = 1,
    correction_bias: torch.Tensor | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
    *,
    config: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` fp32 (last dim contiguous) -> ``(topk_weights [T, k] fp32, topk_ids [T, k]
    int64)``, ids best first; see ``kernels.routing.select_experts`` for the methods."""
    if method != "noaux_tc":
        return select_experts_ref(logits, top_k, method, n_group, topk_group, correction_bias,
                                  norm_topk_prob, routed_scaling_factor)
    _check(logits, top_k, n_group, topk_group, correction_bias)
    n_tokens, n_experts = logits.shape
    weights = torch.empty(n_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n_tokens, top_k, dtype=torch.int64, device=logits.device)
    if n_tokens == 0:
        return weights, ids
    cfg = {"num_warps": _default_warps(n_experts), **(config or {})}
    if set(cfg) - set(CONFIG_KEYS):
        raise ValueError(f"unknown select_experts config keys {sorted(set(cfg) - set(CONFIG_KEYS))}")
    group_size = n_experts // n_group
    has_bias = correction_bias is not None
    _noaux_tc_kernel[(n_tokens,)](
        logits, correction_bias if has_bias else logits, weights, ids,
        logits.stride(0), group_size, float(routed_scaling_factor),
        N_GROUP=n_group, TOPK_GROUP=topk_group, TOP_K=top_k, HAS_BIAS=has_bias,
        RENORMALIZE=bool(norm_topk_prob), EXACT_SIGMOID=logits.is_cuda,
        BLOCK_GROUP=triton.next_power_of_2(n_group), BLOCK_EXPERT=triton.next_power_of_2(group_size),
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=cfg["num_warps"],
    )
    return weights, ids


def _default_warps(n_experts: int) -> int:
    """A warp holds 8 experts per thread for DeepSeek-V3's 256; more only for larger E."""
    return max(1, min(4, n_experts // 256))


def _check(
    logits: torch.Tensor, top_k: int, n_group: int, topk_group: int, correction_bias: torch.Tensor | None
) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be fp32 [T, E], got {logits.dtype} {tuple(logits.shape)}")
    n_experts = logits.shape[1]
    if n_experts > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits must be contiguous in the expert dim, got strides {logits.stride()}")
    if n_group < 1 or n_experts % n_group or n_experts // n_group < 2:
        raise ValueError(f"{n_experts} experts must split into {n_group} groups of at least 2")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, {n_group}], got {topk_group}")
    if not 1 <= top_k <= topk_group * (n_experts // n_group):
        raise ValueError(f"top_k {top_k} must be in [1, experts in the {topk_group} kept groups]")
    if correction_bias is not None:
        if tuple(correction_bias.shape) != (n_experts,) or correction_bias.device != logits.device:
            raise ValueError(f"correction_bias must be [{n_experts}] on {logits.device}, got "
                             f"{tuple(correction_bias.shape)} on {correction_bias.device}")
        if n_experts > 1 and correction_bias.stride(0) != 1:
            raise ValueError("correction_bias must be contiguous")
