"""The prefix cache in the scheduler: the same greedy tokens with it on and off on workloads that
share prefixes (a long system prompt, chat turns), eviction under memory pressure that never takes
a page a request uses, and aborted or retracted requests that drop only their pins."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SMALL = {"dtype": "float32", "page_size": 4}


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def v3_path(hf_model_path):
    return hf_model_path("v3", 0)


def _run(llm: LLM, waves: list[list[list[int]]]) -> list:
    """Each wave of prompts in one batch, the waves one after another."""
    return [o for wave in waves for o in llm.generate(wave, GREEDY, use_tqdm=False)]


def _check_idle(llm: LLM) -> None:
    """Nothing in use once the load ends; what the cache keeps is reported apart and unpinned."""
    pages, cache = llm.scheduler.pages, llm.scheduler.prefix_cache
    assert pages.num_used == 0 and not llm.scheduler.has_work
    assert cache is None or (cache.num_locked_pages == 0 and pages.num_cached == cache.num_evictable_pages)


def test_a_shared_system_prompt_is_computed_once(v3_path):
    system = _tokens(42, seed=1)
    waves = [[system + _tokens(5, seed=2)], [system + _tokens(n, seed=10 + n) for n in (3, 9, 1, 6)]]
    off = LLM(v3_path, disable_radix_cache=True, **SMALL)
    on = LLM(v3_path, max_total_tokens=1024, **SMALL)
    ref, got = _run(off, waves), _run(on, waves)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert off.scheduler.prefix_cache is None and all(o.cached_tokens == 0 for o in ref)
    assert got[0].cached_tokens == 0 and all(o.cached_tokens == 40 for o in got[1:])  # whole pages only
    assert on.scheduler.prefill.cached_tokens == 4 * 40 and on.scheduler.prefill.prompt_tokens == 47 + 4 * 42 + 19
    _check_idle(on)
    _check_idle(off)


def test_chat_turns_reuse_the_earlier_turns_and_their_answers(v3_path):
    """Each turn's prompt is the last one, its answer and a new question: the finished request left
    its prompt and output in the cache, whole pages of them."""
    outs = {}
    for disable in (True, False):
        llm = LLM(v3_path, disable_radix_cache=disable, max_total_tokens=1024, **SMALL)
        prompt, turns = _tokens(17, seed=3), []
        for turn in range(4):
            out = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
            turns.append((len(prompt), out.token_ids, out.cached_tokens))
            prompt = prompt + out.token_ids + _tokens(5 + turn, seed=20 + turn)
        outs[disable] = turns
        _check_idle(llm)
    assert [t for _, t, _ in outs[False]] == [t for _, t, _ in outs[True]]
    assert [c for _, _, c in outs[True]] == [0] * 4
    # the KV of the last turn's prompt and its answer but the answer's last token, in whole pages
    expected = [0] + [(n + len(t) - 1) // 4 * 4 for n, t, _ in outs[False][:-1]]
    assert [c for _, _, c in outs[False]] == expected


def test_eviction_under_memory_pressure_keeps_tokens_and_spares_pages_in_use(v3_path):
    """96 slots cannot hold four 32-token prefixes and their requests: the cache must evict, only
    pages no live request holds, and every answer stays the same."""
    groups = [_tokens(32, seed=40 + g) for g in range(4)]
    question = lambda g, q: groups[g] + _tokens(3 + q, seed=50 + 4 * g + q)  # noqa: E731
    waves = [[question(g, q) for g in pair for q in range(2)] for pair in ((0, 1), (2, 3), (1, 0))]
    settings = dict(max_total_tokens=96, chunked_prefill_size=16, max_running_requests=3, **SMALL)
    ref = _run(LLM(v3_path, disable_radix_cache=True, **settings), waves)
    llm = LLM(v3_path, **settings)
    sched, cache = llm.scheduler, llm.scheduler.prefix_cache
    evicted = []
    remove_leaf = cache._remove_leaf

    def checked_remove(leaf):
        in_use = {p for r in sched.requests for p in r.page_table}
        assert not in_use & set(leaf.pages), "evicted a page a live request holds"
        evicted.extend(leaf.pages)
        return remove_leaf(leaf)

    cache._remove_leaf = checked_remove
    got = _run(llm, waves)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert evicted and sum(o.cached_tokens for o in got) > 0
    _check_idle(llm)


def test_abort_and_retraction_drop_pins_not_cached_pages(v3_path):
    llm = LLM(v3_path, max_total_tokens=1024, **SMALL)
    sched, cache = llm.scheduler, llm.scheduler.prefix_cache
    system = _tokens(24, seed=5)
    llm.generate([system + [7]], GREEDY, use_tqdm=False)
    cached = cache.num_cached_pages
    reqs = [sched.add_request(f"r{i}", system + _tokens(4, seed=60 + i), GREEDY) for i in range(3)]
    for _ in range(3):
        sched.step()
    assert all(r.shared_pages >= 6 and r.cached_tokens == 24 for r in reqs) and cache.num_locked_pages >= 6
    sched.abort("r0")
    sched.decode.retract(reqs[1])
    assert reqs[0].prefix_node is None and reqs[1].page_table == [] and cache.num_cached_pages >= cached
    assert set(reqs[2].page_table[:6]) <= {p for n in cache._nodes() for p in n.pages}
    while sched.has_work:
        sched.step()
    ref = LLM(v3_path, disable_radix_cache=True, **SMALL).generate([r.prompt_ids for r in reqs[1:]], GREEDY,
                                                                   use_tqdm=False)
    assert [r.output_ids for r in reqs[1:]] == [o.token_ids for o in ref]
    _check_idle(llm)
