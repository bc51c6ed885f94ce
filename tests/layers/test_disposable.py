"""DisposableTensor: freed at once whatever refers to it, loud when used after, plain otherwise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeserve.layers.disposable import DisposableTensor, disposal_enabled, dispose, is_disposed


def _wrapped(label: str = "x", device: str = "cpu") -> tuple[DisposableTensor, torch.Tensor]:
    """A fresh ``[4, 6]`` DisposableTensor and a plain copy of its values."""
    values = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)).to(device)
    t = DisposableTensor.wrap(values.clone(), label)
    assert isinstance(t, DisposableTensor)
    return t, values


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def test_ops_compute_as_on_plain_tensors_and_return_plain_tensors():
    t, values = _wrapped()
    for got, want in [(t + 1, values + 1), (t @ t.T, values @ values.T), (torch.cat([t, t]), torch.cat([values] * 2)),
                      (t.float().sum(0), values.sum(0)), (t.t().contiguous(), values.t().contiguous())]:
        assert type(got) is torch.Tensor
        assert torch.equal(got, want)
    assert type(t.topk(2, dim=1).values) is torch.Tensor
    assert t.add_(0) is t  # in place: the same tensor


def test_views_share_the_wrappers_fate_and_copies_do_not():
    t, values = _wrapped()
    views = [t[1:], t.view(24), t.reshape(2, 12), t.t(), *t.split(2)]
    copies = [t.t().reshape(24), t.clone(), t[torch.tensor([0, 2])]]
    assert all(isinstance(v, DisposableTensor) for v in views)
    assert all(type(c) is torch.Tensor for c in copies)
    assert torch.equal(views[0], values[1:])
    dispose(views[0])  # through a view: the storage, so the wrapper and every view, goes
    assert t.is_disposed and all(is_disposed(v) for v in views)
    assert not any(is_disposed(c) for c in copies) and torch.equal(copies[1], values)


def test_dispose_frees_the_storage_while_references_remain():
    t, _ = _wrapped()
    other_ref = t
    assert _nbytes(t) == 4 * 6 * 4
    assert dispose(t) and is_disposed(other_ref)
    assert _nbytes(other_ref) == 0
    assert t.shape == (4, 6) and t.dtype == torch.float32 and t.device.type == "cpu"  # metadata stays
    assert dispose(t)  # again: nothing more to do


@pytest.mark.parametrize("use", [
    lambda t: t + 1, lambda t: t.sum(), lambda t: t[0], lambda t: t.__setitem__(0, 1.0), lambda t: repr(t),
    lambda t: f"{t}", lambda t: t.tolist(), lambda t: t.data_ptr(), lambda t: torch.cat([t, t]),
    lambda t: torch.zeros(4, 6).copy_(t), lambda t: t[1:].float(),
])
def test_any_use_after_dispose_raises_naming_the_tensor(use):
    t, _ = _wrapped("layer 3 MoE input")
    view = t[1:]
    t.dispose()
    for target in (t, view):
        with pytest.raises(RuntimeError, match="'layer 3 MoE input' was disposed"):
            use(target)


def test_inference_mode():
    with torch.inference_mode():
        t, values = _wrapped()
        assert t.is_inference()
        assert torch.equal(t * 2, values * 2)
        assert dispose(t) and _nbytes(t) == 0
        with pytest.raises(RuntimeError, match="disposed"):
            t * 2


def test_dispose_leaves_plain_tensors_and_kept_aliases_alone():
    plain = torch.ones(3)
    assert not dispose(plain) and not dispose(None) and not is_disposed(plain)
    assert _nbytes(plain) == 12
    t, values = _wrapped()
    alias = t.reshape(24)  # what the caller still needs shares t's bytes: t stays
    assert not dispose(t, keep=(None, torch.zeros(2), alias))
    assert torch.equal(t, values)
    assert dispose(t, keep=(torch.zeros(2),))


def test_wrap_takes_over_only_tensors_that_own_their_storage():
    base = torch.arange(10.0)
    for not_owner in (base[2:], base[:5], base.expand(3, 10), torch.from_numpy(np.arange(4.0))):
        t = DisposableTensor.wrap(not_owner, "window")
        assert type(t) is torch.Tensor and t is not_owner  # plain, so dispose leaves it alone
        assert not dispose(t)
    assert torch.equal(base, torch.arange(10.0))
    t, _ = _wrapped()
    assert DisposableTensor.wrap(t, "again") is t
    empty = DisposableTensor.wrap(torch.empty(0, 8), "empty")
    assert type(empty + 1) is torch.Tensor  # an empty storage has no views to follow
    assert dispose(empty)


def test_disposal_can_be_switched_off_for_a_reference_run():
    t, values = _wrapped()
    with disposal_enabled(False):
        assert not dispose(t) and not t.is_disposed
    assert torch.equal(t, values)
    assert dispose(t)


@pytest.mark.gpu
def test_dispose_returns_cuda_memory_at_once():
    big = DisposableTensor.wrap(torch.empty(64, 1 << 20, dtype=torch.bfloat16, device="cuda"), "big")
    still_referenced = [big, big[1:]]
    before = torch.cuda.memory_allocated()
    dispose(big)
    assert before - torch.cuda.memory_allocated() == 64 << 21
    assert all(is_disposed(x) for x in still_referenced)


@pytest.mark.gpu
def test_dispose_is_a_no_op_while_a_cuda_graph_captures():
    t, values = _wrapped(device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = t * 2
        assert not dispose(t) and _nbytes(t) == 4 * 6 * 4
    graph.replay()
    torch.testing.assert_close(out, values * 2)
    assert dispose(t)  # after the capture it frees as usual
