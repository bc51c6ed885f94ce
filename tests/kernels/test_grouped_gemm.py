"""Torch references of the grouped expert GEMMs and the FP8 block-scaled linear, against
per-row loops over dequantized operands in float64."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.fp8 import (
    block_quant_fp8,
    fp8_block_gemm,
    fp8_block_gemm_ref,
    per_token_group_quant_fp8,
)
from moeserve.kernels.grouped_gemm import (
    grouped_gemm_contiguous,
    grouped_gemm_contiguous_ref,
    grouped_gemm_masked,
    grouped_gemm_masked_ref,
)


def _seg_indptr(counts: list[int]) -> torch.Tensor:
    return torch.tensor([0, *counts]).cumsum(0)


def _quant_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [E, N, K]`` -> per-expert 128x128 block quantization, stacked."""
    qs, ss = zip(*(block_quant_fp8(w[e]) for e in range(w.shape[0])))
    return torch.stack(qs), torch.stack(ss)


def _dequant_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``q [..., K]`` fp8 with ``s [..., ceil(K/128)]`` -> float64, one group at a time."""
    return q.double() * s.double().repeat_interleave(128, -1)[..., : q.shape[-1]]


def _dequant_block(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``q [N, K]`` fp8 with ``s [ceil(N/128), ceil(K/128)]`` -> float64."""
    n, k = q.shape
    return q.double() * s.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def _rowwise_reference(x: torch.Tensor, w: torch.Tensor, seg: torch.Tensor) -> torch.Tensor:
    """Row ``r`` of segment ``e`` is ``x[r] @ w[e].T``; every other row is zero (float64)."""
    out = torch.zeros(x.shape[0], w.shape[1], dtype=torch.float64)
    for e in range(w.shape[0]):
        for r in range(int(seg[e]), int(seg[e + 1])):
            out[r] = x[r].double() @ w[e].double().t()
    return out


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def test_contiguous_float_uneven_segments_and_padding() -> None:
    torch.manual_seed(0)
    counts = [3, 0, 17, 1, 0, 9]  # zero-row experts and segments of no particular alignment
    seg = _seg_indptr(counts)
    m = int(seg[-1]) + 5  # five padding rows
    x, w = torch.randn(m, 40), torch.randn(len(counts), 24, 40)

    out = grouped_gemm_contiguous(x, w, seg)
    assert out.shape == (m, 24) and out.dtype == torch.float32
    assert _rel(out, _rowwise_reference(x, w, seg)) < 1e-6
    assert (out[int(seg[-1]):] == 0).all()


def test_contiguous_keeps_input_dtype_and_takes_out_dtype() -> None:
    seg = _seg_indptr([2, 3])
    x, w = torch.randn(6, 16, dtype=torch.bfloat16), torch.randn(2, 8, 16, dtype=torch.bfloat16)
    assert grouped_gemm_contiguous(x, w, seg).dtype == torch.bfloat16
    assert grouped_gemm_contiguous(x, w, seg, out_dtype=torch.float32).dtype == torch.float32


def test_contiguous_fp8_matches_dequantized_operands() -> None:
    torch.manual_seed(1)
    counts = [5, 0, 12, 2]
    seg = _seg_indptr(counts)
    m, n, k = int(seg[-1]) + 3, 200, 300  # partial 128-blocks in N and K
    xq, xs = per_token_group_quant_fp8(torch.randn(m, k))
    wq, ws = _quant_experts(torch.randn(len(counts), n, k) * 0.05)

    out = grouped_gemm_contiguous_ref(xq, wq, seg, xs, ws, out_dtype=torch.float32)
    w_deq = torch.stack([_dequant_block(wq[e], ws[e]) for e in range(len(counts))])
    assert _rel(out, _rowwise_reference(_dequant_rows(xq, xs), w_deq, seg)) < 1e-6
    assert grouped_gemm_contiguous(xq, wq, seg, xs, ws).dtype == torch.bfloat16  # the fp8 default


def test_masked_rows_past_masked_m_are_zero() -> None:
    torch.manual_seed(2)
    num_e, m_max = 4, 9
    x, w = torch.randn(num_e, m_max, 32), torch.randn(num_e, 16, 32)
    masked_m = torch.tensor([0, 9, 4, 1], dtype=torch.int32)  # empty, full and partial experts

    out = grouped_gemm_masked(x, w, masked_m)
    assert out.shape == (num_e, m_max, 16)
    for e in range(num_e):
        rows = int(masked_m[e])
        torch.testing.assert_close(out[e, :rows], x[e, :rows] @ w[e].t())
        assert (out[e, rows:] == 0).all()


def test_masked_fp8_matches_dequantized_operands() -> None:
    torch.manual_seed(3)
    num_e, m_max, n, k = 3, 6, 136, 260
    xq, xs = per_token_group_quant_fp8(torch.randn(num_e, m_max, k))
    wq, ws = _quant_experts(torch.randn(num_e, n, k) * 0.05)
    masked_m = torch.tensor([6, 0, 2])

    out = grouped_gemm_masked_ref(xq, wq, masked_m, xs, ws, out_dtype=torch.float32)
    x_deq = _dequant_rows(xq, xs)
    for e in range(num_e):
        rows = int(masked_m[e])
        ref = x_deq[e, :rows] @ _dequant_block(wq[e], ws[e]).t()
        if rows:
            assert _rel(out[e, :rows], ref) < 1e-6
        assert (out[e, rows:] == 0).all()


@pytest.mark.parametrize("call", ["contiguous", "masked"])
def test_fp8_operands_need_both_scales(call: str) -> None:
    wq, _ws = _quant_experts(torch.randn(2, 8, 16))
    if call == "contiguous":
        xq, xs = per_token_group_quant_fp8(torch.randn(4, 16))
        fn = lambda *a: grouped_gemm_contiguous(xq, wq, _seg_indptr([2, 2]), *a)
    else:
        xq, xs = per_token_group_quant_fp8(torch.randn(2, 4, 16))
        fn = lambda *a: grouped_gemm_masked(xq, wq, torch.tensor([1, 2]), *a)
    with pytest.raises(ValueError, match="scale"):
        fn(xs, None)
    with pytest.raises(ValueError, match="scale"):
        fn()


@pytest.mark.parametrize("shape", [(5, 200, 300), (1, 128, 128), (130, 7, 129)])
def test_fp8_block_gemm_matches_dequantized_operands(shape: tuple[int, int, int]) -> None:
    torch.manual_seed(4)
    m, n, k = shape
    xq, xs = per_token_group_quant_fp8(torch.randn(m, k))
    wq, ws = block_quant_fp8(torch.randn(n, k) * 0.05)

    out = fp8_block_gemm(xq, xs, wq, ws, out_dtype=torch.float32)
    assert out.shape == (m, n)
    assert _rel(out, _dequant_rows(xq, xs) @ _dequant_block(wq, ws).t()) < 1e-6
    assert fp8_block_gemm_ref(xq, xs, wq, ws).dtype == torch.bfloat16


def test_fp8_block_gemm_wants_2d() -> None:
    xq, xs = per_token_group_quant_fp8(torch.randn(2, 3, 128))
    wq, ws = block_quant_fp8(torch.randn(8, 128))
    with pytest.raises(ValueError, match="2-D"):
        fp8_block_gemm(xq, xs, wq, ws)
