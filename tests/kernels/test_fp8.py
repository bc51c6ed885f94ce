"""FP8 block / token-group quantization against a per-block fp32 loop and e4m3's error bound."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels.fp8 import (
    FP8_MAX,
    block_dequant_fp8,
    block_quant_fp8,
    per_token_group_dequant_fp8,
    per_token_group_quant_fp8,
)

# e4m3 keeps 3 mantissa bits: round-to-nearest is off by at most 2^-4 of the value for normal
# numbers, and by at most half the smallest subnormal step (2^-9 units of the scale) below them.
REL_BOUND = 2.0**-4
SUBNORMAL_HALF_STEP = 2.0**-10


def _reference_block_quant(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One block at a time in fp32, the way DeepSeek's ``weight_dequant`` reads it back."""
    n, k = w.shape
    scales = torch.empty(-(-n // bn), -(-k // bk))
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float()
            s = max(blk.abs().max().item(), 1e-10) / FP8_MAX
            scales[i, j] = s
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / torch.tensor(s)).to(torch.float8_e4m3fn)
    return q, scales


def _assert_within_e4m3(x: torch.Tensor, x_hat: torch.Tensor, scale: torch.Tensor) -> None:
    """Element-wise ``|x_hat - x| <= |x| / 16 + scale * 2^-10``, with ``scale`` broadcast to x."""
    bound = x.abs() * REL_BOUND + scale * SUBNORMAL_HALF_STEP + 1e-12
    assert ((x_hat - x).abs() <= bound).all()


def _expand_block_scale(scale_inv: torch.Tensor, shape: torch.Size, bn: int, bk: int) -> torch.Tensor:
    return scale_inv.repeat_interleave(bn, 0)[: shape[0]].repeat_interleave(bk, 1)[:, : shape[1]]


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (64, 48), (576, 130), (1, 1)])
@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_block_quant_matches_reference(shape: tuple[int, int], block: tuple[int, int]) -> None:
    torch.manual_seed(0)
    w = torch.randn(shape) * torch.logspace(-3, 1, shape[1])  # columns spanning 4 decades
    q, s = block_quant_fp8(w, block)
    q_ref, s_ref = _reference_block_quant(w, *block)

    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    # A scale one ulp off may flip a rounding, so compare values and allow a rare off-by-one.
    assert (q.float() != q_ref.float()).float().mean() < 1e-3


@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (576, 7), (129, 257)])
def test_block_round_trip_error_bound(shape: tuple[int, int]) -> None:
    torch.manual_seed(1)
    bn, bk = 128, 128
    w = torch.randn(shape, dtype=torch.bfloat16) * 0.02
    q, s = block_quant_fp8(w, (bn, bk))
    w_hat = block_dequant_fp8(q, s, (bn, bk))
    wf = w.float()

    _assert_within_e4m3(wf, w_hat, _expand_block_scale(s, w.shape, bn, bk))
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk, blk_hat = wf[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk], w_hat[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            assert (blk_hat - blk).norm() <= REL_BOUND * blk.norm()
    assert block_dequant_fp8(q, s, (bn, bk), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_block_amax_is_exact() -> None:
    """The largest element of each block maps to ±448 and comes back exactly."""
    w = torch.randn(130, 260)
    q, s = block_quant_fp8(w)
    w_hat = block_dequant_fp8(q, s)
    i, j = divmod(w[:128, :128].abs().argmax().item(), 128)
    assert q[i, j].float().abs() == FP8_MAX
    torch.testing.assert_close(w_hat[i, j], w[i, j], rtol=1e-6, atol=0)


def test_zero_blocks() -> None:
    w = torch.zeros(200, 300)
    w[:128, :128] = torch.randn(128, 128)  # one live block; the five others stay zero
    q, s = block_quant_fp8(w)
    w_hat = block_dequant_fp8(q, s)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert not q.float().isnan().any()
    assert (w_hat[128:] == 0).all() and (w_hat[:, 128:] == 0).all()
    _assert_within_e4m3(w, w_hat, _expand_block_scale(s, w.shape, 128, 128))


def test_block_dequant_rejects_wrong_scale_shape() -> None:
    q, s = block_quant_fp8(torch.randn(200, 300))
    with pytest.raises(ValueError, match="scale_inv"):
        block_dequant_fp8(q, s[:1])


@pytest.mark.parametrize("shape", [(4, 256), (2, 3, 200), (5, 7), (1, 129)])
@pytest.mark.parametrize("group_size", [128, 64])
def test_per_token_group_round_trip(shape: tuple[int, ...], group_size: int) -> None:
    torch.manual_seed(2)
    x = torch.randn(shape) * 3
    x[..., :3] *= 1e-4  # small values share a group with large ones
    q, s = per_token_group_quant_fp8(x, group_size)
    n_groups = -(-shape[-1] // group_size)

    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == (*shape[:-1], n_groups)
    amax = torch.stack([g.abs().amax(-1) for g in x.split(group_size, dim=-1)], dim=-1)
    torch.testing.assert_close(s, amax / FP8_MAX, rtol=1e-6, atol=0)

    x_hat = per_token_group_dequant_fp8(q, s, group_size)
    scale = s.repeat_interleave(group_size, dim=-1)[..., : shape[-1]]
    _assert_within_e4m3(x, x_hat, scale)


def test_per_token_group_zero_rows() -> None:
    x = torch.zeros(3, 200)
    x[1] = torch.randn(200)
    q, s = per_token_group_quant_fp8(x)
    x_hat = per_token_group_dequant_fp8(q, s)
    assert torch.isfinite(s).all()
    assert (x_hat[0] == 0).all() and (x_hat[2] == 0).all()
    assert (x_hat[1] - x[1]).norm() <= REL_BOUND * x[1].norm()
