"""The arithmetic of speculative decoding: greedy chains emit the target's argmax tokens, and the
rejection rule emits tokens distributed exactly as the target's distribution, whatever the drafts."""

from __future__ import annotations

import torch

from moeserve.core import SamplingParams
from moeserve.executor.sampler import SamplingInfo
from moeserve.executor.speculative import target_probs, verify_greedy, verify_sampled


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test of ``observed`` counts against ``expected`` counts (categories with an expected
    count of at least 5): the probability of a statistic at least this large by chance."""
    keep = expected >= 5
    stat = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def two_sample_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two equal-sized samples' counts ``a`` and ``b`` come from one
    distribution (categories with at least 10 in both together)."""
    keep = (a + b) >= 10
    stat = float(((a[keep] - b[keep]) ** 2 / (a[keep] + b[keep])).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_greedy_chain_keeps_drafts_up_to_the_first_miss():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, plus the bonus token
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the miss is replaced by the target's
    assert verify_greedy([4, 6], [5]) == [4]


def test_target_probs_follow_the_sampler():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.0]])
    infos = [SamplingInfo(SamplingParams(temperature=0.5, top_k=2), None, [1], []),
             SamplingInfo(SamplingParams(temperature=0), None, [1], [])]
    p = target_probs(logits, infos)
    expected = torch.softmax(torch.tensor([2.0, 1.0]) / 0.5, 0)
    torch.testing.assert_close(p[0, :2], expected)
    assert p[0, 2:].sum() == 0 and p[1].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_rejection_rule_emits_the_target_distribution():
    """Draft chains of two tokens from a distribution q far from the target p: the first and the
    second emitted tokens follow p (chi-square, 20,000 chains, seeded)."""
    gen = torch.Generator().manual_seed(0)
    vocab = 6
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, -1)
    q = torch.softmax(torch.randn(2, vocab, generator=gen) * 1.5, -1)
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    n = 20_000
    for _ in range(n):
        drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        out = verify_sampled(p, q, drafts, gen)
        first[out[0]] += 1
        if len(out) > 1:  # the second token comes from position 1 only after the first draft was kept
            second[out[1]] += 1
    assert chi_square_p_value(first, p[0] * n) > 1e-3
    assert chi_square_p_value(second, p[1] * second.sum()) > 1e-3
    # and the rule can fail: the drafts' own distribution is far from p
    assert chi_square_p_value(q[0] * n, p[0] * n) < 1e-6


def test_rejection_rule_with_drafts_from_a_point_mass():
    """A chain drafted greedily (a PD prefill server's) is judged as drawn from a one-hot q: the
    emitted tokens still follow p (chi-square, 20,000 chains)."""
    gen = torch.Generator().manual_seed(1)
    vocab = 6
    p = torch.softmax(torch.randn(3, vocab, generator=gen) * 1.5, -1)
    drafts = [int(p[0].argmin()), int(p[1].argmax())]
    q = torch.nn.functional.one_hot(torch.tensor(drafts), vocab).float()
    first, second = torch.zeros(vocab), torch.zeros(vocab)
    n = 20_000
    for _ in range(n):
        out = verify_sampled(p, q, drafts, gen)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert chi_square_p_value(first, p[0] * n) > 1e-3
    assert chi_square_p_value(second, p[1] * second.sum()) > 1e-3
