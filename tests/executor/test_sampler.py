"""Sampler checks against references: torch.argmax, log_softmax, and a float64 numpy filter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moeserve.core import SamplingParams
from moeserve.executor.sampler import (
    Sampler,
    SamplingInfo,
    apply_penalties,
    filtered_sorted_probs,
    inverse_cdf,
)


def make_info(
    seed: int | None = None,
    prompt_ids: list[int] | None = None,
    output_ids: list[int] | None = None,
    **params: object,
) -> SamplingInfo:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingInfo(
        params=SamplingParams(**params),
        generator=generator,
        prompt_ids=list(prompt_ids or []),
        output_ids=list(output_ids or []),
    )


def reference_probs(
    logits: np.ndarray,
    temperature: float = 1.0,
    top_k: int = -1,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> np.ndarray:
    """[V] float64 distribution after temperature, top-k (ties kept), top-p, min-p, renormalize."""
    x = logits.astype(np.float64) / temperature
    if top_k > 0:
        kth = np.sort(x)[::-1][min(top_k, len(x)) - 1]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    keep = np.zeros(len(p), dtype=bool)
    mass = 0.0
    for i in np.argsort(-p, kind="stable"):
        if p[i] == 0 or (top_p < 1 and mass >= top_p):
            break
        keep[i] = True
        mass += p[i]
    keep &= p >= min_p * p.max()
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper chi-square quantile (z = 3.719 is p = 1e-4) by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# ---------------------------------------------------------------------------------------------
# Greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_matches_argmax(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 1000).to(dtype)
    logits[0, 3] = logits[0, 700] = logits[0].max() + 1  # tie: argmax takes the lowest index
    logits[1] = 0.0  # all tied
    infos = [make_info(temperature=0.0) for _ in range(6)]
    out = Sampler().sample(logits, infos)
    assert out.next_ids == torch.argmax(logits, dim=-1).tolist()
    assert out.next_ids[:2] == [3, 0]
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature: float) -> None:
    torch.manual_seed(1)
    logits = torch.randn(16, 300)
    infos = [make_info(temperature=temperature, top_k=1, top_p=0.5) for _ in range(16)]
    assert Sampler().sample(logits, infos).next_ids == torch.argmax(logits, dim=-1).tolist()


def test_greedy_and_sampled_rows_mixed() -> None:
    torch.manual_seed(2)
    logits = torch.randn(4, 100)
    infos = [
        make_info(temperature=0.0),
        make_info(seed=3),
        make_info(temperature=0.0),
        make_info(top_k=5),
    ]
    out = Sampler().sample(logits, infos)
    argmax = torch.argmax(logits, dim=-1).tolist()
    assert out.next_ids[0] == argmax[0] and out.next_ids[2] == argmax[2]
    assert out.next_ids[3] in torch.topk(logits[3], 5).indices.tolist()


# ---------------------------------------------------------------------------------------------
# Seeds


def _seeded_run(layout: str, steps: int = 8) -> list[int]:
    """Tokens drawn for the seeded target row over ``steps`` steps, batched as ``layout`` says."""
    torch.manual_seed(100 + len(layout))  # a different default-RNG state per layout
    target_logits = torch.linspace(-1.0, 1.0, 500)
    target = make_info(seed=1234, temperature=1.5, top_p=0.95)
    others = [make_info(), make_info(seed=7, top_k=20), make_info(temperature=0.0)]
    tokens = []
    for _ in range(steps):
        rows = {
            "alone": [target],
            "middle": [others[0], target, others[1], others[2]],
            "reversed": [others[2], others[1], others[0], target],
        }[layout]
        logits = torch.stack([target_logits if r is target else torch.randn(500) for r in rows])
        out = Sampler().sample(logits, rows)
        tokens.append(out.next_ids[rows.index(target)])
    return tokens


def test_seeded_row_independent_of_companions_and_order() -> None:
    alone = _seeded_run("alone")
    assert _seeded_run("middle") == alone
    assert _seeded_run("reversed") == alone
    assert len(set(alone)) > 1  # the draws really are random


def test_different_seeds_differ_and_default_rng_is_reproducible() -> None:
    logits = torch.zeros(1, 1000)
    first = [Sampler().sample(logits, [make_info(seed=s)]).next_ids[0] for s in range(10)]
    assert len(set(first)) > 5
    runs = []
    for _ in range(2):
        torch.manual_seed(42)
        out = Sampler().sample(logits.expand(8, -1), [make_info() for _ in range(8)])
        runs.append(out.next_ids)
    assert runs[0] == runs[1]


# ---------------------------------------------------------------------------------------------
# Filtering and frequencies

FILTERS = [
    dict(temperature=0.5),
    dict(temperature=1.0, top_k=5),
    dict(temperature=0.7, top_p=0.5),
    dict(temperature=1.3, min_p=0.1),
    dict(temperature=1.0, top_k=10, top_p=0.8, min_p=0.05),
    dict(temperature=2.0, top_p=0.3),
    dict(temperature=1.0, top_k=1000),  # larger than V: off
]


@pytest.mark.parametrize("params", FILTERS)
def test_filter_mask_matches_reference(params: dict) -> None:
    torch.manual_seed(3)
    logits = torch.randn(40) * 2
    expected = reference_probs(logits.numpy(), **params)
    infos = [make_info(**params)]
    p = infos[0].params
    top_k = torch.tensor([[p.top_k if 0 < p.top_k < 40 else 40]])
    top_p = torch.tensor([[p.top_p if p.top_p < 1 else math.inf]])
    min_p = torch.tensor([[p.min_p]])
    probs, ids = filtered_sorted_probs(logits[None] / p.temperature, top_k, top_p, min_p)
    got = torch.zeros(40, dtype=torch.float64).scatter_(0, ids[0], probs[0].double())
    np.testing.assert_array_equal(got.numpy() > 0, expected > 0)
    np.testing.assert_allclose(got.numpy() / got.sum().item(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("params", FILTERS)
def test_sampled_frequencies_match_filtered_distribution(params: dict) -> None:
    """20k draws in one batch: no filtered token ever, and chi-square against the reference."""
    n, vocab = 20_000, 40
    torch.manual_seed(3)
    logits = torch.randn(vocab) * 2
    expected = reference_probs(logits.numpy(), **params)
    torch.manual_seed(4)
    out = Sampler().sample(logits.expand(n, -1), [make_info(**params) for _ in range(n)])
    counts = np.bincount(out.next_ids, minlength=vocab)
    kept = expected > 0
    assert counts[~kept].sum() == 0
    df = int(kept.sum()) - 1
    if df == 0:
        assert counts[kept].sum() == n
        return
    exp = n * expected[kept]
    chi2 = float(((counts[kept] - exp) ** 2 / exp).sum())
    assert chi2 < chi2_critical(df), (chi2, df)


def test_seeded_draws_never_pick_filtered_tokens() -> None:
    vocab = 64
    torch.manual_seed(5)
    logits = torch.randn(1, vocab) * 3
    params = dict(temperature=1.2, top_k=12, top_p=0.85, min_p=0.02)
    kept = reference_probs(logits[0].numpy(), **params) > 0
    info = make_info(seed=9, **params)
    seen = {Sampler().sample(logits, [info]).next_ids[0] for _ in range(2000)}
    assert all(kept[t] for t in seen)
    assert len(seen) == kept.sum()  # and every kept token does get drawn


def test_inverse_cdf_clamps_to_last_nonzero_token() -> None:
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [1.0, 1e-30, 0.0, 0.0]])
    ids = torch.tensor([[3, 1, 0, 2], [2, 0, 1, 3]])
    # u == 1 is outside rand's [0, 1) but stands for float rounding past the last cdf step.
    assert inverse_cdf(probs, ids, torch.tensor([1.0, 1.0])).tolist() == [1, 0]
    assert inverse_cdf(probs, ids, torch.tensor([0.0, 0.0])).tolist() == [3, 2]
    assert inverse_cdf(probs, ids, torch.tensor([0.49, 0.5])).tolist() == [3, 2]


# ---------------------------------------------------------------------------------------------
# Penalties


def reference_penalties(logits: torch.Tensor, info: SamplingInfo) -> torch.Tensor:
    """[V] logits after the HF repetition penalty, then OpenAI frequency and presence penalties."""
    x = logits.double().tolist()
    p = info.params
    for t in set(info.prompt_ids + info.output_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(info.output_ids):
        x[t] -= p.frequency_penalty * info.output_ids.count(t) + p.presence_penalty
    return torch.tensor(x)


PENALTY_ROWS = [
    dict(repetition_penalty=1.3, prompt_ids=[1, 2, 2, 7], output_ids=[7, 30]),
    dict(repetition_penalty=0.7, prompt_ids=[3, 4], output_ids=[4, 5, 5]),
    dict(frequency_penalty=0.5, prompt_ids=[11, 4], output_ids=[4, 4, 4, 9]),
    dict(presence_penalty=-1.5, prompt_ids=[11], output_ids=[4, 4, 9]),
    dict(prompt_ids=[1, 2, 3], output_ids=[1, 1]),  # no penalties: untouched
    dict(
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        presence_penalty=0.4,
        prompt_ids=[0, 5, 6],
        output_ids=[6, 6, 8, 49],
    ),
]


def test_penalties_match_formulas() -> None:
    torch.manual_seed(6)
    logits = torch.randn(len(PENALTY_ROWS), 50) * 3
    original = logits.clone()
    infos = [make_info(**row) for row in PENALTY_ROWS]
    got = apply_penalties(logits, infos)
    expected = torch.stack([reference_penalties(logits[i], info) for i, info in enumerate(infos)])
    torch.testing.assert_close(got, expected.float())
    assert torch.equal(got[4], logits[4])
    assert torch.equal(logits, original)  # the caller's logits are not modified
    assert apply_penalties(logits, [make_info() for _ in infos]) is logits


def test_penalty_free_rows_keep_their_logits_in_a_mixed_batch() -> None:
    torch.manual_seed(7)
    logits = torch.randn(3, 20)
    infos = [
        make_info(output_ids=[1, 2]),
        make_info(presence_penalty=1.0, output_ids=[1]),
        make_info(),
    ]
    got = apply_penalties(logits, infos)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert got[1, 1] == logits[1, 1] - 1.0


@pytest.mark.parametrize(
    "logits, row",
    [
        ([2.0, 1.9, 0.0], dict(repetition_penalty=1.1, prompt_ids=[0])),  # 2 / 1.1 < 1.9
        ([-1.0, -1.05, -5.0], dict(repetition_penalty=1.1, output_ids=[0])),  # -1 * 1.1 < -1.05
        ([2.0, 1.9, 0.0], dict(frequency_penalty=0.05, output_ids=[0, 0, 0])),  # 2 - 0.15 < 1.9
        ([2.0, 1.9, 0.0], dict(presence_penalty=0.2, output_ids=[0, 0, 0])),  # 2 - 0.2 < 1.9
        ([1.9, 2.0, 0.0], dict(frequency_penalty=-0.2, output_ids=[0])),  # negative penalty boosts
    ],
)
def test_penalty_flips_greedy_choice(logits: list[float], row: dict) -> None:
    sampler = Sampler()
    x = torch.tensor([logits])
    assert sampler.sample(x, [make_info(temperature=0.0)]).next_ids == [int(torch.argmax(x))]
    flipped = sampler.sample(x, [make_info(temperature=0.0, **row)]).next_ids[0]
    assert flipped == 1 - int(torch.argmax(x))


def test_frequency_and_presence_ignore_prompt_tokens() -> None:
    x = torch.tensor([[2.0, 1.9, 0.0]])
    info = make_info(
        temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0, prompt_ids=[0, 0, 0]
    )
    assert Sampler().sample(x, [info]).next_ids == [0]


def test_logprobs_use_penalized_logits() -> None:
    torch.manual_seed(8)
    logits = torch.randn(len(PENALTY_ROWS), 50) * 3
    infos = [make_info(temperature=0.7, logprobs=5, **row) for row in PENALTY_ROWS]
    out = Sampler().sample(logits, infos)
    for i, info in enumerate(infos):
        ref = torch.log_softmax(reference_penalties(logits[i], info), dim=-1)
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.next_ids[i]
        assert lp.logprob == pytest.approx(ref[lp.token_id].item(), abs=1e-5)
        top = torch.topk(ref, 5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        np.testing.assert_allclose([v for _, v in lp.top], top.values.numpy(), atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Logprobs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_match_log_softmax_before_temperature(dtype: torch.dtype) -> None:
    torch.manual_seed(9)
    logits = (torch.randn(5, 200) * 2).to(dtype)
    ks = [None, 0, 3, 20, 1]
    infos = [
        make_info(temperature=0.0, logprobs=ks[0]),
        make_info(temperature=0.0, logprobs=ks[1]),
        make_info(temperature=0.4, top_k=5, logprobs=ks[2], seed=1),
        make_info(temperature=1.7, top_p=0.9, logprobs=ks[3]),
        make_info(temperature=1.0, min_p=0.2, logprobs=ks[4]),
    ]
    out = Sampler().sample(logits, infos)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs[0] is None
    for i in range(1, 5):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.next_ids[i]
        assert lp.logprob == pytest.approx(ref[i, lp.token_id].item(), abs=1e-5)
        assert len(lp.top) == ks[i]
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        for t, v in lp.top:
            assert v == pytest.approx(ref[i, t].item(), abs=1e-5)
        if ks[i]:
            np.testing.assert_allclose(values, torch.topk(ref[i], ks[i]).values.numpy(), atol=1e-5)


def test_empty_batch_and_shape_mismatch() -> None:
    out = Sampler().sample(torch.zeros(0, 10), [])
    assert out.next_ids == [] and out.logprobs == []
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 10), [make_info()])


# ---------------------------------------------------------------------------------------------
# CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    """Same bf16 logits and seeds on both devices: same tokens, logprobs within float error."""
    torch.manual_seed(10)
    logits = (torch.randn(6, 4096) * 4).bfloat16()
    rows = [
        dict(temperature=0.0, repetition_penalty=1.3, prompt_ids=[1, 2, 3], logprobs=3),
        dict(temperature=0.0, logprobs=0),
        dict(temperature=0.9, top_k=50, seed=1, frequency_penalty=0.5, output_ids=[5, 5]),
        dict(temperature=1.1, top_p=0.7, seed=2, logprobs=2),
        dict(temperature=0.8, min_p=0.05, seed=3),
        dict(temperature=1.0, seed=4, presence_penalty=1.0, output_ids=[9]),
    ]
    on_cpu = Sampler().sample(logits, [make_info(**r) for r in rows])
    on_cuda = Sampler().sample(logits.cuda(), [make_info(**r) for r in rows])
    assert on_cuda.next_ids == on_cpu.next_ids
    penalized = apply_penalties(logits.float(), [make_info(**r) for r in rows])
    assert on_cuda.next_ids[:2] == torch.argmax(penalized[:2], dim=-1).tolist()
    for a, b in zip(on_cuda.logprobs, on_cpu.logprobs):
        assert (a is None) == (b is None)
        if a is not None and b is not None:
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("field, value", [("temperature", 1e-300), ("top_p", 1e-300),
                                          ("repetition_penalty", 1e-300), ("repetition_penalty", 1e300)])
def test_values_past_validation_still_give_a_token(field: str, value: float) -> None:
    """Float32 turns these into 0 or inf; the sampler must still pick a valid token (the argmax
    where the value means 'almost greedy'), never index -1 or NaN."""
    torch.manual_seed(0)
    logits = torch.randn(3, 50) * 5
    infos = [make_info(prompt_ids=[1, 2, 3], temperature=1.0) for _ in range(3)]
    for info in infos:
        object.__setattr__(info.params, field, value)  # as if a caller skipped validation
    out = Sampler().sample(logits, infos)
    assert all(0 <= t < 50 for t in out.next_ids)
    if field == "top_p":
        assert out.next_ids == logits.argmax(-1).tolist()


def test_a_row_of_minus_infinity_still_gives_a_token() -> None:
    logits = torch.randn(2, 20)
    logits[1] = float("-inf")
    infos = [make_info(temperature=1.0, repetition_penalty=1.5, prompt_ids=[3]) for _ in range(2)]
    assert all(0 <= t < 20 for t in Sampler().sample(logits, infos).next_ids)


def test_sample_isolated_reports_failing_rows_and_samples_the_rest() -> None:
    logits = torch.randn(3, 20)
    infos = [make_info(temperature=0), make_info(temperature=0), make_info(temperature=0)]

    class Broken(Sampler):
        def sample(self, logits, infos):
            if any(i is infos_bad for i in infos):
                raise RuntimeError("boom")
            return super().sample(logits, infos)

    infos_bad = infos[1]
    out = Broken().sample_isolated(logits, infos)
    assert list(out.errors) == [1] and "boom" in out.errors[1]
    assert out.next_ids[0] == int(logits[0].argmax()) and out.next_ids[2] == int(logits[2].argmax())
