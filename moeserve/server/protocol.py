"""OpenAI-compatible request bodies (plus the extensions SGLang and vLLM users rely on)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from moeserve.core import BootstrapInfo, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _BootstrapFields(BaseModel):
    """Set by the PD router on requests to a prefill or a decode server; a monolithic server
    ignores them. Choice ``i`` of a request (prompts x n) uses room ``bootstrap_room + i``."""

    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = Field(None, ge=0, lt=2**63)
    prefill_dp_rank: int | None = Field(None, ge=0)

    def bootstrap(self, index: int) -> BootstrapInfo | None:
        if self.bootstrap_room is None or self.bootstrap_host is None or self.bootstrap_port is None:
            return None
        return BootstrapInfo(self.bootstrap_host, self.bootstrap_port, (self.bootstrap_room + index) % 2**63,
                             self.prefill_dp_rank)


class _SamplingFields(_BootstrapFields):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # extensions
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=None if self.seed is None else self.seed + choice,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            repetition_penalty=self.repetition_penalty, stop=[] if self.stop is None else self.stop,
            stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class GenerateRequest(_BootstrapFields):
    """The native endpoint, shaped like SGLang's ``/generate``."""

    model_config = ConfigDict(extra="ignore")

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
