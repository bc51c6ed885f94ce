"""moeserve: a serving engine for DeepSeek-V3-class mixture-of-experts models."""

from typing import Any

from moeserve.core import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # the engine is imported on first use, so that processes that only validate and route
    # requests (the HTTP API) never load the executor
    if name in ("LLM", "RequestOutput"):
        from moeserve import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'moeserve' has no attribute {name!r}")
