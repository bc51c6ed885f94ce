"""The API process's engine channel reader survives whatever an (authenticated) peer sends."""

from __future__ import annotations

import asyncio
import os
import pickle

import msgspec
import zmq

from moeserve.config import ParallelConfig
from moeserve.core import SamplingParams
from moeserve.scheduler.channel import connect, terminate
from moeserve.scheduler.io import Codec, EngineInput, EngineStats, GenerateInput, TokenBatch, TokenOutput
from moeserve.scheduler.ranks import RankAddresses
from moeserve.server.engine_client import EngineClient
from moeserve.server.metrics import Metrics

GARBAGE = [[os.urandom(300)], [pickle.dumps(os.system)], [b"a", b"b"],
           [msgspec.msgpack.encode({"type": "batch", "outputs": [{"rid": 1}]})],
           [msgspec.msgpack.encode({"type": "generate", "rid": "x", "prompt_ids": [], "params": {}})]]


def _count(metrics: Metrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m"})


def test_reader_drops_and_counts_malformed_messages_and_keeps_routing():
    addrs = RankAddresses.derive(ParallelConfig())
    metrics = Metrics("m")
    client = EngineClient(None, metrics, addrs)
    rank_ctx = zmq.Context()
    codec = Codec(EngineInput)

    async def scenario() -> list[int]:
        client.start()
        rank_in = connect(rank_ctx, zmq.PULL, addrs.inputs[0], addrs.keys)
        rank_out = connect(rank_ctx, zmq.PUSH, addrs.output, addrs.keys)
        first = asyncio.ensure_future(anext(client.generate([1, 2, 3], SamplingParams(max_tokens=1))))
        frames = await asyncio.to_thread(rank_in.recv_multipart)
        msg = codec.decode(frames)
        assert isinstance(msg, GenerateInput) and msg.prompt_ids == [1, 2, 3]
        for frames in GARBAGE:
            rank_out.send_multipart(frames)
        rank_out.send(codec.encode(TokenBatch([TokenOutput("someone else", [9])])))  # unknown: ignored
        rank_out.send(codec.encode(EngineStats(0, 0, 0, 0, 16, 0, 0, dp_rank=99)))  # no such DP group: ignored
        rank_out.send(codec.encode(TokenBatch([TokenOutput(msg.rid, [7], finish_reason="length")])))
        chunk = await asyncio.wait_for(first, 10)
        assert not client._reader.done()
        for sock in (rank_in, rank_out):
            sock.close(linger=0)
        client._reader.cancel()
        return chunk.token_ids

    try:
        assert asyncio.run(scenario()) == [7]
        assert _count(metrics, "moeserve:rejected_messages_total") == len(GARBAGE)
        assert client.stats == {} and client.queued == 0
    finally:
        client.close()
        terminate(rank_ctx)
        addrs.cleanup()
