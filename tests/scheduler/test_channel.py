"""Only peers with the launch's keys get through the engine channel's handshake."""

from __future__ import annotations

import gc
import os

import pytest
import zmq

from moeserve.scheduler.channel import ChannelKeys, ServerSide, connect, terminate


@pytest.fixture
def channel():
    """A launch's keys, a context and its server side (ZAP handler running); torn down after."""
    keys = ChannelKeys.generate()
    ctx = zmq.Context()
    side = ServerSide(ctx, keys)
    try:
        yield keys, ctx, side
    finally:
        side.close()


def test_only_the_launch_key_passes(tmp_path, channel):
    keys, ctx, side = channel
    addr = f"ipc://{tmp_path}/s"
    pull = side.bind(zmq.PULL, addr)
    other = ChannelKeys.generate()
    impostor = connect(ctx, zmq.PUSH, addr, ChannelKeys(keys.server_public, b"", other.client_public,
                                                          other.client_secret))
    plain = ctx.socket(zmq.PUSH)
    plain.connect(addr)
    for sock in (impostor, plain):
        sock.setsockopt(zmq.SNDTIMEO, 500)
        try:
            sock.send(b"forged")
        except zmq.Again:
            pass
    rank = connect(ctx, zmq.PUSH, addr, keys)
    rank.send(b"real")
    assert pull.recv() == b"real"
    assert pull.poll(300) == 0  # nothing forged arrived
    assert side.refusals.count == 1  # the impostor reached the ZAP check; the plain peer not even that


def test_a_foreign_puller_gets_no_message(tmp_path, channel):
    keys, ctx, side = channel
    addr = f"ipc://{tmp_path}/in"
    push = side.bind(zmq.PUSH, addr)
    thief = ctx.socket(zmq.PULL)
    thief.connect(addr)
    rank = connect(ctx, zmq.PULL, addr, keys)
    for i in range(6):
        push.send(str(i).encode())
    assert sorted(int(rank.recv()) for _ in range(6)) == list(range(6))
    assert thief.poll(300) == 0


def test_keys_from_a_secret_are_the_same_everywhere():
    secret = os.urandom(32)
    assert ChannelKeys.from_secret(secret) == ChannelKeys.from_secret(secret)
    assert ChannelKeys.from_secret(secret) != ChannelKeys.from_secret(os.urandom(32))
    keys = ChannelKeys.from_secret(secret)
    assert zmq.curve_public(keys.client_secret) == keys.client_public


def test_a_dropped_server_side_closes_its_sockets_handler_and_context(tmp_path):
    keys, ctx, rank_ctx = ChannelKeys.generate(), zmq.Context(), zmq.Context()
    side = ServerSide(ctx, keys)
    addr = f"ipc://{tmp_path}/out"
    pull = side.bind(zmq.PULL, addr)
    rank = connect(rank_ctx, zmq.PUSH, addr, keys)
    rank.send(b"hello")
    assert pull.recv() == b"hello"  # a peer past the handshake, its connection open
    handler = side._auth.thread
    del side
    gc.collect()
    try:
        assert pull.closed and not handler.is_alive() and ctx.closed
    finally:
        rank.close(linger=0)
        terminate(rank_ctx)


def test_close_twice_is_fine():
    ctx = zmq.Context()
    side = ServerSide(ctx, ChannelKeys.generate())
    sock = side.bind(zmq.PUSH, "inproc://out")
    assert side.close() and sock.closed and ctx.closed
    assert side.close()
