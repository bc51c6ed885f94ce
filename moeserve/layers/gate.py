"""The MoE router."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig
from moeserve.kernels.routing import select_experts
from moeserve.layers.linear import frozen


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = frozen(cfg.n_routed_experts, cfg.hidden_size)
        # the bias only steers the choice, so it stays fp32 whatever the model dtype
        self.e_score_correction_bias = (
            frozen(cfg.n_routed_experts, dtype=torch.float32) if cfg.router == "noaux_tc" else None
        )

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [T, D]`` -> ``(topk_weights [T, k] fp32, topk_ids [T, k])`` (logical expert ids)."""
        cfg = self.cfg
        logits = F.linear(hidden.float(), self.weight.float())  # [T, E]
        return select_experts(
            logits, cfg.num_experts_per_tok, cfg.router, cfg.n_group, cfg.topk_group,
            self.e_score_correction_bias, cfg.norm_topk_prob, cfg.routed_scaling_factor,
        )
