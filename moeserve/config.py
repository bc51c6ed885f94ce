"""Frozen configuration, one dataclass per concern, gathered in ``EngineConfig``."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

import torch

ROUTERS = ("noaux_tc", "greedy", "group_limited_greedy")
MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



_FIELD_DEFAULT = object()  # a flag's default is its field's


@dataclass(frozen=True)
class FlagSpec:
    """How a config field shows on the command line (``--field-name``)."""

    help: str = ""
    choices: tuple[str, ...] | None = None
    cli_default: Any = _FIELD_DEFAULT  # when the flag's "not given" differs from the field's default


def flag(default: Any, help: str = "", choices: tuple[str, ...] | None = None,
         cli_default: Any = _FIELD_DEFAULT) -> Any:
    """A config field that is also a command-line flag: declared once, here, with its default; the CLI
    and the benchmarks build their parsers from these (``flags.py``)."""
    return field(default=default, metadata={"flag": FlagSpec(help, choices, cli_default)})

@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # "default" or "yarn"
    factor: float = 1.0
    original_max_position: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    interleave: bool = True

    @classmethod
    def from_hf(cls, hf: dict[str, Any], interleave: bool) -> RopeConfig:
        # transformers 5 writes ``rope_parameters``; released checkpoints write ``rope_scaling``.
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in ("default", "yarn"):
            raise ValueError(f"rope_type {kind!r} is not supported (default, yarn)")
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        if kind == "default":
            return cls(theta=float(theta), interleave=interleave)
        max_pos = hf.get("max_position_embeddings", 4096)
        original = params.get("original_max_position_embeddings", max_pos)
        return cls(
            theta=float(theta), kind=kind,
            factor=float(params.get("factor") or max_pos / original),
            original_max_position=int(original),
            beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
            mscale=float(params.get("mscale") or 0), mscale_all_dim=float(params.get("mscale_all_dim") or 0),
            interleave=interleave,
        )


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a DeepSeek V2/V3 checkpoint, read from its ``config.json``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    moe_layer_freq: int
    router: str
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    checkpoint_dtype: str = "bfloat16"
    fp8_block: tuple[int, int] | None = None
    num_mtp_layers: int = 0
    # DeepSeek-V3.2's sparse attention (DSA): each query attends to the ``index_topk`` earlier tokens
    # its layer's indexer scores highest (0: dense MLA, V2/V3)
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.index_topk and (self.index_n_heads < 1 or self.index_head_dim < self.qk_rope_head_dim):
            raise ValueError(f"index_n_heads ({self.index_n_heads}) must be >= 1 and index_head_dim "
                             f"({self.index_head_dim}) >= qk_rope_head_dim ({self.qk_rope_head_dim})")
        if self.router not in ROUTERS:
            raise ValueError(f"topk_method {self.router!r} is not supported; expected one of {ROUTERS}")
        if self.n_routed_experts % max(self.n_group, 1):
            raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must divide into n_group ({self.n_group})")
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer: the latent plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_row_dim(self) -> int:
        """Values cached per token per layer: ``kv_cache_dim``, then V3.2's index key."""
        return self.kv_cache_dim + (self.index_head_dim if self.index_topk else 0)

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        if self.rope.kind == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def scoring_func(self) -> str:
        return "sigmoid" if self.router == "noaux_tc" else "softmax"

    def is_moe_layer(self, layer: int) -> bool:
        return (self.n_routed_experts > 0 and layer >= self.first_k_dense_replace
                and layer % self.moe_layer_freq == 0)

    @classmethod
    def from_dict(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type", "deepseek_v3")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a DeepSeek V2/V3/V3.2 model; "
                             f"expected one of {MODEL_TYPES}")
        v3 = model_type != "deepseek_v2"
        sparse = model_type == "deepseek_v32"
        n_group = hf.get("n_group") or 1
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        quant = hf.get("quantization_config") or {}
        fp8_block = None
        if quant:
            if quant.get("quant_method") != "fp8":
                raise ValueError(f"quantization_config.quant_method {quant.get('quant_method')!r} is not supported")
            fp8_block = tuple(quant.get("weight_block_size") or (128, 128))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], moe_intermediate_size=hf["moe_intermediate_size"],
            num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
            q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            n_routed_experts=hf.get("n_routed_experts") or 0, n_shared_experts=hf.get("n_shared_experts") or 0,
            num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
            first_k_dense_replace=hf.get("first_k_dense_replace", 0), moe_layer_freq=hf.get("moe_layer_freq", 1),
            router=hf.get("topk_method") or ("noaux_tc" if v3 else "greedy"),
            n_group=n_group, topk_group=hf.get("topk_group") or n_group,
            norm_topk_prob=bool(hf.get("norm_topk_prob", v3)),
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rope=RopeConfig.from_hf(hf, interleave=hf.get("rope_interleave", True)),
            attention_bias=hf.get("attention_bias", False),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            eos_token_ids=eos_ids, bos_token_id=hf.get("bos_token_id"),
            checkpoint_dtype=str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16"),
            fp8_block=fp8_block,
            num_mtp_layers=hf.get("num_nextn_predict_layers", 0) or 0,
            index_topk=hf.get("index_topk", 2048) if sparse else 0,
            index_n_heads=hf.get("index_n_heads", 64) if sparse else 0,
            index_head_dim=hf.get("index_head_dim", 128) if sparse else 0,
        )

    @classmethod
    def from_path(cls, model_path: str) -> ModelConfig:
        path = os.path.join(model_path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model_path {model_path!r} has no config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class LoadConfig:
    model_path: str | None = None
    load_format: str = flag("auto", "auto (safetensors), safetensors, or dummy: random weights of the real shapes",
                            ("auto", "safetensors", "dummy"))
    dtype: str = flag("auto", "compute dtype (auto: the checkpoint's)", ("auto", "float32", "bfloat16", "float16"))
    device: str = flag("cpu", choices=("cpu", "cuda"))
    seed: int = 0  # seeds random weights (--load-format dummy)
    tokenizer_path: str | None = flag(None, "default: the model folder")
    # "fp8": weights kept in FP8 e4m3 with 128x128 block scales (an FP8 checkpoint keeps its own;
    # a bf16/fp32 one is quantized at load). None: an FP8 checkpoint is kept in FP8 on CUDA and
    # dequantized elsewhere (the CPU has no FP8 matmul, so it would only be slower).
    quantization: str | None = flag(None, "keep weights in FP8 with 128x128 block scales (a bf16 checkpoint is "
                                          "quantized at load)", ("fp8",))

    def __post_init__(self) -> None:
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"quantization {self.quantization!r} must be None or 'fp8'")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format {self.load_format!r} must be auto, safetensors or dummy")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} must be auto or one of {sorted(DTYPES)}")

    def torch_dtype(self, model: ModelConfig) -> torch.dtype:
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        # FP8 checkpoints compute in bf16; otherwise keep the checkpoint's own float type.
        return DTYPES.get(model.checkpoint_dtype, torch.bfloat16)


