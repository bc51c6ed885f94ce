"""The MLA latent KV cache: one row per token slot per layer."""

from __future__ import annotations

import torch


class MLAKVPool:
    """``buffer [layers, slots, kv_lora_rank + qk_rope_head_dim]``: the normalised latent
    followed by the rope key, exactly what absorbed MLA reads."""

    def __init__(self, num_layers: int, num_slots: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.kv_lora_rank = kv_lora_rank
        self.buffer = torch.zeros(num_layers, num_slots, kv_lora_rank + rope_dim, dtype=dtype, device=device)

    @property
    def num_slots(self) -> int:
        return self.buffer.shape[1]

    def layer(self, layer_id: int) -> torch.Tensor:
        return self.buffer[layer_id]

    def write(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor) -> None:
        """``loc [T]`` slots; ``latent [T, L]``; ``rope [T, R]``."""
        buf = self.buffer[layer_id]
        buf[loc, :self.kv_lora_rank] = latent.to(buf.dtype)
        buf[loc, self.kv_lora_rank:] = rope.to(buf.dtype)


def kv_capacity_tokens(budget_bytes: int, num_layers: int, kv_dim: int, dtype: torch.dtype) -> int:
    """How many token slots a byte budget holds."""
    per_token = num_layers * kv_dim * torch.empty((), dtype=dtype).element_size()
    return max(budget_bytes // per_token, 0)
