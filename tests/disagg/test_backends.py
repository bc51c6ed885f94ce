"""Every KV transfer backend copies exactly the pieces it is given between two real processes."""

from __future__ import annotations

import pytest
import torch

from moeserve.disagg.transfer.base import KVPoll, Piece, create_backend
from tests.disagg.backend_pair import backend_available, buffers, expected_decode_buffers, run_pair

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
