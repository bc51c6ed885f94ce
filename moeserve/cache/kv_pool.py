"""The MLA latent KV cache: one row per token slot per layer."""

from __future__ import annotations

import torch


class MLAKVPool:
    """``buffer [layers, slots, kv_lora_rank + qk_rope_head_dim (+ index_dim)]``: the normalised
    latent followed by the rope key, exactly what absorbed MLA reads, and for DeepSeek-V3.2 the
    token's index key after them. One row per slot holds everything of a token, so whatever moves,
    caches or counts slots (PD transfer, prefix cache, retraction, the planner) carries it all."""

    def __init__(self, num_layers: int, num_slots: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device: torch.device | str, index_dim: int = 0) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.kv_dim = kv_lora_rank + rope_dim
        self.buffer = torch.zeros(num_layers, num_slots, self.kv_dim + index_dim, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.buffer.shape[1]

    def layer(self, layer_id: int) -> torch.Tensor:
        """``[slots, kv_lora_rank + rope_dim]``: what MLA reads (a strided view with index keys)."""
        return self.buffer[layer_id, :, :self.kv_dim]

    def index_keys(self, layer_id: int) -> torch.Tensor:
        """``[slots, index_dim]``: the indexer's keys (DeepSeek-V3.2)."""
        return self.buffer[layer_id, :, self.kv_dim:]

    def write(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> None:
        """``loc [T]`` slots; ``latent [T, L]``; ``rope [T, R]``."""
        buf = self.buffer[layer_id]
        buf[loc, :self.kv_lora_rank] = latent.to(buf.dtype)
        buf[loc, self.kv_lora_rank:self.kv_dim] = rope.to(buf.dtype)

    def write_index(self, layer_id: int, loc: torch.Tensor, keys: torch.Tensor) -> None:
        """``loc [T]`` slots; ``keys [T, index_dim]``."""
        buf = self.buffer[layer_id]
        buf[loc, self.kv_dim:] = keys.to(buf.dtype)


def kv_capacity_tokens(budget_bytes: int, num_layers: int, kv_dim: int, dtype: torch.dtype) -> int:
    """How many token slots a byte budget holds."""
    per_token = num_layers * kv_dim * torch.empty((), dtype=dtype).element_size()
    return max(budget_bytes // per_token, 0)
