"""The PD roles' queues, one prefill and one decode scheduler in one process (fake data path):
greedy tokens equal the monolithic engine's and every page and slot comes back."""

from __future__ import annotations

import time

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.core import BootstrapInfo
from tests.disagg.pd_utils import ENGINE, add_pair, bootstrap_server, pd_scheduler, run_pair, settle

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _prompts(lens, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module")
def model_path(hf_model_path):
    return hf_model_path("v3", 0)


@pytest.fixture(scope="module")
def reference(model_path):
    with LLM(model_path, **ENGINE) as llm:
        return [o.token_ids for o in llm.generate(_prompts([7, 30, 45, 3]), GREEDY, use_tqdm=False)]


@pytest.fixture
def pair(model_path, tmp_path):
    """A prefill and a decode scheduler (fake data path) and their bootstrap port."""
    secret = str(tmp_path / "secret")
    with bootstrap_server(secret) as (port, _):
        prefill = pd_scheduler(model_path, "prefill", "fake", port, secret)
        decode = pd_scheduler(model_path, "decode", "fake", port, secret)
        try:
            yield prefill, decode, port
        finally:
            prefill.role.close()
            decode.role.close()


def test_pd_queues_give_the_monolithic_tokens(pair, reference):
    prefill, decode, port = pair
    reqs = run_pair(prefill, decode, _prompts([7, 30, 45, 3]), GREEDY, port)  # 30, 45 > chunk of 16
    settle(prefill, decode)
    assert [r.output_ids for r in reqs] == reference
    for sched in (prefill, decode):
        assert sched.pages.num_used == 0 and sched.num_requests == 0 and sched.role.num_pending == 0
    assert prefill.role.aux.num_free == decode.role.aux.num_free == 4 * 256
    stats = prefill.role.kv_transfer.stats
    assert stats.transfers == {"success": 4, "failed": 0} and stats.bytes > 0


def test_a_failed_write_fails_the_request_on_both_sides(pair):
    prefill, decode, port = pair
    prefill.role.kv_transfer.backend.fail_writes = True
    reqs = run_pair(prefill, decode, _prompts([9]), GREEDY, port)
    settle(prefill, decode)
    assert reqs[0].finish_reason.value == "error" and "failed" in reqs[0].finish_message
    assert prefill.pages.num_used == decode.pages.num_used == 0
    assert prefill.num_requests == decode.num_requests == 0


def test_a_request_without_bootstrap_info_is_refused(pair):
    prefill, decode, _ = pair
    for sched in (prefill, decode):
        with pytest.raises(ValueError, match="bootstrap_room"):
            sched.add_request("x", [5, 6, 7], GREEDY)
        assert sched.num_requests == 0


def test_an_abort_mid_transfer_holds_the_decode_pages_until_the_prefill_side_confirms(pair):
    prefill, decode, port = pair
    info = BootstrapInfo("127.0.0.1", port, room=77)
    prompt = _prompts([40])[0]
    prefill.add_request("p", prompt, GREEDY, info)
    req = decode.add_request("d", prompt, GREEDY, info)
    deadline = time.monotonic() + 30
    while not (req in decode.role.transfer and decode.role.receivers["d"].requested):  # the indices left
        decode.step()
        assert time.monotonic() < deadline
        time.sleep(0.001)
    held = decode.pages.num_used
    assert held > 0
    decode.abort("d")
    assert decode.pages.num_used == held and decode.role.num_pending == 1  # draining, not freed
    settle(prefill, decode)
    assert decode.pages.num_used == 0 and decode.role.num_pending == 0
    assert prefill.num_requests == 0 and prefill.pages.num_used == 0  # the prefill leg failed and freed
    assert decode.role.aux.num_free == prefill.role.aux.num_free == 4 * 256


def test_an_abort_before_the_indices_left_frees_at_once_and_the_prefill_leg_waits(pair):
    prefill, decode, port = pair
    info = BootstrapInfo("127.0.0.1", port, room=78)
    prefill.add_request("p", _prompts([20])[0], GREEDY, info)
    decode.add_request("d", _prompts([20])[0], GREEDY, info)
    decode.abort("d")  # before anything reached the prefill side
    settle(decode)
    assert decode.pages.num_used == 0 and decode.role.num_pending == 0 and decode.num_requests == 0
    for _ in range(20):
        prefill.step()
    assert prefill.role.stats()["bootstrap"] == 1  # no decode side ever came: the router cancels this leg
    prefill.abort("p")
    assert prefill.num_requests == 0 and prefill.role.num_pending == 0 and prefill.pages.num_used == 0


def test_a_decode_server_short_of_pages_retracts_and_recomputes_locally(model_path, reference, tmp_path):
    """Four requests whose outputs outgrow a 48-slot decode cache: some are retracted and prefill
    again on the decode server itself; greedy tokens do not change."""
    secret = str(tmp_path / "secret")
    with bootstrap_server(secret) as (port, _):
        prefill = pd_scheduler(model_path, "prefill", "fake", port, secret)
        decode = pd_scheduler(model_path, "decode", "fake", port, secret, max_total_tokens=48)
        try:
            prompts = _prompts([7, 30, 45, 3])
            reqs = add_pair(prefill, decode, [prompts[0], prompts[3], prompts[0], prompts[3]], GREEDY, port)
            deadline = time.monotonic() + 60
            while len(decode.decode.running) < len(reqs):  # all four transferred before any decodes,
                assert time.monotonic() < deadline  # however the machine's load times the transfers
                prefill.step()
                decode.role.poll()
                time.sleep(0.001)
            settle(prefill, decode)
            assert decode.decode.retracted > 0
            assert [r.output_ids for r in reqs] == [reference[0], reference[3]] * 2
            assert decode.pages.num_used == prefill.pages.num_used == 0
        finally:
            prefill.role.close()
            decode.role.close()


def test_prefill_server_shares_prefixes_and_pushes_the_whole_prompt(pair, model_path):
    """The prefill side's prefix cache serves the second wave's shared prompt; the decode side, which
    has no cache, still receives every page (the cached ones too) and gives the monolithic tokens."""
    prefill, decode, port = pair
    system = _prompts([37], seed=8)[0]
    waves = [[system + q] for q in _prompts([4], seed=9)] + [[system + q for q in _prompts([2, 6, 5], seed=10)]]
    with LLM(model_path, disable_radix_cache=True, **ENGINE) as llm:
        ref = [o.token_ids for wave in waves for o in llm.generate(wave, GREEDY, use_tqdm=False)]
    reqs = []
    for wave in waves:
        reqs += run_pair(prefill, decode, wave, GREEDY, port, first=len(reqs))
        settle(prefill, decode)
    assert [r.output_ids for r in reqs] == ref
    assert decode.prefix_cache is None and prefill.prefix_cache is not None
    assert prefill.prefill.cached_tokens == 3 * (37 // ENGINE["page_size"] * ENGINE["page_size"])
    for sched in (prefill, decode):
        assert sched.pages.num_used == 0 and sched.num_requests == 0
