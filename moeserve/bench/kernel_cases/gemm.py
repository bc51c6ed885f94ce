"""Microbenchmark cases: the grouped expert GEMMs (contiguous and masked, bf16 and fp8) and the FP8
block-scaled linear, on DeepSeek-V3 shapes (hidden 7168, expert intermediate 2048).

``cases()`` times the default launch configs against a torch baseline of the same FLOPs;
``sweep()`` times candidate configs per shape, checks each against the torch reference, and
prints a table and the best config per shape, for the tables in ``kernels/triton/gemm.py``.

Byte counts are what the call must move at least: the activations of real rows, the weights of
experts that have rows (each read once), the scales, and the whole output (zero rows included).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moeserve.bench.kernels import KernelCase, copy_gbps, time_ms
from moeserve.kernels.fp8 import FP8_DTYPE, FP8_MAX, fp8_block_gemm, fp8_block_gemm_ref
from moeserve.kernels.grouped_gemm import (
    grouped_gemm_contiguous,
    grouped_gemm_contiguous_ref,
    grouped_gemm_masked,
    grouped_gemm_masked_ref,
)

HIDDEN, MOE_INTER = 7168, 2048
Q_KV_A = 1536 + 576  # the fused q_a / kv_a projection: q_lora_rank + kv_lora_rank + rope dim
W13 = (2 * MOE_INTER, HIDDEN)  # (N, K) of the gate-up projection
W2 = (HIDDEN, MOE_INTER)  # (N, K) of the down projection
N_EXPERTS, TOP_K = 256, 8
EP_LOCAL, EP_RANKS, LL_TOKENS = 32, 8, 128  # low-latency EP decode: 32 local experts, 128 tokens x 8 ranks
PREFILL_EXPERTS, PREFILL_ROWS = 8, 4096  # the compute-bound target: 8 experts x 4096 rows each
DECODE_TOKENS = (32, 128)  # T * top_k = 256 and 1024 rows routed over all experts
BLOCK = 128
DEVICE = "cuda"
REL_TOL = 1e-2  # bf16 output rounding is ~2e-3 relative; a wrong tile is O(1)


@dataclass
class Shape:
    """One benchmarked call: ``run(config)`` launches the Triton kernel (``None``: its default
    config); ``ref()`` the torch reference (slow; for checking only)."""

    name: str
    run: Callable[[dict | None], torch.Tensor]
    ref: Callable[[], torch.Tensor]
    flops: float
    bytes: float
    candidates: list[dict]
    baseline: Callable[[], object] | None = None
    baseline_name: str = ""
    notes: str = ""


def cases() -> list[KernelCase]:
    weights = _WeightCache()
    return [KernelCase(s.name, (lambda s=s: s.run(None)), s.flops, s.bytes, s.baseline, s.baseline_name, s.notes)
            for s in (build(weights) for _, build in _builders())]


def sweep(only: str | None = None, iters: int = 10) -> dict[str, dict]:
    """Time every candidate config of every shape whose name contains ``only``; print a table
    (ms, TFLOP/s, GB/s) and the best config per shape; return ``{shape name: best config}``."""
    copy_bw = copy_gbps(2**29, iters=10)  # 2 GiB
    print(f"copy bandwidth {copy_bw:.0f} GB/s (bytes read + written)")
    print(f"{'shape':50s} {'config':60s} {'ms':>8s} {'TFLOP/s':>8s} {'GB/s':>6s} {'%copy':>6s}")
    best = {}
    for name, build in _builders():
        if only is not None and only not in name:
            continue
        shape = build(_WeightCache())
        ref_out = shape.ref()
        results = []
        for cfg in [None, *shape.candidates]:
            ms = _time_candidate(shape, cfg, ref_out, iters)
            if ms is not None:
                results.append((cfg, ms))
                gbps = shape.bytes / ms / 1e6
                print(f"{shape.name:50s} {_cfg_str(cfg):60s} {ms:8.4f} {shape.flops / ms / 1e9:8.1f} "
                      f"{gbps:6.0f} {100 * gbps / copy_bw:5.1f}%", flush=True)
        if results:
            cfg, ms = min(results, key=lambda r: r[1])
            best[shape.name] = cfg
            print(f"BEST {shape.name}: {_cfg_str(cfg)} {ms:.4f} ms, {shape.flops / ms / 1e9:.1f} TFLOP/s, "
                  f"{shape.bytes / ms / 1e6:.0f} GB/s", flush=True)
        del shape, ref_out
        torch.cuda.empty_cache()
    return best


def _time_candidate(shape: Shape, cfg: dict | None, ref_out: torch.Tensor, iters: int) -> float | None:
    try:
        err = _rel_err(shape.run(cfg), ref_out)
        if not err < REL_TOL:
            print(f"{shape.name:50s} {_cfg_str(cfg):60s} WRONG rel err {err:.3g}")
            return None
        return time_ms(lambda: shape.run(cfg), iters=iters)
    except Exception as e:
        print(f"{shape.name:50s} {_cfg_str(cfg):60s} FAILED {type(e).__name__}: {str(e)[:100]}")
        return None


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30)).item()


def _cfg_str(cfg: dict | None) -> str:
    if cfg is None:
        return "default"
    short = {"BLOCK_M": "M", "BLOCK_N": "N", "BLOCK_K": "K", "GROUP_M": "G", "num_warps": "w",
             "num_stages": "s", "ctas_per_sm": "ctas", "SPLIT_K": "split", "TMA": "tma", "WS": "ws"}
    return " ".join(f"{short[k]}{v}" for k, v in cfg.items())


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int, **extra: int) -> dict:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, **extra)


# ----------------------------------------------------------------------------- candidates

FP8_LARGE = [
    _cfg(128, 128, 128, 8, 3), _cfg(128, 128, 128, 8, 4), _cfg(128, 128, 128, 8, 5),
    _cfg(64, 128, 128, 4, 3), _cfg(64, 128, 128, 4, 4), _cfg(64, 128, 128, 4, 5),
    _cfg(128, 64, 128, 4, 4), _cfg(64, 256, 128, 8, 4), _cfg(64, 128, 128, 8, 4),
    _cfg(128, 128, 128, 8, 4, GROUP_M=16), _cfg(64, 128, 128, 4, 4, GROUP_M=16),
    _cfg(128, 128, 128, 8, 4, ctas_per_sm=1), _cfg(64, 128, 128, 4, 4, ctas_per_sm=2),
    # operand tiles through tensor descriptors (TMA), then also warp-specialised
    _cfg(128, 128, 128, 8, 3, TMA=1), _cfg(128, 128, 128, 8, 4, TMA=1), _cfg(128, 128, 128, 8, 5, TMA=1),
    _cfg(64, 128, 128, 4, 4, TMA=1), _cfg(128, 128, 128, 8, 4, TMA=1, ctas_per_sm=1),
    _cfg(128, 128, 128, 8, 4, TMA=1, WS=1), _cfg(128, 128, 128, 8, 5, TMA=1, WS=1),
]
BF16_LARGE = [
    _cfg(128, 256, 64, 8, 3), _cfg(128, 256, 64, 8, 4), _cfg(256, 128, 64, 8, 3), _cfg(256, 128, 64, 8, 4),
    _cfg(128, 128, 64, 4, 4), _cfg(128, 128, 64, 8, 4), _cfg(128, 128, 64, 8, 5), _cfg(128, 128, 128, 8, 3),
    _cfg(64, 256, 64, 4, 4), _cfg(128, 256, 64, 8, 3, GROUP_M=16), _cfg(128, 256, 64, 8, 3, ctas_per_sm=1),
    _cfg(128, 128, 64, 4, 4, ctas_per_sm=2),
    _cfg(128, 256, 64, 8, 3, TMA=1), _cfg(128, 256, 64, 8, 4, TMA=1), _cfg(128, 128, 64, 8, 4, TMA=1),
    _cfg(256, 128, 64, 8, 3, TMA=1), _cfg(64, 256, 64, 4, 4, TMA=1), _cfg(128, 256, 64, 8, 3, TMA=1, ctas_per_sm=1),
    _cfg(128, 256, 64, 8, 3, TMA=1, WS=1), _cfg(128, 128, 64, 8, 4, TMA=1, WS=1),
]
BF16_DECODE = [
    _cfg(16, 128, 128, 4, 3), _cfg(16, 128, 128, 4, 4), _cfg(16, 64, 256, 4, 3), _cfg(16, 64, 128, 4, 5),
    _cfg(16, 128, 64, 4, 6), _cfg(16, 256, 64, 8, 4), _cfg(16, 64, 64, 4, 8), _cfg(32, 128, 128, 4, 4),
    _cfg(64, 128, 64, 4, 4), _cfg(16, 128, 128, 4, 4, ctas_per_sm=2), _cfg(16, 64, 128, 4, 5, ctas_per_sm=4),
]
FP8_DECODE = [
    _cfg(16, 128, 128, 4, 4), _cfg(16, 128, 128, 4, 5), _cfg(16, 128, 128, 4, 6), _cfg(16, 64, 128, 4, 6),
    _cfg(16, 64, 128, 4, 8), _cfg(16, 256, 128, 8, 4), _cfg(32, 128, 128, 4, 5), _cfg(64, 128, 128, 4, 4),
    _cfg(16, 128, 64, 4, 8), _cfg(16, 128, 128, 4, 5, ctas_per_sm=2), _cfg(16, 64, 128, 4, 6, ctas_per_sm=4),
]
BF16_MASKED = [
    _cfg(16, 128, 128, 4, 4, ctas_per_sm=2), _cfg(32, 128, 128, 4, 4, ctas_per_sm=2),
    _cfg(64, 128, 64, 4, 4, ctas_per_sm=2), _cfg(64, 128, 128, 4, 3, ctas_per_sm=1),
    _cfg(32, 128, 128, 4, 4, ctas_per_sm=1), _cfg(32, 128, 128, 4, 4, ctas_per_sm=4),
    _cfg(32, 64, 128, 4, 5, ctas_per_sm=4), _cfg(64, 128, 64, 4, 4, ctas_per_sm=3),
]
FP8_MASKED = [
    _cfg(16, 128, 128, 4, 5, ctas_per_sm=2), _cfg(32, 128, 128, 4, 5, ctas_per_sm=2),
    _cfg(64, 128, 128, 4, 4, ctas_per_sm=2), _cfg(64, 128, 128, 4, 5, ctas_per_sm=1),
    _cfg(32, 128, 128, 4, 5, ctas_per_sm=1), _cfg(32, 128, 128, 4, 5, ctas_per_sm=4),
    _cfg(32, 64, 128, 4, 6, ctas_per_sm=4), _cfg(64, 128, 128, 4, 4, ctas_per_sm=3),
]
FP8_DENSE_DECODE = [
    _cfg(16, 128, 128, 4, 5, SPLIT_K=s) for s in (1, 2, 4, 8, 14)
] + [_cfg(16, 64, 128, 4, 6, SPLIT_K=s) for s in (1, 4, 7)]


# ----------------------------------------------------------------------------- inputs


class _WeightCache:
    """Expert weights made once per ``cases()`` call and shared by its shapes (the decode
    shapes hold all 256 experts: 15 GB of bf16 w13)."""

    def __init__(self) -> None:
        self._made: dict[tuple, tuple] = {}

    def get(self, experts: int, n: int, k: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = (experts, n, k, fp8)
        if key not in self._made:
            self._made[key] = random_weights(experts, n, k, fp8)
        return self._made[key]


def random_weights(experts: int, n: int, k: int, fp8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``w [E, N, K]`` bf16 (scale ~ 1/sqrt(K)), or fp8 values with random block scales."""
    if not fp8:
        return torch.randn(experts, n, k, device=DEVICE, dtype=torch.bfloat16) / math.sqrt(k), None
    w = torch.empty(experts, n, k, device=DEVICE, dtype=FP8_DTYPE)
    for e in range(experts):  # one expert at a time keeps the bf16 temporary small
        w[e] = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scale = (torch.rand(experts, _cdiv(n, BLOCK), _cdiv(k, BLOCK), device=DEVICE) + 0.5) / (2 * math.sqrt(k))
    return w, scale


