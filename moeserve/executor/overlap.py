"""Two-batch overlap (TBO): one small executor over the model's operation list, and the rules that
split a batch into two micro-batches.

The model gives its forward as one flat list of operations over a per-micro-batch state, with
``YIELD`` markers where a micro-batch hands over to the other (around the MoE dispatch and
combine, whose issue and wait halves are separate operations). ``run`` executes the list for one
state, ignoring the markers; ``run_overlapped`` runs two states over it, switching at the markers,
the second ``delta`` stages behind the first: while one micro-batch's all-to-all is in flight (on
the NCCL stream, or gloo's threads), the other's computation is queued. Every rank runs the same
list with the same markers and delta, so the collectives of the two micro-batches line up.

Strategies, as the reference deployment has them: ``PREFILL`` (no delta: the micro-batches take
turns), ``DECODE`` (a five-stage pipeline per layer, the second micro-batch two stages behind).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from moeserve.core import YIELD, ForwardMode, ScheduleBatch, ScheduledSeq, Yield

Op = Callable[[Any, Any], None]  # (state, batch) -> None


@dataclass(frozen=True)
class Strategy:
    name: str
    delta: int  # stages the second micro-batch runs behind the first


PREFILL = Strategy("prefill", delta=0)
DECODE = Strategy("decode", delta=2)


def stages(ops: Sequence[Op | Yield]) -> list[list[Op]]:
    """The operations between consecutive ``YIELD`` markers (empty stages kept: they still count
    for the delta)."""
    out: list[list[Op]] = [[]]
    for op in ops:
        if op is YIELD:
            out.append([])
        else:
            out[-1].append(op)
    return out


def run(ops: Sequence[Op | Yield], state: Any, batch: Any) -> None:
    """Plain execution: every operation in order, the markers ignored."""
    for op in ops:
        if op is not YIELD:
            op(state, batch)


def run_overlapped(ops: Sequence[Op | Yield], states: tuple[Any, Any], batches: tuple[Any, Any],
                   delta: int) -> None:
    """Both micro-batches through ``ops``: stage ``i`` of the first, then stage ``i - delta`` of the
    second, for ``i`` up to the last stage of the second."""
    split = stages(ops)
    for i in range(len(split) + delta):
        if i < len(split):
            for op in split[i]:
                op(states[0], batches[0])
        if i >= delta:
            for op in split[i - delta]:
                op(states[1], batches[1])


# ---- splitting a batch --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    """A batch in two micro-batches; ``cut`` is the index (in the first) of a sequence whose second
    part starts the second micro-batch, or None when the split falls between sequences."""

    first: ScheduleBatch
    second: ScheduleBatch
    cut: int | None = None

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        """(tokens, sequences) of the first, then of the second."""
        return (self.first.num_tokens, len(self.first.seqs), self.second.num_tokens, len(self.second.seqs))


def split_batch(batch: ScheduleBatch | None, threshold: float) -> Split:
    """Decode: the sequences in halves. Prefill: at the sequence boundary that balances the token
    counts best; when the smaller side would still hold less than ``threshold`` of the tokens, one
    sequence is cut so that both halves hold equal tokens (its second part attends to the first
    part's KV, which the first micro-batch writes earlier in each layer). An empty or absent batch
    gives two idle halves."""
    if batch is None or not batch.seqs:
        idle = ScheduleBatch(ForwardMode.IDLE, [])
        return Split(idle, idle)
    seqs, mode = batch.seqs, batch.mode
    if mode.is_decode:
        half = (len(seqs) + 1) // 2
        return Split(ScheduleBatch(mode, seqs[:half]), _maybe_idle(mode, seqs[half:]))
    lens = [s.end - s.start for s in seqs]
    total = sum(lens)
    best, best_gap, acc = 0, total, 0
    for i, n in enumerate(lens[:-1]):
        acc += n
        if abs(total - 2 * acc) < best_gap:
            best, best_gap = i + 1, abs(total - 2 * acc)
    first_tokens = sum(lens[:best])
    if best and min(first_tokens, total - first_tokens) >= threshold * total:
        return Split(ScheduleBatch(mode, seqs[:best]), ScheduleBatch(mode, seqs[best:]))
    if total < 2:
        return Split(batch, ScheduleBatch(ForwardMode.IDLE, []))
    return _cut(mode, seqs, lens, total // 2)


def _cut(mode: ForwardMode, seqs: list[ScheduledSeq], lens: list[int], target: int) -> Split:
    """The first ``target`` tokens in the first micro-batch, cutting the sequence they end in."""
    acc = 0
    for i, (seq, n) in enumerate(zip(seqs, lens)):
        if acc + n > target:
            mid = seq.start + (target - acc)
            head = [*seqs[:i], ScheduledSeq(seq.req, seq.start, mid)] if mid > seq.start else seqs[:i]
            tail = [ScheduledSeq(seq.req, mid, seq.end), *seqs[i + 1:]]
            return Split(ScheduleBatch(mode, head), ScheduleBatch(mode, tail), i if mid > seq.start else None)
        acc += n
    raise AssertionError("target inside the batch")


def _maybe_idle(mode: ForwardMode, seqs: list[ScheduledSeq]) -> ScheduleBatch:
    return ScheduleBatch(mode if seqs else ForwardMode.IDLE, seqs)
