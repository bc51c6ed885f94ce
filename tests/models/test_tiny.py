"""Tiny checkpoints load into transformers' own DeepSeek classes with no key left over."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from moeserve.config import ModelConfig
from moeserve.kernels.fp8 import block_dequant_fp8
from moeserve.models.tiny import ASSISTANT, BOS, EOS, USER, make_tiny_model

transformers = pytest.importorskip("transformers")

PRESETS = ("v3", "v2-lite", "v2")


def _stored(model_path: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for name in sorted(os.listdir(model_path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_path, name), framework="pt") as f:
                tensors.update({k: f.get_tensor(k) for k in f.keys()})
    return tensors


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    dirs = {p: make_tiny_model(str(root / p), p) for p in PRESETS}
    dirs["v3-fp8"] = make_tiny_model(str(root / "v3-fp8"), "v3", fp8=True)
    return dirs


@pytest.mark.parametrize("preset", PRESETS)
def test_transformers_loads_every_key(tiny_dirs: dict[str, str], preset: str) -> None:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs[preset], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    expected_arch = "DeepseekV3ForCausalLM" if preset == "v3" else "DeepseekV2ForCausalLM"
    assert type(model).__name__ == expected_arch

    # Values arrive too: transformers fuses the per-expert files into gate_up_proj [E, 2I, H].
    stored = _stored(tiny_dirs[preset])
    fused = model.model.layers[1].mlp.experts.gate_up_proj[3]
    inter = fused.shape[0] // 2
    assert torch.equal(fused[:inter], stored["model.layers.1.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(fused[inter:], stored["model.layers.1.mlp.experts.3.up_proj.weight"])
    assert torch.isfinite(model(torch.tensor([[0, 5, 6, 7]])).logits).all()


@pytest.mark.parametrize("preset", PRESETS)
def test_config_parses(tiny_dirs: dict[str, str], preset: str) -> None:
    cfg = ModelConfig.from_path(tiny_dirs[preset])
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 4 and cfg.num_layers == 3
    assert cfg.router == {"v3": "noaux_tc", "v2-lite": "greedy", "v2": "group_limited_greedy"}[preset]
    assert (cfg.q_lora_rank is None) == (preset == "v2-lite")
    assert cfg.checkpoint_dtype == "float32" and cfg.fp8_block is None
    assert cfg.bos_token_id == 0 and cfg.eos_token_ids == (1,)
    bias = _stored(tiny_dirs[preset]).get("model.layers.1.mlp.gate.e_score_correction_bias")
    assert (bias is not None and bias.abs().sum() > 0) == (preset == "v3")


def test_fp8_keys_are_bf16_keys_plus_scales(tiny_dirs: dict[str, str]) -> None:
    plain, fp8 = _stored(tiny_dirs["v3"]), _stored(tiny_dirs["v3-fp8"])
    scales = {n for n in fp8 if n.endswith("_scale_inv")}
    assert set(fp8) == set(plain) | scales
    quantized = {n.removesuffix("_scale_inv") for n in scales}
    for name in plain:
        linear_in_layer = name.startswith("model.layers.") and name.endswith("proj.weight")
        linear_in_layer |= name.endswith("kv_a_proj_with_mqa.weight")
        assert (name in quantized) == linear_in_layer, name
    for name in quantized:
        assert fp8[name].dtype == torch.float8_e4m3fn and fp8[name + "_scale_inv"].dtype == torch.float32
    assert fp8["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert fp8["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert fp8["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32

    cfg = ModelConfig.from_path(tiny_dirs["v3-fp8"])
    assert cfg.fp8_block == (128, 128) and cfg.checkpoint_dtype == "bfloat16"
    with open(os.path.join(tiny_dirs["v3-fp8"], "config.json")) as f:
        assert json.load(f)["quantization_config"]["fmt"] == "e4m3"
    # Same seed, same draw: the FP8 checkpoint is the fp32 one, quantized.
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    deq = block_dequant_fp8(fp8[name], fp8[name + "_scale_inv"], cfg.fp8_block)
    assert (deq - plain[name]).norm() <= plain[name].norm() / 16


def test_sharded_and_overrides(tmp_path: Path) -> None:
    out = make_tiny_model(str(tmp_path), "v2-lite", shard_size_mb=0.3, hidden_size=96, num_hidden_layers=2)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    assert len(set(weight_map.values())) > 1
    assert not os.path.exists(os.path.join(out, "model.safetensors"))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.hidden_size == 96 and len(model.model.layers) == 2


def test_seed_is_deterministic(tmp_path: Path) -> None:
    a = _stored(make_tiny_model(str(tmp_path / "a"), "v3", seed=3, num_hidden_layers=2))
    b = _stored(make_tiny_model(str(tmp_path / "b"), "v3", seed=3, num_hidden_layers=2))
    c = _stored(make_tiny_model(str(tmp_path / "c"), "v3", seed=4, num_hidden_layers=2))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_unknown_preset(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="preset"):
        make_tiny_model(str(tmp_path), "v4")


def test_tokenizer_round_trip_and_ids(tiny_dirs: dict[str, str]) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dirs["v3"])
    with open(os.path.join(tiny_dirs["v3"], "config.json")) as f:
        hf = json.load(f)
    assert tok.bos_token_id == hf["bos_token_id"] and tok.eos_token_id == hf["eos_token_id"]
    assert len(tok) <= hf["vocab_size"]
    text = "héllo → 世界, the end"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.convert_tokens_to_ids(USER) != tok.unk_token_id and len(tok.encode(USER, add_special_tokens=False)) == 1


def test_chat_template_renders(tiny_dirs: dict[str, str]) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dirs["v3"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == f"{BOS}Be brief.{USER}hi{ASSISTANT}hello{EOS}{USER}again{ASSISTANT}"
    text = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=False)
    assert text == f"{BOS}{USER}hi"
    with open(os.path.join(tiny_dirs["v3"], "generation_config.json")) as f:
        assert json.load(f) == {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
