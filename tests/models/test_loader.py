"""Checkpoint loading into the model: names, shapes, unknown/missing tensors, dummy weights."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.config import ModelConfig, build_engine_config
from moeserve.executor.model_runner import ModelRunner


def _copy_with(src: str, dst: str, edit) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def test_unknown_tensor_is_named(hf_model_path, tmp_path):
    path = _copy_with(hf_model_path("v3", 0), str(tmp_path / "m"),
                      lambda t: t.__setitem__("model.layers.0.mlp.surprise.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match="model.layers.0.mlp.surprise.weight"):
        ModelRunner(build_engine_config(path, dtype="float32", max_total_tokens=64))


def test_missing_tensor_is_named(hf_model_path, tmp_path):
    path = _copy_with(hf_model_path("v3", 0), str(tmp_path / "m"),
                      lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(ValueError, match="model.layers.2.mlp.experts.5.up_proj.weight"):
        ModelRunner(build_engine_config(path, dtype="float32", max_total_tokens=64))


def test_wrong_shape_is_named(hf_model_path, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"
    path = _copy_with(hf_model_path("v3", 0), str(tmp_path / "m"),
                      lambda t: t.__setitem__(name, torch.zeros(3, 3)))
    with pytest.raises(ValueError, match=name):
        ModelRunner(build_engine_config(path, dtype="float32", max_total_tokens=64))


def test_every_checkpoint_tensor_lands_where_transformers_keeps_it(hf_model_path):
    path = hf_model_path("v3", 0)
    runner = ModelRunner(build_engine_config(path, dtype="float32", max_total_tokens=64))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    layer = runner.model.model.layers[2]
    inter = 32
    torch.testing.assert_close(layer.mlp.experts.w13[5, inter:], tensors["model.layers.2.mlp.experts.5.up_proj.weight"])
    torch.testing.assert_close(layer.mlp.experts.w2[7], tensors["model.layers.2.mlp.experts.7.down_proj.weight"])
    torch.testing.assert_close(runner.model.model.layers[0].mlp.gate_up_proj.weight[:96],
                               tensors["model.layers.0.mlp.gate_proj.weight"])
    torch.testing.assert_close(layer.mlp.gate.e_score_correction_bias,
                               tensors["model.layers.2.mlp.gate.e_score_correction_bias"])


def test_dummy_load_format_gives_real_shapes_without_weights(hf_model_path, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(os.path.join(hf_model_path("v3", 0), "config.json"), folder)
    runner = ModelRunner(build_engine_config(str(folder), load_format="dummy", dtype="bfloat16",
                                             max_total_tokens=64))
    assert runner.model.model.layers[1].mlp.experts.w13.shape == (8, 64, 64)
    assert runner.model.model.layers[1].mlp.experts.w13.dtype == torch.bfloat16
    assert runner.model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_released_deepseek_v3_config_parses():
    """The released config.json format: ``rope_scaling`` (not ``rope_parameters``), FP8 blocks."""
    hf = {
        "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "max_position_embeddings": 163840, "rope_theta": 10000, "rms_norm_eps": 1e-6,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
        "num_nextn_predict_layers": 1, "eos_token_id": 1, "bos_token_id": 0, "torch_dtype": "bfloat16",
    }
    cfg = ModelConfig.from_dict(json.loads(json.dumps(hf)))
    assert cfg.rope.kind == "yarn" and cfg.rope.factor == 40 and cfg.fp8_block == (128, 128)
    assert cfg.kv_cache_dim == 576 and cfg.num_mtp_layers == 1
    mscale = 0.1 * 1.0 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * mscale * mscale)
    assert [cfg.is_moe_layer(i) for i in (0, 2, 3, 60)] == [False, False, True, True]
