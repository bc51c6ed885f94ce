"""Messages between the API process and the engine ranks: plain data with a schema.

Every message is a tagged ``msgspec`` struct encoded as MessagePack, never a pickle: a decoder
accepts only the types of its channel, checks every field's type, and runs ``SamplingParams``'
range checks, so a malformed or forged message is refused (and counted) instead of run.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from moeserve.core import BootstrapInfo, SamplingParams, TokenLogprob


class GenerateInput(msgspec.Struct, tag="generate"):
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    bootstrap: BootstrapInfo | None = None  # the other side of a disaggregated request
    reply_to: int = 0  # the API worker that sent it: its tokens go back there


class AbortInput(msgspec.Struct, tag="abort"):
    rid: str


class ShutdownInput(msgspec.Struct, tag="shutdown"):
    pass


ExpertAction = Literal["start_record", "stop_record", "dump_record", "rebalance", "stats", "flush_cache"]


class ExpertControlInput(msgspec.Struct, tag="expert_control"):
    """An action on the expert recorder or placement. Every DP group gets it; the ranks run it at
    the first step where all of them have it (``seq`` rides on the step agreement)."""

    seq: int
    action: ExpertAction
    reply_to: int = 0  # the API worker that sent it: rank 0's answer goes back there


class ControlOutput(msgspec.Struct, tag="control"):
    """The answer to an ``ExpertControlInput`` (from rank 0)."""

    seq: int
    ok: bool
    message: str = ""
    result: dict[str, Any] = msgspec.field(default_factory=dict)


class TokenOutput(msgspec.Struct, tag="tokens"):
    """New tokens of one request since the last message; ``finish_reason`` set on the last one.

    ``text`` is the engine's final text (cut at a stop string) and comes only with the finish;
    ``error`` is set when the request ended without a result: ``error_status`` 400 when the engine
    refused it (bad input), 500 when the engine failed while running it, 503 when it waited past
    ``--queue-timeout``.
    """

    rid: str
    new_ids: list[int]
    new_logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    finish_reason: str | None = None
    text: str | None = None
    error: str | None = None
    error_status: int = 400
    prompt_len: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with the first tokens, when asked for


class TokenBatch(msgspec.Struct, tag="batch"):
    outputs: list[TokenOutput]


class EngineStats(msgspec.Struct, tag="stats"):
    num_running: int
    num_waiting: int
    pages_used: int
    pages_total: int
    page_size: int
    retracted: int
    generation_steps: int
    dp_rank: int = 0
    rejected_messages: int = 0  # malformed messages this rank dropped
    pd_queues: dict[str, int] = msgspec.field(default_factory=dict)  # requests per queue of a PD role
    transfers: dict[str, int] = msgspec.field(default_factory=dict)  # finished KV transfers by result
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    transfer_writes: int = 0
    prefill_peers_lost: int = 0  # decode: prefill servers its heartbeat found dead or restarted
    ended_early: dict[str, int] = msgspec.field(default_factory=dict)  # aborted or failed requests, by stage
    expert_balancedness: float | None = None  # measured mean / max tokens per GPU (the recorder's window)
    expert_rebalances: int = 0
    expert_max_pause_s: float = 0.0  # the longest pause of a rebalance so far
    pages_cached: int = 0  # pages the prefix cache holds (those no request uses are not in pages_used)
    prefix_prompt_tokens: int = 0  # prompt tokens of requests that started their prefill
    prefix_hit_tokens: int = 0  # of those, the tokens the prefix cache held
    spec_verified: int = 0  # speculative decoding: (request, verify step) pairs
    spec_emitted: int = 0  # tokens those steps appended (mean accept length = emitted / verified)


EngineInput = GenerateInput | AbortInput | ShutdownInput | ExpertControlInput
EngineOutput = TokenBatch | EngineStats | ControlOutput


class Codec:
    """Encodes any message; decodes only ``accepts``, counting what it refuses."""

    def __init__(self, accepts: object) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(accepts)
        self.rejected = 0
        self.last_error: str | None = None

    def encode(self, msg: object) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, frames: list[bytes]) -> object | None:
        """The message in ``frames`` (one frame), or None when it is malformed."""
        if len(frames) != 1:
            self._reject(f"{len(frames)} frames, expected 1")
            return None
        try:
            return self._decoder.decode(frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as exc:
            self._reject(str(exc))
            return None

    def _reject(self, why: str) -> None:
        self.rejected += 1
        self.last_error = why
