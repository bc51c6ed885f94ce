"""Online expert rebalancing, and the recorder's collective side (dumps, the balancedness metric).

Every rank runs every forward pass (idle ones included), so counting passes gives every rank the
same clock: each decision below happens at the same pass on all of them.

A rebalance, every ``eplb_rebalance_num_iterations`` passes or when asked:
1. all ranks sum the recorded window (one all-reduce) and compute the same new placement
   (``algorithm.rebalance_experts``); the weights of experts a rank will newly hold come from
   host memory, a mapped checkpoint or the dummy generator (stage 1, ``ExpertWeights``);
2. for the next chunk of ``eplb_rebalance_layers_per_chunk`` layers, those weights are copied to
   the device on a side stream while serving goes on (stage 2);
3. at the next pass boundary the chunk is swapped in: device-to-device copies into the expert
   slots, then the maps of its layers updated in place (stage 3); the next chunk is staged.
So no pause between two steps covers more than a chunk, slots that keep their expert are never
copied, FP8 weights move with their scales, and CUDA graphs (which read the same tensors) stay
valid. Shapes: ``L`` layers, ``E`` logical experts, ``P`` physical slots.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moeserve.config import EplbConfig
from moeserve.distributed.groups import Group
from moeserve.eplb import algorithm, files
from moeserve.eplb.placement import ExpertLocation, ExpertPlacement
from moeserve.eplb.recorder import ExpertRecorder, gpu_balancedness

logger = logging.getLogger(__name__)
METRICS_EVERY = 100  # passes between two measurements of the balancedness metric while recording

Fetch = Callable[[int, int], dict[str, torch.Tensor]]  # (layer, logical expert) -> one row of each stack


@dataclass
class _Move:
    layer: int
    slot: int  # this rank's slot index
    staged: dict[str, torch.Tensor]  # the expert's rows, on the device (stage 2)


@dataclass
class EplbStats:
    rebalances: int = 0
    last_pauses_s: list[float] = field(default_factory=list)  # each chunk's pause, the last rebalance
    max_pause_s: float = 0.0
    balancedness: float | None = None  # measured from the recorded physical load (mean / max per GPU)
    planned_before: float | None = None  # the last plan's estimate on its window: old placement
    planned_after: float | None = None  # ... and new


class EplbManager:
    def __init__(self, config: EplbConfig, location: ExpertLocation, recorder: ExpertRecorder,
                 stacks: dict[int, dict[str, torch.Tensor]], fetch: Fetch | None, world: Group, ep_rank: int,
                 moe_layers: list[int], num_groups: int, num_nodes: int, meta: dict | None = None) -> None:
        self.config, self.location, self.recorder = config, location, recorder
        self.stacks, self.fetch, self.world, self.ep_rank = stacks, fetch, world, ep_rank
        self.moe_layers, self.num_groups, self.num_nodes = moe_layers, num_groups, num_nodes
        self.meta = meta or {}
        self.current = location.placement()  # a host mirror of the maps on the device
        self.stats = EplbStats()
        self.passes = 0
        self._plan: ExpertPlacement | None = None
        self._chunks: deque[list[int]] = deque()
        self._staged: tuple[list[_Move], torch.cuda.Event | None] | None = None
        self._pause_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._pauses: list[float] = []  # of the rebalance under way
        self._requested = False
        self._done_callbacks: list[Callable[[dict], None]] = []
        device = location.phy2log.device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def moving(self) -> bool:
        return bool(self._chunks)

    @property
    def busy(self) -> bool:
        """A rebalance is asked for or under way: it needs forward passes (idle ones will do)."""
        return self._requested or bool(self._chunks)

    def summary(self) -> dict:
        s = self.stats
        return {"rebalances": s.rebalances, "balancedness": s.balancedness, "balancedness_before": s.planned_before,
                "balancedness_after": s.planned_after, "pauses_s": s.last_pauses_s, "max_pause_s": s.max_pause_s,
                "recording": self.recorder.recording, "passes": self.passes,
                "phy2log": self.current.phy2log.tolist()}

    # ---- the pass clock ------------------------------------------------------------------------
    def before_forward(self) -> None:
        """Between two steps, on every rank at the same pass."""
        self.passes += 1
        if self._chunks:
            self._apply_chunk()
            return
        due = self.config.enable_eplb and self.passes % self.config.eplb_rebalance_num_iterations == 0
        if due or self._requested:
            self._requested = False
            self._start()
        elif self.recorder.recording and self.passes % METRICS_EVERY == 0:
            self._measure()

    def after_forward(self, is_prefill: bool, positions: torch.Tensor | None = None) -> None:
        self.recorder.end_pass(is_prefill, positions)

    def request_rebalance(self, on_done: Callable[[dict], None] | None = None) -> None:
        """Rebalance at the next pass (called on every rank at the same pass: an agreed control)."""
        if self.fetch is None:
            raise ValueError("rebalancing experts needs --enable-eplb (expert weights are staged at load)")
        self._requested = True
        if on_done is not None:
            self._done_callbacks.append(on_done)

    # ---- stage 1: plan ---------------------------------------------------------------------------
    def _global_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The recorded ``(logical [L, E], physical [L, P])`` counts summed over every rank."""
        logical, physical = self.recorder.totals()
        both = torch.cat([logical.flatten(), physical.flatten()])
        if self.world.size > 1:
            dist.all_reduce(both, group=self.world.group)
        both = both.cpu()
        return both[:logical.numel()].view(logical.shape), both[logical.numel():].view(physical.shape)

    def _start(self) -> None:
        logical, physical = self._global_counts()
        weight = logical[self.moe_layers].double()
        if weight.sum() == 0:
            logger.info("expert rebalance skipped: no load recorded yet")
            self._finish()
            return
        place = self.current
        phy2log, _, _ = algorithm.rebalance_experts(weight, place.num_physical, self.num_groups, self.num_nodes,
                                                    place.ep_size)
        full = place.phy2log.clone()
        full[self.moe_layers] = phy2log
        self._plan = ExpertPlacement.from_phy2log(full, place.num_logical, place.ep_size)
        self.stats.balancedness = gpu_balancedness(physical[self.moe_layers], place.ep_size)
        self.stats.planned_before = algorithm.balancedness(place.phy2log[self.moe_layers], weight, place.ep_size)
        self.stats.planned_after = algorithm.balancedness(phy2log, weight, place.ep_size)
        k = self.config.eplb_rebalance_layers_per_chunk or len(self.moe_layers)
        self._chunks = deque(self.moe_layers[i:i + k] for i in range(0, len(self.moe_layers), k))
        self._pauses, self._pause_events = [], []
        logger.info("expert rebalance: balancedness %.3f -> %.3f (planned on %d passes), %d chunk(s)",
                    self.stats.planned_before, self.stats.planned_after, self.recorder.num_passes,
                    len(self._chunks))
        self._stage(self._chunks[0])

    # ---- stage 2: host -> device, while serving ----------------------------------------------
    def _stage(self, layers: list[int]) -> None:
        moves = []
        slots = self.current.local_slots(self.ep_rank)
        stream = self._stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for layer in layers:
                old = self.current.phy2log[layer, slots.start:slots.stop]
                new = self._plan.phy2log[layer, slots.start:slots.stop]
                for j in (old != new).nonzero().flatten().tolist():
                    source = self.fetch(layer, int(new[j]))
                    staged = {name: source[name].to(stack.device, non_blocking=True)
                              for name, stack in self.stacks[layer].items()}
                    moves.append(_Move(layer, j, staged))
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
        self._staged = (moves, event)

    # ---- stage 3: swap in, between steps ----------------------------------------------------------
    def _apply_chunk(self) -> None:
        layers = self._chunks.popleft()
        moves, staged_event = self._staged
        started = time.perf_counter()
        timing = None
        if staged_event is not None:
            torch.cuda.current_stream().wait_event(staged_event)
            timing = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            timing[0].record()
        for move in moves:
            for name, stack in self.stacks[move.layer].items():
                stack[move.slot].copy_(move.staged[name])
                if staged_event is not None:  # made on the side stream, read on this one: keep it till then
                    move.staged[name].record_stream(torch.cuda.current_stream())
        for layer in layers:
            self.location.update_layer(layer, self._plan)
            self.current.phy2log[layer].copy_(self._plan.phy2log[layer])
            self.current.log2phy[layer].copy_(self._plan.log2phy[layer])
            self.current.logcnt[layer].copy_(self._plan.logcnt[layer])
        if timing is not None:
            timing[1].record()
            self._pause_events.append(timing)
        else:
            self._pauses.append(time.perf_counter() - started)
        self._staged = None
        if self._chunks:
            self._stage(self._chunks[0])
        else:
            self._finish()

    def _finish(self) -> None:
        if self._plan is not None:
            self.stats.rebalances += 1
            self._collect_pauses()
        self._plan = None
        result = self.summary()
        callbacks, self._done_callbacks = self._done_callbacks, []
        for callback in callbacks:
            callback(result)

    def _collect_pauses(self) -> None:
        """The finished rebalance's pauses: device time of each chunk's swap on a GPU (one wait for
        the last, at the end of the rebalance), host time on the CPU."""
        for start, end in self._pause_events:
            end.synchronize()
            self._pauses.append(start.elapsed_time(end) / 1000)
        self._pause_events = []
        self.stats.last_pauses_s = self._pauses
        self.stats.max_pause_s = max([self.stats.max_pause_s, *self._pauses])

    # ---- the recorder's collective side -------------------------------------------------------------
    def _measure(self) -> None:
        _, physical = self._global_counts()
        self.stats.balancedness = gpu_balancedness(physical[self.moe_layers], self.current.ep_size)

    def dump(self, directory: str) -> str | None:
        """Sum the recording over every rank; rank 0 writes it (``eplb.files``) and returns the path."""
        logical, physical = self._global_counts()
        self.stats.balancedness = gpu_balancedness(physical[self.moe_layers], self.current.ep_size)
        rec = self.recorder
        extra = {}
        if rec.mode == "per_token":  # token streams cannot be summed: each rank writes its own
            extra["per_token"] = [{"phase": p.phase, "topk_ids": {str(k): v.cpu() for k, v in p.topk_ids.items()},
                                   "positions": None if p.positions is None else p.positions.cpu()}
                                  for p in rec.passes]
        elif rec.mode == "per_pass":
            extra["per_pass"] = self._per_pass()
        if self.world.rank != 0 and rec.mode != "per_token":
            return None
        os.makedirs(directory, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        suffix = f"-rank{self.world.rank}" if rec.mode == "per_token" else ""
        path = os.path.join(directory, f"expert_distribution-{stamp}-{self.passes}{suffix}"
                                       f"{'.pt' if extra else '.json'}")
        files.save_distribution(path, logical, mode=rec.mode, passes=rec.num_passes, num_groups=self.num_groups,
                                physical_count=physical.tolist(), ep_size=self.current.ep_size,
                                balancedness=self.stats.balancedness, **self.meta, **extra)
        return path

    def _per_pass(self) -> list[dict]:
        """Each kept pass's counts summed over the ranks (every rank kept the same passes)."""
        passes = self.recorder.passes
        if not passes:
            return []
        stacked = torch.stack([p.logical for p in passes])  # [passes, L, E]
        if self.world.size > 1:
            dist.all_reduce(stacked, group=self.world.group)
        return [{"phase": p.phase, "logical_count": c.tolist()} for p, c in zip(passes, stacked.cpu())]

