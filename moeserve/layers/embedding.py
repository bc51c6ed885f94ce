from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.distributed.comm import all_gather_last_dim
from moeserve.distributed.groups import Group
from moeserve.layers.linear import Slot, frozen


class Embedding(nn.Module):
    """Replicated on every rank: a lookup needs no communication."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = frozen(vocab_size, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Vocab-parallel over ``group``: each rank scores ``ceil(V / n)`` tokens (the last shard
    padded), the shards are gathered; logits are always fp32 for sampling."""

    def __init__(self, vocab_size: int, dim: int, group: Group) -> None:
        super().__init__()
        self.vocab_size, self.group = vocab_size, group
        self.shard = -(-vocab_size // group.size)
        self.weight = frozen(self.shard, dim)

    def checkpoint_slots(self) -> dict[str, list[Slot]]:
        start = self.group.rank * self.shard
        stop = min(start + self.shard, self.vocab_size)
        # padding rows of the last shard stay as they are: their logits are cut off in forward
        return {"weight": [(self.weight, (slice(0, max(stop - start, 0)),), (slice(start, stop),))]}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight).float()  # [N, V / n]
        return all_gather_last_dim(logits, self.group)[:, :self.vocab_size]
