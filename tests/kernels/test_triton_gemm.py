"""Triton grouped GEMMs and FP8 block-scaled linear against the torch references.

On CPU the kernels run in Triton's interpreter at tiny shapes (fp16, fp32 and fp8 operands: its
bf16 loads are unreliable), all cases in one subprocess, since ``TRITON_INTERPRET`` must be set
before Triton is imported. On a GPU, medium shapes with every edge case: uneven and empty
segments, padding rows, partial K and N blocks, ``masked_m`` of 0 and ``M_max``, split K, and
capture in a CUDA graph (which fails on any host synchronisation).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve.kernels.activation import silu_and_mul_ref
from moeserve.kernels.backend import kernel_backend
from moeserve.kernels.fp8 import block_quant_fp8, fp8_block_gemm, fp8_block_gemm_ref, per_token_group_quant_fp8
from moeserve.kernels.grouped_gemm import grouped_gemm_contiguous_ref, grouped_gemm_masked_ref
from tests.kernels.interpreter import fix_interpreter_scalars, interpreted, report

INTERPRETED = "tests.kernels.test_triton_gemm:_interpreter_main"  # prefetched (tests/kernels/interpreter.py)

ROOT = Path(__file__).resolve().parents[2]


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` (``max |out|`` for an all-zero ref); NaN (never written) fails."""
    out, ref = out.double().cpu(), ref.double().cpu()
    if out.isnan().any():
        return float("inf")
    if ref.norm() == 0:
        return out.abs().max().item()
    return ((out - ref).norm() / ref.norm()).item()


def _seg_indptr(counts: list[int], device: str = "cpu") -> torch.Tensor:
    return torch.tensor([0, *counts], device=device).cumsum(0)


def _quant_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    qs, ss = zip(*(block_quant_fp8(w[e]) for e in range(w.shape[0])))
    return torch.stack(qs), torch.stack(ss)


