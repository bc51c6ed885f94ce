"""Tiny DeepSeek checkpoints written by transformers' own ``save_pretrained`` — the oracle side."""

from __future__ import annotations

import os

import torch

TINY_DIMS = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16,
    v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
    max_position_embeddings=512, initializer_range=0.1, bos_token_id=0, eos_token_id=1, pad_token_id=None,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
        "beta_slow": 1, "rope_theta": 10000.0}

VARIANTS = {
    # DeepSeek-V3: q-LoRA, sigmoid router with bias and group-limited top-k, YaRN with mscale 1
    "v3": ("deepseek_v3", dict(q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2, norm_topk_prob=True,
                               routed_scaling_factor=2.5,
                               rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0})),
    # DeepSeek-V2-Lite: no q-LoRA, softmax greedy router, two shared experts, YaRN mscale 0.707
    "v2-lite": ("deepseek_v2", dict(q_lora_rank=None, n_shared_experts=2, topk_method="greedy",
                                    norm_topk_prob=False, routed_scaling_factor=1.0,
                                    rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707})),
    # DeepSeek-V2: q-LoRA, softmax group-limited greedy router, plain RoPE
    "v2": ("deepseek_v2", dict(q_lora_rank=48, n_shared_experts=2, topk_method="group_limited_greedy", n_group=4,
                               topk_group=2, norm_topk_prob=False, routed_scaling_factor=1.5,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
}


def hf_config(variant: str, **overrides):
    from transformers import DeepseekV2Config, DeepseekV3Config

    model_type, extra = VARIANTS[variant]
    cls = DeepseekV3Config if model_type == "deepseek_v3" else DeepseekV2Config
    return cls(**{**TINY_DIMS, **extra, **overrides})


def save_hf_model(path: str, variant: str, seed: int, **overrides) -> str:
    """Random weights (the router bias too) saved by transformers; returns ``path``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(variant, **overrides), dtype=torch.float32)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.rand_like(buf) * 0.1)
    model.save_pretrained(path)
    return path


def load_hf_model(path: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None  # compare fixed-length greedy runs
    model.generation_config.pad_token_id = 0
    return model.eval()


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def cached_hf_model(root: str, variant: str, seed: int) -> str:
    path = os.path.join(root, f"{variant}-seed{seed}")
    if not os.path.exists(os.path.join(path, "config.json")):
        save_hf_model(path, variant, seed)
    return path
