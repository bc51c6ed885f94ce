"""The expert distribution recorder: how many tokens each layer routes to each logical expert (and
each physical slot), counted on the device with no host sync inside a step.

Modes (``--expert-distribution-recorder-mode``):
- ``stat``: a window of the last ``window`` forward passes (what online rebalancing plans from);
- ``per_pass``: every pass's counts, kept until dumped;
- ``per_token``: every pass's routed logical experts per layer and token, with the pass's kind
  (prefill or decode), for the workload simulator.

``record`` is called by each MoE layer with the router's choice; a flag on the device (``enabled``)
gates the counting, so starting and stopping never changes the captured code of a CUDA graph, and
``valid`` (set per step) leaves out the padding rows of a graph's bucket. ``end_pass`` closes a
pass on the host side after the forward. Shapes: ``L`` layers, ``E`` logical experts, ``P``
physical slots, ``T`` tokens of this rank, ``k`` experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moeserve.eplb.algorithm import balancedness_of

RECORDER_MODES = ("stat", "per_pass", "per_token")
ALL_TOKENS = 1 << 62  # ``valid`` when every row of the batch is a real token


@dataclass
class PassRecord:
    """One forward pass as ``per_pass`` / ``per_token`` keep it (on the CPU once dumped)."""

    phase: str  # "prefill" or "decode"
    logical: torch.Tensor | None = None  # [L, E] counts (per_pass)
    physical: torch.Tensor | None = None  # [L, P] counts (per_pass)
    topk_ids: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, k] logical ids (per_token)
    positions: torch.Tensor | None = None  # [T] each token's position in its sequence (per_token)


class ExpertRecorder:
    def __init__(self, mode: str, num_layers: int, num_logical: int, num_physical: int, window: int,
                 device: torch.device | str) -> None:
        if mode not in RECORDER_MODES:
            raise ValueError(f"expert_distribution_recorder_mode must be one of {RECORDER_MODES}, got {mode!r}")
        self.mode, self.window = mode, window
        self.enabled = torch.zeros((), dtype=torch.int64, device=device)  # 1 while recording
        self.valid = torch.full((), ALL_TOKENS, dtype=torch.int64, device=device)  # real rows of this step
        self.logical = torch.zeros(num_layers, num_logical, dtype=torch.int64, device=device)  # this pass
        self.physical = torch.zeros(num_layers, num_physical, dtype=torch.int64, device=device)
        if mode == "stat":
            self.window_logical = torch.zeros(window, num_layers, num_logical, dtype=torch.int64, device=device)
            self.window_physical = torch.zeros(window, num_layers, num_physical, dtype=torch.int64, device=device)
        self.passes: list[PassRecord] = []
        self._ids: dict[int, torch.Tensor] = {}  # per_token: this pass's ids per layer
        self.recording = False  # the host's view of ``enabled``
        self.num_passes = 0  # passes recorded since ``start``
        self._slot = 0

    # ---- inside the step (device work only) ---------------------------------------------------
    def record(self, layer: int, logical_ids: torch.Tensor, physical_ids: torch.Tensor) -> None:
        """Count ``logical_ids [T, k]`` and ``physical_ids [T, k]`` of ``layer``: rows past ``valid``
        (padding) and everything while not recording add zero."""
        tokens, k = logical_ids.shape
        real = (torch.arange(tokens, device=logical_ids.device) < self.valid).to(torch.int64) * self.enabled
        weight = real.repeat_interleave(k)  # [T * k]
        self.logical[layer].index_add_(0, logical_ids.flatten(), weight)
        self.physical[layer].index_add_(0, physical_ids.flatten(), weight)
        if self.mode == "per_token" and self.recording:
            self._ids[layer] = logical_ids

    # ---- between steps (host) ------------------------------------------------------------------
    def end_pass(self, is_prefill: bool, positions: torch.Tensor | None = None) -> None:
        """Close this forward pass (after it ran): file its counts, zero the running ones.
        ``positions [T]``: the positions of this rank's tokens (per_token keeps them)."""
        if not self.recording:
            return
        phase = "prefill" if is_prefill else "decode"
        if self.mode == "stat":
            self.window_logical[self._slot].copy_(self.logical)
            self.window_physical[self._slot].copy_(self.physical)
            self._slot = (self._slot + 1) % self.window
        elif self.mode == "per_pass":
            self.passes.append(PassRecord(phase, self.logical.clone(), self.physical.clone()))
        else:
            self.passes.append(PassRecord(phase, topk_ids={layer: ids.clone() for layer, ids in self._ids.items()},
                                          positions=None if positions is None else positions.clone()))
            self._ids = {}
        self.logical.zero_()
        self.physical.zero_()
        self.num_passes += 1

    def start(self) -> None:
        """Forget what was recorded and record from the next pass on."""
        self.logical.zero_()
        self.physical.zero_()
        if self.mode == "stat":
            self.window_logical.zero_()
            self.window_physical.zero_()
        self.passes, self._ids, self._slot, self.num_passes = [], {}, 0, 0
        self.enabled.fill_(1)
        self.recording = True

    def stop(self) -> None:
        self.enabled.fill_(0)
        self.recording = False

    def totals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's recorded ``(logical [L, E], physical [L, P])`` token counts: the window (stat),
        or every pass kept (per_pass, per_token: physical counts are not kept per token)."""
        if self.mode == "stat":
            return self.window_logical.sum(0), self.window_physical.sum(0)
        logical, physical = torch.zeros_like(self.logical), torch.zeros_like(self.physical)
        for record in self.passes:
            if record.logical is not None:
                logical += record.logical
                physical += record.physical
            for layer, ids in record.topk_ids.items():
                logical[layer].index_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))
        return logical, physical


def gpu_balancedness(physical: torch.Tensor, num_gpus: int) -> float:
    """Mean over layers (with any load) of mean / max tokens per GPU, from ``physical [L, P]``
    token counts (slot ``p`` on GPU ``p // (P / num_gpus)``); 1.0 is a perfect balance."""
    return balancedness_of(physical.view(physical.shape[0], num_gpus, -1).sum(-1))
