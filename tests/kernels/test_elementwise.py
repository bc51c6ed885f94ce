"""Torch references of norm, activation, rope and routing against independent formulations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.kernels import activation, norm, rope, routing
from moeserve.kernels.activation import silu_and_mul_ref
from moeserve.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from moeserve.kernels.rope import apply_rope_ref
from moeserve.kernels.routing import select_experts_ref


def test_rms_norm_ref() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, 100, dtype=torch.float64) * 5
    w = torch.randn(100, dtype=torch.float64)
    expected = x / (x.pow(2).sum(-1, keepdim=True) / 100 + 1e-6).sqrt() * w
    torch.testing.assert_close(rms_norm_ref(x, w, 1e-6), expected, rtol=1e-5, atol=1e-6)  # fp32 statistics
    out = rms_norm_ref(x.bfloat16(), w.bfloat16(), 1e-6)
    assert out.dtype == torch.bfloat16
    assert (out.double() - expected).norm() < 1e-2 * expected.norm()


def test_fused_add_rms_norm_ref_is_functional() -> None:
    x, res, w = torch.randn(5, 64), torch.randn(5, 64), torch.randn(64)
    x0, res0 = x.clone(), res.clone()
    out, new_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert torch.equal(x, x0) and torch.equal(res, res0)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out, rms_norm_ref(x + res, w, 1e-6))


def test_silu_and_mul_ref() -> None:
    x = torch.randn(2, 3, 40, dtype=torch.float64)
    gate, up = x[..., :20], x[..., 20:]
    torch.testing.assert_close(silu_and_mul_ref(x), gate / (1 + torch.exp(-gate)) * up)


def _angles(n_tokens: int, half: int) -> tuple[torch.Tensor, torch.Tensor]:
    theta = torch.rand(n_tokens, half, dtype=torch.float64) * 10
    return theta.cos(), theta.sin()


def test_apply_rope_ref_interleaved_is_complex_rotation() -> None:
    """DeepSeek's own form: pairs (2i, 2i+1) as complex numbers times ``e^{i theta}``."""
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    cos, sin = _angles(4, 8)
    z = torch.view_as_complex(x.view(4, 3, 8, 2)) * torch.complex(cos, sin)[:, None, :]
    expected = torch.cat([z.real, z.imag], dim=-1)  # the reference writes [evens | odds]
    torch.testing.assert_close(apply_rope_ref(x, cos, sin, interleave=True), expected)


def test_apply_rope_ref_halves_is_rotate_half() -> None:
    """The Llama form: ``x cos + rotate_half(x) sin`` with the angles repeated over both halves."""
    x = torch.randn(4, 3, 16, dtype=torch.float64)
    cos, sin = _angles(4, 8)
    rotated = torch.cat([-x[..., 8:], x[..., :8]], dim=-1)
    expected = x * cos.repeat(1, 2)[:, None] + rotated * sin.repeat(1, 2)[:, None]
    torch.testing.assert_close(apply_rope_ref(x, cos, sin, interleave=False), expected)


@pytest.mark.parametrize("interleave", [True, False])
def test_apply_rope_ref_scores_depend_on_relative_position(interleave: bool) -> None:
    q, k = torch.randn(1, 2, 32, dtype=torch.float64), torch.randn(1, 2, 32, dtype=torch.float64)
    inv_freq = 1.0 / 10000 ** (torch.arange(16, dtype=torch.float64) / 16)

    def score(pos_q: int, pos_k: int) -> torch.Tensor:
        rq = apply_rope_ref(q, *_rotation(pos_q, inv_freq), interleave)
        rk = apply_rope_ref(k, *_rotation(pos_k, inv_freq), interleave)
        return (rq * rk).sum(-1)

    torch.testing.assert_close(score(7, 3), score(107, 103))


def _rotation(pos: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    theta = pos * inv_freq[None, :]
    return theta.cos(), theta.sin()


def _route_one(logits: list[float], bias: list[float], top_k: int, n_group: int, topk_group: int,
               renorm: bool, scale: float) -> tuple[list[float], list[int]]:
    """DeepSeek-V3's router for one token, in plain Python."""
    scores = [1 / (1 + torch.tensor(v, dtype=torch.float64).neg().exp().item()) for v in logits]
    choice = [s + b for s, b in zip(scores, bias)]
    size = len(logits) // n_group
    rank = [sum(sorted(choice[g * size:(g + 1) * size])[-2:]) for g in range(n_group)]
    kept = sorted(range(n_group), key=lambda g: -rank[g])[:topk_group]
    candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
    ids = sorted(candidates, key=lambda e: -choice[e])[:top_k]
    weights = [scores[e] for e in ids]
    total = sum(weights) if renorm else 1.0
    return [w / total * scale for w in weights], ids


@pytest.mark.parametrize("renorm", [True, False])
def test_select_experts_ref_noaux_tc(renorm: bool) -> None:
    torch.manual_seed(1)
    n_experts, n_group, topk_group, top_k = 64, 8, 3, 6
    logits, bias = torch.randn(20, n_experts) * 2, torch.randn(n_experts) * 0.1
    weights, ids = select_experts_ref(logits, top_k, "noaux_tc", n_group, topk_group, bias, renorm, 2.5)
    for t in range(20):
        exp_w, exp_ids = _route_one(logits[t].tolist(), bias.tolist(), top_k, n_group, topk_group, renorm, 2.5)
        assert ids[t].tolist() == exp_ids
        torch.testing.assert_close(weights[t], torch.tensor(exp_w, dtype=torch.float32), rtol=1e-5, atol=0)


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_select_experts_ref_softmax_methods(method: str) -> None:
    torch.manual_seed(2)
    logits = torch.randn(10, 32)
    weights, ids = select_experts_ref(logits, 4, method, 4, 2, None, False, 1.5)
    probs = logits.double().softmax(-1)
    for t in range(10):
        allowed = range(32)
        if method == "group_limited_greedy":
            best = probs[t].view(4, 8).amax(-1)
            kept = best.topk(2).indices.tolist()
            allowed = [e for g in kept for e in range(8 * g, 8 * g + 8)]
        exp_ids = sorted(allowed, key=lambda e: -probs[t, e].item())[:4]
        assert ids[t].tolist() == exp_ids
        torch.testing.assert_close(weights[t].double(), probs[t, exp_ids] * 1.5, rtol=1e-5, atol=0)


def test_cpu_calls_run_the_references() -> None:
    x, w = torch.randn(4, 64), torch.randn(64)
    cos, sin = torch.randn(4, 8), torch.randn(4, 8)
    logits = torch.randn(4, 32)
    assert torch.equal(norm.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))
    assert torch.equal(norm.fused_add_rms_norm(x, x, w, 1e-6)[1], fused_add_rms_norm_ref(x, x, w, 1e-6)[1])
    assert torch.equal(activation.silu_and_mul(x), F.silu(x[:, :32]) * x[:, 32:])
    assert torch.equal(rope.apply_rope(x.view(4, 4, 16), cos, sin, True),
                       apply_rope_ref(x.view(4, 4, 16), cos, sin, True))
    args = (logits, 4, "noaux_tc", 4, 2, None, True, 2.5)
    for out, ref in zip(routing.select_experts(*args), select_experts_ref(*args)):
        assert torch.equal(out, ref)
