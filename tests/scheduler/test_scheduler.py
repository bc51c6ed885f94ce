"""Continuous batching, retraction, aborts and request validation on a tiny V3 checkpoint."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.core import FinishReason
from moeserve.scheduler.scheduler import LocalCollectives, Scheduler

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def _prompts(lens, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module")
def v3_path(hf_model_path):
    return hf_model_path("v3", 0)


@pytest.fixture(scope="module")
def reference(v3_path):
    """Greedy tokens with a roomy cache and one request at a time."""
    llm = LLM(v3_path, dtype="float32", max_total_tokens=2048, max_running_requests=1)
    return llm.generate(_prompts([12, 30, 7, 19, 25, 10]), GREEDY, use_tqdm=False)


def test_retraction_under_tiny_kv_budget_keeps_greedy_tokens(v3_path, reference):
    # 64 slots cannot hold six requests of 7..50 tokens at once: decode must retract some.
    llm = LLM(v3_path, dtype="float32", page_size=4, max_total_tokens=64, chunked_prefill_size=16)
    outs = llm.generate(_prompts([12, 30, 7, 19, 25, 10]), GREEDY, use_tqdm=False)
    assert llm.scheduler.decode.retracted > 0
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    pool = llm.scheduler.pages
    assert pool.num_free == pool.capacity and pool.num_used == 0


def test_requests_joining_mid_run_get_the_same_tokens(v3_path, reference):
    llm = LLM(v3_path, dtype="float32", page_size=4, max_total_tokens=512, chunked_prefill_size=8)
    sched, prompts = llm.scheduler, _prompts([12, 30, 7, 19, 25, 10])
    reqs = [sched.add_request("a0", prompts[0], GREEDY)]
    for i, prompt in enumerate(prompts[1:], start=1):
        for _ in range(3):
            sched.step()
        reqs.append(sched.add_request(f"a{i}", prompt, GREEDY))
    while sched.has_work:
        sched.step()
    assert [r.output_ids for r in reqs] == [r.token_ids for r in reference]


def test_abort_anywhere_frees_every_page(v3_path):
    llm = LLM(v3_path, dtype="float32", page_size=4, max_total_tokens=96, chunked_prefill_size=8,
              max_running_requests=2)
    sched, pool = llm.scheduler, llm.scheduler.pages
    reqs = [sched.add_request(f"b{i}", p, GREEDY) for i, p in enumerate(_prompts([20, 9, 14, 30, 5]))]
    sched.step()  # b0 is mid-prefill (a chunk of 8 of 20)
    assert sched.prefill.chunked is reqs[0]
    sched.abort("b0")
    for _ in range(4):
        sched.step()
    running = list(sched.decode.running)
    assert running, "some request should be decoding"
    sched.abort(running[0].rid)
    sched.abort(reqs[-1].rid)  # still waiting
    while sched.has_work:
        sched.step()
    assert pool.num_free == pool.capacity
    aborted = [r for r in reqs if r.finish_reason is FinishReason.ABORT]
    assert len(aborted) == 3 and all(r.page_table == [] for r in reqs)
    assert sched.abort("b0") is None  # already gone


def test_stop_token_ids_and_max_tokens(v3_path, reference):
    llm = LLM(v3_path, dtype="float32", max_total_tokens=512)
    expected = reference[1].token_ids
    stop_at = expected[5]
    first = expected.index(stop_at)
    out = llm.generate([_prompts([12, 30])[1]], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                               stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.token_ids == expected[:first + 1] and out.finish_reason == "stop"
    out = llm.generate([_prompts([12, 30])[1]], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert len(out.token_ids) <= 3


def test_seeded_sampling_ignores_batch_companions(v3_path):
    llm = LLM(v3_path, dtype="float32", max_total_tokens=1024)
    prompts = _prompts([12, 30, 7])
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[1]], seeded, use_tqdm=False)[0]
    others = SamplingParams(max_tokens=16, temperature=0.7, ignore_eos=True)
    together = llm.generate(prompts, [others, seeded, others], use_tqdm=False)
    again = llm.generate([prompts[2], prompts[1]], [others, seeded], use_tqdm=False)[1]
    assert together[1].token_ids == alone.token_ids == again.token_ids


def test_logprobs_are_returned_per_token(v3_path):
    llm = LLM(v3_path, dtype="float32", max_total_tokens=512)
    out = llm.generate([_prompts([9])[0]], SamplingParams(max_tokens=5, temperature=0, logprobs=3,
                                                          ignore_eos=True), use_tqdm=False)[0]
    assert len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top) == 3 and lp.top[0][0] == token  # greedy picks the most likely


@pytest.mark.parametrize("prompt, params, field", [
    ([], SamplingParams(), "prompt is empty"),
    (list(range(2, 300)) * 2, SamplingParams(max_tokens=1), "context length"),
    ([5, 6, 7], SamplingParams(max_tokens=600), "max_tokens"),
    ([5, 6, 7], SamplingParams(max_tokens=200), "never fit"),
    ([5, 6, 999], SamplingParams(), "token ids"),
])
def test_bad_requests_are_refused_with_a_clear_error(v3_path, prompt, params, field):
    llm = LLM(v3_path, dtype="float32", max_total_tokens=128)
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], params, use_tqdm=False)
    assert not llm.scheduler.has_work


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-1), "temperature"),
    (dict(logprobs=50), "logprobs"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


class _FailsOnSeed:
    """A sampler that cannot sample rows whose request has seed 666 (any per-request bug)."""

    def __init__(self, sampler) -> None:
        self.inner = sampler

    def sample(self, logits, infos):
        if any(info.params.seed == 666 for info in infos):
            raise RuntimeError("cannot sample this row")
        return self.inner.sample(logits, infos)

    def sample_isolated(self, logits, infos):
        return type(self.inner).sample_isolated(self, logits, infos)


def test_a_request_that_breaks_the_sampler_fails_alone(v3_path, reference):
    llm = LLM(v3_path, dtype="float32", page_size=4, max_total_tokens=1024, chunked_prefill_size=16)
    llm.scheduler.sampler = _FailsOnSeed(llm.scheduler.sampler)
    prompts = _prompts([12, 30, 7, 19, 25, 10])
    bad = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, seed=666)
    outs = llm.generate(prompts, [GREEDY, GREEDY, bad, GREEDY, GREEDY, GREEDY], use_tqdm=False)
    assert outs[2].finish_reason == "error" and outs[2].token_ids == []
    assert [o.token_ids for i, o in enumerate(outs) if i != 2] == [r.token_ids for i, r in enumerate(reference)
                                                                   if i != 2]
    pool = llm.scheduler.pages
    assert pool.num_used == 0 and not llm.scheduler.has_work
    assert llm.generate([prompts[2]], GREEDY, use_tqdm=False)[0].token_ids == reference[2].token_ids


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=1e30), "temperature"),
    (dict(top_k=-5), "top_k"),
    (dict(repetition_penalty=1e-300), "repetition_penalty"),
    (dict(stop=[f"s{i}" for i in range(17)]), "stop"),
    (dict(stop=[""]), "stop"),
    (dict(seed=2**64), "seed"),
    (dict(ignore_eos="yes"), "ignore_eos"),
])
def test_values_the_sampler_cannot_use_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_vanishing_temperature_means_greedy():
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.01).greedy


def _fake_clock(sched: Scheduler) -> list[float]:
    """The prefill queue's clock, set by the test: ``now[0]`` seconds."""
    now = [0.0]
    sched.prefill.clock = lambda: now[0]
    return now


