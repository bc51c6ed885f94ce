"""Speculative decoding with the checkpoint's MTP module (``--speculative-algorithm NEXTN``) on a
random tiny V3 with a random MTP module: greedy output equals decoding one token at a time whatever
the drafts, for one draft and for chains; sampled output follows the same distribution (chi-square);
stops, max_tokens, aborts and retraction behave as without it."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.models.tiny import make_tiny_model
from tests.executor.test_speculative import two_sample_p_value

ENGINE = {"dtype": "float32", "page_size": 4, "chunked_prefill_size": 16}


def _prompts(lens: list[int], seed: int = 7) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 320, (n,), generator=gen).tolist() for n in lens]


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("mtp") / "v3"), preset="v3", seed=3, mtp=True)


@pytest.fixture(scope="module")
def reference(mtp_path):
    """Greedy tokens one at a time (the MTP module unused)."""
    llm = LLM(mtp_path, max_total_tokens=2048, **ENGINE)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (17, 5, 30, 1, 12)]
    return [o.token_ids for o in llm.generate(_prompts([9, 40, 3, 20, 26]), params, use_tqdm=False)], params


@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_tokens_equal_decoding_one_at_a_time(mtp_path, reference, steps):
    tokens, params = reference
    llm = LLM(mtp_path, max_total_tokens=2048, speculative_algorithm="NEXTN", speculative_num_steps=steps, **ENGINE)
    outs = llm.generate(_prompts([9, 40, 3, 20, 26]), params, use_tqdm=False)
    assert [o.token_ids for o in outs] == tokens
    spec = llm.scheduler.spec
    assert spec.verified > 0 and 1.0 <= spec.accept_length <= steps + 1
    assert llm.scheduler.pages.num_used == 0 and not spec.drafts


def test_retraction_and_stops_under_a_tiny_cache(mtp_path, reference):
    """80 slots: decode retracts, and stop tokens end a chain in its middle."""
    tokens, params = reference
    stops = [SamplingParams(max_tokens=p.max_tokens, temperature=0, ignore_eos=True,
                            stop_token_ids=[t[len(t) // 2]] if len(t) > 2 else []) for p, t in zip(params, tokens)]
    expected = [t[:t.index(s.stop_token_ids[0]) + 1] if s.stop_token_ids else t for t, s in zip(tokens, stops)]
    llm = LLM(mtp_path, max_total_tokens=80, speculative_algorithm="NEXTN", speculative_num_steps=2, **ENGINE)
    outs = llm.generate(_prompts([9, 40, 3, 20, 26]), stops, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert llm.scheduler.decode.retracted > 0 and llm.scheduler.pages.num_used == 0


def test_abort_mid_decode_frees_everything(mtp_path):
    llm = LLM(mtp_path, max_total_tokens=512, speculative_algorithm="NEXTN", speculative_num_steps=2, **ENGINE)
    sched = llm.scheduler
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reqs = [sched.add_request(f"r{i}", p, params) for i, p in enumerate(_prompts([6, 11]))]
    for _ in range(4):
        sched.step()
    assert sched.spec.drafts
    sched.abort("r0")
    assert "r0" not in sched.spec.drafts
    while sched.has_work:
        sched.step()
    assert reqs[1].finished and len(reqs[1].output_ids) == 40 and sched.pages.num_used == 0


def test_sampled_tokens_follow_the_same_distribution(mtp_path):
    """1,000 seeded samples of the second and third output token of one prompt, with and without
    speculation (the second is the first a verify step emits): two-sample chi-square."""
    prompt = _prompts([5], seed=11)[0]
    n = 1000
    counts = {}
    for spec in (False, True):
        settings = {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2} if spec else {}
        llm = LLM(mtp_path, max_total_tokens=16384, max_running_requests=512, **ENGINE, **settings)
        params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=6, seed=i, ignore_eos=True) for i in range(n)]
        outs = llm.generate([prompt] * n, params, use_tqdm=False)
        counts[spec] = [torch.bincount(torch.tensor([o.token_ids[k] for o in outs]), minlength=400).double()
                        for k in (1, 2)]
    for plain, spec in zip(counts[False], counts[True]):
        assert two_sample_p_value(plain, spec) > 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("steps", [1, 2])
def test_greedy_tokens_on_the_gpu(mtp_path, steps, graphs):
    """Verify runs absorbed MLA with several queries a sequence on the GPU kernels (fp32, so that the
    kernels' other reduction orders stay far below the gaps between top logits); with graphs, the
    verify, the MTP pass after it and the draft steps replay CUDA graphs, and so does the run
    without speculation that gives the reference."""
    prompts = _prompts([9, 40, 3, 20, 26, 64, 1])
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    outs = []
    for settings in ({}, {"speculative_algorithm": "NEXTN", "speculative_num_steps": steps}):
        with LLM(mtp_path, device="cuda", dtype="float32", page_size=16, max_total_tokens=4096,
                 disable_cuda_graph=not graphs, **settings) as llm:
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            runner = llm.runner
            if settings and graphs:
                assert runner.verify_graphs is not None and runner.graph_runner is None
                assert sorted(runner.mtp_graphs) == sorted({steps + 1} | ({1} if steps > 1 else set()))
                assert runner.verify_graphs.replays > 0 and all(g.replays > 0 for g in runner.mtp_graphs.values())
                assert llm.scheduler.spec.verified > 0
            elif settings:
                assert runner.verify_graphs is None and not runner.mtp_graphs
    assert outs[0] == outs[1]


def test_settings_it_cannot_serve_are_refused(mtp_path, tmp_path):
    from moeserve.config import build_engine_config

    with pytest.raises(ValueError, match="speculative_algorithm.*MTP module"):
        build_engine_config(make_tiny_model(str(tmp_path / "plain"), preset="v3"), speculative_algorithm="NEXTN")
    with pytest.raises(ValueError, match="speculative_eagle_topk"):
        build_engine_config(mtp_path, speculative_algorithm="NEXTN", speculative_eagle_topk=2)
    with pytest.raises(ValueError, match="speculative_num_draft_tokens"):
        build_engine_config(mtp_path, speculative_algorithm="NEXTN", speculative_num_steps=2,
                            speculative_num_draft_tokens=2)
    with pytest.raises(ValueError, match="speculative_num_steps.*at most 16 with --disaggregation-mode"):
        build_engine_config(mtp_path, speculative_algorithm="NEXTN", speculative_num_steps=17,
                            disaggregation_mode="decode")
    assert build_engine_config(mtp_path, speculative_algorithm="NEXTN", speculative_num_steps=3,
                               speculative_num_draft_tokens=4).spec.num_drafts == 3