# --kv-cache-dtype: auto keeps the model dtype; fp8 is an alias of fp8_e4m3 (cache/kv_pool.py)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = flag(16, "tokens per KV-cache page (default: 64 on CUDA, where decode reads whole pages; "
                              "16 on CPU)", cli_default=None)
    max_total_tokens: int | None = flag(None, "KV cache size in tokens (default: sized from the memory budget)")
    mem_fraction_static: float = flag(0.88, "share of device memory for weights + KV cache (CUDA)")
    cpu_kv_cache_gb: float = flag(1.0, "KV cache budget on the CPU, where there is no device memory to measure")
    disable_radix_cache: bool = flag(False, "do not share the KV of common prompt prefixes between requests (the "
                                            "prefix cache is on for monolithic and prefill servers, off on decode "
                                            "servers, which receive their KV)")
    kv_cache_dtype: str = flag("auto", "the latent cache's dtype: auto (the model's) or fp8_e4m3 (alias fp8: the "
                                       "latent, rope key and V3.2's index key in FP8 with float32 scales, 596 "
                                       "bytes a token a layer for V3 against 1,152 in BF16)")

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            hint = "; e5m2 is not built: use fp8_e4m3" if self.kv_cache_dtype == "fp8_e5m2" else ""
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not supported: one of "
                             f"{', '.join(KV_CACHE_DTYPES)}{hint}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens ({self.max_total_tokens}) must be >= page_size ({self.page_size})")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")


