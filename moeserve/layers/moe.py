"""Mixture of experts: routed experts through grouped GEMMs, plus always-on shared experts."""

from __future__ import annotations

import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.distributed.dispatcher import DispatchOutput, LocalDispatcher
from moeserve.kernels.activation import silu_and_mul
from moeserve.kernels.grouped_gemm import grouped_gemm_contiguous
from moeserve.layers.gate import Gate
from moeserve.layers.linear import frozen
from moeserve.layers.mlp import MLP


class Experts(nn.Module):
    """All routed experts of a layer as stacked weights: ``w13 [E, 2I, D]`` (gate then up) and
    ``w2 [E, D, I]``, filled from the checkpoint's per-expert tensors."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.w13 = frozen(num_experts, 2 * intermediate_size, hidden_size)
        self.w2 = frozen(num_experts, hidden_size, intermediate_size)

    def checkpoint_slots(self) -> dict[str, list[tuple[torch.Tensor, tuple]]]:
        inter = self.intermediate_size
        slots = {}
        for e in range(self.num_experts):
            slots[f"{e}.gate_proj.weight"] = [(self.w13, (e, slice(0, inter)))]
            slots[f"{e}.up_proj.weight"] = [(self.w13, (e, slice(inter, 2 * inter)))]
            slots[f"{e}.down_proj.weight"] = [(self.w2, (e,))]
        return slots

    def forward(self, recv: DispatchOutput) -> torch.Tensor:
        """Contiguous layout in, contiguous layout out: ``[M, D] -> [M, D]``."""
        h = grouped_gemm_contiguous(recv.hidden, self.w13, recv.seg_indptr)  # [M, 2I]
        return grouped_gemm_contiguous(silu_and_mul(h), self.w2, recv.seg_indptr)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Gate(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )
        self.dispatcher = LocalDispatcher(cfg.n_routed_experts)

    def shared(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.shared_experts(hidden) if self.shared_experts is not None else None
