"""The KV pool's layouts: the bytes a token takes, the typed views the kernels read, and what a write
stores (the model dtype's values unchanged; FP8 values with their scales)."""

from __future__ import annotations

import pytest
import torch

from moeserve.cache import KVLayout, MLAKVPool, kv_capacity_tokens
from moeserve.kernels.fp8 import dequantize_kv_rows, per_token_group_dequant_fp8
from moeserve.planner import preset_config

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize(("preset", "auto_bytes", "fp8_bytes"), [("dsv3", 1152, 596), ("dsv32", 1408, 728)])
def test_a_deepseek_token_takes_596_bytes_a_layer_in_fp8(preset: str, auto_bytes: int, fp8_bytes: int) -> None:
    """V3: 512 + 64 FP8 values and 5 float32 scales against 576 BF16 values; V3.2 adds its index key,
    128 FP8 values and a scale against 128 BF16 values."""
    model = preset_config(preset)
    auto = KVLayout.for_model(model, "auto", torch.bfloat16)
    fp8, alias = (KVLayout.for_model(model, name, torch.bfloat16) for name in ("fp8_e4m3", "fp8"))
    assert (auto.row_bytes, fp8.row_bytes, alias) == (auto_bytes, fp8_bytes, fp8)
    assert (auto.name, fp8.name) == ("bfloat16", "fp8_e4m3")
    budget = 10 * 2**30
    tokens = [kv_capacity_tokens(budget, model.num_layers, layout) for layout in (auto, fp8)]
    assert tokens == [budget // (model.num_layers * auto_bytes), budget // (model.num_layers * fp8_bytes)]
    assert tokens[1] / tokens[0] == pytest.approx(auto_bytes / fp8_bytes, rel=1e-4)  # 1.93x for V3
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVLayout.for_model(model, "fp8_e5m2", torch.bfloat16)


def test_fp8_rows_keep_every_float32_field_aligned() -> None:
    for latent, rope, index in [(512, 64, 0), (512, 64, 128), (32, 16, 0), (24, 6, 24), (160, 8, 7)]:
        layout = KVLayout(latent, rope, index, FP8)
        assert layout.scales_offset % 4 == layout.index_scale_offset % 4 == layout.row_bytes % 4 == 0
        assert layout.scales_offset >= latent + rope and layout.num_scales == -(-latent // 128) + 1
        assert layout.row_bytes <= latent + rope + index + 4 * (layout.num_scales + 1) + 6  # at most 2 pads of 3


def test_the_model_dtype_pool_stores_the_values_as_they_are() -> None:
    pool = MLAKVPool(KVLayout(32, 16, 8, torch.bfloat16), 2, 10, "cpu")
    assert pool.buffer.shape == (2, 10, 56) and pool.buffer.dtype == torch.bfloat16
    loc = torch.tensor([3, 7])
    latent, rope, keys = torch.randn(2, 32), torch.randn(2, 16), torch.randn(2, 8)
    pool.write(1, loc, latent, rope)
    pool.write_index(1, loc, keys)
    assert torch.equal(pool.buffer[1, loc], torch.cat([latent, rope, keys], -1).bfloat16())
    assert torch.equal(pool.read(1, loc, torch.float32), pool.layer(1)[loc])  # no cast: the stored values
    assert pool.layer_scales(1) is None and pool.index_scales(1) is None
    assert (pool.buffer[0] == 0).all()


def test_the_fp8_pool_stores_values_and_scales_in_one_row_of_bytes() -> None:
    layout = KVLayout(160, 8, 24, FP8)
    pool = MLAKVPool(layout, 2, 10, "cpu")
    assert pool.buffer.shape == (2, 10, layout.row_bytes) and pool.buffer.dtype == torch.uint8
    loc = torch.tensor([8, 2, 5])
    latent, rope, keys = torch.randn(3, 160) * 7, torch.randn(3, 8) / 3, torch.randn(3, 24) * 50
    pool.write(1, loc, latent, rope)
    pool.write_index(1, loc, keys)
    views = (pool.layer(1), pool.layer_scales(1), pool.index_keys(1), pool.index_scales(1))
    base, end = pool.buffer.data_ptr(), pool.buffer.data_ptr() + pool.buffer.numel()
    assert all(base <= v.data_ptr() < end for v in views), "views of the buffer, not copies"
    values, scales, index, index_scales = views
    assert (values.dtype, values.shape, scales.dtype, scales.shape) == (FP8, (10, 168), torch.float32, (10, 3))
    assert (index.shape, index_scales.shape) == ((10, 24), (10,))
    got = pool.read(1, loc, torch.float32)
    assert torch.equal(got, dequantize_kv_rows(values[loc], scales[loc], 160, torch.float32))
    assert (got - torch.cat([latent, rope], -1)).abs().max() <= 2**-4 * torch.cat([latent, rope], -1).abs().max()
    back = per_token_group_dequant_fp8(index[loc], index_scales[loc, None], 24)
    assert (back - keys).abs().max() <= 2**-4 * keys.abs().max()
    assert (pool.buffer[0] == 0).all() and (pool.buffer[1, [0, 1, 3, 4, 6, 7, 9]] == 0).all()


def test_fill_normal_gives_finite_keys_everywhere() -> None:
    pool = MLAKVPool(KVLayout(32, 16, 8, FP8), 2, 300, "cpu")
    pool.fill_normal_()
    rows = pool.read(1, torch.arange(300), torch.float32)
    assert torch.isfinite(rows).all() and 0.5 < rows.std() < 1.5
    assert torch.isfinite(pool.index_keys(0).float()).all() and (pool.index_scales(0) > 0).all()

