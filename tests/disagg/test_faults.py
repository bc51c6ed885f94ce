"""The PD roles under faults, a prefill and a decode scheduler in one process (fake data path, real
bootstrap server and side channel): an abort at every stage of either side, each timeout, the
heartbeat, injected failures, and peers that skip the handshake. Every case ends with every page
and aux slot back and both sides empty."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from moeserve import SamplingParams
from moeserve.core import BootstrapInfo, FinishReason
from moeserve.disagg.transfer.base import KVPoll
from moeserve.disagg.transfer.loop import INJECTED
from moeserve.disagg.transfer.protocol import RoomAbort, RoomRequest, pd_keys
from moeserve.scheduler.channel import connect, terminate
from tests.disagg.pd_utils import bootstrap_server, pd_scheduler
from tests.disagg.test_roles import _prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
WAIT_S = 30  # the longest any case waits for something that takes milliseconds
FAST = {"disaggregation_heartbeat_interval": 0.1, "disaggregation_heartbeat_max_failures": 2}
RACE_WAIT_S = 5.0


@pytest.fixture(scope="module")
def model_path(hf_model_path):
    return hf_model_path("v3", 0)


class Pair:
    """A prefill and a decode scheduler sharing a bootstrap server; ``step`` drives either side."""

    def __init__(self, prefill, decode, port, table) -> None:
        self.prefill, self.decode, self.port, self.table = prefill, decode, port, table
        self._rooms = iter(range(500, 10_000))

    def add(self, prompt_len: int = 20, prefill: bool = True, decode: bool = True, room: int | None = None,
            params: SamplingParams = GREEDY):
        info = BootstrapInfo("127.0.0.1", self.port, room=next(self._rooms) if room is None else room)
        ids = _prompts([prompt_len], seed=prompt_len)[0]
        p = self.prefill.add_request(f"p{info.room}", ids, params, info) if prefill else None
        d = self.decode.add_request(f"d{info.room}", ids, params, info) if decode else None
        return p, d

    def until(self, condition, sides=("prefill", "decode"), what: str = "the condition",
              timeout_s: float = WAIT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            for side in sides:
                getattr(self, side).step()
            time.sleep(0.001)

    def settle(self) -> None:
        """Step both sides until neither holds a request, then check that everything came back."""
        self.until(lambda: not any(s.num_requests or s.role.num_pending for s in (self.prefill, self.decode)),
                   what="both sides to empty")
        for sched in (self.prefill, self.decode):
            assert sched.pages.num_used == 0
            assert sched.role.aux.num_free == 4 * sched.config.scheduler.max_running_requests


@pytest.fixture
def make_pair(model_path, tmp_path):
    made = []

    def make(prefill_settings=None, decode_settings=None) -> Pair:
        secret = str(tmp_path / "secret")
        server = bootstrap_server(secret)
        port, table = server.__enter__()
        prefill = pd_scheduler(model_path, "prefill", "fake", port, secret, **(prefill_settings or {}))
        decode = pd_scheduler(model_path, "decode", "fake", port, secret, **(decode_settings or {}))
        made.append((server, prefill, decode))
        return Pair(prefill, decode, port, table)

    yield make
    for server, prefill, decode in made:
        prefill.role.close()
        decode.role.close()
        server.__exit__(None, None, None)


def _indices_sent(pair: Pair, d) -> bool:
    return d in pair.decode.role.transfer and pair.decode.role.receivers[d.rid].requested


def _errored(req, needle: str) -> bool:
    return req.finish_reason is FinishReason.ERROR and needle in (req.finish_message or "")


# ---- an abort at each stage -------------------------------------------------------------------
def _to_prefill_stage(pair: Pair, stage: str):
    """A request pair whose prefill side is at ``stage``."""
    if stage == "bootstrap":  # no decode side ever comes
        p, _ = pair.add(decode=False)
        pair.until(lambda: p in pair.prefill.role.bootstrapping, ("prefill",))
        return p, None
    p, d = pair.add(prompt_len=40)  # 40 tokens: three chunks of 16
    pair.until(lambda: _indices_sent(pair, d), ("decode",), "the indices to leave")
    if stage == "waiting":  # polled into the prefill queue, not yet scheduled
        deadline = time.monotonic() + WAIT_S
        while p not in pair.prefill.prefill.waiting:
            assert time.monotonic() < deadline, "timed out waiting for the room to be ready"
            pair.prefill.role.poll()
            time.sleep(0.001)
    elif stage == "prefilling":
        pair.until(lambda: pair.prefill.prefill.chunked is p, ("prefill",))
    else:  # inflight: prefilled, its writes held
        pair.prefill.role.kv_transfer.backend.hold_writes = True
        pair.until(lambda: p in pair.prefill.role.in_flight, ("prefill",))
    return p, d


@pytest.mark.parametrize("stage", ["bootstrap", "waiting", "prefilling", "inflight"])
def test_an_abort_on_the_prefill_side_frees_everything_at_each_stage(make_pair, stage):
    pair = make_pair()
    p, d = _to_prefill_stage(pair, stage)
    assert pair.prefill.stage(p) == stage
    pair.prefill.abort(p.rid)
    assert pair.prefill.ended_early[stage] == 1 and pair.prefill.pages.num_used == 0
    pair.prefill.role.kv_transfer.backend.hold_writes = False
    pair.settle()
    if d is not None:  # the decode side hears of it and fails the request (the router would also cancel it)
        assert _errored(d, "aborted on the prefill side"), d.finish_message


def _to_decode_stage(pair: Pair, stage: str):
    """A request pair whose decode side is at ``stage``."""
    if stage == "prealloc":  # its prefill server's ranks are not all registered yet
        pair.table.world = 2
        p, d = pair.add()
        pair.until(lambda: pair.decode.role.receivers[d.rid].created < time.monotonic() - 0.2, ("decode",))
        return p, d
    if stage == "retracted":
        return _retracted(pair)
    p, d = pair.add()
    if stage == "transfer":
        pair.prefill.role.kv_transfer.backend.hold_writes = True
        pair.until(lambda: p in pair.prefill.role.in_flight, what="the writes to start")
    elif stage == "transferred":  # the KV is in, the decode side has not polled since
        pair.until(lambda: _indices_sent(pair, d), ("decode",))
        pair.until(lambda: pair.decode.role.receivers[d.rid].state is KVPoll.Success, ("prefill",))
    else:  # decoding
        pair.until(lambda: len(d.output_ids) >= 3)
    return p, d


def _retracted(pair: Pair):
    """Four requests whose outputs outgrow the decode side's 48-slot cache: one is retracted."""
    reqs = [pair.add(prompt_len=n, params=SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
            for n in (7, 3, 7, 3)]
    deadline = time.monotonic() + WAIT_S
    while len(pair.decode.decode.running) < len(reqs):  # all transferred before any decodes, whatever the load
        assert time.monotonic() < deadline, "timed out waiting for the transfers"
        pair.prefill.step()
        pair.decode.role.poll()
        time.sleep(0.001)
    pair.until(lambda: any(d.num_retractions and d in pair.decode.prefill.waiting for _, d in reqs),
               ("decode",), "a retraction")
    return next((p, d) for p, d in reqs if d.num_retractions and d in pair.decode.prefill.waiting)


@pytest.mark.parametrize("stage", ["prealloc", "transfer", "transferred", "decoding", "retracted"])
def test_an_abort_on_the_decode_side_frees_everything_at_each_stage(make_pair, stage):
    pair = make_pair(decode_settings={"max_total_tokens": 48} if stage == "retracted" else None)
    p, d = _to_decode_stage(pair, stage)
    assert pair.decode.stage(d) == stage
    pair.decode.abort(d.rid)
    assert pair.decode.ended_early[stage] == 1
    if stage == "transfer":  # the prefill side may still write into its pages: held until it confirms
        assert pair.decode.pages.num_used > 0 and pair.decode.role.draining
        pair.until(lambda: p.finished, what="the prefill side to hear")
    pair.prefill.role.kv_transfer.backend.hold_writes = False
    if stage == "prealloc":  # nothing reached the prefill rank: the router cancels that leg
        pair.prefill.abort(p.rid)
    pair.settle()
    if stage == "transfer":  # the prefill side was told and gave up too
        assert _errored(p, "the decode side aborted"), p.finish_message


# ---- timeouts ----------------------------------------------------------------------------------
def test_a_room_whose_decode_side_never_comes_fails_after_the_bootstrap_timeout(make_pair):
    pair = make_pair(prefill_settings={"disaggregation_bootstrap_timeout": 0.3})
    p, _ = pair.add(decode=False)
    pair.until(lambda: p.finished, ("prefill",))
    assert _errored(p, "--disaggregation-bootstrap-timeout")
    pair.settle()


def test_a_decode_side_whose_prefill_server_never_registers_fails_after_the_bootstrap_timeout(make_pair):
    pair = make_pair(decode_settings={"disaggregation_bootstrap_timeout": 0.3})
    pair.table.world = 2  # one rank of two registered: /route answers 503 all along
    _, d = pair.add(prefill=False)
    pair.until(lambda: d.finished, ("decode",))
    assert _errored(d, "--disaggregation-bootstrap-timeout")
    pair.settle()


def test_kv_that_never_arrives_fails_after_the_waiting_timeout_and_the_prefill_side_is_told(make_pair):
    pair = make_pair(decode_settings={"disaggregation_waiting_timeout": 0.3})
    pair.prefill.role.kv_transfer.backend.hold_writes = True
    p, d = pair.add()
    pair.until(lambda: d.finished, what="the decode side to give up")
    assert _errored(d, "--disaggregation-waiting-timeout")
    assert pair.decode.pages.num_used > 0  # held: a write may still land, until the prefill side confirms
    pair.until(lambda: p.finished, ("prefill",))
    assert _errored(p, "the decode side aborted")
    pair.prefill.role.kv_transfer.backend.hold_writes = False
    pair.settle()


def test_indices_for_a_request_the_prefill_server_never_gets_fail_after_the_waiting_timeout(make_pair):
    pair = make_pair(decode_settings={"disaggregation_waiting_timeout": 0.3})
    _, d = pair.add(prefill=False)
    pair.until(lambda: d.finished, what="the decode side to give up")
    assert _errored(d, "--disaggregation-waiting-timeout")
    pair.settle()  # its abort answered at once: the prefill rank dropped the early indices


def test_a_write_that_hangs_fails_the_room_after_the_transfer_timeout(make_pair):
    pair = make_pair(prefill_settings={"disaggregation_transfer_timeout": 0.3})
    pair.prefill.role.kv_transfer.backend.hold_writes = True
    p, d = pair.add()
    pair.until(lambda: p.finished and d.finished)
    assert _errored(p, "--disaggregation-transfer-timeout")
    assert _errored(d, "--disaggregation-transfer-timeout")  # the decode side is told why
    pair.settle()


def test_indices_for_a_room_that_already_ended_fail_at_once(make_pair):
    pair = make_pair()
    p, _ = pair.add(decode=False, room=42)
    pair.prefill.abort(p.rid)
    pair.until(lambda: 42 in pair.prefill.role.kv_transfer._ended, ("prefill",))
    _, d = pair.add(prefill=False, room=42)
    pair.until(lambda: d.finished, what="the decode side to hear")
    assert _errored(d, "already ended on the prefill side")
    pair.settle()


# ---- the heartbeat ---------------------------------------------------------------------------------
def test_a_dead_prefill_server_fails_exactly_its_rooms_and_frees_their_pages(make_pair):
    pair = make_pair(decode_settings=FAST)
    pair.prefill.role.kv_transfer.backend.hold_writes = True
    p, d = pair.add()
    pair.until(lambda: p in pair.prefill.role.in_flight, what="the writes to start")
    assert pair.decode.pages.num_used > 0
    pair.table.ranks.clear()  # /health answers 503 from now on, as for a server whose ranks died
    pair.until(lambda: d.finished, ("decode",), "the heartbeat verdict")
    assert _errored(d, "missed 2 health checks in a row")
    assert pair.decode.role.kv_transfer.stats.peers_lost == 1
    pair.until(lambda: pair.decode.pages.num_used == 0, ("decode",))  # at once: nothing of it can write now
    assert not pair.decode.role.kv_transfer._layouts and not pair.decode.role.kv_transfer._dealers


def test_a_restarted_prefill_server_fails_the_old_rooms_and_serves_new_ones(make_pair):
    pair = make_pair(decode_settings=FAST)
    pair.prefill.role.kv_transfer.backend.hold_writes = True
    p, d = pair.add()
    pair.until(lambda: p in pair.prefill.role.in_flight, what="the writes to start")
    pair.table.instance = "a-new-start"
    pair.until(lambda: d.finished, ("decode",), "the heartbeat verdict")
    assert _errored(d, "restarted")
    pair.prefill.role.kv_transfer.backend.hold_writes = False
    pair.settle()
    _, d2 = pair.add()  # looked up and handshaken anew
    pair.until(lambda: d2.finished)
    assert d2.finish_reason is FinishReason.LENGTH and len(d2.output_ids) == GREEDY.max_tokens
    pair.settle()


def test_rooms_with_a_healthy_prefill_server_are_untouched_by_the_heartbeat(make_pair):
    pair = make_pair(decode_settings=FAST)
    reqs = [pair.add(prompt_len=n) for n in (5, 17, 33)]
    pair.until(lambda: all(d.finished for _, d in reqs))
    assert all(d.finish_reason is FinishReason.LENGTH for _, d in reqs)
    assert pair.decode.role.kv_transfer.stats.peers_lost == 0
    pair.settle()


# ---- one writer: the transfer loop's thread ----------------------------------------------------------
def test_a_prefill_failure_between_the_decode_poll_and_its_indices_fails_the_request(make_pair, monkeypatch):
    """The prefill server dies after the decode role polled a room ready and before it sent the
    room's page indices (``KVReceiver.init``, right after the role took the pages): the failure must
    stay, so that the request ends with an error within the waiting timeout (not when its client
    leaves) and its pages and aux slot come back."""
    pair = make_pair(decode_settings={**FAST, "disaggregation_waiting_timeout": RACE_WAIT_S})
    _, d = pair.add(prefill=False)  # the prefill rank is registered and shakes hands without a request
    pool = pair.decode.pages
    alloc = pool.alloc

    def alloc_as_the_prefill_server_dies(n: int):
        """The decode role's allocation, between its poll (the room ready) and ``init``."""
        monkeypatch.setattr(pool, "alloc", alloc)  # once
        receiver = pair.decode.role.receivers[d.rid]
        assert receiver.state is KVPoll.WaitingForInput
        pair.table.ranks.clear()  # /health answers 503 from now on: the heartbeat's verdict follows
        deadline = time.monotonic() + WAIT_S
        while receiver.state is not KVPoll.Failed:
            assert time.monotonic() < deadline, "the heartbeat never failed the room"
            time.sleep(0.005)
        return alloc(n)

    monkeypatch.setattr(pool, "alloc", alloc_as_the_prefill_server_dies)
    pair.until(lambda: d.finished, ("decode",), "the request to end", timeout_s=RACE_WAIT_S)
    assert _errored(d, "missed 2 health checks in a row"), d.finish_message
    pair.settle()


def test_a_transfer_state_is_written_only_on_the_loop_thread(make_pair):
    """A second writer is an error at once, not a race: the scheduler's thread may only queue."""
    pair = make_pair()
    p, d = pair.add()
    sides = {"prefill": pair.prefill.role.senders[p.rid], "decode": pair.decode.role.receivers[d.rid]}
    for side, transfer in sides.items():
        with pytest.raises(RuntimeError, match=f"written only on the kv-{side} thread"):
            transfer.fail("from the scheduler's thread")
        assert transfer.state is not KVPoll.Failed
    pair.until(lambda: d.finished)
    assert d.finish_reason is FinishReason.LENGTH
    pair.settle()


# ---- injected failures and strangers ------------------------------------------------------------
@pytest.mark.parametrize("side", ["prefill", "decode"])
def test_injected_poll_failures_end_requests_with_an_error_and_free_everything(make_pair, side):
    pair = make_pair()
    getattr(pair, side).role.kv_transfer.args.failure_prob = 1.0
    reqs = [pair.add(prompt_len=n) for n in (5, 30)]
    failing = [p if side == "prefill" else d for p, d in reqs]
    pair.until(lambda: all(r.finished for r in failing))
    assert all(_errored(r, INJECTED) for r in failing)
    if side == "prefill":  # the decode side hears that the room ended
        pair.until(lambda: all(d.finished for _, d in reqs))
        assert all(_errored(d, "already ended on the prefill side") for _, d in reqs)
    else:  # before its handshake a decode rank cannot tell the prefill rank: the router cancels that leg
        for p, _ in reqs:
            pair.prefill.abort(p.rid)
    pair.settle()


def test_room_messages_from_a_peer_that_skipped_the_handshake_are_ignored(make_pair, tmp_path):
    """A stranger with the deployment's keys but no ``Hello``: it can name no room, write nothing,
    and garbage does not stop the prefill rank's side channel."""
    pair = make_pair()
    p, _ = pair.add(decode=False, room=7)
    pair.until(lambda: p in pair.prefill.role.bootstrapping, ("prefill",))
    transfer = pair.prefill.role.kv_transfer
    ctx = zmq.Context()
    try:
        stranger = connect(ctx, zmq.DEALER, transfer.endpoint, pd_keys(transfer.args.secret))
        encode = msgspec.msgpack.Encoder().encode
        stranger.send(encode(RoomRequest(7, "stranger", 0, 1, [1, 2, 3], 0)))
        stranger.send(encode(RoomAbort(7, "stranger")))
        stranger.send(b"\x92\xa4room" + bytes(range(40)))
        stranger.send_multipart([b"two", b"frames"])
        for _ in range(50):
            pair.prefill.step()
            time.sleep(0.002)
        assert transfer.loop.is_alive() and p in pair.prefill.role.bootstrapping
        assert transfer._senders[7].state is KVPoll.Bootstrapping and not transfer._early
    finally:
        terminate(ctx)
    _, d = pair.add(prefill=False, room=7)  # the real decode side still gets through
    pair.until(lambda: d.finished)
    assert d.finish_reason is FinishReason.LENGTH
    pair.settle()
