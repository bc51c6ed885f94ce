"""Where each expert lives: the physical-slot maps of DeepSeek's EPLB.

Abbreviations, defined once:
- ``phy2log [layers, physical]``: the logical expert held by each physical slot;
- ``log2phy [layers, logical, max_replicas]``: the physical slots holding each logical expert,
  padded with -1;
- ``logcnt [layers, logical]``: how many replicas each logical expert has.
Physical slot ``p`` lives on EP rank ``p // slots_per_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertPlacement:
    phy2log: torch.Tensor
    log2phy: torch.Tensor
    logcnt: torch.Tensor
    ep_size: int

    def __post_init__(self) -> None:
        if self.num_physical % self.ep_size:
            raise ValueError(f"{self.num_physical} physical experts do not divide over ep_size {self.ep_size}")

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phy2log.shape[1]

    @property
    def num_logical(self) -> int:
        return self.logcnt.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def local_slots(self, ep_rank: int) -> range:
        n = self.slots_per_rank
        return range(ep_rank * n, (ep_rank + 1) * n)

    @classmethod
    def from_phy2log(cls, phy2log: torch.Tensor, num_logical: int, ep_size: int) -> ExpertPlacement:
        """Build ``log2phy`` and ``logcnt`` from ``phy2log [layers, physical]``."""
        layers = phy2log.shape[0]
        logcnt = torch.zeros(layers, num_logical, dtype=torch.int64)
        logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))
        if (logcnt == 0).any():
            raise ValueError("every logical expert needs at least one physical slot")
        log2phy = torch.full((layers, num_logical, int(logcnt.max())), -1, dtype=torch.int64)
        for layer in range(layers):
            seen = [0] * num_logical
            for phy, log in enumerate(phy2log[layer].tolist()):
                log2phy[layer, log, seen[log]] = phy
                seen[log] += 1
        return cls(phy2log, log2phy, logcnt, ep_size)

    @classmethod
    def trivial(cls, num_layers: int, num_logical: int, ep_size: int, num_redundant: int = 0) -> ExpertPlacement:
        """Logical experts in order, then ``num_redundant`` replicas of experts 0, 1, … appended.

        The replicas are spread so that with ``num_redundant`` a multiple of ``ep_size`` each rank
        gets the same number of slots; EPLB replaces this with a placement balanced by load.
        """
        order = list(range(num_logical)) + [i % num_logical for i in range(num_redundant)]
        phy2log = torch.tensor(order, dtype=torch.int64).expand(num_layers, -1).contiguous()
        return cls.from_phy2log(phy2log, num_logical, ep_size)

    def to_physical(self, layer: int, topk_ids: torch.Tensor, ep_rank: int) -> torch.Tensor:
        """Map logical ``topk_ids [T, k]`` to physical slots, preferring a replica on ``ep_rank``
        and otherwise spreading tokens over the replicas by token index."""
        return self.layer_map(layer, topk_ids.device).to_physical(topk_ids, ep_rank)

    def layer_map(self, layer: int, device: torch.device | str) -> LayerExpertMap:
        """One layer's maps on ``device``, made once so that routing needs no host copy or sync
        each step (and can be captured in a CUDA graph)."""
        logcnt = self.logcnt[layer]
        return LayerExpertMap(self.log2phy[layer].to(device), logcnt.to(device), int(logcnt.max()),
                              self.slots_per_rank)


@dataclass(frozen=True)
class LayerExpertMap:
    """``log2phy [logical, max_replicas]`` and ``logcnt [logical]`` of one layer, on the device."""

    log2phy: torch.Tensor
    logcnt: torch.Tensor
    max_replicas: int
    slots_per_rank: int

    def to_physical(self, topk_ids: torch.Tensor, ep_rank: int) -> torch.Tensor:
        """Logical ``topk_ids [T, k]`` -> physical slots ``[T, k]``."""
        if self.max_replicas == 1:
            return self.log2phy[topk_ids, 0]
        replicas = self.log2phy[topk_ids]  # [T, k, R]
        local = (replicas // self.slots_per_rank == ep_rank) & (replicas >= 0)
        token = torch.arange(topk_ids.shape[0], device=topk_ids.device)[:, None]
        spread = token % self.logcnt[topk_ids]  # [T, k]
        choice = torch.where(local.any(-1), local.int().argmax(-1), spread)
        return replicas.gather(2, choice.unsqueeze(-1)).squeeze(-1)
