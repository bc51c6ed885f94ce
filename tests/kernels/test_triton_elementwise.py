"""Triton norm, activation, rope, FP8 group quantization and router top-k against fp64 references.

The ``check_*`` functions hold the comparisons. GPU tests run them in bf16 on DeepSeek-V3 shapes;
one CPU test runs them all at tiny shapes through Triton's interpreter in a subprocess
(``TRITON_INTERPRET`` must be set before Triton is imported; the interpreter's bf16 loads are
unreliable, so it gets fp16 and fp32).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.kernels.fp8 import FP8_MAX, per_token_group_quant_fp8_ref
from moeserve.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from moeserve.kernels.rope import apply_rope_ref
from moeserve.kernels.routing import select_experts_ref
from tests.kernels.accuracy import REL_TOL, poison_allocator, rel_error
from tests.kernels.interpreter import interpreted, run_checks

INTERPRETED = "tests.kernels.test_triton_elementwise:run_interpreted_checks"  # prefetched (tests/kernels/interpreter.py)


def _rows(n_rows: int, dim: int, pad: int, dtype: torch.dtype, device: str, scale: float = 1.0) -> torch.Tensor:
    """``[n_rows, dim]``, a row-strided view when ``pad`` > 0 (like MLA's latent split)."""
    base = torch.randn(n_rows, dim + pad, device=device) * scale
    return base.to(dtype)[:, :dim]


# --- checks (shared by the GPU tests and the interpreter run) -----------------------------------

def check_rms_norm(device: str, dtype: torch.dtype, n_rows: int, dim: int, pad: int = 0, **config) -> None:
    from moeserve.kernels.triton import norm

    x = _rows(n_rows, dim, pad, dtype, device, scale=3.0)
    w = (1 + 0.1 * torch.randn(dim, device=device)).to(dtype)
    poison_allocator(device)
    out = norm.rms_norm(x, w, 1e-6, config=config or None)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert rel_error(out, rms_norm_ref(x.double(), w.double(), 1e-6)) < REL_TOL[dtype]


def check_fused_add_rms_norm(device: str, dtype: torch.dtype, n_rows: int, dim: int, pad: int = 0,
                             **config) -> None:
    from moeserve.kernels.triton import norm

    x = _rows(n_rows, dim, pad, dtype, device)
    res = _rows(n_rows, dim, pad, dtype, device, scale=4.0)
    w = (1 + 0.1 * torch.randn(dim, device=device)).to(dtype)
    x_before, res_before = x.clone(), res.clone()
    poison_allocator(device)
    out, new_res = norm.fused_add_rms_norm(x, res, w, 1e-6, config=config or None)
    assert torch.equal(x, x_before) and torch.equal(res, res_before), "inputs were modified"
    assert out.dtype == dtype and new_res.dtype == dtype and new_res.shape == x.shape
    ref_out, ref_res = fused_add_rms_norm_ref(x.double(), res.double(), w.double(), 1e-6)
    assert rel_error(new_res, ref_res) < REL_TOL[dtype]
    assert rel_error(out, ref_out) < REL_TOL[dtype]
    # the residual is rounded once, like the reference's ``x + residual``
    assert torch.equal(new_res, x + res)


def check_silu_and_mul(device: str, dtype: torch.dtype, lead: tuple[int, ...], inter: int, pad: int = 0,
                       **config) -> None:
    from moeserve.kernels.triton import activation

    base = torch.randn(*lead, 2 * inter + pad, device=device).to(dtype)
    x = base[..., : 2 * inter]
    poison_allocator(device)
    out = activation.silu_and_mul(x, config=config or None)
    gate, up = x.double().chunk(2, dim=-1)
    assert out.shape == (*lead, inter) and out.dtype == dtype
    assert rel_error(out, F.silu(gate) * up) < REL_TOL[dtype]


def check_apply_rope(device: str, dtype: torch.dtype, n_tokens: int, n_heads: int, rope_dim: int,
                     head_dim: int, interleave: bool, **config) -> None:
    """``x`` is the rope slice of a ``[T, H, head_dim]`` query, as MLA hands it over."""
    from moeserve.kernels.triton import rope

    q = torch.randn(n_tokens, n_heads, head_dim, device=device).to(dtype)
    x = q[..., head_dim - rope_dim:]
    angles = torch.rand(n_tokens, rope_dim // 2, device=device) * 100
    cos, sin = angles.cos() * 1.2, angles.sin() * 1.2  # fp32, scaled like YaRN's attention factor
    poison_allocator(device)
    out = rope.apply_rope(x, cos, sin, interleave, config=config or None)
    ref = apply_rope_ref(x.double(), cos.double(), sin.double(), interleave)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert rel_error(out, ref) < REL_TOL[dtype]
    assert rel_error(out, apply_rope_ref(x, cos, sin, interleave)) < 2 * REL_TOL[dtype]
    # in place, into the strided slice itself; the rest of q untouched
    rest = q[..., :head_dim - rope_dim].clone()
    assert rope.apply_rope(x, cos, sin, interleave, out=x, config=config or None).data_ptr() == x.data_ptr()
    assert torch.equal(x, out)
    assert torch.equal(q[..., :head_dim - rope_dim], rest)


def check_per_token_group_quant(device: str, dtype: torch.dtype, lead: tuple[int, ...], k: int,
                                group_size: int = 128, pad: int = 0, **config) -> None:
    """Same scales as the reference to 1e-6 and the same fp8 values but for rare rounding ties."""
    from moeserve.kernels.triton import quant

    if device == "cpu":  # the interpreter's fp8 casts round wrongly: feed values that need no rounding
        base = _fp8_exact_rows(lead, k + pad, group_size)
    else:
        base = torch.randn(*lead, k + pad, device=device) * 3
        base[..., :3] *= 1e-4  # small values share a group with large ones
    if base.dim() > 1:
        base[0] = 0  # an all-zero row takes the scale floor
    x = base.to(dtype)[..., :k]
    poison_allocator(device)
    q, s = quant.per_token_group_quant_fp8(x, group_size, config=config or None)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x, group_size)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    deq = q.float() * s.repeat_interleave(group_size, dim=-1)[..., :k]
    deq_ref = q_ref.float() * s_ref.repeat_interleave(group_size, dim=-1)[..., :k]
    # a tie may round the other way: one e4m3 step (2^-3 relative, 2^-9 of the scale below normals)
    step = deq_ref.abs() * 2.0**-3 + s_ref.repeat_interleave(group_size, dim=-1)[..., :k] * 2.0**-9
    assert ((deq - deq_ref).abs() <= step + 1e-30).all()
    # ties are rare: at most 0.1% of the values, or two in a small input (800 values had one)
    assert (q.float() != q_ref.float()).sum().item() <= max(2, 1e-3 * q.numel())
    assert q.float().abs().max().item() <= FP8_MAX


def _fp8_exact_rows(lead: tuple[int, ...], k: int, group_size: int) -> torch.Tensor:
    """Rows whose groups each hold ±448·2^e and other e4m3 values times 2^e: the scales are 2^e and
    quantization is exact, so the result does not depend on how the cast rounds."""
    v = (torch.randn(*lead, k) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    v[..., ::group_size] = FP8_MAX * torch.randn(*lead, -(-k // group_size)).sign()
    return v * 2.0 ** torch.randint(-8, 1, (*lead, 1)).float()


def _decisive_tokens(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, n_group: int,
                     topk_group: int, margin: float = 1e-5) -> torch.Tensor:
    """``[T]`` bool: tokens whose kept groups and chosen experts are not near-ties in fp64, so any
    correct fp32 implementation must choose exactly as the reference does."""
    choice = logits.double().sigmoid()
    if bias is not None:
        choice = choice + bias.double()
    n_tokens, n_experts = choice.shape
    rank = choice.view(n_tokens, n_group, -1).topk(2, dim=-1)[0].sum(-1).sort(-1, descending=True)[0]
    ok = torch.ones(n_tokens, dtype=torch.bool, device=logits.device)
    if topk_group < n_group:
        ok &= rank[:, topk_group - 1] - rank[:, topk_group] > margin
    kept = choice.view(n_tokens, n_group, -1).topk(2, dim=-1)[0].sum(-1).topk(topk_group, -1)[1]
    mask = torch.zeros(n_tokens, n_group, dtype=torch.bool, device=logits.device).scatter_(1, kept, True)
    kept_choice = choice.masked_fill(~mask.repeat_interleave(n_experts // n_group, 1), float("-inf"))
    top = kept_choice.topk(top_k + 1, dim=-1)[0]
    return ok & (top[:, top_k - 1] - top[:, top_k] > margin)


def check_select_experts(device: str, n_tokens: int, n_experts: int, top_k: int, n_group: int, topk_group: int,
                         with_bias: bool, norm_topk_prob: bool, **config) -> None:
    from moeserve.kernels.triton import routing

    logits = torch.randn(n_tokens, n_experts, device=device) * 2
    bias = torch.randn(n_experts, device=device) * 0.1 if with_bias else None
    args = (logits, top_k, "noaux_tc", n_group, topk_group, bias, norm_topk_prob, 2.5)
    poison_allocator(device)
    weights, ids = routing.select_experts(*args, config=config or None)
    ref_w, ref_ids = select_experts_ref(*args)
    assert weights.shape == ids.shape == (n_tokens, top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    decisive = _decisive_tokens(logits, bias, top_k, n_group, topk_group)
    assert n_tokens < 100 or decisive.float().mean().item() > 0.95  # near-ties are rare
    ids_sorted, order = ids.sort(-1)
    ref_sorted, ref_order = ref_ids.sort(-1)
    assert torch.equal(ids_sorted[decisive], ref_sorted[decisive])
    torch.testing.assert_close(weights.gather(1, order)[decisive], ref_w.gather(1, ref_order)[decisive],
                               rtol=1e-6, atol=1e-7)


# --- GPU tests ------------------------------------------------------------------------------------

def check_topk_weighted_sum(device: str, dtype: torch.dtype, n_tokens: int, k: int, dim: int, shuffled: bool,
                            pad: int = 0, **config) -> None:
    """Against an fp64 loop, and equal to the torch reference within one rounding of the dtype."""
    from moeserve.kernels.combine import topk_weighted_sum_ref
    from moeserve.kernels.triton import combine

    rows = _rows(n_tokens * k + 3, dim, pad, dtype, device)  # 3 rows nobody picks
    weights = torch.rand(n_tokens, k, device=device)
    position = torch.randperm(rows.shape[0], device=device)[:n_tokens * k] if shuffled else None
    if not shuffled:
        rows = rows[:n_tokens * k]
    poison_allocator(device)
    out = combine.topk_weighted_sum(rows, weights, position, config=config or None)
    picked = rows.double() if position is None else rows.double()[position]
    ref = (picked.view(n_tokens, k, dim) * weights.to(dtype).double()[..., None]).sum(1)
    assert out.shape == (n_tokens, dim) and out.dtype == dtype
    assert rel_error(out, ref) < REL_TOL[dtype]
    torch.testing.assert_close(out, topk_weighted_sum_ref(rows, weights, position), rtol=REL_TOL[dtype], atol=1e-3)


def check_expert_order(device: str, n: int, num_experts: int, dtype: torch.dtype = torch.int64) -> None:
    """The Triton layout step equals a stable sort, and its counts and segment starts a count."""
    from moeserve.kernels.expert_order import expert_order_ref
    from moeserve.kernels.triton import expert_order

    ids = torch.randint(0, num_experts, (n,), device=device)
    if n > 4:
        ids[: n // 4] = num_experts - 1  # a run of ties, as a hot expert gives
    order, position, seg_indptr, counts = expert_order.expert_order(ids.to(dtype), num_experts)
    ref = expert_order_ref(ids, num_experts)
    assert torch.equal(order, torch.argsort(ids, stable=True))
    assert torch.equal(position, ref.position) and torch.equal(order[position], torch.arange(n, device=device))
    assert torch.equal(counts, torch.bincount(ids, minlength=num_experts))
    assert seg_indptr.tolist() == [0, *torch.cumsum(counts, 0).tolist()]


gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("n_rows,dim,pad", [(1, 7168, 0), (257, 7168, 0), (64, 1536, 0), (37, 512, 64), (5, 100, 3)])
def test_rms_norm_gpu(n_rows: int, dim: int, pad: int) -> None:
    check_rms_norm("cuda", torch.bfloat16, n_rows, dim, pad)
    check_fused_add_rms_norm("cuda", torch.bfloat16, n_rows, dim, pad)


@gpu
def test_rms_norm_gpu_3d_and_empty() -> None:
    from moeserve.kernels.triton import norm

    x = torch.randn(3, 5, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    assert rel_error(norm.rms_norm(x, w, 1e-6), rms_norm_ref(x.double(), w.double(), 1e-6)) < 1e-2
    assert norm.rms_norm(x[:0], w, 1e-6).shape == (0, 5, 256)


@gpu
@pytest.mark.parametrize("lead,inter,pad", [((8192,), 2048, 0), ((3, 5), 2048, 0), ((2,), 18432, 0), ((7,), 100, 6)])
def test_silu_and_mul_gpu(lead: tuple[int, ...], inter: int, pad: int) -> None:
    check_silu_and_mul("cuda", torch.bfloat16, lead, inter, pad)


@gpu
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("n_tokens,n_heads,rope_dim,head_dim", [(300, 128, 64, 192), (5, 16, 64, 64),
                                                                (9, 1, 64, 576), (4, 3, 48, 80)])
def test_apply_rope_gpu(n_tokens: int, n_heads: int, rope_dim: int, head_dim: int, interleave: bool) -> None:
    check_apply_rope("cuda", torch.bfloat16, n_tokens, n_heads, rope_dim, head_dim, interleave)


@gpu
@pytest.mark.parametrize("lead,k,group_size,pad", [((513,), 7168, 128, 0), ((3, 5), 2048, 128, 0),
                                                   ((9,), 1600, 128, 64), ((4,), 200, 64, 0), ((2,), 100, 48, 0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_per_token_group_quant_gpu(lead: tuple[int, ...], k: int, group_size: int, pad: int,
                                   dtype: torch.dtype) -> None:
    check_per_token_group_quant("cuda", dtype, lead, k, group_size, pad)


@gpu
@pytest.mark.parametrize("n_tokens", [1, 4096])
@pytest.mark.parametrize("with_bias,norm_topk_prob", [(True, True), (False, False)])
def test_select_experts_dsv3_gpu(n_tokens: int, with_bias: bool, norm_topk_prob: bool) -> None:
    check_select_experts("cuda", n_tokens, 256, 8, 8, 4, with_bias, norm_topk_prob)


@gpu
@pytest.mark.parametrize("n_experts,top_k,n_group,topk_group", [(512, 16, 16, 8), (72, 6, 3, 2), (64, 4, 1, 1)])
def test_select_experts_shapes_gpu(n_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    check_select_experts("cuda", 999, n_experts, top_k, n_group, topk_group, True, True)


@gpu
@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_select_experts_other_methods_fall_back_gpu(method: str) -> None:
    from moeserve.kernels.triton import routing

    logits = torch.randn(33, 64, device="cuda")
    args = (logits, 6, method, 8, 3, None, False, 1.0)
    for out, ref in zip(routing.select_experts(*args), select_experts_ref(*args)):
        assert torch.equal(out, ref)


@gpu
@pytest.mark.parametrize("n_tokens,k,dim,shuffled", [(8192, 8, 7168, True), (3, 8, 7168, False), (5, 6, 100, True),
                                                      (0, 8, 64, True)])
def test_topk_weighted_sum_gpu(n_tokens: int, k: int, dim: int, shuffled: bool) -> None:
    check_topk_weighted_sum("cuda", torch.bfloat16, n_tokens, k, dim, shuffled)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_logits_gpu_match_the_fp32_gemm(dtype: torch.dtype) -> None:
    """The 16-bit GEMM with fp32 accumulation is the fp32 GEMM of the same values up to the
    order of the sum: errors at fp32 rounding level, and the same experts chosen."""
    from moeserve.layers.gate import router_logits

    gen = torch.Generator(device="cuda").manual_seed(3)
    hidden = torch.randn(4096, 7168, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(256, 7168, device="cuda", generator=gen) / 7168**0.5).to(dtype)
    logits = router_logits(hidden, weight)
    ref = F.linear(hidden.double(), weight.double())
    assert logits.dtype == torch.float32
    assert ((logits.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5  # a bf16 result would be ~4e-3
    fp32 = F.linear(hidden.float(), weight.float())
    same = (logits.topk(8).indices.sort().values == fp32.topk(8).indices.sort().values).all(1)
    assert same.float().mean().item() > 0.999  # only exact near-ties may order differently


@gpu
@pytest.mark.parametrize("n,num_experts", [(0, 8), (1, 1), (1024, 288), (2048, 256), (2049, 72), (8192, 288)])
def test_expert_order_gpu(n: int, num_experts: int) -> None:
    check_expert_order("cuda", n, num_experts)


@gpu
def test_public_functions_dispatch_to_triton_gpu() -> None:
    """The ``kernels/`` entry points run Triton on CUDA tensors and the references under "torch"."""
    from moeserve.kernels import activation, fp8, norm, rope, routing
    from moeserve.kernels.backend import kernel_backend

    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    cos, sin = torch.randn(16, 32, device="cuda"), torch.randn(16, 32, device="cuda")
    logits = torch.randn(16, 256, device="cuda")
    calls = {
        "rms_norm": lambda: norm.rms_norm(x, w, 1e-6),
        "fused_add_rms_norm": lambda: norm.fused_add_rms_norm(x, x, w, 1e-6)[0],
        "silu_and_mul": lambda: activation.silu_and_mul(x),
        "apply_rope": lambda: rope.apply_rope(x.view(16, 4, 64), cos, sin, True),
        "quant": lambda: fp8.per_token_group_quant_fp8(x)[1],
        "routing": lambda: routing.select_experts(logits, 8, "noaux_tc", 8, 4, None, True, 2.5)[0].sort(-1)[0],
    }
    for name, call in calls.items():
        fast = call()
        with kernel_backend("torch"):
            slow = call()
        assert rel_error(fast, slow) < 2e-2, name


# --- validation (CPU: wrappers raise before launching) ------------------------------------------

def test_wrappers_reject_bad_inputs() -> None:
    pytest.importorskip("triton")
    from moeserve.kernels.triton import activation, norm, quant, rope, routing

    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm(x, torch.randn(32), 1e-6)
    with pytest.raises(ValueError, match="last dim"):
        norm.rms_norm(x.t(), torch.randn(4), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        norm.fused_add_rms_norm(x, x[:2], torch.randn(64), 1e-6)
    with pytest.raises(ValueError, match="config"):
        norm.rms_norm(x, torch.randn(64), 1e-6, config={"BLOCK_X": 1})
    with pytest.raises(ValueError, match="2I"):
        activation.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(ValueError, match="cos"):
        rope.apply_rope(torch.randn(4, 2, 64), torch.randn(4, 16), torch.randn(4, 32), True)
    with pytest.raises(ValueError, match="last dim"):
        quant.per_token_group_quant_fp8(x.t())
    with pytest.raises(ValueError, match="fp32"):
        routing.select_experts(torch.randn(4, 256).half(), 8, "noaux_tc", 8, 4)
    with pytest.raises(ValueError, match="groups"):
        routing.select_experts(torch.randn(4, 250), 8, "noaux_tc", 8, 4)
    with pytest.raises(ValueError, match="top_k"):
        routing.select_experts(torch.randn(4, 16), 9, "noaux_tc", 4, 2)


# --- the interpreter run (CPU) --------------------------------------------------------------------

f16, f32 = torch.float16, torch.float32
INTERPRETED_CHECKS = {
    "rms_norm": lambda: check_rms_norm("cpu", f16, 5, 100, 3),
    "rms_norm_fp32_rows_per_program": lambda: check_rms_norm("cpu", f32, 9, 64, BLOCK_R=4, num_warps=2),
    "fused_add_rms_norm": lambda: check_fused_add_rms_norm("cpu", f16, 3, 96, 32),
    "silu_and_mul": lambda: check_silu_and_mul("cpu", f16, (2, 3), 40, 4, BLOCK_I=16),
    "apply_rope_interleave": lambda: check_apply_rope("cpu", f16, 3, 5, 16, 24, True, BLOCK_H=4),
    "apply_rope_halves": lambda: check_apply_rope("cpu", f32, 3, 2, 12, 12, False),
    "apply_rope_k": lambda: check_apply_rope("cpu", f16, 4, 1, 8, 40, True),
    "quant": lambda: check_per_token_group_quant("cpu", f16, (3,), 80, 32, 8, BLOCK_G=2),
    "quant_fp32_partial_group": lambda: check_per_token_group_quant("cpu", f32, (2, 2), 50, 24),
    "quant_reciprocal": lambda: check_per_token_group_quant("cpu", f16, (3,), 64, 32, DIV_RN=False),
    "select_experts": lambda: check_select_experts("cpu", 6, 32, 4, 4, 2, True, True),
    "select_experts_padded_groups": lambda: check_select_experts("cpu", 4, 18, 3, 3, 2, False, False),
    "topk_weighted_sum": lambda: check_topk_weighted_sum("cpu", f16, 5, 3, 40, True, pad=8, BLOCK_D=16),
    "topk_weighted_sum_in_order_fp32": lambda: check_topk_weighted_sum("cpu", f32, 4, 8, 24, False),
    "expert_order": lambda: check_expert_order("cpu", 300, 37),
    "expert_order_int32_one_expert": lambda: check_expert_order("cpu", 129, 1, torch.int32),
    "expert_order_empty": lambda: check_expert_order("cpu", 0, 5),
}


def run_interpreted_checks() -> None:
    """Entry of the interpreter subprocess."""
    run_checks(INTERPRETED_CHECKS)


@pytest.fixture(scope="module")
def interpreted_results() -> dict[str, object]:
    return interpreted(INTERPRETED)


@pytest.mark.parametrize("name", list(INTERPRETED_CHECKS))
def test_interpreted(interpreted_results: dict[str, object], name: str) -> None:
    assert interpreted_results[name] == "ok", interpreted_results[name]
