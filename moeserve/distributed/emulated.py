"""One rank of an expert-parallel group, emulated alone on one device (``moeserve bench rank``).

Under DP attention and EP every rank runs the same program on its own share, so one rank's step
predicts the deployment's. ``EmulatedDispatcher`` stands in for the all-to-all: it moves no data
between devices, but hands the local experts what the *busiest* rank of an ``ep_size``-rank group
receives (the rows the balancedness implies: a rank's own ``T * k`` rows on average, divided by
the balancedness for the busiest), made by local copies of the right sizes, in the layout the
dispatch mode produces (contiguous for ``normal``, masked for ``low_latency``), and combines by the
same gather-and-sum as the real dispatchers. A group of one rank is exactly the engine's
single-rank dispatch (its outputs and its kernels are the engine's), which is how the emulator is
checked against ``bench one-batch``. The time the network would take is modelled
separately (``moeserve.bench.network``).

The tokens it hands over are this rank's own, repeated: the values are meaningless, the shapes,
the bytes moved and the kernels' work are the deployment's. Everything is sized from the batch's
shape on the host, with no sync, so it runs inside CUDA graphs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeserve.distributed.dispatcher import (
    Dispatcher,
    DispatchOutput,
    LocalDispatcher,
    MaskedDispatchOutput,
    received_tokens,
    token_parts,
)
from moeserve.kernels.combine import topk_weighted_sum
from moeserve.kernels.expert_order import expert_order


@dataclass(frozen=True)
class EmulatedEP:
    """The group one rank is emulated in: ``ep_size`` ranks, and the balancedness of each MoE layer
    (mean rows a rank receives / the busiest rank's: 1.0 is perfect balance), one value for all or
    one a layer, keyed by layer id."""

    ep_size: int
    balancedness: float | dict[int, float] = 1.0

    def __post_init__(self) -> None:
        if self.ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {self.ep_size}")
        values = self.balancedness.values() if isinstance(self.balancedness, dict) else [self.balancedness]
        if any(not 0 < b <= 1 for b in values):
            raise ValueError(f"balancedness must be in (0, 1], got {self.balancedness}")
        if self.ep_size == 1 and any(b != 1 for b in values):
            raise ValueError("balancedness: one rank alone receives exactly its own rows (1.0)")

    def balancedness_of(self, layer_id: int) -> float:
        if isinstance(self.balancedness, dict):
            return self.balancedness[layer_id]
        return self.balancedness

    def busiest_rows(self, layer_id: int, rows: int) -> int:
        """Rows the busiest rank receives when every rank sends ``rows`` (its tokens times top-k)."""
        return math.ceil(rows / self.balancedness_of(layer_id) - 1e-9)


@dataclass
class EmulatedHandle:
    position: torch.Tensor  # [T * k]: the received row standing for each (token, choice)
    topk_weights: torch.Tensor  # [T, k]


class EmulatedDispatcher(Dispatcher):
    """``mode``: ``"normal"`` (contiguous, ``num_local`` segments) or ``"low_latency"`` (masked
    ``[num_local, rows, D]``). The busiest rank's rows are spread evenly over the local slots.
    ``fp8``: the tokens travel as the EP dispatchers send them to FP8 experts (quantized once a
    token, then its FP8 values and scales copied alike, as ``ep_dispatch`` does)."""

    disposable_buffers = True  # index_select gives a fresh buffer a call

    def __init__(self, mode: str, num_local: int, group: EmulatedEP, layer_id: int, fp8: bool = False) -> None:
        if mode not in ("normal", "low_latency"):
            raise ValueError(f"an emulated dispatcher runs 'normal' or 'low_latency', not {mode!r}")
        self.mode, self.num_local, self.group, self.layer_id, self.fp8 = mode, num_local, group, layer_id, fp8
        self._consts: dict[tuple[str, int, int], torch.Tensor] = {}  # made once, before any graph capture
        # one rank alone receives exactly its own rows: the engine's own single-rank dispatch (in
        # contiguous layout, whichever mode; a one-rank engine has no masked path to compare with)
        self.exact = LocalDispatcher(num_local) if group.ep_size == 1 else None

    def _const(self, name: str, n: int, m: int, device: torch.device) -> torch.Tensor:
        key = (name, n, m)
        if key not in self._consts:
            if name == "seg_indptr":  # n rows over m segments, the first n % m one row longer
                per = [n // m + (i < n % m) for i in range(m)]
                self._consts[key] = torch.tensor([0, *per], dtype=torch.int64).cumsum(0).to(device)
            elif name == "masked_m":
                self._consts[key] = torch.full((m,), n, dtype=torch.int32, device=device)
            else:  # "cycle": 0 .. m - 1 repeated to n entries
                self._consts[key] = torch.arange(n, device=device) % m
        return self._consts[key]

    def dispatch_a(self, hidden, topk_ids, topk_weights):
        if self.exact is not None:
            return self.exact.dispatch_a(hidden, topk_ids, topk_weights)
        tokens, k = topk_ids.shape
        sent = tokens * k
        rows = self.group.busiest_rows(self.layer_id, sent) if sent else 0
        if self.mode == "low_latency":  # every local slot padded to the same row count
            per_slot = -(-rows // self.num_local)
            rows = per_slot * self.num_local
        device = hidden.device
        # the layout step of a real dispatch: this rank's (token, choice) rows sorted by expert
        order = expert_order(topk_ids.flatten(), self.num_local * self.group.ep_size).order
        source = order.index_select(0, self._const("cycle", rows, max(sent, 1), device)) // k if sent else order
        # [rows, D] (FP8: and [rows, G]): the copies a receive would make
        received = [part.index_select(0, source) for part in token_parts(hidden, self.fp8)]
        if self.mode == "low_latency":
            tokens = received_tokens([r.view(self.num_local, per_slot, r.shape[-1]) for r in received], hidden.dtype)
            recv = MaskedDispatchOutput(masked_m=self._const("masked_m", per_slot, self.num_local, device),
                                        expected_m=per_slot, **tokens)
        else:
            seg = self._const("seg_indptr", rows, self.num_local, device)
            recv = DispatchOutput(seg_indptr=seg, tokens_per_expert=seg.diff(), tail_rows=False,
                                  **received_tokens(received, hidden.dtype))
        # combine reads one received row per (token, choice)
        handle = EmulatedHandle(self._const("cycle", sent, max(rows, 1), device), topk_weights)
        return recv, handle

    def dispatch_b(self, pending):
        return pending

    def combine_a(self, expert_out, handle):
        if self.exact is not None:
            return self.exact.combine_a(expert_out, handle)
        rows = expert_out.reshape(-1, expert_out.shape[-1])
        if handle.position.numel() == 0:
            return rows.new_zeros(handle.topk_weights.shape[0], rows.shape[-1])
        return topk_weighted_sum(rows, handle.topk_weights, handle.position)

    def combine_b(self, pending):
        return pending
