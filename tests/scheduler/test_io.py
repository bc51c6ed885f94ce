"""The engine channel's messages: plain data with a schema; anything else is refused and counted."""

from __future__ import annotations

import os
import pickle

import msgspec
import pytest

from moeserve.core import SamplingParams, TokenLogprob
from moeserve.scheduler.io import (AbortInput, Codec, EngineInput, EngineOutput, EngineStats, GenerateInput,
                                   ShutdownInput, TokenBatch, TokenOutput)


def test_every_message_round_trips():
    inputs = Codec(EngineInput)
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, stop=["x"], seed=-3, logprobs=2)
    for msg in (GenerateInput("r", [1, 2, 3], params), AbortInput("r"), ShutdownInput()):
        assert inputs.decode([inputs.encode(msg)]) == msg
    outputs = Codec(EngineOutput)
    batch = TokenBatch([TokenOutput("r", [4], [TokenLogprob(4, -0.5, [(4, -0.5), (9, -1.0)])], "stop", "hi")])
    stats = EngineStats(1, 2, 3, 4, 16, 0, 9, dp_rank=1, rejected_messages=2)
    for msg in (batch, stats):
        assert outputs.decode([outputs.encode(msg)]) == msg
    assert inputs.rejected == outputs.rejected == 0


class _Evil:
    def __reduce__(self):
        return os.system, ("true",)


BAD_FRAMES = [
    ("pickle", [pickle.dumps(_Evil())]),
    ("random bytes", [os.urandom(300)]),
    ("two frames", [b"a", b"b"]),
    ("no frames", []),
    ("wrong type", [msgspec.msgpack.encode({"type": "tokens", "rid": 5, "new_ids": []})]),
    ("unknown tag", [msgspec.msgpack.encode({"type": "exec", "code": "print(1)"})]),
    ("an output on the input channel", [msgspec.msgpack.encode(TokenBatch([]))]),
    ("temperature out of range", [msgspec.msgpack.encode(
        {"type": "generate", "rid": "r", "prompt_ids": [1], "params": {"temperature": -1.0}})]),
    ("seed out of range", [msgspec.msgpack.encode(
        {"type": "generate", "rid": "r", "prompt_ids": [1], "params": {"seed": 2**64 - 1}})]),
]


@pytest.mark.parametrize("name, frames", BAD_FRAMES, ids=[b[0] for b in BAD_FRAMES])
def test_malformed_input_is_refused_and_counted(name, frames):
    codec = Codec(EngineInput)
    assert codec.decode(frames) is None
    assert codec.rejected == 1 and codec.last_error
    assert codec.decode([codec.encode(AbortInput("ok"))]) == AbortInput("ok")  # and it goes on
