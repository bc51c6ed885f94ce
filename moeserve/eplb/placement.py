"""Where each expert lives: the physical-slot maps of DeepSeek's EPLB, and how a routed logical
expert picks one of its replicas.

Abbreviations, defined once:
- ``phy2log [layers, physical]``: the logical expert held by each physical slot;
- ``log2phy [layers, logical, X]``: the physical slots holding each logical expert, padded with
  -1; ``X = 1 + redundant slots`` (the most replicas one expert can have), fixed for a server;
- ``logcnt [layers, logical]``: how many replicas each logical expert has.
Physical slot ``p`` lives on EP rank ``p // slots_per_rank``.

``ExpertPlacement`` is a placement as plain CPU tensors (built, checked, compared, saved);
``ExpertLocation`` holds the one a server runs with on its device, in tensors whose shapes never
change: a rebalance copies new values into them (``update_layer``), so code paths and CUDA graphs
that read them stay valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.eplb.algorithm import replica_counts, replica_slots, trivial_phy2log

DISPATCH_ALGORITHMS = ("static", "dynamic", "fake")


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
        """Build ``log2phy`` (width ``X = physical - logical + 1``) and ``logcnt`` from ``phy2log
        [layers, physical]``; raises ValueError when a logical expert has no slot."""
        phy2log = phy2log.to(torch.int64).cpu()
        physical = phy2log.shape[1]
        if physical < num_logical:
            raise ValueError(f"{physical} physical slots cannot hold {num_logical} logical experts")
        if phy2log.numel() and (phy2log.min() < 0 or phy2log.max() >= num_logical):
            raise ValueError(f"phy2log names experts outside [0, {num_logical})")
        logcnt = replica_counts(phy2log, num_logical)
        if (logcnt == 0).any():
            raise ValueError("every logical expert needs at least one physical slot")
        log2phy = replica_slots(phy2log, logcnt, physical - num_logical + 1)
        return cls(phy2log, log2phy, logcnt, ep_size)

    @classmethod
    def trivial(cls, num_layers: int, num_logical: int, ep_size: int, num_redundant: int = 0) -> ExpertPlacement:
        """Logical experts in order, then ``num_redundant`` replicas of experts 0, 1, … appended.

        The replicas are spread so that with ``num_redundant`` a multiple of ``ep_size`` each rank
        gets the same number of slots; EPLB replaces this with a placement balanced by load.
        """
        phy2log = trivial_phy2log(num_layers, num_logical, num_logical + num_redundant)
        return cls.from_phy2log(phy2log, num_logical, ep_size)


class ExpertLocation:
    """The placement a server runs with, on its device, in tensors of fixed shapes."""

    def __init__(self, placement: ExpertPlacement, device: torch.device | str) -> None:
        self.ep_size, self.slots_per_rank = placement.ep_size, placement.slots_per_rank
        self.num_logical, self.num_physical = placement.num_logical, placement.num_physical
        self.phy2log = placement.phy2log.to(device)  # [L, P]
        self.log2phy = placement.log2phy.to(device)  # [L, E, X]
        self.logcnt = placement.logcnt.to(device)  # [L, E]
        # the static choice depends only on (layer, logical expert, rank): one table a rank, [L, E],
        # made when a map asks for it and refreshed by ``update_layer``, so routing is one lookup
        self._static: dict[int, torch.Tensor] = {}

    @property
    def width(self) -> int:
        return self.log2phy.shape[2]

    def placement(self) -> ExpertPlacement:
        """The maps as they are now, on the CPU (a host sync)."""
        return ExpertPlacement(self.phy2log.cpu(), self.log2phy.cpu(), self.logcnt.cpu(), self.ep_size)

    def update_layer(self, layer: int, new: ExpertPlacement) -> None:
        """Take ``new``'s maps of ``layer`` (same sizes): values change, shapes and storage stay."""
        if new.log2phy.shape[1:] != self.log2phy.shape[1:] or new.num_physical != self.num_physical:
            raise ValueError(f"a placement of {new.num_physical} slots and width {new.log2phy.shape[2]} cannot "
                             f"replace one of {self.num_physical} slots and width {self.width}")
        self.phy2log[layer].copy_(new.phy2log[layer], non_blocking=True)
        self.log2phy[layer].copy_(new.log2phy[layer], non_blocking=True)
        self.logcnt[layer].copy_(new.logcnt[layer], non_blocking=True)
        for ep_rank, table in self._static.items():
            table[layer].copy_(static_slots(self.log2phy[layer], self.logcnt[layer], self.slots_per_rank, ep_rank))

    def static_table(self, ep_rank: int) -> torch.Tensor:
        """``[L, E]``: the physical slot rank ``ep_rank``'s static routing sends each logical expert
        to (kept current by ``update_layer``)."""
        if ep_rank not in self._static:
            self._static[ep_rank] = static_slots(self.log2phy, self.logcnt, self.slots_per_rank, ep_rank)
        return self._static[ep_rank]

    def layer_map(self, layer: int, ep_rank: int, algorithm: str = "static") -> LayerExpertMap:
        """One layer's routing to physical slots, reading this location's tensors (views)."""
        if algorithm not in DISPATCH_ALGORITHMS:
            raise ValueError(f"ep_dispatch_algorithm must be one of {DISPATCH_ALGORITHMS}, got {algorithm!r}")
        static = self.static_table(ep_rank)[layer] if algorithm == "static" else None
        return LayerExpertMap(self.log2phy[layer], self.logcnt[layer], self.slots_per_rank, ep_rank,
                              self.num_physical, algorithm, static)


