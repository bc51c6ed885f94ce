"""OpenAI-compatible request bodies (plus the extensions SGLang and vLLM users rely on)."""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moeserve.core import BootstrapInfo, SamplingParams

logger = logging.getLogger(__name__)

# Fields of OpenAI's and SGLang's request schemas that this server does not honour yet, each with the
# values that ask for nothing (sending one of those is fine). Any other value is a 400 naming the
# field: an answer that silently ignored it would have the wrong shape (no tool call, no JSON, ...).
NOT_HONOURED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []), "function_call": (None, "none", "auto"),
    "reasoning_effort": (None,),
    "suffix": (None, ""), "best_of": (None, 1), "prediction": (None,), "audio": (None,),
    "modalities": (None, ["text"]), "web_search_options": (None,),
}
# fields of those schemas that change nothing in what the engine computes or returns
HARMLESS = frozenset({"user", "store", "metadata", "service_tier", "rid"})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk


def check_fields(model: type[BaseModel], data: Any) -> Any:
    """Refuse a field of ``NOT_HONOURED`` set to a value that asks for something; note the unknown
    fields in one log line (vLLM's rule: ignored, but said)."""
    if not isinstance(data, dict):
        return data
    for name, inert in NOT_HONOURED.items():
        if name in data and not any(data[name] == value for value in inert):
            raise ValueError(f"{name} is not supported by this server (leave it out)")
    unknown = sorted(set(data) - set(model.model_fields) - set(NOT_HONOURED) - HARMLESS)
    if unknown:
        logger.info("a %s had fields this server does not know; ignored: %s", model.__name__, ", ".join(unknown))
    return data


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


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always matches the schema here


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self

    def schema_text(self) -> str:
        if self.type == "json_object":
            return '{"type": "object"}'
        return json.dumps(self.json_schema.json_schema)


def token_biases(bias: dict[str, float] | dict[int, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON's string keys) with integer keys."""
    if not bias:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except (TypeError, ValueError) as exc:
        raise ValueError("logit_bias keys must be token ids") from exc


class _SamplingFields(_BootstrapFields):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _check_fields(cls, data: Any) -> Any:
        return check_fields(cls, data)

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
    logit_bias: dict[str, float] | None = None
    min_tokens: int = 0
    priority: int = 0
    # structured outputs: OpenAI's response_format, or SGLang's fields (at most one of them all)
    response_format: ResponseFormat | None = None
    json_schema: str | dict | None = None
    regex: str | None = None
    ebnf: str | None = None

    def grammar(self) -> dict[str, str]:
        """The grammar field of ``SamplingParams`` this request asks for, if any."""
        given = {name: getattr(self, name) for name in ("json_schema", "regex", "ebnf") if getattr(self, name)}
        fmt = self.response_format
        if fmt is not None and fmt.type != "text":
            if given:
                raise ValueError(f"response_format and {next(iter(given))} both constrain the output: give one")
            given = {"json_schema": fmt.schema_text()}
        if isinstance(given.get("json_schema"), dict):
            given["json_schema"] = json.dumps(given["json_schema"])
        return given

    def sampling_params(self, max_tokens: int, logprobs: int | None, choice: int) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        return SamplingParams(
            logit_bias=token_biases(self.logit_bias), min_tokens=self.min_tokens, priority=self.priority,
            **self.grammar(),
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


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    """An assistant turn's call, as the server returned it (sent back in the history)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionCall | dict[str, str]

    @property
    def name(self) -> str:
        return self.function.name if isinstance(self.function, FunctionCall) else self.function.get("name", "")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (HF's convention: a call's arguments as given)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    separate_reasoning: bool = True  # SGLang's: with --reasoning-parser, reasoning_content apart from content
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # false: tool_choice required makes exactly one call
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the last (assistant) message is left open for the model to go on with
    continue_final_message: bool = False
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _choice_needs_tools(self) -> ChatCompletionRequest:
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice required or a named function needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.name not in {
                t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not among the tools")
        return self

    @property
    def tool_mode(self) -> str:
        """``none`` (no tools, or the client said so), ``auto``, ``required`` or ``named``."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"


class GenerateRequest(_BootstrapFields):
    """The native endpoint, shaped like SGLang's ``/generate``."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _check_fields(cls, data: Any) -> Any:
        return check_fields(cls, data)

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict = Field(default_factory=dict)
    stream: bool = False
    return_logprob: bool = False
    priority: int = 0  # SGLang's: with --enable-priority-scheduling
    logprob_start_len: int = Field(-1, ge=-1)  # SGLang's: input logprobs from this prompt position (-1: none)
    top_logprobs_num: int = 0


class TokenizeRequest(BaseModel):
    """``/tokenize``: a text (``prompt``, vLLM's name, or ``text``, SGLang's) to token ids."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    text: str | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    """``/detokenize``: token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]

