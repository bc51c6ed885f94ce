"""Two-batch overlap changes how a step runs, never what it computes: greedy tokens with
``--enable-two-batch-overlap`` equal the single-process engine's in every layout of the layout
tests (gloo, real processes), with prefills whose split cuts a sequence, steps below the token
threshold that run whole, and DP groups that run two idle halves."""

from __future__ import annotations

import pytest

from tests.distributed.layouts import greedy_tokens
from tests.distributed.test_layouts import LAYOUTS

# every step overlaps (prefill chunks of one sequence are cut in two), or only steps of 20 tokens
# and more (decode steps of these requests run whole)
OVERLAP = {"enable_two_batch_overlap": True, "tbo_min_tokens": 2}
SOME = {"enable_two_batch_overlap": True, "tbo_min_tokens": 20}


@pytest.mark.parametrize("name", ["single", *LAYOUTS])
def test_overlap_matches_single_process(layout_model, layout_reference, name):
    layout = LAYOUTS.get(name, {})
    assert greedy_tokens(layout_model, **layout, **OVERLAP) == layout_reference


@pytest.mark.parametrize("name", ["single", "tp4-dp4-auto-dense1"])
def test_steps_below_the_threshold_run_whole(layout_model, layout_reference, name):
    assert greedy_tokens(layout_model, **LAYOUTS.get(name, {}), **SOME) == layout_reference
