"""The two-batch-overlap executor and the rules that split a batch into two micro-batches."""

from __future__ import annotations

import pytest

from moeserve.core import YIELD, ForwardMode, Req, SamplingParams, ScheduleBatch, ScheduledSeq
from moeserve.executor.overlap import run, run_overlapped, split_batch, stages


def _ops(log: list, names: str) -> list:
    """Operations named by letters; ``|`` is a yield. Each appends (state, name) when run."""
    def op(name):
        return lambda state, batch: log.append((state, name, batch))
    return [YIELD if c == "|" else op(c) for c in names]


@pytest.mark.parametrize("delta", [0, 1, 2])
def test_two_states_run_every_op_once_in_order_switching_exactly_at_the_yields(delta):
    log: list = []
    ops = _ops(log, "ab|c||de|f")
    run_overlapped(ops, ("A", "B"), ("batch A", "batch B"), delta)
    for state, batch in (("A", "batch A"), ("B", "batch B")):
        mine = [(name, b) for s, name, b in log if s == state]
        assert mine == [(c, batch) for c in "abcdef"]  # each once, in order, with its own batch
    # the switches: stage i of A, then stage i - delta of B
    expected = []
    split = ["ab", "c", "", "de", "f"]
    for i in range(len(split) + delta):
        if i < len(split):
            expected += [("A", c) for c in split[i]]
        if i >= delta:
            expected += [("B", c) for c in split[i - delta]]
    assert [(s, name) for s, name, _ in log] == expected


def test_plain_execution_ignores_the_markers():
    log: list = []
    run(_ops(log, "a|b||c"), "S", None)
    assert [name for _, name, _ in log] == ["a", "b", "c"]
    assert [len(s) for s in stages(_ops([], "a|b||c"))] == [1, 1, 0, 1]


def _batch(mode, lens, starts=None):
    starts = starts or [0] * len(lens)
    seqs = [ScheduledSeq(Req(f"r{i}", list(range(s + n)), SamplingParams()), s, s + n)
            for i, (s, n) in enumerate(zip(starts, lens))]
    return ScheduleBatch(mode, seqs)


def test_decode_splits_the_sequences_in_half():
    split = split_batch(_batch(ForwardMode.DECODE, [1] * 5), 0.48)
    assert split.sizes == (3, 3, 2, 2) and split.cut is None
    one = split_batch(_batch(ForwardMode.DECODE, [1]), 0.48)
    assert one.sizes == (1, 1, 0, 0) and one.second.mode is ForwardMode.IDLE


def test_prefill_splits_at_the_balancing_boundary_when_it_is_balanced_enough():
    split = split_batch(_batch(ForwardMode.EXTEND, [10, 30, 20, 40]), 0.4)
    assert split.sizes == (40, 2, 60, 2) and split.cut is None  # 40 / 60 (ties: the first): 0.4 >= 0.4


def test_prefill_cuts_a_sequence_below_the_threshold():
    batch = _batch(ForwardMode.EXTEND, [10, 90], starts=[0, 5])
    split = split_batch(batch, 0.48)  # the best boundary gives 10 / 90
    assert split.sizes == (50, 2, 50, 1) and split.cut == 1
    head, tail = split.first.seqs[1], split.second.seqs[0]
    assert (head.start, head.end, tail.start, tail.end) == (5, 45, 45, 95)
    assert not head.completes_fill and tail.completes_fill  # only the second part samples
    whole = split_batch(_batch(ForwardMode.EXTEND, [64]), 0.48)
    assert whole.sizes == (32, 1, 32, 1) and whole.cut == 0


def test_no_batch_gives_two_idle_halves():
    split = split_batch(None, 0.48)
    assert split.sizes == (0, 0, 0, 0)
    assert split.first.mode is split.second.mode is ForwardMode.IDLE
