"""Roofline of one forward step: the least time a device of given ceilings needs for it.

A step must read the weights it touches and the KV cache it attends over (memory), and do its
matmuls (compute); the roofline time is the larger of ``bytes / copy bandwidth`` and
``flops / matmul rate``. Both terms are reported, so a benchmark can say which one binds.

What is counted (single rank, no parallelism):

- weights: every non-routed weight (attention projections and norms, dense MLPs, shared
  experts, router gates, the final norm, the LM head; the embedding rows a step gathers are
  negligible and left out) plus the routed experts the step activates. Under uniform routing a
  step of ``T`` tokens with ``k`` of ``E`` experts per token activates
  ``E * (1 - (1 - k/E)^T)`` distinct experts per MoE layer; a measured count can replace it.
  FP8 weights (``"fp8"``) are one byte per value plus fp32 scales per 128x128 block for every
  decoder-layer linear (as DeepSeek-V3's checkpoint); router gates, norms, embedding and LM head
  stay bf16, the router's correction bias fp32.
- KV cache: decode reads ``context`` latent rows (``kv_lora_rank + qk_rope_head_dim`` values) per
  sequence per layer and writes one; prefill writes one per prompt token.
- FLOPs: ``2 x`` the linear weights each token multiplies (attention projections with
  ``kv_b_proj`` counted once: absorbed into ``W_UK``/``W_UV`` in decode, expanding the latent in
  prefill; the dense MLP or the router, the shared and the ``k`` routed experts), the LM head for
  one row per sequence, and attention: absorbed MLA in decode,
  ``2 (L + R) ctx + 2 L ctx`` per head per token (scores over latent and rope key, then the
  latent output); plain causal attention over ``qk_head_dim`` keys and ``v_head_dim`` values in
  prefill, ``i`` keys for the ``i``-th prompt token.

Activations, norms' arithmetic, softmax and routing are left out: small next to the above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeserve.bench.kernels import Ceilings
from moeserve.config import EngineConfig, ModelConfig

WEIGHT_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
WEIGHT_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class StepWork:
    """The least work of one forward step: bytes read or written, and FLOPs by kind."""

    weight_bytes: float
    kv_bytes: float
    linear_flops: float  # matmuls against weights (at the weights' matmul rate)
    attention_flops: float  # matmuls against the KV cache (at the activation dtype's rate)
    experts_per_layer: float  # distinct routed experts read per MoE layer

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops


@dataclass(frozen=True)
class Roofline:
    memory_s: float
    compute_s: float

    @property
    def step_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts ``tokens`` tokens activate when each picks ``top_k`` of ``num_experts``
    uniformly: ``E * (1 - (1 - k/E)^T)``."""
    if num_experts == 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def linear_bytes(out_features: int, in_features: int, weight_dtype: str) -> float:
    """One ``[out, in]`` weight; FP8 adds fp32 scales per 128x128 block."""
    values = out_features * in_features * WEIGHT_DTYPES[weight_dtype]
    if weight_dtype != "fp8":
        return values
    return values + 4 * math.ceil(out_features / FP8_BLOCK[0]) * math.ceil(in_features / FP8_BLOCK[1])


def _plain_bytes(weight_dtype: str) -> int:
    """Bytes per value of what FP8 leaves unquantized (norms, router, embedding, LM head)."""
    return 2 if weight_dtype == "fp8" else WEIGHT_DTYPES[weight_dtype]