def static_slots(log2phy: torch.Tensor, logcnt: torch.Tensor, slots_per_rank: int, ep_rank: int) -> torch.Tensor:
    """``log2phy [..., E, X]``, ``logcnt [..., E]`` -> ``[..., E]``: for each logical expert, a replica
    on rank ``ep_rank`` if it has one (the first), else replica ``ep_rank mod logcnt`` (so the ranks
    spread over the replicas)."""
    local = (log2phy // slots_per_rank == ep_rank) & (log2phy >= 0)
    choice = torch.where(local.any(-1), local.int().argmax(-1), ep_rank % logcnt)
    return log2phy.gather(-1, choice.unsqueeze(-1)).squeeze(-1)


@dataclass(frozen=True)
class LayerExpertMap:
    """``log2phy [logical, X]`` and ``logcnt [logical]`` of one layer (views of the location's
    tensors on the device), and how this rank picks among replicas. Only tensor shapes steer the
    code, so a CUDA graph can capture it and a rebalance changes only values."""

    log2phy: torch.Tensor
    logcnt: torch.Tensor
    slots_per_rank: int
    ep_rank: int
    num_physical: int
    algorithm: str = "static"
    static: torch.Tensor | None = None  # [logical]: the static choice (``static_slots``), a view; static only

    def to_physical(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """Logical ``topk_ids [T, k]`` -> physical slots ``[T, k]``.

        static: a replica on this rank if there is one, else replica ``ep_rank mod logcnt`` (each
        rank sends an expert's tokens to one replica, and the ranks spread over the replicas);
        dynamic: a replica drawn at random per token; fake: ``k`` distinct slots drawn uniformly
        per token whatever the router chose (a perfectly balanced load, for measurements)."""
        if self.algorithm == "fake":
            noise = torch.rand(topk_ids.shape[0], self.num_physical, device=topk_ids.device)
            return noise.topk(topk_ids.shape[1], dim=1).indices
        if self.algorithm == "static":
            return self.static[topk_ids]
        if self.log2phy.shape[1] == 1:
            return self.log2phy[topk_ids, 0]
        replicas = self.log2phy[topk_ids]  # [T, k, X]
        count = self.logcnt[topk_ids]  # [T, k]
        choice = (torch.rand(topk_ids.shape, device=topk_ids.device) * count).long().clamp_(max=count - 1)
        return replicas.gather(2, choice.unsqueeze(-1)).squeeze(-1)