def _quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation quantization by the torch reference, so these tests check the GEMMs alone."""
    with kernel_backend("torch"):
        return per_token_group_quant_fp8(x.float())


# ----------------------------------------------------------------------------- interpreter (CPU)


def _interpreter_cases() -> dict[str, tuple]:
    """name -> (thunk returning (out, ref), tolerance). Runs inside the interpreter subprocess."""
    from moeserve.kernels.triton import gemm as tg

    torch.manual_seed(0)
    small = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "num_warps": 4, "num_stages": 2}
    fp8_small = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128}
    cases: dict[str, tuple] = {}

    # contiguous, fp16: zero-row experts, a 1-row expert, padding, partial N and K, strided x and w
    seg = _seg_indptr([7, 0, 23, 1, 14])
    x = torch.randn(52, 48, dtype=torch.float16)[:, :40]  # row stride 48, K = 40 (not a multiple of 16)
    w = torch.randn(5, 48, 40, dtype=torch.float16)[:, :44]  # N = 44
    ref = grouped_gemm_contiguous_ref(x.float(), w.float(), seg)
    for tag, cfg in (("", small), ("_persistent", dict(small, ctas_per_sm=1)), ("_group2", dict(small, GROUP_M=2)),
                     ("_bk32", dict(small, BLOCK_K=32, BLOCK_N=64)), ("_default", None)):
        cases[f"contiguous_fp16{tag}"] = (lambda cfg=cfg: (tg.grouped_gemm_contiguous(x, w, seg, config=cfg), ref), 2e-3)
    # through tensor descriptors (w packed, as the copy engine needs; x keeps its row stride)
    w_packed = w.contiguous()
    for tag, cfg in (("", dict(small, TMA=1)), ("_ws", dict(small, TMA=1, WS=1, ctas_per_sm=1))):
        cases[f"contiguous_fp16_tma{tag}"] = (
            lambda cfg=cfg: (tg.grouped_gemm_contiguous(x, w_packed, seg, config=cfg), ref), 2e-3)
    late = torch.tensor([3, 10, 10, 30])  # rows before seg_indptr[0] are zero too
    cases["contiguous_fp16_late_start"] = (
        lambda: (tg.grouped_gemm_contiguous(x, w[:3], late, config=small),
                 grouped_gemm_contiguous_ref(x.float(), w[:3].float(), late)), 2e-3)
    x32, w32 = torch.randn(20, 24), torch.randn(2, 24, 24)
    seg32 = _seg_indptr([5, 11])
    cases["contiguous_fp32"] = (lambda: (tg.grouped_gemm_contiguous(x32, w32, seg32, config=small),
                                         grouped_gemm_contiguous_ref(x32, w32, seg32)), 1e-5)

    # contiguous, fp8: K = 160 and N = 160 end in partial 128-blocks; BLOCK_N 256 takes per-column scales
    seg8 = _seg_indptr([6, 0, 19, 4])
    xq, xs = per_token_group_quant_fp8(torch.randn(33, 160))
    wq, ws = _quant_experts(torch.randn(4, 160, 160) * 0.1)
    ref8 = grouped_gemm_contiguous_ref(xq, wq, seg8, xs, ws, out_dtype=torch.float32)
    for tag, cfg in (("", fp8_small), ("_bn64_bk64", dict(fp8_small, BLOCK_N=64, BLOCK_K=64)),
                     ("_bn256", dict(fp8_small, BLOCK_N=256)), ("_default", None)):
        cases[f"contiguous_fp8{tag}"] = (
            lambda cfg=cfg: (tg.grouped_gemm_contiguous(xq, wq, seg8, xs, ws, torch.float32, config=cfg), ref8), 1e-5)
    cases["contiguous_fp8_tma"] = (
        lambda: (tg.grouped_gemm_contiguous(xq, wq, seg8, xs, ws, torch.float32, config=dict(fp8_small, TMA=1)), ref8),
        1e-5)
    cases["contiguous_fp8_fp16_out"] = (
        lambda: (tg.grouped_gemm_contiguous(xq, wq, seg8, xs, ws, torch.float16, config=fp8_small), ref8), 2e-3)

    # masked: an empty expert, a full one (M_max = 20 is not a multiple of BLOCK_M) and a partial one
    masked_m = torch.tensor([0, 20, 7], dtype=torch.int32)
    xm = torch.randn(3, 20, 40, dtype=torch.float16)
    wm = torch.randn(3, 44, 40, dtype=torch.float16)
    refm = grouped_gemm_masked_ref(xm.float(), wm.float(), masked_m)
    cases["masked_fp16"] = (lambda: (tg.grouped_gemm_masked(xm, wm, masked_m, config=small), refm), 2e-3)
    cases["masked_fp16_default"] = (lambda: (tg.grouped_gemm_masked(xm, wm, masked_m), refm), 2e-3)
    cases["masked_fp16_tma"] = (lambda: (tg.grouped_gemm_masked(xm, wm, masked_m, config=dict(small, TMA=1)), refm),
                                2e-3)
    xmq, xms = per_token_group_quant_fp8(torch.randn(3, 20, 160))
    wmq, wms = wq[:3], ws[:3]
    refm8 = grouped_gemm_masked_ref(xmq, wmq, masked_m.long(), xms, wms, out_dtype=torch.float32)
    cases["masked_fp8"] = (
        lambda: (tg.grouped_gemm_masked(xmq, wmq, masked_m.long(), xms, wms, torch.float32, config=fp8_small), refm8),
        1e-5)

    # dense FP8 linear: K = 288 is two full 128-steps and a partial one; three K-splits take one each
    xd, xds = per_token_group_quant_fp8(torch.randn(20, 288))
    wd, wds = block_quant_fp8(torch.randn(160, 288) * 0.1)
    refd = fp8_block_gemm_ref(xd, xds, wd, wds, torch.float32)
    for split in (1, 3):
        cases[f"dense_fp8_split{split}"] = (
            lambda split=split: (tg.fp8_block_gemm(xd, xds, wd, wds, torch.float32,
                                                   config=dict(fp8_small, SPLIT_K=split)), refd), 1e-5)
    cases["dense_fp8_split3_tma"] = (
        lambda: (tg.fp8_block_gemm(xd, xds, wd, wds, torch.float32, config=dict(fp8_small, SPLIT_K=3, TMA=1)), refd),
        1e-5)
    cases["dense_fp8_default"] = (lambda: (tg.fp8_block_gemm(xd, xds, wd, wds, torch.float32), refd), 1e-5)

    # SiLU-and-mul fused into the epilogue: w holds [gate | up] rows (2 x 22 here; fp8: 2 x 128)
    glu_ref = silu_and_mul_ref(ref)
    for tag, cfg in (("", small), ("_tma", dict(small, TMA=1)), ("_default", None)):
        cases[f"glu_contiguous_fp16{tag}"] = (
            lambda cfg=cfg: (tg.grouped_gemm_contiguous(x, w_packed, seg, fuse_silu_and_mul=True, config=cfg),
                             glu_ref), 3e-3)
    cases["glu_masked_fp16"] = (
        lambda: (tg.grouped_gemm_masked(xm, wm, masked_m, fuse_silu_and_mul=True, config=small),
                 silu_and_mul_ref(refm)), 3e-3)
    wgq, wgs = _quant_experts(torch.randn(4, 256, 160) * 0.1)
    glu_ref8 = silu_and_mul_ref(grouped_gemm_contiguous_ref(xq, wgq, seg8, xs, wgs, out_dtype=torch.float32))
    for tag, cfg in (("", fp8_small), ("_bn256", dict(fp8_small, BLOCK_N=256)), ("_tma", dict(fp8_small, TMA=1))):
        cases[f"glu_contiguous_fp8{tag}"] = (
            lambda cfg=cfg: (tg.grouped_gemm_contiguous(xq, wgq, seg8, xs, wgs, torch.float32, fuse_silu_and_mul=True,
                                                        config=cfg), glu_ref8), 1e-5)

    # the public masked function: fused where the weights allow, else the kernel and then the pass
    # (FP8 gate and up of 96 rows each split a 128-row scale block)
    xmq96, xms96 = per_token_group_quant_fp8(torch.randn(3, 20, 160))
    for rows in (256, 192):
        wgm, wgms = _quant_experts(torch.randn(3, rows, 160) * 0.1)
        ref_m = silu_and_mul_ref(grouped_gemm_masked_ref(xmq96, wgm, masked_m, xms96, wgms, out_dtype=torch.float32))
        cases[f"glu_masked_fp8_public_n{rows}"] = (
            lambda wgm=wgm, wgms=wgms, ref_m=ref_m: (
                _public_on_cpu(xmq96, wgm, masked_m, xms96, wgms, torch.float32, fuse_silu_and_mul=True), ref_m), 1e-5)

    # no rows at all: every row is padding
    cases["contiguous_all_padding"] = (
        lambda: (tg.grouped_gemm_contiguous(x, w, torch.zeros(6, dtype=torch.int64), config=small),
                 torch.zeros(52, 44)), 0.0)
    return cases


def _public_on_cpu(*args, **kwargs) -> torch.Tensor:
    """``kernels.grouped_gemm.grouped_gemm_masked`` choosing as it would for CUDA inputs (the
    interpreter runs the kernel on CPU tensors)."""
    from moeserve.kernels import grouped_gemm as public

    saved, public.use_triton = public.use_triton, lambda t: True
    try:
        return public.grouped_gemm_masked(*args, **kwargs)
    finally:
        public.use_triton = saved


def _poison_empty() -> None:
    """Make ``torch.empty`` return NaN-filled float tensors, so an unwritten output shows."""
    empty = torch.empty

    def nan_empty(*args, **kwargs) -> torch.Tensor:
        t = empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = nan_empty


def _interpreter_main() -> None:
    """Entry point of the subprocess: print ``{case: relative error or error text}`` as JSON."""
    fix_interpreter_scalars()
    _poison_empty()
    results: dict[str, object] = {}
    for name, (thunk, _) in _interpreter_cases().items():
        try:
            results[name] = _rel(*thunk())
        except Exception as e:
            results[name] = f"{type(e).__name__}: {e}"
    report(results)


_INTERPRETER_CASES = [
    ("contiguous_fp16", 2e-3), ("contiguous_fp16_persistent", 2e-3), ("contiguous_fp16_group2", 2e-3),
    ("contiguous_fp16_bk32", 2e-3), ("contiguous_fp16_default", 2e-3), ("contiguous_fp16_late_start", 2e-3),
    ("contiguous_fp32", 1e-5), ("contiguous_fp8", 1e-5), ("contiguous_fp8_bn64_bk64", 1e-5),
    ("contiguous_fp8_bn256", 1e-5), ("contiguous_fp8_default", 1e-5), ("contiguous_fp8_fp16_out", 2e-3),
    ("masked_fp16", 2e-3), ("masked_fp16_default", 2e-3), ("masked_fp8", 1e-5),
    ("dense_fp8_split1", 1e-5), ("dense_fp8_split3", 1e-5), ("dense_fp8_default", 1e-5),
    ("contiguous_all_padding", 0.0), ("contiguous_fp16_tma", 2e-3), ("contiguous_fp16_tma_ws", 2e-3),
    ("contiguous_fp8_tma", 1e-5), ("masked_fp16_tma", 2e-3), ("dense_fp8_split3_tma", 1e-5),
    ("glu_contiguous_fp16", 3e-3), ("glu_contiguous_fp16_tma", 3e-3), ("glu_contiguous_fp16_default", 3e-3),
    ("glu_masked_fp16", 3e-3), ("glu_contiguous_fp8", 1e-5), ("glu_contiguous_fp8_bn256", 1e-5),
    ("glu_contiguous_fp8_tma", 1e-5), ("glu_masked_fp8_public_n256", 1e-5), ("glu_masked_fp8_public_n192", 1e-5),
]


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, object]:
    return interpreted(INTERPRETED)


@pytest.mark.parametrize("name, tol", _INTERPRETER_CASES)
def test_interpreter(interpreter_results: dict[str, object], name: str, tol: float) -> None:
    err = interpreter_results[name]
    assert isinstance(err, float), err
    assert err <= tol


def test_interpreter_covers_every_case() -> None:
    pytest.importorskip("triton")
    assert sorted(_interpreter_cases()) == sorted(name for name, _ in _INTERPRETER_CASES)


def test_tma_descriptors_only_for_operands_the_copy_engine_takes() -> None:
    """The TMA cases above test the kernel only if their operands really go through descriptors;
    operands the copy engine cannot take fall back to pointer loads instead of failing."""
    pytest.importorskip("triton")
    from moeserve.kernels.triton import gemm as tg

    cfg = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}
    x = torch.randn(52, 48, dtype=torch.float16)[:, :40]
    w = torch.randn(5, 48, 40, dtype=torch.float16)
    assert tg._tma_descriptors(x[None], w[:, :44].contiguous(), cfg) is not None
    assert tg._tma_descriptors(torch.randn(3, 20, 40, dtype=torch.float16), w, cfg) is not None  # masked batches
    assert tg._tma_descriptors(x[None], w[:, :44], cfg) is None  # experts not back to back
    odd_rows = torch.randn(52, 41, dtype=torch.float16)[:, :40]  # rows 82 bytes apart
    assert tg._tma_descriptors(odd_rows[None], w, cfg) is None
    assert tg._tma_descriptors(x[None], w, dict(cfg, BLOCK_K=4)) is None  # an 8-byte box row


# ----------------------------------------------------------------------------- GPU


def _poison_allocator(nbytes: int) -> None:
    """Leave a NaN-filled block of ``nbytes`` in the caching allocator, so the kernel's
    ``torch.empty`` output most likely starts as NaN."""
    torch.full((nbytes // 4 + 1,), float("nan"), device="cuda")


def _random_counts(num_e: int, mean: int, gen: torch.Generator) -> list[int]:
    counts = torch.randint(0, 2 * mean + 1, (num_e,), generator=gen)
    counts[torch.randperm(num_e, generator=gen)[: max(1, num_e // 4)]] = 0  # some experts get no rows
    return counts.tolist()


def _gpu_contiguous_inputs(num_e: int, mean: int, n: int, k: int, fp8: bool, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    counts = _random_counts(num_e, mean, gen)
    seg = _seg_indptr(counts, "cuda")
    m = sum(counts) + 13  # padding rows
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    w = torch.randn(num_e, n, k, device="cuda", dtype=dtype) / k**0.5
    if not fp8:
        return x, w, seg, None, None
    xq, xs = _quant_rows(x)
    wq, ws = _quant_experts(w.float())
    return xq, wq, seg, xs, ws


def _gpu_masked_inputs(num_e: int, m_max: int, n: int, k: int, fp8: bool):
    x = torch.randn(num_e, m_max, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(num_e, n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    if not fp8:
        return x, w, None, None
    xq, xs = _quant_rows(x)
    wq, ws = _quant_experts(w.float())
    return xq, wq, xs, ws


GPU_CONTIGUOUS = [
    # (experts, mean rows, fp8, config): default configs in both regimes, then explicit ones
    (8, 300, False, None), (16, 3, False, None), (8, 300, True, None), (16, 3, True, None),
    (8, 300, False, {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4, "ctas_per_sm": 1}),
    (8, 300, True, {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "HOPPER": 0}),
    (16, 3, True, {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 6, "ctas_per_sm": 4}),
    (8, 300, False, {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "TMA": 1}),
    (8, 300, True, {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4, "TMA": 1,
                    "HOPPER": 0}),
    (8, 300, True, {"HOPPER": 0}),  # the Triton kernel's default large tiles, where Hopper takes Gluon
    (16, 3, False, {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "TMA": 1}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("num_e, mean, fp8, config", GPU_CONTIGUOUS)
def test_gpu_contiguous(num_e: int, mean: int, fp8: bool, config: dict | None) -> None:
    from moeserve.kernels.triton import gemm as tg

    n, k = 384 + 32, 1024 + 64  # partial blocks in N and K
    x, w, seg, xs, ws = _gpu_contiguous_inputs(num_e, mean, n, k, fp8, torch.bfloat16, seed=num_e * 7 + mean)
    ref = grouped_gemm_contiguous_ref(x, w, seg, xs, ws, out_dtype=torch.float32)
    _poison_allocator(x.shape[0] * n * 2)
    out = tg.grouped_gemm_contiguous(x, w, seg, xs, ws, config=config)
    assert out.dtype == torch.bfloat16
    assert _rel(out, ref) < 1e-2
    assert (out[int(seg[-1]):] == 0).all()


@pytest.mark.gpu
def test_gpu_contiguous_fp16_and_public_dispatch() -> None:
    from moeserve.kernels.grouped_gemm import grouped_gemm_contiguous

    x, w, seg, _, _ = _gpu_contiguous_inputs(6, 40, 256, 512, False, torch.float16, seed=3)
    _poison_allocator(x.shape[0] * 256 * 2)
    out = grouped_gemm_contiguous(x, w, seg)  # CUDA inputs go to the Triton kernel
    assert out.dtype == torch.float16
    assert _rel(out, grouped_gemm_contiguous_ref(x.float(), w.float(), seg)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("m_max", [64, 200])
def test_gpu_masked(fp8: bool, m_max: int) -> None:
    from moeserve.kernels.triton import gemm as tg

    num_e, n, k = 6, 384 + 32, 1024 + 64
    gen = torch.Generator().manual_seed(m_max + fp8)
    masked_m = torch.randint(0, m_max + 1, (num_e,), generator=gen)
    masked_m[0], masked_m[1] = 0, m_max
    masked_m = masked_m.to(device="cuda", dtype=torch.int32)
    x, w, xs, ws = _gpu_masked_inputs(num_e, m_max, n, k, fp8)
    ref = grouped_gemm_masked_ref(x, w, masked_m, xs, ws, out_dtype=torch.float32)
    _poison_allocator(num_e * m_max * n * 2)
    out = tg.grouped_gemm_masked(x, w, masked_m, xs, ws)
    assert _rel(out, ref) < 1e-2
    for e in range(num_e):
        assert (out[e, int(masked_m[e]):] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 200])
@pytest.mark.parametrize("split", [None, 1, 4])
def test_gpu_fp8_block_gemm(m: int, split: int | None) -> None:
    from moeserve.kernels.triton import gemm as tg

    n, k = 384 + 32, 1024 + 64
    xq, xs = _quant_rows(torch.randn(m, k, device="cuda"))
    wq, ws = block_quant_fp8(torch.randn(n, k, device="cuda") / k**0.5)
    cfg = None if split is None else {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4,
                                          "SPLIT_K": split}
    _poison_allocator(m * n * 4 * 4)
    out = fp8_block_gemm(xq, xs, wq, ws) if cfg is None else tg.fp8_block_gemm(xq, xs, wq, ws, config=cfg)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert _rel(out, fp8_block_gemm_ref(xq, xs, wq, ws, torch.float32)) < 1e-2


GPU_FUSED = [
    # (experts, mean rows or M_max, fp8, masked): both regimes' default configs, both layouts
    (8, 300, False, False), (16, 3, False, False), (8, 300, True, False), (16, 3, True, False),
    (6, 200, False, True), (6, 64, True, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("num_e, rows, fp8, masked", GPU_FUSED)
def test_gpu_fused_silu_and_mul(num_e: int, rows: int, fp8: bool, masked: bool) -> None:
    """SiLU-and-mul in the kernel's epilogue against the unfused reference: w13-like weights (gate
    and up halves of 2 x 384 rows, whole FP8 scale blocks each), K with a partial block."""
    from moeserve.kernels.triton.gemm import grouped_gemm_contiguous, grouped_gemm_masked

    n, k = 2 * 384, 1024 + 64
    if masked:
        x, w, xs, ws = _gpu_masked_inputs(num_e, rows, n, k, fp8)
        masked_m = torch.randint(0, rows + 1, (num_e,), generator=torch.Generator().manual_seed(rows))
        masked_m[0], masked_m[1] = 0, rows
        masked_m = masked_m.to(device="cuda", dtype=torch.int32)
        ref = grouped_gemm_masked_ref(x, w, masked_m, xs, ws, out_dtype=torch.float32)
        _poison_allocator(num_e * rows * n * 2)
        out = grouped_gemm_masked(x, w, masked_m, xs, ws, fuse_silu_and_mul=True)
        zero_rows = [out[e, int(masked_m[e]):] for e in range(num_e)]
    else:
        x, w, seg, xs, ws = _gpu_contiguous_inputs(num_e, rows, n, k, fp8, torch.bfloat16, seed=num_e + rows)
        ref = grouped_gemm_contiguous_ref(x, w, seg, xs, ws, out_dtype=torch.float32)
        _poison_allocator(x.shape[0] * n * 2)
        out = grouped_gemm_contiguous(x, w, seg, xs, ws, fuse_silu_and_mul=True)
        zero_rows = [out[int(seg[-1]):]]
    assert out.shape[-1] == n // 2 and out.dtype == torch.bfloat16
    assert _rel(out, silu_and_mul_ref(ref)) < 1e-2
    assert all((z == 0).all() for z in zero_rows)


@pytest.mark.gpu
def test_gpu_masked_silu_and_mul_falls_back_where_the_kernel_cannot_fuse() -> None:
    """FP8 gate and up halves that split a 128-row scale block (96 + 96 rows, as in the tiny test
    models) take the unfused pass through the public function, with the same result."""
    from moeserve.kernels.grouped_gemm import grouped_gemm_masked

    x, w, xs, ws = _gpu_masked_inputs(4, 16, 192, 256, fp8=True)
    masked_m = torch.tensor([0, 16, 5, 9], device="cuda", dtype=torch.int32)
    out = grouped_gemm_masked(x, w, masked_m, xs, ws, fuse_silu_and_mul=True)
    ref = grouped_gemm_masked_ref(x, w, masked_m, xs, ws, out_dtype=torch.float32)
    assert out.shape == (4, 16, 96)
    assert _rel(out, silu_and_mul_ref(ref)) < 1e-2


def test_which_weights_the_fused_activation_takes() -> None:
    pytest.importorskip("triton")
    from moeserve.kernels.fp8 import FP8_DTYPE
    from moeserve.kernels.triton import gemm as tg

    assert tg.can_fuse_silu_and_mul(torch.empty(2, 192, 8, dtype=torch.float16))
    assert not tg.can_fuse_silu_and_mul(torch.empty(2, 193, 8, dtype=torch.float16))
    assert tg.can_fuse_silu_and_mul(torch.empty(2, 256, 8, dtype=FP8_DTYPE))
    assert not tg.can_fuse_silu_and_mul(torch.empty(2, 192, 8, dtype=FP8_DTYPE))  # 96-row halves
    x, w = torch.empty(4, 8, dtype=torch.float16), torch.empty(2, 193, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match="fuse_silu_and_mul needs w's N"):
        tg.grouped_gemm_contiguous(x, w, torch.tensor([0, 2, 4]), fuse_silu_and_mul=True)


@pytest.mark.gpu
def test_gpu_empty_inputs() -> None:
    from moeserve.kernels.triton import gemm as tg

    w = torch.randn(3, 64, 32, device="cuda", dtype=torch.bfloat16)
    empty = tg.grouped_gemm_contiguous(w.new_empty(0, 32), w, torch.zeros(4, dtype=torch.int64, device="cuda"))
    assert empty.shape == (0, 64)
    masked = tg.grouped_gemm_masked(w.new_empty(3, 0, 32), w, torch.zeros(3, dtype=torch.int32, device="cuda"))
    assert masked.shape == (3, 0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_cuda_graph_replays_new_segments(fp8: bool) -> None:
    """The launch reads its segments on the device: capture once, change them, replay."""
    from moeserve.kernels.triton import gemm as tg

    x, w, seg, xs, ws = _gpu_contiguous_inputs(8, 5, 256, 512, fp8, torch.bfloat16, seed=11)
    xm, wm, xms, wms = _gpu_masked_inputs(4, 8, 256, 512, fp8)
    masked_m = torch.tensor([3, 0, 7, 1], device="cuda", dtype=torch.int32)
    run = lambda: (tg.grouped_gemm_contiguous(x, w, seg, xs, ws),
                   tg.grouped_gemm_masked(xm, wm, masked_m, xms, wms))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_c, out_m = run()

    new_counts = torch.randint(0, x.shape[0] // 8 + 1, (8,), generator=torch.Generator().manual_seed(13))
    seg.copy_(_seg_indptr(new_counts.tolist(), "cuda"))
    masked_m.copy_(torch.tensor([8, 2, 0, 5]))
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out_c, grouped_gemm_contiguous_ref(x, w, seg, xs, ws, torch.float32)) < 1e-2
    assert _rel(out_m, grouped_gemm_masked_ref(xm, wm, masked_m, xms, wms, torch.float32)) < 1e-2


def _needs_hopper() -> None:
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon FP8 kernel runs on Hopper (compute capability 9.0)")


GLUON_CONTIGUOUS = [
    # (rows per expert, N, K, padding rows, rows before seg_indptr[0])
    ([300, 0, 1, 129, 0, 1000], 4096, 7168, 77, 0),
    ([5, 200], 2112, 1600, 3, 0),  # partial N and K blocks
    ([130, 70], 256, 512, 10, 5),  # rows before the first segment are zero as well
    ([0, 0, 0], 256, 512, 40, 0),  # no live rows: zeros only
    ([100, 130], 256, 512, 0, 0),  # the last tile's second warpgroup has no rows, and they would lie past x
]


@pytest.mark.gpu
@pytest.mark.parametrize("counts, n, k, pad, first", GLUON_CONTIGUOUS)
def test_gpu_gluon_fp8_contiguous(counts: list[int], n: int, k: int, pad: int, first: int) -> None:
    """The Gluon kernel (``gemm_hopper``) in the contiguous layout against the reference and the
    Triton kernel: every live row, zeros everywhere else."""
    _needs_hopper()
    from moeserve.kernels.triton import gemm as tg

    seg = torch.tensor([first, *counts], device="cuda").cumsum(0)
    x = torch.randn(int(seg[-1]) + pad, k, device="cuda")
    xq, xs = _quant_rows(x)
    wq, ws = _quant_experts(torch.randn(len(counts), n, k, device="cuda") / k**0.5)
    _poison_allocator(x.shape[0] * n * 2)
    out = tg.grouped_gemm_contiguous(xq, wq, seg, xs, ws, config={"HOPPER": 1})
    ref = grouped_gemm_contiguous_ref(xq, wq, seg, xs, ws, out_dtype=torch.float32)
    assert _rel(out, ref) < 1e-2
    assert (out[: int(seg[0])] == 0).all() and (out[int(seg[-1]):] == 0).all()
    triton_out = tg.grouped_gemm_contiguous(xq, wq, seg, xs, ws, config={"HOPPER": 0})
    assert _rel(out, triton_out) < 1e-2


@pytest.mark.gpu
def test_gpu_gluon_fp8_masked_takes_wide_batches_by_expected_m() -> None:
    """``expected_m`` of 256 rows or more sends FP8 masked calls to the Gluon kernel (which does
    not fuse SiLU-and-mul); the output is the reference's either way."""
    _needs_hopper()
    from moeserve.kernels.grouped_gemm import grouped_gemm_masked
    from moeserve.kernels.triton import gemm as tg

    for m_max, counts in ((512, [0, 512, 37, 300]), (288, [288, 0, 288, 288])):  # 288: a partial last tile
        x, w, xs, ws = _gpu_masked_inputs(4, m_max, 2 * 384, 1024 + 64, fp8=True)
        masked_m = torch.tensor(counts, device="cuda", dtype=torch.int32)
        ref = silu_and_mul_ref(grouped_gemm_masked_ref(x, w, masked_m, xs, ws, out_dtype=torch.float32))
        assert not tg.masked_fuses_silu_and_mul(x, w, expected_m=m_max)
        assert tg.masked_fuses_silu_and_mul(x, w, expected_m=32) and tg.masked_fuses_silu_and_mul(x, w)
        for expected in (None, 32, m_max):
            _poison_allocator(4 * m_max * 384 * 2)
            out = grouped_gemm_masked(x, w, masked_m, xs, ws, fuse_silu_and_mul=True, expected_m=expected)
            assert _rel(out, ref) < 1e-2
            assert all((out[e, int(masked_m[e]):] == 0).all() for e in range(4))


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(4096, 4096, 7168), (333, 2112, 7168), (128, 24576, 1536), (256, 4096, 7168)])
def test_gpu_gluon_fp8_block_gemm(m: int, n: int, k: int) -> None:
    _needs_hopper()
    xq, xs = _quant_rows(torch.randn(m, k, device="cuda"))
    wq, ws = block_quant_fp8(torch.randn(n, k, device="cuda") / k**0.5)
    _poison_allocator(m * n * 2)
    out = fp8_block_gemm(xq, xs, wq, ws)  # 128 rows or more: the Gluon kernel on Hopper
    assert _rel(out, fp8_block_gemm_ref(xq, xs, wq, ws, torch.float32)) < 1e-2