def _quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 1x128-group fp8 quantization of ``x [..., K]`` (K a multiple of 128), in plain torch."""
    g = x.float().unflatten(-1, (-1, BLOCK))  # [..., K/128, 128]
    scale = g.abs().amax(-1).clamp(min=1e-10) / FP8_MAX
    return (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).flatten(-2), scale


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


PREFILL_TOKENS = 8192


def routed_counts(tokens: int) -> torch.Tensor:
    """Rows per expert [N_EXPERTS] when ``tokens`` tokens each pick TOP_K distinct experts uniformly."""
    picks = torch.rand(tokens, N_EXPERTS, device=DEVICE).topk(TOP_K, dim=1).indices
    return torch.bincount(picks.flatten(), minlength=N_EXPERTS)


def _bytes(rows: int, k: int, out_elems: int, hit_experts: int, n: int, fp8: bool) -> float:
    elt = 1 if fp8 else 2
    scales = (rows * _cdiv(k, BLOCK) + hit_experts * _cdiv(n, BLOCK) * _cdiv(k, BLOCK)) * 4 if fp8 else 0
    return rows * k * elt + hit_experts * n * k * elt + scales + out_elems * 2


# ----------------------------------------------------------------------------- shapes


def _builders() -> list[tuple[str, Callable[[_WeightCache], Shape]]]:
    out = []
    for fp8 in (True, False):
        dt = "fp8" if fp8 else "bf16"
        name = f"grouped contiguous {dt} E{PREFILL_EXPERTS}x{PREFILL_ROWS} N{W13[0]} K{W13[1]}"
        out.append((name, lambda c, name=name, fp8=fp8: _contiguous_shape(
            name, c, torch.full((PREFILL_EXPERTS,), PREFILL_ROWS), *W13, fp8, FP8_LARGE if fp8 else BF16_LARGE)))
    for fp8 in (True, False):  # a prefill of 8192 tokens, routed at random: ragged segments
        dt = "fp8" if fp8 else "bf16"
        for proj, (n, k) in (("w13", W13), ("w2", W2)):
            name = f"grouped contiguous {dt} prefill {proj} M{PREFILL_TOKENS * TOP_K} E{N_EXPERTS}"
            out.append((name, lambda c, name=name, fp8=fp8, n=n, k=k: _contiguous_shape(
                name, c, routed_counts(PREFILL_TOKENS).cpu(), n, k, fp8, FP8_LARGE if fp8 else BF16_LARGE)))
    for fp8 in (True, False):
        dt = "fp8" if fp8 else "bf16"
        for proj, (n, k) in (("w13", W13), ("w2", W2)):
            for tokens in DECODE_TOKENS:
                name = f"grouped contiguous {dt} decode {proj} M{tokens * TOP_K} E{N_EXPERTS}"
                out.append((name, lambda c, name=name, fp8=fp8, n=n, k=k, tokens=tokens: _contiguous_shape(
                    name, c, routed_counts(tokens).cpu(), n, k, fp8, FP8_DECODE if fp8 else BF16_DECODE)))
    for fp8 in (True, False):
        dt = "fp8" if fp8 else "bf16"
        for proj, (n, k) in (("w13", W13), ("w2", W2)):
            name = f"grouped masked {dt} decode {proj} E{EP_LOCAL} Mmax{LL_TOKENS * EP_RANKS}"
            out.append((name, lambda c, name=name, fp8=fp8, n=n, k=k: _masked_shape(
                name, c, n, k, fp8, FP8_MASKED if fp8 else BF16_MASKED)))
    dense_large = FP8_LARGE[:9] + [c for c in FP8_LARGE if c.get("TMA")][:4]
    for m, n, k, candidates in ((PREFILL_ROWS, *W13, dense_large), (64, Q_KV_A, HIDDEN, FP8_DENSE_DECODE)):
        name = f"fp8_block_gemm{' decode' if m < 128 else ''} M{m} N{n} K{k}"
        out.append((name, lambda c, name=name, m=m, n=n, k=k, cands=candidates: _dense_shape(name, m, n, k, cands)))
    return out


def _contiguous_shape(name: str, cache: _WeightCache, counts: torch.Tensor, n: int, k: int, fp8: bool,
                      candidates: list[dict]) -> Shape:
    """``counts [E]`` rows per expert (host tensor)."""
    num_e = counts.numel()
    seg = torch.zeros(num_e + 1, dtype=torch.int64)
    seg[1:] = counts.cumsum(0)
    rows, hit = int(seg[-1]), int((counts > 0).sum())
    seg_d = seg.to(DEVICE)
    w, w_scale = cache.get(num_e, n, k, fp8)
    x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
    x_scale = None
    if fp8:
        x, x_scale = _quant_rows(x)
    baseline, base_name = (_fp8_baseline if fp8 else _bf16_baseline)(x, x_scale, w, w_scale, seg)
    return Shape(
        name=name,
        run=lambda cfg: _contiguous_call(x, w, seg_d, x_scale, w_scale, cfg),
        ref=lambda: grouped_gemm_contiguous_ref(x, w, seg_d, x_scale, w_scale, torch.bfloat16),
        flops=2.0 * rows * n * k,
        bytes=_bytes(rows, k, rows * n, hit, n, fp8),
        candidates=candidates,
        baseline=baseline,
        baseline_name=base_name,
        notes=f"{hit} of {num_e} experts have rows",
    )


def _contiguous_call(x, w, seg, x_scale, w_scale, cfg):
    if cfg is None:
        return grouped_gemm_contiguous(x, w, seg, x_scale, w_scale)
    from moeserve.kernels.triton import gemm as triton_gemm

    return triton_gemm.grouped_gemm_contiguous(x, w, seg, x_scale, w_scale, config=cfg)


def _masked_shape(name: str, cache: _WeightCache, n: int, k: int, fp8: bool, candidates: list[dict]) -> Shape:
    m_max = LL_TOKENS * EP_RANKS
    masked_m = routed_counts(m_max)[:EP_LOCAL].to(torch.int32)  # this rank's share of 1024 tokens' picks
    w_all, ws_all = cache.get(N_EXPERTS, n, k, fp8)
    w, w_scale = w_all[:EP_LOCAL], (ws_all[:EP_LOCAL] if fp8 else None)
    x = torch.randn(EP_LOCAL, m_max, k, device=DEVICE, dtype=torch.bfloat16)
    x_scale = None
    if fp8:
        x, x_scale = _quant_rows(x)
    rows, hit = int(masked_m.sum()), int((masked_m > 0).sum())
    ref = lambda: grouped_gemm_masked_ref(x, w, masked_m, x_scale, w_scale, torch.bfloat16)
    return Shape(
        name=name,
        run=lambda cfg: _masked_call(x, w, masked_m, x_scale, w_scale, cfg),
        ref=ref,
        flops=2.0 * rows * n * k,
        bytes=_bytes(rows, k, EP_LOCAL * m_max * n, hit, n, fp8),
        candidates=candidates,
        baseline=None if fp8 else ref,
        baseline_name="" if fp8 else "torch bmm over M_max",
        notes=f"masked_m mean {rows / EP_LOCAL:.1f}; output incl. zero rows {EP_LOCAL * m_max * n * 2 / 1e6:.0f} MB",
    )


def _masked_call(x, w, masked_m, x_scale, w_scale, cfg):
    if cfg is None:
        return grouped_gemm_masked(x, w, masked_m, x_scale, w_scale)
    from moeserve.kernels.triton import gemm as triton_gemm

    return triton_gemm.grouped_gemm_masked(x, w, masked_m, x_scale, w_scale, config=cfg)


def _dense_shape(name: str, m: int, n: int, k: int, candidates: list[dict]) -> Shape:
    w, w_scale = random_weights(1, n, k, fp8=True)
    w, w_scale = w[0], w_scale[0]
    x, x_scale = _quant_rows(torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16))
    baseline = _scaled_mm_baseline(x, torch.ones(m, 1, device=DEVICE), w, torch.ones(1, n, device=DEVICE))
    return Shape(
        name=name,
        run=lambda cfg: _dense_call(x, x_scale, w, w_scale, cfg),
        ref=lambda: fp8_block_gemm_ref(x, x_scale, w, w_scale),
        flops=2.0 * m * n * k,
        bytes=_bytes(m, k, m * n, 1, n, fp8=True),
        candidates=candidates,
        baseline=baseline,
        baseline_name="torch._scaled_mm rowwise" if baseline else "",
    )


def _dense_call(x, x_scale, w, w_scale, cfg):
    if cfg is None:
        return fp8_block_gemm(x, x_scale, w, w_scale)
    from moeserve.kernels.triton import gemm as triton_gemm

    return triton_gemm.fp8_block_gemm(x, x_scale, w, w_scale, config=cfg)


# ----------------------------------------------------------------------------- baselines


def _bf16_baseline(x, x_scale, w, w_scale, seg: torch.Tensor) -> tuple[Callable | None, str]:
    """``torch._grouped_mm`` where this torch has it and takes these segments, else one
    ``torch.matmul`` per expert with rows (same FLOPs and weight bytes)."""
    offs = seg[1:].to(device=DEVICE, dtype=torch.int32)
    if hasattr(torch, "_grouped_mm"):
        fn = lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        if _works(fn, x, w, seg):
            return fn, "torch._grouped_mm"
    bounds = [(e, int(seg[e]), int(seg[e + 1])) for e in range(w.shape[0]) if seg[e + 1] > seg[e]]
    return (lambda: [x[s:t] @ w[e].t() for e, s, t in bounds]), "torch.matmul per expert"


def _fp8_baseline(x, x_scale, w, w_scale, seg: torch.Tensor) -> tuple[Callable | None, str]:
    """FP8 with per-row/per-column scales through cuBLAS (the block-scaled recipe has no torch
    kernel here): ``torch._scaled_grouped_mm``, else ``torch._scaled_mm`` per expert."""
    m, n = x.shape[0], w.shape[1]
    offs = seg[1:].to(device=DEVICE, dtype=torch.int32)
    row_scale, col_scale = torch.ones(m, device=DEVICE), torch.ones(w.shape[0], n, device=DEVICE)
    if hasattr(torch, "_scaled_grouped_mm"):
        fn = lambda: torch._scaled_grouped_mm(
            x, w.transpose(1, 2), row_scale, col_scale, offs=offs, out_dtype=torch.bfloat16)
        if _works(fn):
            return fn, "torch._scaled_grouped_mm rowwise"
    bounds = [(e, int(seg[e]), int(seg[e + 1])) for e in range(w.shape[0]) if seg[e + 1] > seg[e]]
    calls = [_scaled_mm_baseline(x[s:t], row_scale[s:t, None], w[e], col_scale[e][None]) for e, s, t in bounds]
    if all(calls):
        return (lambda: [c() for c in calls]), "torch._scaled_mm rowwise per expert"
    return None, ""


def _scaled_mm_baseline(x, x_scale, w, w_scale) -> Callable | None:
    fn = lambda: torch._scaled_mm(x, w.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
    return fn if _works(fn) else None


def _works(fn: Callable, x=None, w=None, seg=None) -> bool:
    """Whether a baseline runs here (and, given bf16 operands, agrees with the reference)."""
    try:
        out = fn()
        torch.cuda.synchronize()
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return False
    if x is None:
        return True
    return _rel_err(out, grouped_gemm_contiguous_ref(x, w, seg.to(DEVICE))) < REL_TOL
