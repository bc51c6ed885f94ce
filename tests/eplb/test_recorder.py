"""The expert distribution recorder: what it counts, and what it leaves out."""

from __future__ import annotations

import torch

from moeserve.eplb.recorder import ExpertRecorder, gpu_balancedness


def _ids(*rows):
    return torch.tensor(rows, dtype=torch.int64)


def test_counts_only_while_recording_and_never_padding_rows():
    rec = ExpertRecorder("stat", num_layers=2, num_logical=4, num_physical=6, window=3, device="cpu")
    rec.record(1, _ids([0, 1]), _ids([0, 1]))
    rec.end_pass(True)
    assert rec.totals()[0].sum() == 0  # not recording yet
    rec.start()
    rec.valid.fill_(2)  # a graph bucket of 3 rows, 2 of them real
    rec.record(1, _ids([0, 1], [2, 0], [3, 3]), _ids([0, 5], [2, 4], [3, 3]))
    rec.end_pass(False)
    logical, physical = rec.totals()
    assert logical[1].tolist() == [2, 1, 1, 0] and logical[0].sum() == 0
    assert physical[1].tolist() == [1, 0, 1, 0, 1, 1]
    rec.stop()
    rec.record(1, _ids([0, 1]), _ids([0, 1]))
    rec.end_pass(False)
    assert rec.totals()[0][1].tolist() == [2, 1, 1, 0]


def test_stat_keeps_a_window_of_the_last_passes():
    rec = ExpertRecorder("stat", 1, 2, 2, window=2, device="cpu")
    rec.start()
    for expert in (0, 1, 1):
        rec.record(0, _ids([expert]), _ids([expert]))
        rec.end_pass(False)
    assert rec.totals()[0].tolist() == [[0, 2]]  # the first pass fell out of the window
    assert rec.num_passes == 3


def test_per_pass_and_per_token_keep_each_pass():
    per_pass = ExpertRecorder("per_pass", 1, 3, 3, window=1, device="cpu")
    per_token = ExpertRecorder("per_token", 1, 3, 3, window=1, device="cpu")
    for rec in (per_pass, per_token):
        rec.start()
        rec.record(0, _ids([0, 1], [1, 2]), _ids([0, 1], [1, 2]))
        rec.end_pass(True)
        rec.record(0, _ids([2, 1]), _ids([2, 1]))
        rec.end_pass(False)
        assert [p.phase for p in rec.passes] == ["prefill", "decode"]
        assert rec.totals()[0].tolist() == [[1, 3, 2]]
    assert per_token.passes[0].topk_ids[0].tolist() == [[0, 1], [1, 2]]
    assert per_pass.passes[1].logical.tolist() == [[0, 1, 1]]


def test_gpu_balancedness_is_mean_over_max_per_layer():
    physical = torch.tensor([[4, 4, 4, 4], [8, 0, 0, 0], [0, 0, 0, 0]])  # 2 GPUs of 2 slots each
    assert gpu_balancedness(physical, 2) == (1.0 + 0.5) / 2  # the empty layer is left out
