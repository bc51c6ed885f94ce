from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.layers.linear import frozen


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = frozen(vocab_size, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Hidden states to vocabulary logits, always returned in fp32 for sampling."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = frozen(vocab_size, dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
