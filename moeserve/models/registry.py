"""Which model class serves a checkpoint, by its ``config.json``'s ``model_type``."""

from __future__ import annotations

from moeserve.config import ModelConfig
from moeserve.models.deepseek import DeepseekForCausalLM
from moeserve.models.deepseek_v32 import DeepseekV32ForCausalLM

MODEL_CLASSES: dict[str, type[DeepseekForCausalLM]] = {
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,
    "deepseek_v32": DeepseekV32ForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[DeepseekForCausalLM]:
    return MODEL_CLASSES[cfg.model_type]
