"""The layout step of a MoE dispatch: the (token, choice) rows grouped by expert, stable.

``expert_order(ids, num_experts)`` takes the flat top-k expert ids ``[N]`` (``N = T * k``) and
gives where each row goes when the rows are laid out expert after expert, in their original order
within an expert (what ``torch.argsort(ids, stable=True)`` gives), both ways round, with each
expert's row count and segment start. On CUDA, up to ``TRITON_MAX_ROWS`` rows (decode's sizes),
one Triton kernel computes it by counting instead of sorting: a small sort of 64-bit keys spends
tens of microseconds in one thread block, which at decode is more than the experts' own GEMM
prologue; larger calls (prefill) sort.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.kernels.backend import use_triton

TRITON_MAX_ROWS = 8192  # the kernel does O(N^2 / 32) comparisons in parallel: decode's N, not prefill's


@dataclass
class ExpertOrder:
    order: torch.Tensor  # [N] int64: row j of the grouped layout holds entry order[j]
    position: torch.Tensor  # [N] int64: where entry i sits (the inverse of ``order``)
    seg_indptr: torch.Tensor  # [E + 1] int64: expert e's rows are seg_indptr[e] .. seg_indptr[e + 1]
    counts: torch.Tensor  # [E] int64


def expert_order(ids: torch.Tensor, num_experts: int) -> ExpertOrder:
    """``ids [N]`` (integers in ``[0, num_experts)``) -> ``ExpertOrder``. No host sync: it runs
    inside CUDA graphs."""
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D (the flat top-k ids), got shape {tuple(ids.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be int32 or int64, got {ids.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if use_triton(ids) and ids.numel() <= TRITON_MAX_ROWS:
        from moeserve.kernels.triton import expert_order as triton_expert_order

        return ExpertOrder(*triton_expert_order.expert_order(ids, num_experts))
    return expert_order_ref(ids, num_experts)


def expert_order_ref(ids: torch.Tensor, num_experts: int) -> ExpertOrder:
    """The torch version: a stable sort, and a scatter-add for the counts (``bincount`` would sync)."""
    ids = ids.long()
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    seg_indptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
    position = torch.empty_like(order)
    position[order] = torch.arange(order.shape[0], device=order.device)
    return ExpertOrder(order, position, seg_indptr, counts)
