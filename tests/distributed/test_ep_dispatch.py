"""Expert-parallel dispatchers against the single-process engine (LocalDispatcher + Experts).

Multi-rank tests spawn real gloo worlds (``ep_workers``); each world runs several checks, since
spawning costs seconds. The in-process tests cover a group of one, the factory and the
low-latency mode's freedom from host synchronisation.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from moeserve.distributed.dispatcher import LocalDispatcher, MaskedDispatchOutput, make_dispatcher
from moeserve.distributed.ep_dispatch import TorchLowLatencyDispatcher, TorchNormalDispatcher
from moeserve.distributed.groups import Group
from tests.distributed import ep_workers as w

ONE = Group(None, 0, 1, [0])


@pytest.mark.parametrize(
    ("world_size", "num_experts", "top_k", "rounds"),
    [
        (2, 8, 2, [[5, 0], [7, 7], [0, 0]]),
        (4, 12, 3, [[5, 0, 9, 3], [9, 9, 1, 0]]),
    ],
)
def test_dispatch_matches_single_process(world_size, num_experts, top_k, rounds):
    """Per rank, for uneven token counts (idle ranks too; capacity 9): normal (alignment 1 and 4)
    and low-latency outputs equal the reference, layouts hold exactly the expected rows, the a/b
    halves equal the one-shot calls; then T > capacity raises on every rank."""
    w.run_world(world_size, w.check_world, num_experts, top_k, rounds, 9)


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_group_of_one_matches_local(mode):
    p = w.make_problem(8, 2, [6], seed=0)
    experts = w.make_experts(p.w13, p.w2)
    dispatcher = make_dispatcher(mode, ONE, 8, 8)
    recv, handle = dispatcher.dispatch(p.hidden[0], p.topk_ids[0], p.topk_weights[0])
    assert isinstance(recv, MaskedDispatchOutput) == (mode == "low_latency")
    w.close(dispatcher.combine(experts(recv), handle), w.reference(p, 0), mode)


def test_factory():
    assert isinstance(make_dispatcher("none", ONE, 8, 8), LocalDispatcher)
    assert isinstance(make_dispatcher("normal", ONE, 8, 8, alignment=128), TorchNormalDispatcher)
    assert isinstance(make_dispatcher("low_latency", ONE, 8, 8), TorchLowLatencyDispatcher)
    with pytest.raises(ValueError, match="one rank"):
        make_dispatcher("none", Group(None, 0, 2, [0, 1]), 4, 8)
    with pytest.raises(ValueError, match="unknown dispatch mode"):
        make_dispatcher("auto", ONE, 8, 8)


def test_local_dispatcher_halves_match_one_shot():
    p = w.make_problem(8, 2, [5], seed=1)
    experts, dispatcher = w.make_experts(p.w13, p.w2), LocalDispatcher(8)
    recv, handle = dispatcher.dispatch_b(dispatcher.dispatch_a(p.hidden[0], p.topk_ids[0], p.topk_weights[0]))
    out = dispatcher.combine_b(dispatcher.combine_a(experts(recv), handle))
    assert torch.equal(out, w.reference(p, 0))


def _ll_step(dispatcher, experts, hidden, topk_ids, topk_weights):
    recv, handle = dispatcher.dispatch(hidden, topk_ids, topk_weights)
    return dispatcher.combine(experts(recv), handle)


def test_low_latency_needs_no_host_sync():
    """Fake tensors carry shapes but no data: any ``.item()``, ``.tolist()`` or data-dependent
    shape raises. The low-latency path runs through; the normal path (which syncs) does not."""
    p = w.make_problem(8, 2, [6], seed=2)
    experts = w.make_experts(p.w13, p.w2)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        args = [mode.from_tensor(t) for t in (p.hidden[0], p.topk_ids[0], p.topk_weights[0])]
        out = _ll_step(TorchLowLatencyDispatcher(ONE, 8, 8), experts, *args)
        assert out.shape == (6, w.DIM)
        with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
            _ll_step(TorchNormalDispatcher(ONE, 8), experts, *args)