def test_queue_timeout_fails_requests_never_started_but_not_one_prefilling(v3_path, reference):
    llm = LLM(v3_path, dtype="float32", page_size=4, max_total_tokens=512, chunked_prefill_size=8,
              max_running_requests=1, queue_timeout=5.0)
    sched, now, prompts = llm.scheduler, _fake_clock(llm.scheduler), _prompts([12, 30, 7, 19, 25, 10])
    first = sched.add_request("q0", prompts[1], GREEDY)  # 30 tokens: four chunks of 8
    sched.step()
    now[0] = 4.0
    late = [sched.add_request(f"q{i}", prompts[i], GREEDY) for i in (2, 3)]
    now[0] = 5.5  # q0 queued 5.5 s ago but is prefilling; the others have waited 1.5 s
    sched.step()
    assert sched.prefill.chunked is first and not any(r.finished for r in late)
    now[0] = 9.5  # q0 is still prefilling (its third chunk), the others waited 5.5 s without starting
    changed = sched.step()
    assert all(r in changed and r.finish_reason is FinishReason.ERROR and r.error_status == 503 for r in late)
    assert late[0].finish_message == "the request waited more than 5.0 s in the queue (--queue-timeout)"
    while sched.has_work:
        sched.step()
    assert first.output_ids == reference[1].token_ids and sched.pages.num_used == 0