GRAMMAR_BACKENDS = ("xgrammar", "llguidance")


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = flag(256)
    chunked_prefill_size: int = flag(8192, "prefill tokens per step; <= 0 disables chunking")
    max_prefill_tokens: int = flag(16384, "most prefill tokens in one step without chunking")
    context_length: int | None = flag(None, "default: the model's max_position_embeddings")
    decode_reserve_tokens: int = 8  # pages kept free per running request when admitting prefill
    # here, not in ServerConfig: the ranks' schedulers, which alone know when a prefill starts, enforce it
    queue_timeout: float | None = flag(None, "fail (503) a request that waits more than this many seconds in the "
                                             "queue before its prefill starts (default: no limit)")
    enable_priority_scheduling: bool = flag(False, "admit waiting requests by their priority (by default the "
                                                   "largest value first), then in arrival order")
    schedule_low_priority_values_first: bool = flag(False, "with --enable-priority-scheduling: the smallest "
                                                           "priority value first (vLLM's order)")
    grammar_backend: str = flag("xgrammar", "the library that compiles structured-output grammars (JSON "
                                            "schema, regex, EBNF)", choices=GRAMMAR_BACKENDS)

    def __post_init__(self) -> None:
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.queue_timeout is not None and not self.queue_timeout > 0:
            raise ValueError(f"queue_timeout must be > 0 seconds, got {self.queue_timeout}")


# torch: both modes over torch.distributed all-to-alls; symm_mem: low-latency dispatch as peer
# writes into torch symmetric memory (CUDA; only real tokens move), normal mode as torch
A2A_BACKENDS = ("none", "torch", "symm_mem", "deepep")
DEEPEP_MODES = ("normal", "low_latency", "auto")


