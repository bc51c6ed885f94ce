"""Messages between the API process and the engine ranks (pickled over ZMQ)."""

from __future__ import annotations

from dataclasses import dataclass, field

from moeserve.core import SamplingParams, TokenLogprob


@dataclass
class GenerateInput:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class AbortInput:
    rid: str


@dataclass
class ShutdownInput:
    pass


@dataclass
class TokenOutput:
    """New tokens of one request since the last message; ``finish_reason`` set on the last one.

    ``text`` is the engine's final text (cut at a stop string) and comes only with the finish;
    ``error`` is set when the engine refused the request.
    """

    rid: str
    new_ids: list[int]
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None
    error: str | None = None
    prompt_len: int = 0


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    pages_used: int
    pages_total: int
    page_size: int
    retracted: int
    generation_steps: int
    dp_rank: int = 0
