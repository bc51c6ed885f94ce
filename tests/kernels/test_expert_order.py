"""The MoE dispatch's layout step (``kernels/expert_order.py``): the torch version against a plain
stable sort, its errors, and that the public function runs the Triton kernel on CUDA (the kernel
itself is checked through the interpreter and on the GPU in ``test_triton_elementwise.py``)."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.expert_order import TRITON_MAX_ROWS, expert_order


def test_rows_grouped_by_expert_keep_their_order_within_an_expert():
    ids = torch.tensor([3, 0, 3, 1, 0, 3])
    out = expert_order(ids, 5)
    assert out.order.tolist() == [1, 4, 3, 0, 2, 5]
    assert out.position.tolist() == [3, 0, 4, 2, 1, 5]
    assert out.counts.tolist() == [2, 1, 0, 3, 0]
    assert out.seg_indptr.tolist() == [0, 2, 3, 3, 6, 6]


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="1-D"):
        expert_order(torch.zeros(2, 3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="int32 or int64"):
        expert_order(torch.zeros(3), 4)
    with pytest.raises(ValueError, match="num_experts"):
        expert_order(torch.zeros(3, dtype=torch.int64), 0)


@pytest.mark.gpu
def test_cuda_calls_run_the_kernel_up_to_its_size_and_sort_past_it():
    from moeserve.kernels.backend import kernel_backend

    for n in (TRITON_MAX_ROWS, TRITON_MAX_ROWS + 1):
        ids = torch.randint(0, 288, (n,), device="cuda")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fast = expert_order(ids, 288)
            torch.cuda.synchronize()
        names = " ".join(e.key for e in prof.key_averages())
        assert ("_expert_order_kernel" in names) == (n <= TRITON_MAX_ROWS), names
        with kernel_backend("torch"):
            slow = expert_order(ids, 288)
        for a, b in zip((fast.order, fast.position, fast.seg_indptr, fast.counts),
                        (slow.order, slow.position, slow.seg_indptr, slow.counts)):
            assert torch.equal(a, b)
