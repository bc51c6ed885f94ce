"""Token dispatchers: route each token's hidden state to the experts it chose, and back.

The interface is DeepEP's: ``dispatch`` returns what the local experts must compute plus a
handle, and ``combine`` uses the handle to bring the expert outputs back to the token order,
weighted and summed over each token's top-k. Expert-parallel dispatchers send tokens across
ranks; ``LocalDispatcher`` is the single-rank case where every expert is local.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class DispatchOutput:
    """Tokens for the local experts in contiguous layout: ``hidden [M, D]`` with expert ``e``
    owning rows ``seg_indptr[e]:seg_indptr[e+1]``."""

    hidden: torch.Tensor
    seg_indptr: torch.Tensor


@dataclass
class LocalHandle:
    token_index: torch.Tensor  # [M] source token of each dispatched row
    weights: torch.Tensor  # [M] routing weight of each dispatched row
    num_tokens: int


class Dispatcher(ABC):
    @abstractmethod
    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> tuple[DispatchOutput, object]:
        """``hidden [T, D]``, ``topk_ids [T, k]`` (physical expert ids), ``topk_weights [T, k]``."""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, handle: object) -> torch.Tensor:
        """``expert_out`` in the layout ``dispatch`` produced -> ``[T, D]``."""


class LocalDispatcher(Dispatcher):
    """All ``num_experts`` experts live on this rank: dispatch is a sort by expert id."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, hidden, topk_ids, topk_weights):
        flat_ids = topk_ids.flatten()  # [T * k]
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        seg_indptr = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
        token_index = order // topk_ids.shape[1]
        handle = LocalHandle(token_index, topk_weights.flatten()[order], hidden.shape[0])
        return DispatchOutput(hidden[token_index], seg_indptr), handle

    def combine(self, expert_out, handle):
        weighted = expert_out * handle.weights.unsqueeze(1).to(expert_out.dtype)
        out = expert_out.new_zeros(handle.num_tokens, expert_out.shape[1])
        return out.index_add_(0, handle.token_index, weighted)