@dataclass(frozen=True)
class ParallelConfig:
    """The layout over ``tp_size`` ranks (one process each), named as SGLang names it.

    ``tp_size`` is the world. With DP attention the world is split into ``dp_size`` attention
    groups of ``tp_size / dp_size`` ranks; routed experts are spread over all ranks (EP);
    the dense FFN runs tensor-parallel over groups of ``moe_dense_tp_size`` ranks.
    """

    tp_size: int = flag(1, "ranks (processes / GPUs) in all")
    dp_size: int = flag(1, "data-parallel attention groups")
    enable_dp_attention: bool = flag(False)
    ep_size: int | None = flag(None, "default: tp-size with an all-to-all backend, else 1")
    moe_a2a_backend: str = flag("none", choices=A2A_BACKENDS)
    deepep_mode: str = flag("auto", choices=DEEPEP_MODES)
    moe_dense_tp_size: int | None = flag(None, "TP size of the dense FFN layers (default: the attention-TP size)")
    enable_dp_lm_head: bool = flag(False, "vocab-parallel LM head inside attention TP")
    max_dispatch_tokens_per_rank: int = flag(128, "low-latency dispatch buffer: tokens per source rank")
    nnodes: int = flag(1)
    node_rank: int = flag(0)
    dist_init_addr: str | None = flag(None, "host:port of node 0 with --nnodes > 1: torch.distributed and the "
                                            "request channel listen on this host, ports port .. port+1+dp")
    dist_secret_file: str | None = flag(None, "with --nnodes > 1: a file holding the same secret (>= 16 bytes) "
                                              "on every node; the request channel between nodes authenticates "
                                              "and encrypts with keys derived from it")
    load_balance_method: str = flag("round_robin", "how the API process picks a request's DP group: in turn, "
                                    "the fewest outstanding tokens, or cache_aware: the group that was sent the "
                                    "longest prefix of its prompt unless the load is imbalanced",
                                    choices=("round_robin", "shortest_queue", "cache_aware"))

    def __post_init__(self) -> None:
        n = self.tp_size
        _require(n >= 1, "tp_size", f"must be >= 1, got {n}")
        _require(self.moe_a2a_backend in A2A_BACKENDS, "moe_a2a_backend", f"must be one of {A2A_BACKENDS}")
        _require(self.deepep_mode in DEEPEP_MODES, "deepep_mode", f"must be one of {DEEPEP_MODES}")
        _require(self.dp_size >= 1 and n % self.dp_size == 0, "dp_size", f"must divide tp_size {n}")
        _require(self.dp_size == 1 or self.enable_dp_attention, "dp_size",
                 "> 1 needs --enable-dp-attention (data parallelism is over attention)")
        _require(n % self.dense_tp_size == 0, "moe_dense_tp_size", f"must divide tp_size {n}")
        _require(self.ep_world in (1, n), "ep_size", f"must be 1 or tp_size ({n})")
        _require(self.moe_a2a_backend != "none" or self.ep_world == 1, "ep_size",
                 "> 1 needs an all-to-all backend (--moe-a2a-backend torch, symm_mem or deepep)")
        _require(self.max_dispatch_tokens_per_rank >= 1, "max_dispatch_tokens_per_rank", "must be >= 1")
        _require(self.nnodes >= 1 and n % self.nnodes == 0, "nnodes", f"must divide tp_size {n}")
        _require(0 <= self.node_rank < self.nnodes, "node_rank", f"must be in [0, {self.nnodes})")
        _require(self.nnodes == 1 or self.dist_init_addr is not None, "dist_init_addr",
                 "is required with nnodes > 1 (host:port of node 0)")
        _require(self.nnodes == 1 or self.dist_secret_file is not None, "dist_secret_file",
                 "is required with nnodes > 1 (a file with the same secret on every node)")
        _require(self.load_balance_method in ("round_robin", "shortest_queue", "cache_aware"), "load_balance_method",
                 "must be round_robin, shortest_queue or cache_aware")

    @property
    def world_size(self) -> int:
        return self.tp_size

    @property
    def attn_dp_size(self) -> int:
        return self.dp_size if self.enable_dp_attention else 1

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size // self.attn_dp_size

    @property
    def dense_tp_size(self) -> int:
        return self.moe_dense_tp_size or self.attn_tp_size

    @property
    def ep_world(self) -> int:
        if self.ep_size is not None:
            return self.ep_size
        return self.tp_size if self.moe_a2a_backend != "none" else 1

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes


DISAGGREGATION_MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("nixl", "mooncake", "torch", "fake")  # disagg.transfer.base's registry has each


