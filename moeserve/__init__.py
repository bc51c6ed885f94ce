"""moeserve: a serving engine for DeepSeek-V3-class mixture-of-experts models."""

from typing import Any

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # imported on first use: the PD router needs neither torch nor the engine, the HTTP API
    # process not the executor
    if name in ("LLM", "RequestOutput"):
        from moeserve import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from moeserve.core import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
