"""Tiny random DeepSeek V2/V3 checkpoints in the released Hugging Face layout, for tests.

Built from torch and safetensors alone (no transformers model), so the file layout is ours to
check against transformers rather than borrowed from it. Tensor names are the ones
``DeepseekV3ForCausalLM.save_pretrained`` writes: experts one by one
(``mlp.experts.{e}.gate_proj.weight``), although transformers 5 fuses them into 3-D tensors in memory.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors.torch import save_file

from moeserve.config import DTYPES, ModelConfig
from moeserve.kernels.fp8 import block_quant_fp8
from moeserve.models.checkpoint import INDEX_FILE

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"

# DeepSeek-V3's template: bos, system text, then User/Assistant turns; with tools, their list after
# the system text and the V3 call format (``--tool-call-parser deepseekv3``), calls in assistant turns
# and tool results in V3's tags. Without tools the text is DeepSeek-V3's.
CALLS = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
OUTPUTS = "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{{ message['content'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- if tools %}{{ '\n\n## Tools\nYou can call these functions:' }}"
    "{%- for tool in tools %}{{ '\n### ' + tool['function']['name'] + '\n' }}"
    "{{ (tool['function']['description'] or '') + '\nParameters: ' + (tool['function']['parameters'] | tojson) }}"
    "{%- endfor %}"
    "{{ '\nA call is written ' + '" + CALLS[0] + CALLS[2] + "function" + CALLS[4] + "NAME\\n```json\\nARGUMENTS"
    "\\n```" + CALLS[3] + CALLS[1] + "' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '" + USER + "' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '" + ASSISTANT + "' + (message['content'] or '') + '" + CALLS[0] + "' }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set args = call['function']['arguments'] %}"
    "{{ '" + CALLS[2] + "function" + CALLS[4] + "' + call['function']['name'] + '\n```json\n' }}"
    "{{ (args if args is string else args | tojson) + '\n```" + CALLS[3] + "' }}"
    "{%- endfor %}{{ '" + CALLS[1] + EOS + "' }}"
    "{%- elif message['role'] == 'assistant' %}{{ '" + ASSISTANT + "' + message['content'] + '" + EOS + "' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{ '" + OUTPUTS[0] + OUTPUTS[2] + "' + message['content'] + '" + OUTPUTS[3] + OUTPUTS[1] + "' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{%- endif %}"
)

# A few merges so some tokens span several bytes, including half of a UTF-8 character
# ("ä¸" is the first two bytes of 世), which the incremental detokenizer must hold back.
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("e", "r"), ("Ã", "©"), ("ä", "¸")]

FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128],
}

_COMMON: dict[str, Any] = {
    "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "num_attention_heads": 4,
    "kv_lora_rank": 32, "q_lora_rank": 48, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "initializer_range": 0.02,
    "max_position_embeddings": 512, "rope_theta": 10000,
    "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "use_cache": True,
}
_YARN = {"type": "yarn", "factor": 4, "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1}

PRESETS: dict[str, dict[str, Any]] = {
    "v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 4, "topk_group": 2,
        "n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        # The released V3 ships one MTP layer; a tiny checkpoint ships none, so says 0.
        "num_nextn_predict_layers": 0,
        "rope_scaling": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    # V3 plus the lightning indexer; few index tokens, so that tiny prompts already select
    "v32": {
        "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "n_group": 4, "topk_group": 2,
        "n_shared_experts": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 0,
        "index_topk": 16, "index_n_heads": 16, "index_head_dim": 32,
        "rope_scaling": {**_YARN, "mscale": 1.0, "mscale_all_dim": 1.0},
    },
    "v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "topk_method": "greedy", "scoring_func": "softmax", "n_group": 1, "topk_group": 1, "q_lora_rank": None,
        "n_shared_experts": 2, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
        "rope_scaling": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
    },
    "v2": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "topk_method": "group_limited_greedy", "scoring_func": "softmax", "n_group": 4, "topk_group": 2,
        "n_shared_experts": 2, "norm_topk_prob": False, "routed_scaling_factor": 16.0,  # as released V2
        "rope_scaling": {**_YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
    },
}

# Initialisations: "linear" (normal 0.02, quantized in FP8 checkpoints); "router", "embed" and
# "bias" (normal 0.02, never quantized); "norm" (ones); "scale" (ones plus normal 0.1: the MTP
# module's own norms, which a test must tell apart); "correction" (V3's e_score_correction_bias).
_Spec = tuple[str, tuple[int, ...], str]

# The MTP tensors are drawn from a generator of their own (seeded ``seed + _MTP_SEED``), so that the
# model's weights are those of the checkpoint without them.
_MTP_SEED = 0x6D7470


def make_tiny_model(
    out_dir: str,
    preset: str = "v3",
    fp8: bool = False,
    seed: int = 0,
    shard_size_mb: float | None = None,
    mtp: bool = False,
    **overrides: Any,
) -> str:
    """Write config.json, generation_config.json, safetensors weights and a tokenizer to ``out_dir``.

    ``overrides`` replace config.json keys (``hidden_size=192``, ``num_hidden_layers=2``, ...).
    ``fp8`` stores decoder-layer linear weights as float8_e4m3fn plus a ``weight_scale_inv``
    exactly like the released DeepSeek-V3; with the same ``seed`` they dequantize to about the
    weights of the non-FP8 checkpoint. ``shard_size_mb`` splits the weights into several files
    with a ``model.safetensors.index.json``. ``mtp`` adds one multi-token-prediction module as
    DeepSeek-V3 ships it (``num_nextn_predict_layers: 1``, tensors under
    ``model.layers.{num_hidden_layers}.``, the embedding and LM head repeated there); the other
    weights stay those of the checkpoint without it. Returns ``out_dir``.
    """
    hf = _hf_config(preset, fp8, overrides)
    if mtp:
        hf["num_nextn_predict_layers"] = 1
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = write_tiny_tokenizer(out_dir)
    hf["bos_token_id"], hf["eos_token_id"] = tokenizer.bos_token_id, tokenizer.eos_token_id
    if hf["vocab_size"] < len(tokenizer):
        raise ValueError(f"vocab_size {hf['vocab_size']} is smaller than the tokenizer's {len(tokenizer)} tokens")
    cfg = ModelConfig.from_dict(hf)
    tensors = _storage_form(_random_weights(cfg, seed, hf["initializer_range"], mtp), _kinds(cfg, mtp), cfg,
                            DTYPES[hf["torch_dtype"]], fp8)
    _save_weights(out_dir, tensors, shard_size_mb)
    _write_json(os.path.join(out_dir, "config.json"), hf)
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"]})
    return out_dir


def write_tiny_tokenizer(out_dir: str) -> Any:
    """Save a byte-level BPE tokenizer with DeepSeek's special tokens and chat template.

    Returns the ``transformers.PreTrainedTokenizerFast`` (typed ``Any`` to keep transformers an
    import of this function only).
    """
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_bpe(), bos_token=BOS, eos_token=EOS,
        additional_special_tokens=[USER, ASSISTANT], chat_template=CHAT_TEMPLATE, model_max_length=16384,
    )
    # Released checkpoints keep the template inside tokenizer_config.json, not chat_template.jinja.
    tok.save_pretrained(out_dir, save_jinja_files=False)
    return tok


def _byte_level_bpe() -> Any:
    """GPT-2 style byte-level BPE: bos=0, eos=1, the 256 bytes, a few merges, then User/Assistant
    and the tool-call tags."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {BOS: 0, EOS: 1}
    for ch in _bytes_to_unicode().values():
        vocab[ch] = len(vocab)
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOS, EOS, USER, ASSISTANT)])
    # the tool-call tags, one token each as in DeepSeek's tokenizers (kept in decoded text)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (*CALLS, *OUTPUTS)])
    # DeepSeek's tokenizers prepend bos when asked for special tokens, and nothing else.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 0)]
    )
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (what ByteLevel pre-tokenizers emit)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _hf_config(preset: str, fp8: bool, overrides: dict[str, Any]) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} is unknown; expected one of {sorted(PRESETS)}")
    hf = {**_COMMON, **PRESETS[preset]}
    dtype = "bfloat16" if fp8 else "float32"
    hf.update(torch_dtype=dtype, dtype=dtype)
    if fp8:
        hf["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    hf.update(overrides)
    if "torch_dtype" in overrides or "dtype" in overrides:  # keep the two spellings in step
        hf["torch_dtype"] = hf["dtype"] = overrides.get("torch_dtype", overrides.get("dtype"))
    # MLA has one key/value head per query head; follow num_attention_heads unless told otherwise.
    hf.setdefault("num_key_value_heads", hf["num_attention_heads"])
    return hf


def _random_weights(cfg: ModelConfig, seed: int, std: float, mtp: bool = False) -> dict[str, torch.Tensor]:
    """Draw every tensor in fp32, in a fixed order, from one seeded generator (the MTP module's
    from a second one); linears get normal(0, ``std``) (config.json's ``initializer_range``)."""
    tensors = _draw(_weight_specs(cfg), torch.Generator().manual_seed(seed), std)
    if mtp:
        tensors.update(_draw(_mtp_specs(cfg), torch.Generator().manual_seed(seed + _MTP_SEED), std))
        tensors.update({name: tensors[source].clone() for name, source in _mtp_copies(cfg).items()})
    return tensors


def _draw(specs: Iterator[_Spec], gen: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, shape, kind in specs:
        if kind == "norm":
            tensors[name] = torch.ones(shape)
        elif kind == "scale":
            tensors[name] = 1 + torch.randn(shape, generator=gen) * 0.1
        elif kind == "correction":
            # Comparable to the spread of sigmoid router scores, so it really changes choices.
            tensors[name] = torch.randn(shape, generator=gen) * 0.05
        else:
            tensors[name] = torch.randn(shape, generator=gen) * std
    return tensors


def _kinds(cfg: ModelConfig, mtp: bool) -> dict[str, str]:
    """Each tensor's init kind; the MTP module's copies of the embedding and head are "embed"."""
    kinds = {name: kind for name, _, kind in _weight_specs(cfg)}
    if mtp:
        kinds.update({name: kind for name, _, kind in _mtp_specs(cfg)})
        kinds.update(dict.fromkeys(_mtp_copies(cfg), "embed"))
    return kinds


def _storage_form(
    tensors: dict[str, torch.Tensor], kinds: dict[str, str], cfg: ModelConfig, dtype: torch.dtype, fp8: bool
) -> dict[str, torch.Tensor]:
    """Cast to the checkpoint dtype as released checkpoints store them.

    FP8: each "linear" weight becomes float8_e4m3fn followed by ``<name>_scale_inv`` (fp32),
    quantized from the fp32 draw. The correction bias stays fp32 (transformers keeps it so).
    """
    out = {}
    for name, t in tensors.items():
        if fp8 and kinds[name] == "linear":
            out[name], out[name + "_scale_inv"] = block_quant_fp8(t, cfg.fp8_block)
        else:
            out[name] = t if kinds[name] == "correction" else t.to(dtype)
    return out


def _weight_specs(cfg: ModelConfig) -> Iterator[_Spec]:
    """(name, shape, init kind) for every tensor ``save_pretrained`` writes, in a fixed order."""
    h, v = cfg.hidden_size, cfg.vocab_size
    yield "model.embed_tokens.weight", (v, h), "embed"
    for i in range(cfg.num_layers):
        yield from _layer_specs(cfg, i, f"model.layers.{i}.")
    yield "model.norm.weight", (h,), "norm"
    if not cfg.tie_word_embeddings:  # tied heads are not written, as in save_pretrained
        yield "lm_head.weight", (v, h), "embed"


def _layer_specs(cfg: ModelConfig, layer: int, prefix: str) -> Iterator[_Spec]:
    h = cfg.hidden_size
    yield prefix + "input_layernorm.weight", (h,), "norm"
    yield from _attention_specs(cfg, prefix + "self_attn.")
    yield prefix + "post_attention_layernorm.weight", (h,), "norm"
    if cfg.is_moe_layer(layer):
        yield from _moe_specs(cfg, prefix + "mlp.")
    else:
        yield from _mlp_specs(prefix + "mlp.", h, cfg.intermediate_size)


def _mtp_specs(cfg: ModelConfig) -> Iterator[_Spec]:
    """DeepSeek-V3's MTP module, layer ``num_layers``: its own norms and projection around one
    decoder layer (the embedding and head it repeats: ``_mtp_copies``)."""
    h, layer = cfg.hidden_size, cfg.num_layers
    prefix = f"model.layers.{layer}."
    yield prefix + "enorm.weight", (h,), "scale"
    yield prefix + "hnorm.weight", (h,), "scale"
    yield prefix + "eh_proj.weight", (h, 2 * h), "linear"
    yield from _layer_specs(cfg, layer, prefix)
    yield prefix + "shared_head.norm.weight", (h,), "scale"


def _mtp_copies(cfg: ModelConfig) -> dict[str, str]:
    """The MTP module's repeats of the model's embedding and LM head: name -> the model's name."""
    prefix = f"model.layers.{cfg.num_layers}."
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    return {prefix + "embed_tokens.weight": "model.embed_tokens.weight", prefix + "shared_head.head.weight": head}


def _attention_specs(cfg: ModelConfig, p: str) -> Iterator[_Spec]:
    h, heads = cfg.hidden_size, cfg.num_heads
    if cfg.q_lora_rank is None:
        yield p + "q_proj.weight", (heads * cfg.qk_head_dim, h), "linear"
    else:
        yield p + "q_a_proj.weight", (cfg.q_lora_rank, h), "linear"
        if cfg.attention_bias:
            yield p + "q_a_proj.bias", (cfg.q_lora_rank,), "bias"
        yield p + "q_a_layernorm.weight", (cfg.q_lora_rank,), "norm"
        yield p + "q_b_proj.weight", (heads * cfg.qk_head_dim, cfg.q_lora_rank), "linear"
    yield p + "kv_a_proj_with_mqa.weight", (cfg.kv_cache_dim, h), "linear"
    if cfg.attention_bias:
        yield p + "kv_a_proj_with_mqa.bias", (cfg.kv_cache_dim,), "bias"
    yield p + "kv_a_layernorm.weight", (cfg.kv_lora_rank,), "norm"
    yield p + "kv_b_proj.weight", (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "linear"
    yield p + "o_proj.weight", (h, heads * cfg.v_head_dim), "linear"
    if cfg.attention_bias:
        yield p + "o_proj.bias", (h,), "bias"
    if cfg.index_topk:
        yield from _indexer_specs(cfg, p + "indexer.")


def _indexer_specs(cfg: ModelConfig, p: str) -> Iterator[_Spec]:
    """DeepSeek-V3.2's indexer as released: FP8 projections but for the head weights; a LayerNorm
    whose bias is drawn, like every tensor that would otherwise start at zero."""
    heads, dim = cfg.index_n_heads, cfg.index_head_dim
    yield p + "wq_b.weight", (heads * dim, cfg.q_lora_rank), "linear"
    yield p + "wk.weight", (dim, cfg.hidden_size), "linear"
    yield p + "k_norm.weight", (dim,), "scale"
    yield p + "k_norm.bias", (dim,), "correction"
    yield p + "weights_proj.weight", (heads, cfg.hidden_size), "router"


def _moe_specs(cfg: ModelConfig, p: str) -> Iterator[_Spec]:
    h = cfg.hidden_size
    yield p + "gate.weight", (cfg.n_routed_experts, h), "router"
    if cfg.router == "noaux_tc":
        yield p + "gate.e_score_correction_bias", (cfg.n_routed_experts,), "correction"
    for e in range(cfg.n_routed_experts):
        yield from _mlp_specs(f"{p}experts.{e}.", h, cfg.moe_intermediate_size)
    if cfg.n_shared_experts:
        yield from _mlp_specs(p + "shared_experts.", h, cfg.moe_intermediate_size * cfg.n_shared_experts)


def _mlp_specs(p: str, hidden: int, inter: int) -> Iterator[_Spec]:
    yield p + "gate_proj.weight", (inter, hidden), "linear"
    yield p + "up_proj.weight", (inter, hidden), "linear"
    yield p + "down_proj.weight", (hidden, inter), "linear"


def _save_weights(out_dir: str, tensors: dict[str, torch.Tensor], shard_size_mb: float | None) -> None:
    """One ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` shards plus an index."""
    # Weights left by an earlier call (another sharding) would be read alongside the new ones.
    for stale in glob.glob(os.path.join(out_dir, "*.safetensors")) + glob.glob(os.path.join(out_dir, INDEX_FILE)):
        os.remove(stale)
    metadata = {"format": "pt"}
    if shard_size_mb is None:
        save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata=metadata)
        return
    shards = _split_shards(tensors, int(shard_size_mb * 2**20))
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out_dir, fname), metadata=metadata)
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(os.path.join(out_dir, INDEX_FILE), index)


def _split_shards(tensors: dict[str, torch.Tensor], limit: int) -> list[dict[str, torch.Tensor]]:
    """Fill shards in order, starting a new one when the next tensor would pass ``limit`` bytes."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _write_json(path: str, obj: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False, sort_keys=True)
        f.write("\n")