@dataclass(frozen=True)
class DisaggConfig:
    """Prefill/decode disaggregation, with SGLang's flag names. ``bootstrap_host`` is where this
    server's own bootstrap server listens (set by the launcher from ``--host``)."""

    disaggregation_mode: str = flag("null", choices=DISAGGREGATION_MODES)
    disaggregation_transfer_backend: str = flag("torch", "how KV moves from prefill to decode ranks (fake: "
                                                         "in-process, for unit tests only)", TRANSFER_BACKENDS)
    disaggregation_bootstrap_port: int = flag(8998, "prefill: where its bootstrap server listens (on --host; 0: a free "
                                                    "port, reported in --port-file)")
    disaggregation_ib_device: str | None = flag(None, "RDMA device for mooncake / nixl")
    disaggregation_host: str = flag("127.0.0.1", "the address this server's side channels and KV data paths "
                                                 "listen on")
    disaggregation_secret_file: str | None = flag(None, "a secret (>= 16 bytes) every prefill and decode server "
                                                        "of the deployment shares; default: "
                                                        "~/.config/moeserve/pd_secret, made on first use")
    # SGLang's defaults for the bootstrap and waiting timeouts (its environment variables of these names)
    disaggregation_bootstrap_timeout: float = flag(300.0, "seconds a request may wait for its other side: on a "
                                                          "prefill server for the decode side's page indices, on a "
                                                          "decode server for the prefill server's route and handshake")
    disaggregation_waiting_timeout: float = flag(300.0, "decode: seconds from sending the page indices to the whole "
                                                        "KV cache having arrived; then the request fails, the prefill "
                                                        "side is told to abort, and its pages are freed")
    disaggregation_transfer_timeout: float = flag(60.0, "prefill: seconds a KV write to a decode rank may take")
    disaggregation_heartbeat_interval: float = flag(2.0, "decode: seconds between health checks of each prefill "
                                                         "server it has requests with")
    disaggregation_heartbeat_max_failures: int = flag(3, "decode: a prefill server that misses this many health "
                                                         "checks in a row is dead: its requests fail, their pages are "
                                                         "freed, the connection is dropped")
    bootstrap_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        _require(self.disaggregation_mode in DISAGGREGATION_MODES, "disaggregation_mode",
                 f"must be one of {DISAGGREGATION_MODES}")
        _require(self.disaggregation_transfer_backend in TRANSFER_BACKENDS, "disaggregation_transfer_backend",
                 f"must be one of {TRANSFER_BACKENDS}")
        _require(0 <= self.disaggregation_bootstrap_port < 65536, "disaggregation_bootstrap_port", "must be a port")
        for name in ("disaggregation_bootstrap_timeout", "disaggregation_waiting_timeout",
                     "disaggregation_transfer_timeout", "disaggregation_heartbeat_interval"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value > 0, name, f"must be a positive number of seconds, got {value}")
        _require(self.disaggregation_heartbeat_max_failures >= 1, "disaggregation_heartbeat_max_failures",
                 f"must be >= 1, got {self.disaggregation_heartbeat_max_failures}")

    @property
    def enabled(self) -> bool:
        return self.disaggregation_mode != "null"

    @property
    def secret_path(self) -> str:
        return self.disaggregation_secret_file or os.path.join(os.path.expanduser("~"), ".config", "moeserve",
                                                               "pd_secret")


EP_DISPATCH_ALGORITHMS = ("static", "dynamic", "fake")
RECORDER_MODES = ("stat", "per_pass", "per_token")
EPLB_WEIGHT_SOURCES = ("host", "mmap")


@dataclass(frozen=True)
class EplbConfig:
    """The expert-parallel load balancer (SGLang's flag names): redundant expert slots, where experts
    start, how a routed logical expert picks one of its replicas, the recorder of expert load, and
    online rebalancing every ``eplb_rebalance_num_iterations`` forward passes."""

    ep_num_redundant_experts: int = flag(0, "physical expert slots beyond one per logical expert")
    init_expert_location: str = flag("trivial", "trivial, a placement or distribution file (.json / .pt), or "
                                                "inline JSON (see moeserve eplb plan)")
    ep_dispatch_algorithm: str = flag("static", "which replica a routed expert goes to: static (one on this "
                                                "rank, else a fixed one), dynamic (random per token), fake "
                                                "(uniform random experts: a perfectly balanced load)",
                                      EP_DISPATCH_ALGORITHMS)
    expert_distribution_recorder_mode: str | None = flag(None, "record tokens per expert (on with "
                                                               "--enable-eplb: stat)", RECORDER_MODES)
    expert_distribution_recorder_buffer_size: int = flag(1000, "stat: the window of forward passes kept")
    expert_distribution_recorder_dir: str | None = flag(None, "where /dump_expert_distribution_record "
                                                              "writes (default: a folder under the system "
                                                              "temp dir)")
    enable_eplb: bool = flag(False, "rebalance experts online from the recorded load")
    eplb_rebalance_num_iterations: int = flag(1000, "forward passes between rebalances")
    eplb_rebalance_layers_per_chunk: int | None = flag(None, "layers moved per pause between two steps "
                                                             "(default: all at once)")
    eplb_weights_source: str = flag("host", "where moved expert weights come from: host (a copy in host "
                                            "memory made at load) or mmap (read from the checkpoint on "
                                            "demand)", EPLB_WEIGHT_SOURCES)

    def __post_init__(self) -> None:
        _require(self.ep_num_redundant_experts >= 0, "ep_num_redundant_experts", "must be >= 0")
        _require(self.ep_dispatch_algorithm in EP_DISPATCH_ALGORITHMS, "ep_dispatch_algorithm",
                 f"must be one of {EP_DISPATCH_ALGORITHMS}")
        _require(self.expert_distribution_recorder_mode in (None, *RECORDER_MODES),
                 "expert_distribution_recorder_mode", f"must be one of {RECORDER_MODES}")
        _require(self.expert_distribution_recorder_buffer_size >= 1, "expert_distribution_recorder_buffer_size",
                 "must be >= 1")
        _require(self.eplb_rebalance_num_iterations >= 1, "eplb_rebalance_num_iterations", "must be >= 1")
        _require(self.eplb_rebalance_layers_per_chunk is None or self.eplb_rebalance_layers_per_chunk >= 1,
                 "eplb_rebalance_layers_per_chunk", "must be >= 1")
        _require(self.eplb_weights_source in EPLB_WEIGHT_SOURCES, "eplb_weights_source",
                 f"must be one of {EPLB_WEIGHT_SOURCES}")
        _require(not self.enable_eplb or self.expert_distribution_recorder_mode in (None, "stat"),
                 "expert_distribution_recorder_mode", "must be stat (or unset) with --enable-eplb")

    @property
    def recorder_mode(self) -> str | None:
        """The recorder that runs: the one asked for, or stat for online rebalancing."""
        return self.expert_distribution_recorder_mode or ("stat" if self.enable_eplb else None)