def test_queue_timeout_spares_retracted_requests(v3_path, reference):
    # 64 slots cannot hold six requests at once: decode retracts some, which queue again, first in line
    llm = LLM(v3_path, dtype="float32", page_size=4, max_total_tokens=64, chunked_prefill_size=16, queue_timeout=5.0)
    sched, now = llm.scheduler, _fake_clock(llm.scheduler)
    reqs = [sched.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(_prompts([12, 30, 7, 19, 25, 10]))]
    while sched.decode.retracted == 0:
        sched.step()
    retracted = [r for r in sched.prefill.waiting if r.num_retractions > 0]
    never_started = [r for r in sched.prefill.waiting if r.num_retractions == 0]
    assert retracted and never_started
    now[0] = 1000.0  # every queued request is long overdue: only those never started expire
    sched.step()
    assert all(r.finish_reason is FinishReason.ERROR and r.error_status == 503 for r in never_started)
    while sched.has_work:
        sched.step()
    served = [i for i, r in enumerate(reqs) if r.finish_reason is not FinishReason.ERROR]
    assert {reqs[i].rid for i in served} == {r.rid for r in reqs} - {r.rid for r in never_started}
    assert [reqs[i].output_ids for i in served] == [reference[i].token_ids for i in served]
    assert sched.pages.num_used == 0


class _LaggingPeer(LocalCollectives):
    """An attention-TP group whose other rank's clock is behind: nothing is overdue there until
    ``caught_up``."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.caught_up = False

    def tp_min(self, values: list[int]) -> list[int]:
        self.calls.append(list(values))
        return values if self.caught_up else [0] * len(values)


def test_queue_timeout_waits_for_the_tp_group_to_agree(v3_path):
    llm = LLM(v3_path, dtype="float32", page_size=4, max_total_tokens=512, max_running_requests=1, queue_timeout=1.0)
    peer = _LaggingPeer()
    sched = Scheduler(llm.scheduler.config, llm.runner, llm.tokenizer, collectives=peer)
    now = _fake_clock(sched)
    running, waiting = (sched.add_request(f"t{i}", p, GREEDY) for i, p in enumerate(_prompts([12, 7])))
    sched.step()
    now[0] = 3.0
    sched.step()
    assert peer.calls == [[0, 0], [1]] and not waiting.finished  # overdue here, not yet on the peer
    peer.caught_up = True
    sched.step()
    assert waiting.finish_reason is FinishReason.ERROR and not running.finished


def test_offline_generate_ends_timed_out_requests_with_an_error(v3_path, reference, monkeypatch):
    llm = LLM(v3_path, dtype="float32", max_total_tokens=512, max_running_requests=1, queue_timeout=2.5)
    now, forward = _fake_clock(llm.scheduler), llm.scheduler.runner.forward

    def one_second_each(*args, **kwargs):
        now[0] += 1.0
        return forward(*args, **kwargs)

    monkeypatch.setattr(llm.scheduler.runner, "forward", one_second_each)
    first, second = llm.generate(_prompts([12, 30]), GREEDY, use_tqdm=False)
    assert first.token_ids == reference[0].token_ids
    assert second.finish_reason == "error" and second.token_ids == []
    assert llm.scheduler.pages.num_used == 0 and not llm.scheduler.has_work


@pytest.mark.parametrize("low_first", [False, True])
def test_priority_scheduling_admits_by_priority_then_arrival(low_first):
    from moeserve.cache import PagePool
    from moeserve.config import SchedulerConfig
    from moeserve.core import Req, SamplingParams
    from moeserve.scheduler.prefill import PrefillManager

    config = SchedulerConfig(enable_priority_scheduling=True, schedule_low_priority_values_first=low_first,
                             chunked_prefill_size=4, max_running_requests=1)
    prefill = PrefillManager(config, PagePool(64, 4))
    reqs = [Req(f"r{i}", [1, 2, 3], SamplingParams(priority=p)) for i, p in enumerate([0, 5, 1, 5, -2])]
    for req in reqs:
        prefill.add(req)
    order = [r.rid for r in prefill.waiting]
    assert order == (["r4", "r0", "r2", "r1", "r3"] if low_first else ["r1", "r3", "r2", "r0", "r4"])
    retracted = Req("back", [1, 2], SamplingParams(priority=-9))
    retracted.num_retractions = 1
    prefill.add(retracted, first=True)  # a retracted request goes first whatever its priority
    batch = prefill.next_batch(0)
    assert [s.req.rid for s in batch.seqs] == ["back"]
