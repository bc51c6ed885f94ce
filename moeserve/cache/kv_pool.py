"""The MLA latent KV cache: one row per token slot per layer, in the model's dtype or in FP8 with scales."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.config import KV_CACHE_DTYPES, ModelConfig
from moeserve.kernels.fp8 import (
    FP8_BLOCK,
    FP8_DTYPE,
    dequantize_kv_rows,
    per_token_group_quant_fp8_ref,
    quantize_kv_rows,
)

_SCALE_BYTES = 4  # float32
_FILL_CHUNK = 1 << 18  # slots quantized at once by ``fill_normal_``


def _aligned(n: int) -> int:
    """``n`` bytes rounded up to a float32 boundary."""
    return -(-n // _SCALE_BYTES) * _SCALE_BYTES


@dataclass(frozen=True)
class KVLayout:
    """What one token holds in one layer of the pool. The runner's sizing, the planner and the PD
    transfer count ``row_bytes``, never the model dtype (DESIGN §17).

    ``dtype`` the model's (``--kv-cache-dtype auto``): a row is ``L + R (+ I)`` values of it, the
    latent, the rope key and V3.2's index key. ``float8_e4m3fn``: DeepSeek's FlashMLA FP8 layout with
    the rope key in FP8 too, a row of bytes ``[L latent | R rope key | pad to 4 | ceil(L/128) + 1
    float32 scales (latent tiles, rope key) | I index key | pad | 1 float32 scale]``: V3 (L = 512,
    R = 64) takes 596 bytes against 1,152 in BF16 (1.93x the tokens), V3.2 728 against 1,408.
    """

    kv_lora_rank: int
    rope_dim: int
    index_dim: int
    dtype: torch.dtype

    @classmethod
    def for_model(cls, model: ModelConfig, kv_cache_dtype: str, model_dtype: torch.dtype) -> KVLayout:
        """The layout ``--kv-cache-dtype`` asks for (``config.KV_CACHE_DTYPES``), ``auto`` being ``model_dtype``."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} must be one of {', '.join(KV_CACHE_DTYPES)}")
        dtype = model_dtype if kv_cache_dtype == "auto" else FP8_DTYPE
        return cls(model.kv_lora_rank, model.qk_rope_head_dim, model.cache_row_dim - model.kv_cache_dim, dtype)

    @property
    def fp8(self) -> bool:
        return self.dtype == FP8_DTYPE

    @property
    def name(self) -> str:
        """``fp8_e4m3`` or the model dtype's name (``bfloat16``): what a PD pair must agree on."""
        return "fp8_e4m3" if self.fp8 else str(self.dtype).removeprefix("torch.")

    @property
    def kv_dim(self) -> int:
        """Values MLA reads a token: the latent and the rope key."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def num_scales(self) -> int:
        """FP8: float32 scales of MLA's part of a row, one per 128-wide latent tile and the rope key's."""
        return -(-self.kv_lora_rank // FP8_BLOCK) + 1

    @property
    def scales_offset(self) -> int:
        """FP8: the byte where MLA's scales start."""
        return _aligned(self.kv_dim)

    @property
    def index_offset(self) -> int:
        """FP8: the byte where the index key starts."""
        return self.scales_offset + _SCALE_BYTES * self.num_scales

    @property
    def index_scale_offset(self) -> int:
        """FP8: the byte of the index key's float32 scale."""
        return _aligned(self.index_offset + self.index_dim)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token in one layer."""
        if not self.fp8:
            return (self.kv_dim + self.index_dim) * self.dtype.itemsize
        return self.index_scale_offset + _SCALE_BYTES if self.index_dim else self.index_offset


class MLAKVPool:
    """``buffer [layers, slots, row]``: per token, the normalised latent followed by the rope key,
    exactly what absorbed MLA reads, and for DeepSeek-V3.2 the token's index key after them; in the
    model dtype, or as ``layout.row_bytes`` bytes of FP8 values and their scales (``KVLayout``). One
    row per slot holds everything of a token, so whatever moves, caches or counts slots (PD
    transfer, prefix cache, retraction, the planner) carries it all.

    The readers get typed views of the buffer, never copies: ``layer`` and ``index_keys`` the
    values (float8_e4m3fn in FP8), ``layer_scales`` and ``index_scales`` their float32 scales (None
    in the model dtype); ``read`` gathers rows dequantized. FP8 rows are written quantized
    (``kernels.fp8.quantize_kv_rows``) and every reader dequantizes the same bytes, so a token gives
    the same keys whether it was computed here, came from the prefix cache or by PD transfer."""

    def __init__(self, layout: KVLayout, num_layers: int, num_slots: int, device: torch.device | str) -> None:
        self.layout = layout
        self.kv_lora_rank, self.kv_dim = layout.kv_lora_rank, layout.kv_dim
        self._scales = self._index_scales = None
        if not layout.fp8:
            self.buffer = torch.zeros(num_layers, num_slots, layout.kv_dim + layout.index_dim, dtype=layout.dtype,
                                      device=device)
            self._values, self._index = self.buffer[..., :self.kv_dim], self.buffer[..., self.kv_dim:]
            return
        self.buffer = torch.zeros(num_layers, num_slots, layout.row_bytes, dtype=torch.uint8, device=device)
        values = self.buffer.view(FP8_DTYPE)
        self._values = values[..., :self.kv_dim]  # [layers, slots, L + R]
        self._scales = self._floats(layout.scales_offset, layout.num_scales)  # [layers, slots, tiles + 1]
        self._index = values[..., layout.index_offset:layout.index_offset + layout.index_dim]  # [layers, slots, I]
        if layout.index_dim:
            self._index_scales = self._floats(layout.index_scale_offset, 1)[..., 0]  # [layers, slots]

    def _floats(self, offset: int, count: int) -> torch.Tensor:
        """The float32 view of ``count`` scales from byte ``offset`` of every row."""
        return self.buffer[..., offset:offset + _SCALE_BYTES * count].view(torch.float32)

    @property
    def num_slots(self) -> int:
        return self.buffer.shape[1]

    def layer(self, layer_id: int) -> torch.Tensor:
        """``[slots, kv_lora_rank + rope_dim]``: what MLA reads (a strided view)."""
        return self._values[layer_id]

    def layer_scales(self, layer_id: int) -> torch.Tensor | None:
        """FP8: ``[slots, ceil(L/128) + 1]`` float32, each row's latent tile scales, then its rope key's."""
        return None if self._scales is None else self._scales[layer_id]

    def index_keys(self, layer_id: int) -> torch.Tensor:
        """``[slots, index_dim]``: the indexer's keys (DeepSeek-V3.2)."""
        return self._index[layer_id]

    def index_scales(self, layer_id: int) -> torch.Tensor | None:
        """FP8: ``[slots]`` float32, each index key's scale."""
        return None if self._index_scales is None else self._index_scales[layer_id]

    def read(self, layer_id: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[S, kv_lora_rank + rope_dim]``: the rows of ``slots [S]`` in ``dtype`` (dequantized in
        FP8; the stored values as they are otherwise)."""
        rows = self._values[layer_id][slots]
        if self._scales is None:
            return rows
        return dequantize_kv_rows(rows, self._scales[layer_id][slots], self.kv_lora_rank, dtype)

    def write(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> None:
        """``loc [T]`` slots; ``latent [T, L]``; ``rope [T, R]``."""
        buf = self._values[layer_id]
        if self._scales is None:
            buf[loc, :self.kv_lora_rank] = latent.to(buf.dtype)
            buf[loc, self.kv_lora_rank:] = rope.to(buf.dtype)
            return
        values, scales = quantize_kv_rows(latent, rope)
        buf[loc] = values
        self._scales[layer_id][loc] = scales

    def write_index(self, layer_id: int, loc: torch.Tensor, keys: torch.Tensor) -> None:
        """``loc [T]`` slots; ``keys [T, index_dim]`` (FP8: one scale a key)."""
        buf = self._index[layer_id]
        if self._index_scales is None:
            buf[loc] = keys.to(buf.dtype)
            return
        values, scales = per_token_group_quant_fp8_ref(keys, keys.shape[-1])
        buf[loc] = values
        self._index_scales[layer_id][loc] = scales[:, 0]

    def fill_normal_(self) -> None:
        """Every slot's latent, rope and index keys drawn from N(0, 1) (stored as FP8 with scales
        where the pool is), for benchmarks that attend over a cache nobody prefilled."""
        if self._scales is None:
            self.buffer.normal_(0, 1)
            return
        layout, device = self.layout, self.buffer.device
        for layer in range(self.buffer.shape[0]):
            for start in range(0, self.num_slots, _FILL_CHUNK):
                loc = torch.arange(start, min(start + _FILL_CHUNK, self.num_slots), device=device)
                self.write(layer, loc, torch.randn(len(loc), layout.kv_lora_rank, device=device),
                           torch.randn(len(loc), layout.rope_dim, device=device))
                if layout.index_dim:
                    self.write_index(layer, loc, torch.randn(len(loc), layout.index_dim, device=device))


def kv_capacity_tokens(budget_bytes: int, num_layers: int, layout: KVLayout) -> int:
    """How many token slots a byte budget holds."""
    return max(budget_bytes // (num_layers * layout.row_bytes), 0)
