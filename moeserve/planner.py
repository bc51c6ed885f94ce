"""Per-rank memory planner for the large-scale layout (``moeserve plan``).

Given a DeepSeek V2/V3 config and a parallel layout (the server's flags), estimate what one rank
holds: weights by component, a peak-activation estimate, and the KV cache capacity left in the
static budget; then sweep the dense-FFN TP size the way the reference deployment argues for it.

Layout (DESIGN §4). World of N ranks; ``attn_tp = tp / dp`` with ``--enable-dp-attention``
(else ``attn_tp = tp``); dense FFN TP of ``--moe-dense-tp-size`` (default ``attn_tp``, as the
server's ``ParallelConfig``); EP over all N ranks (an all-to-all backend on) with
``num_physical = n_routed + R`` expert slots, ``num_physical / N`` per rank. ``tp`` must equal N
(one server spans the world).

Weights (bytes per rank). FP8 (``--weight-dtype fp8``) stores every decoder-layer linear as one
byte per value plus fp32 block scales ``ceil(out/128) x ceil(in/128)`` of the rank's shard;
embedding, LM head, norms and router gates stay bf16 (the ``noaux_tc`` correction bias fp32).
- attention: ``q_a_proj`` and ``kv_a_proj_with_mqa`` (the latent projections) and their norms
  are replicated; ``q_b_proj``/``q_proj``, ``kv_b_proj`` (column-parallel over heads) and
  ``o_proj`` (row-parallel) are split over ``attn_tp``.
- dense FFN (the ``first_k_dense_replace`` layers): gate/up/down split over ``dense_tp``.
- routed experts: ``num_physical / N`` experts per MoE layer; shared experts and router gates
  replicated on every rank (as with DeepEP).
- LM head: vocab-parallel over the attention-TP group with ``--enable-dp-lm-head``, else over
  the world TP group; the embedding is split over the same group (replicated when it has one
  rank). MTP layers are not counted (moeserve skips them).

Activations: a deliberately simple estimate, bf16 unless said otherwise. ``T`` = tokens per rank
(the rank's share of the batch; the residual stream stays scattered, ``T`` tokens per rank). The
peak is the residual stream (hidden + residual, ``2·T·hidden``) plus the largest single stage:
- attention: the attention-TP group all-gathers its ``attn_tp·T`` tokens; q (+ q latent), the
  KV latent, then expanded per-head K/V (prefill, no prefix hits) or absorbed q/out latents
  (decode), attention output and ``o_proj`` output;
- dense FFN: the ``dense_tp·T`` all-gathered tokens in and out, plus gate/up and act over ``I/t``;
- MoE: fp32 router logits, the dispatch receive buffer — normal mode ``T·topk·hidden``,
  low-latency ``[E_local, C·N, hidden]`` with ``C`` = max dispatch tokens per rank (default
  ``T``) — in FP8 with 1/128 fp32 scales when weights are FP8 (the grouped GEMMs consume FP8),
  else bf16; grouped-GEMM gate/up, act and down outputs over the same rows; shared expert; combine;
- LM head: the gathered hidden and fp32 logits (one row per sequence in prefill, per token in decode).
Two-batch overlap halves the tokens in flight per stage (the reference: TBO "lowers peak memory
usage by halving the effective batch size"). Communication buffers (DeepEP's NVL/RDMA buffers),
CUDA graphs and allocator fragmentation are not modelled: they live in the ``1 - f`` headroom.

Budget and KV. ``budget = mem_fraction_static · gpu_memory`` (GiB; an H100 80GB is 80, H200 141).
Weights + peak activations are charged to it (conservative: SGLang leaves activations to the
``1 - f`` remainder); "fits" means they do not exceed it, and the rest is KV cache. A token costs
``num_layers`` rows of the pool's layout per rank (``cache.KVLayout``): 576 BF16 values for V3 (the
latent plus the rope key; 1,152 bytes), or with ``--kv-cache-dtype fp8_e4m3`` 576 FP8 values and
5 float32 scales (596 bytes, 1.93x the tokens); V3.2 adds its index key. MLA
caches the latent once per rank: with DP attention each DP rank holds its own requests (no
duplication, server capacity = N × per-rank); with attention TP the latent is replicated in the
TP group (server capacity = attn_dp × per-rank).

Dense-FFN TP (the reference's "Optimized Memory Efficiency" argument). With dense TP ``t`` the
per-rank memory of the dense layers is modelled as

    M(t) = N_param / t + (1 + k) · N_hidden · t,   minimised at  t* = sqrt(N_param / ((1 + k) · N_hidden))

where ``N_param`` = the bytes of the dense-FFN weights of all dense layers (persistent, divided
by ``t``), ``N_hidden`` = the bytes of one rank's hidden states entering the dense FFN
(``T · hidden · 2``; the all-gather makes the FFN hold ``t`` of them, only one layer at a time)
and ``k`` the extra copies from CUDA-graph duplication. The reference states the formula per
layer in parameter counts (``N_param = I · hidden``, so ``t* = sqrt(I / ((1 + k) · n_token))``)
with k = 0 for prefill (no CUDA graphs) and k = 3 for decode (128 tokens per device -> t* = 6).
Counting all 3 layers x 3 matrices of FP8 against bf16 activations, as here, makes the ratio
4.5x larger (t* 2.1x), yet for V3 prefill at the reference's 16,384 tokens per device (4K inputs)
t* = 2.25 and the best divisor is 2: a small dense TP (or pure DP) minimises memory. Decode
shifts it up: 256 sequences per rank (the reference's decode) give t* = 9.0 with k = 3 (12.7 with
k = 1); 128 give 12.7 (k = 3). Defaults: k = 0 for prefill, 3 for decode (``--cuda-graph-k``
overrides); with two-batch overlap ``T`` is the tokens in flight (half). Valid ``t`` divide N and ``I``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from moeserve.cache import KVLayout
from moeserve.config import KV_CACHE_DTYPES, ModelConfig
from moeserve.flags import add_config_flags

GiB = 1 << 30
ACT_BYTES = 2  # bf16 activations
LOGIT_BYTES = 4  # fp32 logits and router scores
NORM_BYTES = 2
DEFAULT_BLOCK = (128, 128)

_V3_ROPE = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
_V2_LITE_ROPE = {**_V3_ROPE, "mscale": 0.707, "mscale_all_dim": 0.707}

# config.json of the released checkpoints (the keys ModelConfig reads).
_DSV3: dict[str, Any] = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": _V3_ROPE, "torch_dtype": "bfloat16", "num_nextn_predict_layers": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
PRESETS: dict[str, dict[str, Any]] = {
    "dsv3": _DSV3,
    # DeepSeek-V3.2: V3 plus the lightning indexer (64 heads of 128, top 2,048 tokens per query)
    "dsv32": {**_DSV3, "model_type": "deepseek_v32", "index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128},
    "dsv2-lite": {
        "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1,
        "topk_method": "greedy", "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "rms_norm_eps": 1e-6, "max_position_embeddings": 163840, "rope_theta": 10000,
        "rope_scaling": _V2_LITE_ROPE, "torch_dtype": "bfloat16",
    },
}


def preset_config(name: str, num_layers: int | None = None, num_dense_layers: int | None = None,
                  fp8_checkpoint: bool = False) -> ModelConfig:
    """A released architecture as a ``ModelConfig``, without its checkpoint (plans, benchmarks).

    ``num_layers`` keeps the per-layer shapes and stacks fewer layers; of them
    ``num_dense_layers`` are dense (default: the released share of dense layers, at least one
    when the preset has any: DeepSeek-V3's 3 of 61 give 1 of 4). ``fp8_checkpoint`` keeps the
    released FP8 ``quantization_config``; without it the config describes a bf16 checkpoint, so
    random weights are not taken for FP8 ones.
    """
    if name not in PRESETS:
        raise ValueError(f"preset {name!r} is unknown; expected one of {sorted(PRESETS)}")
    hf = dict(PRESETS[name])
    total, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 0)
    layers = total if num_layers is None else num_layers
    if layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {layers}")
    if num_dense_layers is None:
        num_dense_layers = min(max(1, round(dense * layers / total)), dense)
    if not 0 <= num_dense_layers <= layers:
        raise ValueError(f"num_dense_layers must be in [0, {layers}], got {num_dense_layers}")
    hf.update(num_hidden_layers=layers, first_k_dense_replace=num_dense_layers)
    if not fp8_checkpoint:
        hf.pop("quantization_config", None)
    return ModelConfig.from_dict(hf)


# The reference deployment's workloads: prefill 16,384 tokens per device at 4,096-token inputs;
# decode 256 running sequences per device with a 2,000-token KV.
REFERENCE_WORKLOAD = {"prefill": (16384, 4096), "decode": (256, 2000)}
CUDA_GRAPH_K = {"prefill": 0.0, "decode": 3.0}


@dataclass(frozen=True)
class Layout:
    """The server's parallel flags; ``None`` means the server's default."""

    world: int
    tp_size: int | None = None
    dp_size: int | None = None
    enable_dp_attention: bool = False
    moe_dense_tp_size: int | None = None
    enable_dp_lm_head: bool = False
    ep_num_redundant_experts: int = 0

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"world must be >= 1, got {self.world}")
        if self.tp != self.world:
            raise ValueError(f"tp_size ({self.tp}) must equal world ({self.world}): one server spans the world")
        if self.dp < 1 or self.world % self.dp:
            raise ValueError(f"dp_size ({self.dp}) must divide world ({self.world})")
        if self.dp > 1 and not self.enable_dp_attention:
            raise ValueError("dp_size > 1 needs --enable-dp-attention")
        if self.dense_tp < 1 or self.world % self.dense_tp:
            raise ValueError(f"moe_dense_tp_size ({self.dense_tp}) must divide world ({self.world})")
        if self.ep_num_redundant_experts < 0:
            raise ValueError(f"ep_num_redundant_experts must be >= 0, got {self.ep_num_redundant_experts}")

    @property
    def tp(self) -> int:
        return self.tp_size or self.world

    @property
    def dp(self) -> int:
        if self.dp_size is not None:
            return self.dp_size
        return self.world if self.enable_dp_attention else 1

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp if self.enable_dp_attention else self.tp

    @property
    def attn_dp(self) -> int:
        return self.world // self.attn_tp

    @property
    def dense_tp(self) -> int:
        return self.moe_dense_tp_size or self.attn_tp

    @property
    def lm_head_tp(self) -> int:
        """Ranks the LM head (and embedding) vocabulary is split over."""
        return self.attn_tp if self.enable_dp_lm_head else self.tp

    def num_physical_experts(self, model: ModelConfig) -> int:
        return model.n_routed_experts + self.ep_num_redundant_experts

    def experts_per_rank(self, model: ModelConfig) -> int:
        return self.num_physical_experts(model) // self.world

    def check(self, model: ModelConfig) -> None:
        if model.num_heads % self.attn_tp:
            raise ValueError(f"attention TP ({self.attn_tp}) must divide num_heads ({model.num_heads})")
        if model.intermediate_size % self.dense_tp:
            raise ValueError(f"moe_dense_tp_size ({self.dense_tp}) must divide "
                             f"intermediate_size ({model.intermediate_size})")
        physical = self.num_physical_experts(model)
        if model.n_routed_experts and physical % self.world:
            raise ValueError(f"{physical} physical experts ({model.n_routed_experts} routed + "
                             f"{self.ep_num_redundant_experts} redundant) do not split over {self.world} ranks")


@dataclass(frozen=True)
class Workload:
    phase: str = "prefill"  # "prefill" or "decode"
    tokens_per_rank: int | None = None  # None: the reference's (16384 prefill, 256 decode)
    context_len: int | None = None  # None: the reference's (4096 prefill, 2000 decode)
    deepep_mode: str = "auto"  # auto: normal for prefill, low_latency for decode
    max_dispatch_tokens_per_rank: int | None = None  # low-latency capacity C; None: tokens in flight
    enable_two_batch_overlap: bool = False
    cuda_graph_k: float | None = None  # None: 0 for prefill, 3 for decode (the reference)

    def __post_init__(self) -> None:
        if self.phase not in REFERENCE_WORKLOAD:
            raise ValueError(f"phase {self.phase!r} must be prefill or decode")
        if self.deepep_mode not in ("auto", "normal", "low_latency"):
            raise ValueError(f"deepep_mode {self.deepep_mode!r} must be auto, normal or low_latency")
        if self.tokens < 1 or self.context < 1:
            raise ValueError("tokens_per_rank and context_len must be >= 1")

    @property
    def tokens(self) -> int:
        return self.tokens_per_rank or REFERENCE_WORKLOAD[self.phase][0]

    @property
    def context(self) -> int:
        return self.context_len or REFERENCE_WORKLOAD[self.phase][1]

    @property
    def in_flight(self) -> int:
        """Tokens per stage: two-batch overlap runs half the batch at a time."""
        return math.ceil(self.tokens / 2) if self.enable_two_batch_overlap else self.tokens

    @property
    def dispatch_mode(self) -> str:
        if self.deepep_mode != "auto":
            return self.deepep_mode
        return "normal" if self.phase == "prefill" else "low_latency"

    @property
    def k(self) -> float:
        return CUDA_GRAPH_K[self.phase] if self.cuda_graph_k is None else self.cuda_graph_k


@dataclass(frozen=True)
class Device:
    gpu_memory_gb: float = 80.0  # GiB; 80 = H100, 141 = H200
    mem_fraction_static: float = 0.88
    weight_dtype: str = "bf16"  # "fp8" (1 byte + fp32 block scales) or "bf16"
    kv_cache_dtype: str = "auto"  # the server's --kv-cache-dtype; auto: bf16

    def __post_init__(self) -> None:
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.weight_dtype not in ("fp8", "bf16"):
            raise ValueError("weight_dtype must be fp8 or bf16")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}")

    def kv_layout(self, m: ModelConfig) -> KVLayout:
        """A cache row as the server lays it out (computing in bf16)."""
        return KVLayout.for_model(m, self.kv_cache_dtype, torch.bfloat16)

    @property
    def budget(self) -> int:
        return int(self.mem_fraction_static * self.gpu_memory_gb * GiB)


# ---------------------------------------------------------------------------------------- weights


def linear_bytes(out_features: int, in_features: int, dtype: str, block: tuple[int, int]) -> int:
    """One rank's shard ``[out, in]``: FP8 values plus fp32 ``weight_scale_inv`` blocks, or bf16."""
    if dtype == "bf16":
        return 2 * out_features * in_features
    return out_features * in_features + 4 * math.ceil(out_features / block[0]) * math.ceil(in_features / block[1])


def _layer_counts(m: ModelConfig) -> tuple[int, int]:
    """(dense layers, MoE layers), MTP layers excluded."""
    moe = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    return m.num_layers - moe, moe


def _attention_bytes(m: ModelConfig, attn_tp: int, dtype: str, block: tuple[int, int]) -> tuple[int, int]:
    """(replicated, sharded) attention weights of one layer on one rank."""
    heads = m.num_heads // attn_tp
    replicated = linear_bytes(m.kv_cache_dim, m.hidden_size, dtype, block)
    sharded = linear_bytes(heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, dtype, block)
    sharded += linear_bytes(m.hidden_size, heads * m.v_head_dim, dtype, block)
    if m.q_lora_rank is None:
        sharded += linear_bytes(heads * m.qk_head_dim, m.hidden_size, dtype, block)
    else:
        replicated += linear_bytes(m.q_lora_rank, m.hidden_size, dtype, block)
        sharded += linear_bytes(heads * m.qk_head_dim, m.q_lora_rank, dtype, block)
    if m.index_topk:  # V3.2's indexer, replicated: wq_b and wk as the checkpoint's; weights_proj in fp32
        replicated += linear_bytes(m.index_n_heads * m.index_head_dim, m.q_lora_rank, dtype, block)
        replicated += linear_bytes(m.index_head_dim, m.hidden_size, dtype, block)
        replicated += 4 * m.index_n_heads * m.hidden_size
    return replicated, sharded


def mlp_bytes(hidden: int, intermediate: int, dtype: str, block: tuple[int, int]) -> int:
    """gate_proj + up_proj ``[I, H]`` and down_proj ``[H, I]``."""
    return 2 * linear_bytes(intermediate, hidden, dtype, block) + linear_bytes(hidden, intermediate, dtype, block)


def dense_ffn_bytes(m: ModelConfig, dense_tp: int, dtype: str) -> int:
    """All dense-FFN layers on one rank of a dense-TP group of ``dense_tp``."""
    block = m.fp8_block or DEFAULT_BLOCK
    return _layer_counts(m)[0] * mlp_bytes(m.hidden_size, m.intermediate_size // dense_tp, dtype, block)


def weight_memory(m: ModelConfig, layout: Layout, dtype: str) -> dict[str, int]:
    """Bytes of weights on one rank, by component."""
    block = m.fp8_block or DEFAULT_BLOCK
    dense, moe = _layer_counts(m)
    replicated, sharded = _attention_bytes(m, layout.attn_tp, dtype, block)
    expert = mlp_bytes(m.hidden_size, m.moe_intermediate_size, dtype, block)
    shared = mlp_bytes(m.hidden_size, m.moe_intermediate_size * m.n_shared_experts, dtype, block)
    gate = 2 * m.n_routed_experts * m.hidden_size + (4 * m.n_routed_experts if m.router == "noaux_tc" else 0)
    norms_per_layer = 2 * m.hidden_size + m.kv_lora_rank + (m.q_lora_rank or 0)
    vocab_shard = math.ceil(m.vocab_size / layout.lm_head_tp) * m.hidden_size * 2
    return {
        "attention_replicated": m.num_layers * replicated,
        "attention_sharded": m.num_layers * sharded,
        "dense_ffn": dense_ffn_bytes(m, layout.dense_tp, dtype),
        "routed_experts": moe * layout.experts_per_rank(m) * expert if m.n_routed_experts else 0,
        "shared_experts": moe * shared if m.n_shared_experts else 0,
        "router": moe * gate,
        "norms": NORM_BYTES * (m.num_layers * norms_per_layer + m.hidden_size),
        "embedding": 0 if m.tie_word_embeddings else vocab_shard,
        "lm_head": vocab_shard,
    }


# ------------------------------------------------------------------------------------ activations


def _dispatch_row_bytes(m: ModelConfig, dtype: str) -> int:
    """A dispatched token: FP8 with one fp32 scale per 128 values when the GEMMs run FP8."""
    if dtype == "fp8":
        return m.hidden_size + 4 * math.ceil(m.hidden_size / 128)
    return ACT_BYTES * m.hidden_size


def attention_activations(m: ModelConfig, layout: Layout, work: Workload) -> int:
    rows = layout.attn_tp * work.in_flight  # the attention-TP group's tokens, gathered
    heads = m.num_heads // layout.attn_tp
    values = 2 * m.hidden_size + m.kv_cache_dim + (m.q_lora_rank or 0) + heads * m.qk_head_dim
    if work.phase == "prefill":  # expanded: per-head K and V over the new tokens (no prefix hits)
        values += heads * (m.qk_head_dim + 2 * m.v_head_dim)
    else:  # absorbed: the query and output in latent space
        values += heads * (2 * m.kv_lora_rank + m.v_head_dim)
    return ACT_BYTES * rows * values


def dense_ffn_activations(m: ModelConfig, layout: Layout, work: Workload) -> int:
    if not _layer_counts(m)[0]:
        return 0
    rows = layout.dense_tp * work.in_flight  # all-gathered over the dense-TP group
    return ACT_BYTES * rows * (2 * m.hidden_size + 3 * (m.intermediate_size // layout.dense_tp))


def moe_activations(m: ModelConfig, layout: Layout, work: Workload, dtype: str) -> int:
    if not m.n_routed_experts:
        return 0
    t = work.in_flight
    if work.dispatch_mode == "normal":
        rows = t * m.num_experts_per_tok
    else:  # [E_local, C * N, hidden], fixed size
        capacity = work.max_dispatch_tokens_per_rank or t
        rows = layout.experts_per_rank(m) * capacity * layout.world
    recv = rows * _dispatch_row_bytes(m, dtype)
    experts = ACT_BYTES * rows * (3 * m.moe_intermediate_size + m.hidden_size)
    shared = ACT_BYTES * t * (3 * m.moe_intermediate_size * m.n_shared_experts + m.hidden_size)
    return LOGIT_BYTES * t * m.n_routed_experts + recv + experts + shared + ACT_BYTES * t * m.hidden_size


def lm_head_activations(m: ModelConfig, layout: Layout, work: Workload) -> int:
    rows = work.in_flight if work.phase == "decode" else math.ceil(work.in_flight / work.context)
    gathered = layout.lm_head_tp * rows
    return ACT_BYTES * gathered * m.hidden_size + LOGIT_BYTES * gathered * math.ceil(m.vocab_size / layout.lm_head_tp)


def activation_memory(m: ModelConfig, layout: Layout, work: Workload, dtype: str) -> dict[str, int]:
    """Per-stage activation bytes; the peak is ``residual + max(stage)``."""
    return {
        "residual": 2 * ACT_BYTES * work.tokens * m.hidden_size,
        "attention": attention_activations(m, layout, work),
        "dense_ffn": dense_ffn_activations(m, layout, work),
        "moe": moe_activations(m, layout, work, dtype),
        "lm_head": lm_head_activations(m, layout, work),
    }


def kv_bytes_per_token(m: ModelConfig, layout: KVLayout) -> int:
    return m.num_layers * layout.row_bytes


# -------------------------------------------------------------------------------------- dense TP


@dataclass(frozen=True)
class DenseTPRow:
    t: int
    weights: float  # N_param / t
    activations: float  # (1 + k) N_hidden t
    aligned: bool  # I / t is a multiple of the 128-wide block

    @property
    def total(self) -> float:
        return self.weights + self.activations


@dataclass(frozen=True)
class DenseTPSweep:
    n_param: int
    n_hidden: int
    k: float
    t_star: float
    rows: tuple[DenseTPRow, ...]
    best: int


def dense_tp_sweep(m: ModelConfig, layout: Layout, work: Workload, dtype: str) -> DenseTPSweep:
    """``M(t) = N_param/t + (1+k)·N_hidden·t`` over the divisors of N that divide ``I``."""
    n_param = dense_ffn_bytes(m, 1, dtype)
    n_hidden = work.in_flight * m.hidden_size * ACT_BYTES
    block = (m.fp8_block or DEFAULT_BLOCK)[0]
    rows = tuple(
        DenseTPRow(t, n_param / t, (1 + work.k) * n_hidden * t, (m.intermediate_size // t) % block == 0)
        for t in range(1, layout.world + 1) if layout.world % t == 0 and m.intermediate_size % t == 0
    )
    best = min(rows, key=lambda r: (r.total, r.t)).t
    return DenseTPSweep(n_param, n_hidden, work.k, math.sqrt(n_param / ((1 + work.k) * n_hidden)), rows, best)


# ------------------------------------------------------------------------------------------ plan


@dataclass(frozen=True)
class Plan:
    name: str
    model: ModelConfig
    layout: Layout
    work: Workload
    device: Device
    weights: dict[str, int]
    activations: dict[str, int]
    dense: DenseTPSweep

    @property
    def weights_total(self) -> int:
        return sum(self.weights.values())

    @property
    def peak_stage(self) -> str:
        stages = {k: v for k, v in self.activations.items() if k != "residual"}
        return max(stages, key=stages.__getitem__)

    @property
    def activation_peak(self) -> int:
        return self.activations["residual"] + self.activations[self.peak_stage]

    @property
    def kv_bytes(self) -> int:
        """What the static budget has left for the KV cache (negative: the shortfall)."""
        return self.device.budget - self.weights_total - self.activation_peak

    @property
    def fits(self) -> bool:
        return self.kv_bytes >= 0

    @property
    def kv_per_token(self) -> int:
        return kv_bytes_per_token(self.model, self.device.kv_layout(self.model))

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV one rank holds (its attention-TP group holds the same tokens, replicated)."""
        return max(self.kv_bytes, 0) // self.kv_per_token

    @property
    def kv_tokens_total(self) -> int:
        return self.kv_tokens * self.layout.attn_dp

    def to_dict(self) -> dict[str, Any]:
        """Everything the report shows, in bytes, for ``--json``."""
        w, d = self.weights, self.dense
        return {
            "model": self._model_dict(), "layout": self._layout_dict(),
            "workload": {**asdict(self.work), "tokens_per_rank": self.work.tokens, "context_len": self.work.context,
                         "dispatch_mode": self.work.dispatch_mode, "cuda_graph_k": self.work.k},
            "device": asdict(self.device),
            "weights_bytes": {**w, "attention": w["attention_replicated"] + w["attention_sharded"],
                              "total": self.weights_total},
            "activations_bytes": {**self.activations, "peak": self.activation_peak, "peak_stage": self.peak_stage},
            "budget_bytes": self.device.budget,
            "kv": {"bytes": max(self.kv_bytes, 0), "bytes_per_token": self.kv_per_token,
                   "tokens_per_rank": self.kv_tokens, "tokens_total": self.kv_tokens_total,
                   "sequences_per_rank": self.kv_tokens // self.work.context,
                   "sequences_total": self.kv_tokens_total // self.work.context},
            "fits": self.fits, "shortfall_bytes": max(-self.kv_bytes, 0),
            "dense_tp": {"n_param_bytes": d.n_param, "n_hidden_bytes": d.n_hidden, "k": d.k, "t_star": d.t_star,
                         "best": d.best, "rows": [{**asdict(r), "total": r.total} for r in d.rows]},
        }

    def _model_dict(self) -> dict[str, Any]:
        m = self.model
        dense, moe = _layer_counts(m)
        return {"name": self.name, "model_type": m.model_type, "num_layers": m.num_layers,
                "dense_layers": dense, "moe_layers": moe}

    def _layout_dict(self) -> dict[str, Any]:
        lay, m = self.layout, self.model
        return {"world": lay.world, "tp_size": lay.tp, "dp_size": lay.dp,
                "enable_dp_attention": lay.enable_dp_attention, "attn_tp": lay.attn_tp, "attn_dp": lay.attn_dp,
                "dense_tp": lay.dense_tp, "ep_size": lay.world,
                "num_physical_experts": lay.num_physical_experts(m), "experts_per_rank": lay.experts_per_rank(m),
                "lm_head_tp": lay.lm_head_tp, "enable_dp_lm_head": lay.enable_dp_lm_head}


def plan(model: ModelConfig, layout: Layout, work: Workload, device: Device, name: str = "model") -> Plan:
    layout.check(model)
    return Plan(name, model, layout, work, device,
                weight_memory(model, layout, device.weight_dtype),
                activation_memory(model, layout, work, device.weight_dtype),
                dense_tp_sweep(model, layout, work, device.weight_dtype))


# ---------------------------------------------------------------------------------------- report


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


def _rows(pairs: list[tuple[str, str]], indent: str = "  ") -> list[str]:
    width = max(len(k) for k, _ in pairs)
    return [f"{indent}{k:<{width}}  {v}" for k, v in pairs]


def _layout_lines(p: Plan) -> list[str]:
    lay, m = p.layout, p.model
    experts = (f"{lay.experts_per_rank(m)} per rank ({lay.num_physical_experts(m)} physical = "
               f"{m.n_routed_experts} routed + {lay.ep_num_redundant_experts} redundant)")
    head = "attention-TP group (DP LM head)" if lay.enable_dp_lm_head else "world TP group"
    dp_attention = " (DP attention)" if lay.enable_dp_attention else ""
    return ["layout"] + _rows([
        ("attention TP x DP", f"{lay.attn_tp} x {lay.attn_dp}{dp_attention}"),
        ("dense-FFN TP", str(lay.dense_tp)),
        ("EP", str(lay.world)),
        ("routed experts", experts),
        ("LM head / embedding", f"vocab split over {lay.lm_head_tp} rank(s), the {head}"),
        ("weights / KV dtype", f"{p.device.weight_dtype} / {p.device.kv_layout(p.model).name}"),
    ])


def _memory_lines(p: Plan) -> list[str]:
    w, m, a = p.weights, p.model, p.activations
    dense, moe = _layer_counts(m)
    pairs = [
        (f"attention ({m.num_layers} layers, heads /{p.layout.attn_tp})",
         w["attention_replicated"] + w["attention_sharded"]),
        (f"dense FFN ({dense} layer{'s' * (dense != 1)}, /{p.layout.dense_tp})", w["dense_ffn"]),
        (f"routed experts ({p.layout.experts_per_rank(m)} x {moe} layers)", w["routed_experts"]),
        ("shared experts (replicated)", w["shared_experts"]),
        ("router gates", w["router"]),
        ("norms", w["norms"]),
        (f"embedding (/{p.layout.lm_head_tp})", w["embedding"]),
        (f"LM head (/{p.layout.lm_head_tp})", w["lm_head"]),
        ("weights total", p.weights_total),
        (f"activations, peak ({p.peak_stage} + residual)", p.activation_peak),
        ("  residual stream", a["residual"]),
        ("  attention stage", a["attention"]),
        ("  dense-FFN stage", a["dense_ffn"]),
        ("  MoE stage", a["moe"]),
        ("  LM-head stage", a["lm_head"]),
        (f"static budget ({p.device.mem_fraction_static:g} x {p.device.gpu_memory_gb:g} GiB)", p.device.budget),
        ("KV cache", max(p.kv_bytes, 0)),
    ]
    title = (f"memory per rank, GiB ({p.work.phase}, {p.work.tokens} tokens per rank, {p.work.dispatch_mode} "
             f"dispatch{', two-batch overlap' if p.work.enable_two_batch_overlap else ''})")
    return [title] + _rows([(k, f"{_gib(v):>7}") for k, v in pairs])


def _kv_lines(p: Plan) -> list[str]:
    ctx, lay = p.work.context, p.layout
    share = "own requests per DP rank" if lay.attn_tp == 1 else f"latent replicated over attention TP {lay.attn_tp}"
    lines = ["KV capacity"] + _rows([
        ("per token", f"{p.model.num_layers} layers x {p.device.kv_layout(p.model).row_bytes} bytes = "
                      f"{p.kv_per_token / 1024:.2f} KiB"),
        ("tokens per rank", f"{p.kv_tokens:,} ({p.kv_tokens // ctx:,} sequences of {ctx})"),
        ("tokens per server", f"{p.kv_tokens_total:,} ({p.kv_tokens_total // ctx:,} sequences; {share})"),
    ])
    if p.work.phase == "decode" and p.kv_tokens < p.work.tokens * ctx * lay.attn_tp:
        lines.append(f"  note: {p.work.tokens} running sequences x {ctx} tokens per rank exceed the KV cache")
    return lines


def _dense_lines(p: Plan) -> list[str]:
    d = p.dense
    lines = [f"dense-FFN TP: M(t) = N_param/t + (1+k)*N_hidden*t, N_param = {_gib(d.n_param)} GiB, "
             f"N_hidden = {d.n_hidden / 2**20:.1f} MiB, k = {d.k:g}",
             f"  t* = sqrt(N_param / ((1+k)*N_hidden)) = {d.t_star:.2f}; best valid t = {d.best}",
             f"  {'t':>4}  {'weights':>8}  {'acts':>8}  {'total':>8}  I/t   (GiB)"]
    for r in d.rows:
        mark = ("  <- best" if r.t == d.best else "") + ("  (current)" if r.t == p.layout.dense_tp else "")
        i_local = p.model.intermediate_size // r.t
        lines.append(f"  {r.t:>4}  {r.weights / GiB:>8.3f}  {r.activations / GiB:>8.3f}  {r.total / GiB:>8.3f}  "
                     f"{i_local}{'' if r.aligned else ' (not 128-aligned)'}{mark}")
    return lines


def format_report(p: Plan) -> str:
    verdict = "fits" if p.fits else f"does not fit by {_gib(-p.kv_bytes)} GiB"
    header = (f"moeserve plan: {p.name} ({p.model.model_type}) on {p.layout.world} ranks x "
              f"{p.device.gpu_memory_gb:g} GiB (80 = H100, 141 = H200)")
    sections = [[header], _layout_lines(p), _memory_lines(p), _kv_lines(p), [f"check: {verdict}"], _dense_lines(p)]
    return "\n\n".join("\n".join(s) for s in sections)


# ------------------------------------------------------------------------------------------- CLI


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    """Add the ``moeserve plan`` flags to ``parser``."""
    p = parser
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-path", help="checkpoint folder; only its config.json is read")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a released config (dsv3 = DeepSeek-V3)")
    p.add_argument("--world", type=int, required=True, help="number of ranks (GPUs)")
    # the server's own flags, where a plan reads them; a layout is sized from --world
    add_config_flags(p, {"tp_size", "dp_size", "enable_dp_attention", "moe_dense_tp_size", "enable_dp_lm_head",
                         "ep_num_redundant_experts", "deepep_mode", "enable_two_batch_overlap", "mem_fraction_static",
                         "max_dispatch_tokens_per_rank", "kv_cache_dtype"},
                     defaults={"tp_size": None, "dp_size": None, "max_dispatch_tokens_per_rank": None},
                     helps={"tp_size": "default: --world",
                            "dp_size": "default: --world with --enable-dp-attention, else 1",
                            "max_dispatch_tokens_per_rank": "low-latency dispatch capacity C (default: the tokens "
                                                            "in flight; the server's is 128)"})
    p.add_argument("--weight-dtype", choices=["fp8", "bf16"], default=None,
                   help="default: fp8 for an FP8 checkpoint, else bf16")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="GiB per GPU: 80 = H100, 141 = H200")
    p.add_argument("--phase", choices=["prefill", "decode"], default="prefill")
    p.add_argument("--tokens-per-rank", type=int, default=None,
                   help="prefill: tokens per forward per rank (default 16384); decode: running sequences (256)")
    p.add_argument("--context-len", type=int, default=None, help="sequence length (default 4096 prefill, 2000 decode)")
    p.add_argument("--cuda-graph-k", type=float, default=None, help="k of the dense-TP formula (0 prefill, 3 decode)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def plan_from_args(args: argparse.Namespace) -> Plan:
    if args.model_path:
        model, name = ModelConfig.from_path(args.model_path), args.model_path
    else:
        model, name = ModelConfig.from_dict(PRESETS[args.preset]), args.preset
    layout = Layout(args.world, args.tp_size, args.dp_size, args.enable_dp_attention, args.moe_dense_tp_size,
                    args.enable_dp_lm_head, args.ep_num_redundant_experts)
    work = Workload(args.phase, args.tokens_per_rank, args.context_len, args.deepep_mode,
                    args.max_dispatch_tokens_per_rank, args.enable_two_batch_overlap, args.cuda_graph_k)
    weight_dtype = args.weight_dtype or ("fp8" if model.fp8_block else "bf16")
    device = Device(args.gpu_memory_gb, args.mem_fraction_static, weight_dtype, args.kv_cache_dtype)
    return plan(model, layout, work, device, name)


def run_plan(args: argparse.Namespace) -> int:
    """Print the report (or JSON); 0 when weights + activations fit the static budget, else 1.

    A bad layout raises ``ValueError`` (the CLI prints it and exits 2).
    """
    p = plan_from_args(args)
    print(json.dumps(p.to_dict(), indent=2) if args.json else format_report(p))
    return 0 if p.fits else 1
