"""Every KV transfer backend copies exactly the pieces it is given between two real processes."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from moeserve.disagg.transfer.base import KVPoll, Piece, create_backend
from tests.disagg.backend_pair import AUX_WIDTH, backend_available, buffers, expected_decode_buffers, run_pair

BACKENDS = [pytest.param(name, id=name, marks=pytest.mark.skipif(not backend_available(name), reason=f"{name} "
                                                                   "cannot be imported here"))
            for name in ("torch", "nixl", "mooncake")]


@pytest.mark.parametrize("name", BACKENDS)
def test_pieces_land_exactly_where_they_should(name):
    states, got = run_pair(name, rounds=2)
    assert states == [int(KVPoll.Success)] * 2
    for have, want in zip(got, expected_decode_buffers()):
        assert torch.equal(have, want)


@pytest.mark.gpu
def test_torch_backend_between_gpu_processes_over_cuda_ipc():
    states, got = run_pair("torch", rounds=2, device="cuda")
    assert states == [int(KVPoll.Success)] * 2
    for have, want in zip(got, expected_decode_buffers()):
        assert torch.equal(have, want)


def test_fake_backend_copies_in_process_and_can_fail():
    src, dst = buffers(3.0), buffers(0.0)
    sender, receiver = create_backend("fake", src, "127.0.0.1"), create_backend("fake", dst, "127.0.0.1")
    sender.connect("d", receiver.descriptor())
    assert sender.check(sender.write("d", [Piece(1, 0, 8, 8)])) is KVPoll.Success
    assert dst[1].view(-1)[1] == 3.0 and dst[1].view(-1)[0] == 0.0
    sender.fail_writes = True
    assert sender.check(sender.write("d", [Piece(1, 0, 8, 8)])) is KVPoll.Failed
    with pytest.raises(ConnectionError):
        sender.connect("x", {"fake_id": -1})


def test_an_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown transfer backend"):
        create_backend("carrier-pigeon", buffers(0.0), "127.0.0.1")


def _torch_write(sender, fill: float, dst: list[torch.Tensor]) -> KVPoll:
    """Aux record 0 of ``sender``'s buffers (all ``fill``) into the decode side's record 1; the write's end."""
    return _wait(sender, sender.write("d", [Piece(1, 0, 8 * dst[1].shape[1], 8 * dst[1].shape[1])]))


def _wait(sender, handle: object) -> KVPoll:
    """The write's end, or Transferring after 30 s."""
    deadline = time.monotonic() + 30
    while (state := sender.check(handle)) is KVPoll.Transferring and time.monotonic() < deadline:
        time.sleep(0.01)
    return state


def test_a_torch_pair_outlives_an_idle_spell_longer_than_its_timeout(monkeypatch):
    """The decode side waits for a prefill peer's next write without a deadline: a quiet spell longer
    than the transfer timeout (2 minutes in production: any lull between requests) must not end a
    healthy pair."""
    from moeserve.disagg.transfer import torch_p2p

    monkeypatch.setattr(torch_p2p, "GROUP_TIMEOUT_S", 1)
    dst = buffers(0.0)
    receiver, sender = create_backend("torch", dst, "127.0.0.1"), create_backend("torch", buffers(3.0), "127.0.0.1")
    try:
        sender.connect("d", receiver.descriptor())
        assert _torch_write(sender, 3.0, dst) is KVPoll.Success
        time.sleep(2.5)  # idle, past the timeout
        assert _torch_write(sender, 3.0, dst) is KVPoll.Success
        assert torch.all(dst[1][1] == 3.0) and torch.all(dst[1][0] == 0.0)
    finally:
        sender.close()
        receiver.close()


def test_a_torch_pair_that_broke_is_made_anew_for_the_next_write(monkeypatch):
    """A pair whose connection ended (here: the decode side gave up waiting) fails the write that finds
    it broken; the next write of that peer reconnects instead of failing every later room."""
    from moeserve.disagg.transfer import torch_p2p

    monkeypatch.setattr(torch_p2p, "IDLE_TIMEOUT_S", 1)
    dst = buffers(0.0)
    receiver, sender = create_backend("torch", dst, "127.0.0.1"), create_backend("torch", buffers(3.0), "127.0.0.1")
    try:
        sender.connect("d", receiver.descriptor())
        assert _torch_write(sender, 3.0, dst) is KVPoll.Success
        time.sleep(2.5)  # the decode side's wait ends: the pair is gone
        states = [_torch_write(sender, 3.0, dst) for _ in range(2)]
        assert states[-1] is KVPoll.Success, states
    finally:
        sender.close()
        receiver.close()



def _serve_decode_side(conn) -> None:
    """A decode rank in a process of its own: its descriptor up the pipe, then wait to be killed."""
    receiver = create_backend("torch", buffers(0.0), "127.0.0.1")
    conn.send(receiver.descriptor())
    time.sleep(600)


def test_writes_to_a_dead_decode_rank_never_block_the_caller(monkeypatch):
    """The transfer loop alone calls ``write``: a decode rank that died must fail its writes, not hold
    the loop while the link dials it again (a killed decode server once stalled every room of its
    prefill server for the dial's whole timeout)."""
    from moeserve.disagg.transfer import torch_p2p

    monkeypatch.setattr(torch_p2p, "DIAL_TIMEOUT_S", 1)  # the writes behind the failed one wait for the dial
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    decode = ctx.Process(target=_serve_decode_side, args=(child,), daemon=True)
    decode.start()
    sender = create_backend("torch", buffers(3.0), "127.0.0.1")
    piece = [Piece(1, 0, 0, 8 * AUX_WIDTH)]
    try:
        assert parent.poll(60)
        sender.connect("d", parent.recv())
        assert _wait(sender, sender.write("d", piece)) is KVPoll.Success
        decode.kill()
        decode.join(10)
        states, slowest = [], 0.0
        for _ in range(3):
            start = time.monotonic()
            handle = sender.write("d", piece)
            slowest = max(slowest, time.monotonic() - start)
            states.append(_wait(sender, handle))
        assert slowest < 0.5, slowest
        assert states == [KVPoll.Failed] * 3, states
        start = time.monotonic()
        sender.disconnect("d")
        assert time.monotonic() - start < 1
    finally:
        sender.close()
        decode.kill()
