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
        return select_experts(
            router_logits(hidden, self.weight), cfg.num_experts_per_tok, cfg.router, cfg.n_group, cfg.topk_group,
            self.e_score_correction_bias, cfg.norm_topk_prob, cfg.routed_scaling_factor,
        )


def router_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden [T, D] @ weight [E, D].T`` in fp32, as DeepSeek's reference casts both to fp32.

    On CUDA, 16-bit operands go through a 16-bit tensor-core GEMM that accumulates and returns
    fp32: the products of two bf16 values are exact in fp32, so this is the fp32 GEMM's
    arithmetic up to the order of the sum, several times faster (an fp32 GEMM runs without
    tensor cores) and without an fp32 copy of the hidden states.
    """
    if hidden.is_cuda and hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
    return F.linear(hidden.float(), weight.float())  # [T, E]
