"""Token layouts between sublayers, and the collectives that move tokens between them.

Between sublayers every rank holds a *scattered* share of its data-parallel group's tokens:
the group's batch split into contiguous slices over its attention-TP ranks (with attention TP 1,
the rank's whole batch). Attention needs the whole group batch (all-gather inside attention TP)
and hands back a partial sum (reduce-scatter back to the slices); the dense FFN does the same
over its own TP group. Reduce-scatter + all-gather moves half the bytes of an all-reduce and
leaves the MoE with distinct tokens on every rank for expert-parallel dispatch.
"""

from __future__ import annotations

import torch

from moeserve.core import DPInfo
from moeserve.distributed.comm import all_gather_tokens, reduce_scatter_tokens, scatter_sizes
from moeserve.distributed.groups import ParallelGroups


class TokenLayout:
    def __init__(self, groups: ParallelGroups) -> None:
        self.groups = groups

    def scattered_count(self, dp: DPInfo, rank: int) -> int:
        """Tokens that world rank ``rank`` holds in the scattered layout."""
        tp = self.groups.attn_tp.size
        return scatter_sizes(dp.token_counts[rank // tp], tp)[rank % tp]

    def my_slice(self, dp: DPInfo) -> slice:
        """This rank's rows of its DP group's batch."""
        g = self.groups
        sizes = scatter_sizes(dp.token_counts[g.dp_rank], g.attn_tp.size)
        start = sum(sizes[:g.attn_tp.rank])
        return slice(start, start + sizes[g.attn_tp.rank])

    def _counts(self, dp: DPInfo, ranks: list[int]) -> list[int]:
        return [self.scattered_count(dp, r) for r in ranks]

    def gather_attn(self, x: torch.Tensor, dp: DPInfo) -> torch.Tensor:
        """Scattered ``[t, D]`` -> the DP group's whole batch ``[T_d, D]``."""
        tp = self.groups.attn_tp
        return all_gather_tokens(x, tp, self._counts(dp, tp.ranks))

    def scatter_attn(self, partial: torch.Tensor, dp: DPInfo) -> torch.Tensor:
        """Attention-TP partial sums ``[T_d, D]`` -> this rank's summed slice ``[t, D]``."""
        tp = self.groups.attn_tp
        return reduce_scatter_tokens(partial, tp, self._counts(dp, tp.ranks))

    def gather_dense(self, x: torch.Tensor, dp: DPInfo) -> torch.Tensor:
        g = self.groups.dense_tp
        return all_gather_tokens(x, g, self._counts(dp, g.ranks))

    def scatter_dense(self, partial: torch.Tensor, dp: DPInfo) -> torch.Tensor:
        g = self.groups.dense_tp
        return reduce_scatter_tokens(partial, g, self._counts(dp, g.ranks))
