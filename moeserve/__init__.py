"""moeserve: a serving engine for DeepSeek-V3-class mixture-of-experts models."""

from moeserve.core import SamplingParams
from moeserve.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