def attention_linears(m: ModelConfig) -> list[tuple[int, int]]:
    """``(out, in)`` of the MLA projections of one layer."""
    heads = m.num_heads
    q = ([(heads * m.qk_head_dim, m.hidden_size)] if m.q_lora_rank is None
         else [(m.q_lora_rank, m.hidden_size), (heads * m.qk_head_dim, m.q_lora_rank)])
    return q + [(m.kv_cache_dim, m.hidden_size), (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                (m.hidden_size, heads * m.v_head_dim)]


def mlp_linears(hidden: int, intermediate: int) -> list[tuple[int, int]]:
    """gate_proj, up_proj and down_proj."""
    return [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]


def _bytes(linears: list[tuple[int, int]], weight_dtype: str) -> float:
    return sum(linear_bytes(o, i, weight_dtype) for o, i in linears)


def _params(linears: list[tuple[int, int]]) -> int:
    return sum(o * i for o, i in linears)


def _layer_norm_values(m: ModelConfig) -> int:
    """Norm weights of one layer: input, post-attention, the q and kv latent norms."""
    return 2 * m.hidden_size + (m.q_lora_rank or 0) + m.kv_lora_rank


def _num_moe_layers(m: ModelConfig) -> int:
    return sum(m.is_moe_layer(i) for i in range(m.num_layers))


def weight_bytes(m: ModelConfig, weight_dtype: str, experts_per_layer: float) -> float:
    """Weights a step reads: all non-routed ones and ``experts_per_layer`` routed experts per MoE layer."""
    plain = _plain_bytes(weight_dtype)
    moe_layers = _num_moe_layers(m)
    dense_layers = m.num_layers - moe_layers
    per_layer = _bytes(attention_linears(m), weight_dtype) + plain * _layer_norm_values(m)
    total = m.num_layers * per_layer
    total += dense_layers * _bytes(mlp_linears(m.hidden_size, m.intermediate_size), weight_dtype)
    shared = _bytes(mlp_linears(m.hidden_size, m.moe_intermediate_size * m.n_shared_experts), weight_dtype)
    router = plain * m.n_routed_experts * m.hidden_size + (4 * m.n_routed_experts if m.router == "noaux_tc" else 0)
    expert = _bytes(mlp_linears(m.hidden_size, m.moe_intermediate_size), weight_dtype)
    total += moe_layers * ((shared if m.n_shared_experts else 0) + router + experts_per_layer * expert)
    return total + plain * (m.hidden_size + m.vocab_size * m.hidden_size)  # final norm, LM head


def linear_params_per_token(m: ModelConfig) -> int:
    """Weights one token multiplies, the LM head excepted (it runs once per sequence)."""
    moe_layers = _num_moe_layers(m)
    per_layer = _params(attention_linears(m))
    dense = _params(mlp_linears(m.hidden_size, m.intermediate_size))
    routed = m.num_experts_per_tok * _params(mlp_linears(m.hidden_size, m.moe_intermediate_size))
    shared = _params(mlp_linears(m.hidden_size, m.moe_intermediate_size * m.n_shared_experts))
    moe = m.n_routed_experts * m.hidden_size + routed + (shared if m.n_shared_experts else 0)
    return m.num_layers * per_layer + (m.num_layers - moe_layers) * dense + moe_layers * moe


def kv_row_bytes(m: ModelConfig, kv_bytes: int) -> int:
    """One token's cache rows over all layers."""
    return m.num_layers * m.kv_cache_dim * kv_bytes


def decode_work(m: ModelConfig, batch: int, context: int, weight_dtype: str = "bf16", kv_bytes: int = 2,
                experts_per_layer: float | None = None) -> StepWork:
    """One decode step of ``batch`` sequences, each attending over ``context`` cached tokens
    (the new one included)."""
    experts = expected_experts(m.n_routed_experts, m.num_experts_per_tok, batch) \
        if experts_per_layer is None else experts_per_layer
    kv = batch * (context + 1) * kv_row_bytes(m, kv_bytes)  # read the context, write the new row
    linear = 2.0 * batch * (linear_params_per_token(m) + m.vocab_size * m.hidden_size)
    per_head = 2 * m.kv_cache_dim * context + 2 * m.kv_lora_rank * context
    attention = float(m.num_layers * batch * m.num_heads * per_head)
    return StepWork(weight_bytes(m, weight_dtype, experts), kv, linear, attention, experts)


def prefill_work(m: ModelConfig, batch: int, input_len: int, weight_dtype: str = "bf16", kv_bytes: int = 2,
                 experts_per_layer: float | None = None) -> StepWork:
    """Prefill of ``batch`` prompts of ``input_len`` tokens with nothing cached, as one step."""
    tokens = batch * input_len
    experts = expected_experts(m.n_routed_experts, m.num_experts_per_tok, tokens) \
        if experts_per_layer is None else experts_per_layer
    kv = tokens * kv_row_bytes(m, kv_bytes)
    linear = 2.0 * (tokens * linear_params_per_token(m) + batch * m.vocab_size * m.hidden_size)
    causal_pairs = input_len * (input_len + 1) // 2  # (query, key) pairs per sequence
    attention = 2.0 * m.num_layers * batch * m.num_heads * (m.qk_head_dim + m.v_head_dim) * causal_pairs
    return StepWork(weight_bytes(m, weight_dtype, experts), kv, linear, attention, experts)


def engine_dtypes(config: EngineConfig) -> tuple[str, int]:
    """``(weight dtype, KV bytes a value)`` of an engine as the floors count them: ``"fp8"`` with
    FP8 weights, else the compute dtype's name; the cache in the compute dtype."""
    dtype = config.load.torch_dtype(config.model)
    weights = "fp8" if config.load.quantization == "fp8" else WEIGHT_DTYPE_NAMES[dtype]
    return weights, torch.empty((), dtype=dtype).element_size()


def roofline(work: StepWork, ceilings: Ceilings, weight_dtype: str = "bf16") -> Roofline:
    """Time floors of ``work``: bytes at the copy bandwidth; FLOPs at the matmul rates (the linear
    ones at the fp8 rate when weights are FP8, attention at the bf16 rate)."""
    linear_rate = ceilings.fp8_tflops if weight_dtype == "fp8" else ceilings.bf16_tflops
    compute = work.linear_flops / (linear_rate * 1e12) + work.attention_flops / (ceilings.bf16_tflops * 1e12)
    return Roofline(memory_s=work.bytes / (ceilings.copy_gbps * 1e9), compute_s=compute)