@pytest.mark.gpu
def test_gpu_gluon_fp8_block_gemm_splits_k_into_partial_sums() -> None:
    _needs_hopper()
    from moeserve.kernels.triton import gemm as tg

    xq, xs = _quant_rows(torch.randn(130, 1536, device="cuda"))
    wq, ws = block_quant_fp8(torch.randn(576, 1536, device="cuda") / 1536**0.5)
    ref = fp8_block_gemm_ref(xq, xs, wq, ws, torch.float32)
    for split in (2, 3, 5):  # 12 K-steps: splits of 6, 4 and 3 steps (the last of 5 splits is empty)
        assert _rel(tg.fp8_block_gemm(xq, xs, wq, ws, config={"SPLIT_K": split}), ref) < 1e-2


@pytest.mark.gpu
def test_gpu_gluon_cuda_graph_replays_new_segments() -> None:
    _needs_hopper()
    from moeserve.kernels.triton import gemm as tg

    x, w, seg, xs, ws = _gpu_contiguous_inputs(3, 400, 512, 1024, True, torch.bfloat16, seed=5)
    run = lambda: tg.grouped_gemm_contiguous(x, w, seg, xs, ws)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    rows = x.shape[0] - 13
    for counts in ([rows, 0, 0], [1, 2, rows - 3], [0, 0, 100]):
        seg.copy_(_seg_indptr(counts, "cuda"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel(out, grouped_gemm_contiguous_ref(x, w, seg, xs, ws, torch.float32)) < 1e-2


@pytest.mark.gpu
def test_gpu_contiguous_many_rows_per_expert_through_cublas() -> None:
    """The cuBLAS path (taken by GPUs without TMA; Hopper's go to the Triton kernel)."""
    from moeserve.kernels.grouped_gemm import _cublas_grouped, _cublas_wins

    # ragged segments (one empty), padding rows after the last one, >= 128 rows per expert
    x, w, seg, _, _ = _gpu_contiguous_inputs(8, 300, 384, 1024, False, torch.bfloat16, seed=11)
    assert _cublas_wins(x, w, None, None) == (torch.cuda.get_device_capability() < (9, 0))
    ref = grouped_gemm_contiguous_ref(x, w, seg, out_dtype=torch.float32)
    _poison_allocator(x.shape[0] * 384 * 2)
    out = _cublas_grouped(x, w, seg, tail_rows=True)
    assert out.dtype == torch.bfloat16
    assert _rel(out, ref) < 1e-2
    assert (out[int(seg[-1]):] == 0).all()