@dataclass(frozen=True)
class RunnerConfig:
    """How the model runner executes: decode batches replay CUDA graphs captured per batch size; a
    rank process compiles its kernels before it reports ready (``executor/warmup.py``)."""

    disable_cuda_graph: bool = flag(False, "run decode eagerly")
    cuda_graph_max_bs: int = flag(256, "largest decode batch replayed from a CUDA graph")
    cuda_graph_multi_rank: bool = flag(False, "decode CUDA graphs with several ranks too: every rank pads each "
                                              "decode step to the bucket the step agreement picks (not yet "
                                              "validated on several GPUs, hence off by default)")
    debug_eager_graphs: bool = flag(False, "run the decode graphs' padded buckets eagerly instead of capturing "
                                           "them (checks the padding and the ranks' bucket agreement, on CPU too)")
    enable_two_batch_overlap: bool = flag(False, "split each batch in two micro-batches: one computes while the "
                                                 "other's MoE all-to-all is in flight (and activations halve)")
    tbo_token_distribution_threshold: float = flag(0.48, "a prefill split between sequences must give the smaller "
                                                         "half this share of the tokens, else a sequence is cut")
    tbo_min_tokens: int = flag(64, "no overlap for a step whose largest DP batch has fewer tokens (it slows "
                                   "small batches)")
    skip_server_warmup: bool = flag(False, "report ready without the start-up passes that compile every kernel "
                                           "variant the batch sizes can reach (the first requests then wait for "
                                           "those compiles)")
    triton_cache_dir: str | None = flag(None, "where the ranks keep compiled Triton kernels (their TRITON_CACHE_DIR), "
                                              "so a restart finds them (default: Triton's own, ~/.triton/cache)")

    def __post_init__(self) -> None:
        _require(self.cuda_graph_max_bs >= 1, "cuda_graph_max_bs", "must be at least 1")
        _require(0 <= self.tbo_token_distribution_threshold <= 0.5, "tbo_token_distribution_threshold",
                 f"must be in [0, 0.5], got {self.tbo_token_distribution_threshold}")
        _require(self.tbo_min_tokens >= 2, "tbo_min_tokens", f"must be >= 2, got {self.tbo_min_tokens}")

    def graph_batch_sizes(self, max_running_requests: int) -> list[int]:
        """Buckets a decode batch is padded up to: 1, 2, 4, 8, then every 8 (as SGLang does)."""
        top = min(self.cuda_graph_max_bs, max_running_requests)
        sizes = [b for b in (1, 2, 4) if b < top] + list(range(8, top + 1, 8))
        return sorted(set(sizes + [top]))


