"""The API process's engine channel reader survives whatever an (authenticated) peer sends; the DP
controller picks groups by its load-balance method."""

from __future__ import annotations

import asyncio
import os
import pickle

import msgspec
import pytest
import zmq

from moeserve.config import ParallelConfig
from moeserve.core import BootstrapInfo, SamplingParams
from moeserve.scheduler.channel import connect, terminate
from moeserve.scheduler.io import Codec, EngineInput, EngineStats, GenerateInput, TokenBatch, TokenOutput
from moeserve.scheduler.ranks import RankAddresses
from moeserve.server.engine_client import EngineClient, _Request
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


def test_config_accepts_cache_aware_and_rejects_unknown_methods():
    assert ParallelConfig(load_balance_method="cache_aware").load_balance_method == "cache_aware"
    with pytest.raises(ValueError, match="load_balance_method"):
        ParallelConfig(load_balance_method="random")


@pytest.fixture
def dp2_addrs():
    addrs = RankAddresses.derive(ParallelConfig(tp_size=2, dp_size=2, enable_dp_attention=True))
    yield addrs
    addrs.cleanup()


@pytest.fixture
def two_groups(dp2_addrs):
    """``make(method, route_by_room=False)`` -> an EngineClient over 2 DP groups (no ranks behind it)."""
    clients: list[EngineClient] = []

    def make(method: str, route_by_room: bool = False) -> EngineClient:
        clients.append(EngineClient(None, Metrics("m"), dp2_addrs, method, route_by_room))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


def _in_flight(client: EngineClient, dp: int, cost: int) -> None:
    rid = f"r{len(client._requests)}"
    client._requests[rid] = _Request(rid, SamplingParams(), None, dp, cost)


SYSTEM = list(range(1000, 1064))


def test_round_robin_and_shortest_queue(two_groups):
    client = two_groups("round_robin")
    assert [client._pick_dp(SYSTEM) for _ in range(4)] == [0, 1, 0, 1]
    client = two_groups("shortest_queue")
    _in_flight(client, 0, 10)
    assert client._pick_dp(SYSTEM) == 1


def test_cache_aware_keeps_a_prefix_on_its_group_until_the_load_is_imbalanced(two_groups):
    client = two_groups("cache_aware")
    _in_flight(client, 0, 10)
    first = client._pick_dp(SYSTEM + [1])
    assert first == 1
    _in_flight(client, first, 100)  # more loaded now, but within the balance threshold
    assert client._pick_dp(SYSTEM + [2]) == 1
    assert client._pick_dp([7] * 64) == 0  # nothing cached anywhere: the least loaded
    _in_flight(client, 1, 10**6)
    assert client._pick_dp(SYSTEM + [3]) == 0  # imbalanced: the least loaded, cache or not


def test_route_by_room_takes_precedence_over_cache_aware(two_groups):
    client = two_groups("cache_aware", route_by_room=True)
    assert client._pick_dp(SYSTEM, BootstrapInfo("h", 1, room=5)) == 1
    assert client._pick_dp(SYSTEM, BootstrapInfo("h", 1, room=5, prefill_dp_rank=0)) == 0
    assert client._prefix_router.tree.sizes == [0, 0]  # the room decided: nothing learned
    assert client._pick_dp(SYSTEM) == 0  # no bootstrap: the policy decides


def test_generate_sends_prompts_sharing_a_prefix_to_one_group(two_groups, dp2_addrs):
    client = two_groups("cache_aware")
    rank_ctx = zmq.Context()
    codec = Codec(EngineInput)

    async def send(prompt: list[int], inputs: list[zmq.Socket], streams: list[asyncio.Future]) -> int:
        """Start a request (left in flight) and return the DP group whose input got it."""
        streams.append(asyncio.ensure_future(anext(client.generate(prompt, SamplingParams(max_tokens=1)))))
        poller = zmq.Poller()
        for sock in inputs:
            poller.register(sock, zmq.POLLIN)
        ready = dict(await asyncio.to_thread(poller.poll, 10_000))
        (dp,) = [d for d, sock in enumerate(inputs) if sock in ready]
        msg = codec.decode(inputs[dp].recv_multipart())
        assert isinstance(msg, GenerateInput) and msg.prompt_ids == prompt
        return dp

    async def scenario() -> list[int]:
        inputs = [connect(rank_ctx, zmq.PULL, a, dp2_addrs.keys) for a in dp2_addrs.inputs]
        streams: list[asyncio.Future] = []
        try:
            return [await send(prompt, inputs, streams) for prompt in ([9] * 64, SYSTEM + [1], SYSTEM + [2],
                                                                        SYSTEM + [3])]
        finally:
            for stream in streams:
                stream.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            for sock in inputs:
                sock.close(linger=0)

    try:
        assert asyncio.run(scenario()) == [0, 1, 1, 1]  # the first SYSTEM prompt: the least loaded
    finally:
        terminate(rank_ctx)