# EAGLE: SGLang's name for the same thing with DeepSeek checkpoints (it runs their MTP module as NEXTN)
SPECULATIVE_ALGORITHMS = ("NEXTN", "EAGLE")
PD_MAX_DRAFTS = 16  # draft tokens a PD first-token record carries (moeserve.disagg.roles)


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding with the checkpoint's multi-token-prediction module (SGLang's flags):
    each decode step verifies ``num_steps`` draft tokens per sequence, chained (top-k 1)."""

    speculative_algorithm: str | None = flag(None, "NEXTN (or EAGLE, SGLang's spelling for DeepSeek): the "
                                                   "checkpoint's MTP module drafts, the model verifies (default: off)",
                                             choices=SPECULATIVE_ALGORITHMS)
    speculative_num_steps: int = flag(1, "draft tokens per sequence and step (the MTP module runs this many "
                                         "times, autoregressively)")
    speculative_eagle_topk: int = flag(1, "draft branches per step; only 1 (a chain) is supported")
    speculative_num_draft_tokens: int | None = flag(None, "tokens verified per sequence and step: "
                                                          "--speculative-num-steps + 1 (the default)")

    def __post_init__(self) -> None:
        _require(self.speculative_algorithm in (None, *SPECULATIVE_ALGORITHMS), "speculative_algorithm",
                 f"must be one of {SPECULATIVE_ALGORITHMS}")
        _require(self.speculative_num_steps >= 1, "speculative_num_steps", "must be >= 1")
        _require(self.speculative_eagle_topk == 1, "speculative_eagle_topk", "must be 1 (chain drafts only)")
        _require(self.speculative_num_draft_tokens in (None, self.speculative_num_steps + 1),
                 "speculative_num_draft_tokens", "must be --speculative-num-steps + 1 (chain drafts)")

    @property
    def enabled(self) -> bool:
        return self.speculative_algorithm is not None

    @property
    def num_drafts(self) -> int:
        """Draft tokens per sequence and step (0 when off)."""
        return self.speculative_num_steps if self.enabled else 0


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name} {message}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    load: LoadConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    eplb: EplbConfig = field(default_factory=EplbConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)

    def __post_init__(self) -> None:
        if self.spec.enabled:
            _require(self.model.num_mtp_layers >= 1, "speculative_algorithm",
                     "NEXTN needs a checkpoint with an MTP module (num_nextn_predict_layers >= 1)")
            _require(self.disagg.disaggregation_mode == "null" or self.spec.num_drafts <= PD_MAX_DRAFTS,
                     "speculative_num_steps", f"must be at most {PD_MAX_DRAFTS} with --disaggregation-mode "
                     "(the drafts travel in the first-token record)")

    @property
    def context_length(self) -> int:
        return self.scheduler.context_length or self.model.max_position_embeddings


def default_page_size(device: str) -> int:
    """KV page size when none is given: 64 slots on CUDA, where the Hopper decode kernel reads a
    sequence's cache a whole 64-row page block at a time (as FlashMLA, which SGLang and vLLM run
    with 64-slot pages; about 2x faster attention than gathering rows from 16-slot pages on an
    H200), 16 elsewhere (finer prefix-cache reuse, nothing to gain from larger blocks)."""
    return 64 if device == "cuda" else 16


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP server of ``moeserve serve`` (not an engine section: the ranks never see it)."""

    host: str = flag("127.0.0.1")
    port: int = flag(30000, "0: a free port, reported in --port-file")
    port_file: str | None = flag(None, "once listening, write {\"port\": ..., \"bootstrap_port\": ...} here as JSON "
                                       "(the ports really bound, for --port 0)")
    api_key: str | None = flag(None, "require 'Authorization: Bearer KEY'")
    served_model_name: str = flag("default", "default: the model folder's name", cli_default=None)
    # no limit by default, as SGLang and vLLM: a burst waits in the engine instead of being refused
    max_queued_requests: int | None = flag(None, "answer 503 (Retry-After) while this many requests wait for their "
                                                 "first token (default: no limit; counted per API worker)")
    max_request_bytes: int = flag(16 << 20, "answer 413 to a request body larger than this")
    chat_template: str | None = flag(None, "a Jinja chat template (a file, or the template text) instead of the "
                                           "tokenizer's")
    reasoning_parser: str | None = flag(None, "split chat completions into reasoning_content and content by the "
                                              "model's thinking tags", choices=("deepseek-r1",))
    tool_call_parser: str | None = flag(None, "parse tool calls out of chat completions in this DeepSeek format "
                                              "(chat requests with tools need it)",
                                        choices=("deepseekv3", "deepseekv31", "deepseekv32"))
    # accepted so that SGLang's launch lines start; each says in the log what it means here
    trust_remote_code: bool = flag(False, "accepted for SGLang's launch lines: moeserve runs no code from the "
                                          "checkpoint")
    enable_metrics: bool = flag(False, "accepted for SGLang's launch lines: /metrics is always served")
    api_workers: int = flag(1, "HTTP worker processes, each tokenizing, detokenizing and streaming its own "
                               "requests on the one port (SGLang's --tokenizer-worker-num): one process carries "
                               "a few hundred streams at engine speed, a decode node's thousands need several")

    def __post_init__(self) -> None:
        _require(self.api_workers >= 1, "api_workers", f"must be >= 1, got {self.api_workers}")
        _require(self.max_queued_requests is None or self.max_queued_requests >= 1, "max_queued_requests",
                 f"must be >= 1, got {self.max_queued_requests}")
        _require(self.max_request_bytes >= 1024, "max_request_bytes", f"must be >= 1024, got {self.max_request_bytes}")


_SECTIONS = {"load": LoadConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
             "runner": RunnerConfig, "disagg": DisaggConfig, "eplb": EplbConfig, "spec": SpecConfig}


def config_flags(classes: tuple[type, ...] | None = None) -> list[tuple[str, type, Any, FlagSpec]]:
    """Every field of ``classes`` (default: the engine's sections) that is a flag: ``(name, type,
    default, spec)``; the type is the field's own (``int | None`` gives ``int``), the default the
    field's unless the spec says another."""
    out = []
    for cls in classes or tuple(_SECTIONS.values()):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            spec = f.metadata.get("flag")
            if spec is not None:
                kind = next(t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None))
                default = f.default if spec.cli_default is _FIELD_DEFAULT else spec.cli_default
                out.append((f.name, kind, default, spec))
    return out


def build_engine_config(model_path: str | None = None, **settings: Any) -> EngineConfig:
    """Flat keyword settings (``page_size=4``, ``dtype="float32"`` …) sorted into their sections.

    The CLI and the offline ``LLM`` both come through here, so a flag and a keyword argument of
    the same name always mean the same thing.
    """
    if model_path is None:
        raise ValueError("model_path is required")
    return engine_config_for(ModelConfig.from_path(model_path), model_path=model_path, **settings)


def engine_config_for(model: ModelConfig, model_path: str | None = None, **settings: Any) -> EngineConfig:
    """``build_engine_config`` for a ``ModelConfig`` already in hand (a preset has no config.json)."""
    by_section: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    fields = {f: name for name, cls in _SECTIONS.items() for f in cls.__dataclass_fields__}
    for key, value in settings.items():
        if key not in fields:
            raise ValueError(f"unknown setting {key!r}; known settings: {', '.join(sorted(fields))}")
        by_section[fields[key]][key] = value
    load = LoadConfig(model_path=model_path, **by_section["load"])
    if by_section["cache"].get("page_size") is None:
        by_section["cache"]["page_size"] = default_page_size(load.device)
    return EngineConfig(
        model=model, load=load,
        cache=CacheConfig(**by_section["cache"]), scheduler=SchedulerConfig(**by_section["scheduler"]),
        parallel=ParallelConfig(**by_section["parallel"]), runner=RunnerConfig(**by_section["runner"]),
        disagg=DisaggConfig(**by_section["disagg"]), eplb=EplbConfig(**by_section["eplb"]),
        spec=SpecConfig(**by_section["spec"]),
    )
