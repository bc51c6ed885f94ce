"""FP8 block-scaled GEMMs on Hopper: the Gluon kernel (``kernels/triton/gemm_hopper.py``) checked
against the torch reference, then timed beside the Triton kernel and every torch path at the
reference deployment's per-rank shapes, in one run.

    python3 tools/fp8_gemm_gpu.py [--check] [--bench [--only NAME ...]] [--sweep] [--json OUT]

--check  every layout against the torch reference (ragged and empty segments, padding, partial
         tiles in M, N and K, a CUDA graph replayed over new segment bounds) -> exit 1 on a failure
--bench  the shapes below, each as: the Gluon kernel, the Triton kernel, ``torch._scaled_grouped_mm``
         / ``torch._scaled_mm`` with row-wise scales (cuBLAS, no block scales) and, where this torch
         has it, cuBLAS's block-scaled ``scaled_mm`` (1x128 x 128x128, DeepSeek's own recipe)
--sweep  the Gluon kernel's launch configs at the prefill shapes

Times are the device's (``bench.kernels.time_ms``: calls queued behind a spin kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from moeserve.bench.kernel_cases.gemm import _quant_rows, _rel_err, random_weights, routed_counts
from moeserve.bench.kernels import time_ms
from moeserve.kernels.fp8 import fp8_block_gemm_ref
from moeserve.kernels.grouped_gemm import (
    _gated,
    grouped_gemm_contiguous_ref,
    grouped_gemm_masked,
    grouped_gemm_masked_ref,
)
from moeserve.kernels.triton import gemm as tg
from moeserve.kernels.triton import gemm_hopper as gh

DEV = "cuda"
HIDDEN, INTER = 7168, 2048
W13, W2 = (2 * INTER, HIDDEN), (HIDDEN, INTER)
TRITON = {"HOPPER": 0}  # the Triton kernel's own default large config
TOL = 1e-2


def seg_of(counts: list[int], first: int = 0) -> torch.Tensor:
    seg = torch.tensor([first] + counts, dtype=torch.int64).cumsum(0)
    return seg.to(DEV)


def contiguous_inputs(counts: list[int], n: int, k: int, pad: int = 0, first: int = 0):
    w, ws = random_weights(len(counts), n, k, fp8=True)
    rows = first + sum(counts) + pad
    x, xs = _quant_rows(torch.randn(rows, -(-k // 128) * 128, device=DEV, dtype=torch.bfloat16))
    x, xs = x[:, :k].contiguous(), xs
    return x, xs, w, ws, seg_of(counts, first)


def masked_inputs(masked: list[int], m_max: int, n: int, k: int):
    w, ws = random_weights(len(masked), n, k, fp8=True)
    x, xs = _quant_rows(torch.randn(len(masked), m_max, k, device=DEV, dtype=torch.bfloat16))
    return x, xs, w, ws, torch.tensor(masked, dtype=torch.int32, device=DEV)


# ----------------------------------------------------------------------------- check


def check() -> bool:
    ok = True

    def report(name, out, ref, exact_zero_rows=None):
        nonlocal ok
        err = _rel_err(out, ref)
        good = err < TOL and torch.isfinite(out.float()).all().item()
        if exact_zero_rows is not None:
            good = good and bool((out[exact_zero_rows] == 0).all())
        ok &= good
        print(f"{'ok  ' if good else 'FAIL'} {name}: rel err {err:.2e}", flush=True)

    hopper = {"HOPPER": 1}
    for counts, n, k, pad, first in (
        ([300, 0, 1, 129, 0, 1000], *W13, 77, 0),
        ([14564] * 3, *W2, 0, 0),
        ([5, 200], 2112, 1600, 3, 0),  # N and K not multiples of 128
        ([130, 70], 256, 512, 10, 5),  # rows before seg_indptr[0] are zero too
        ([0, 0, 0], 256, 512, 40, 0),  # no live rows: zeros only
        ([100, 130], 256, 512, 0, 0),  # the last tile's second warpgroup has no rows
    ):
        x, xs, w, ws, seg = contiguous_inputs(counts, n, k, pad, first)
        out = tg.grouped_gemm_contiguous(x, w, seg, xs, ws, config=hopper)
        ref = grouped_gemm_contiguous_ref(x, w, seg, xs, ws, torch.bfloat16)
        zero = torch.ones(x.shape[0], dtype=torch.bool, device=DEV)
        zero[seg[0]:seg[-1]] = False
        name = f"contiguous counts {counts[:4]} N{n} K{k} pad {pad} first {first}"
        if ref.abs().sum() == 0:
            good = bool((out == 0).all())
            ok &= good
            print(f"{'ok  ' if good else 'FAIL'} {name}: all zero", flush=True)
        else:
            report(name, out, ref, zero)
            report(name + " (vs Triton)", out, tg.grouped_gemm_contiguous(x, w, seg, xs, ws, config=TRITON))
    for masked, m_max, n, k in (([0, 512, 37, 300], 512, *W13), ([64, 1, 200], 256, *W2), ([288] * 4, 288, *W2)):
        x, xs, w, ws, mm = masked_inputs(masked, m_max, n, k)
        out = tg.grouped_gemm_masked(x, w, mm, xs, ws, config=dict(tg.masked_config(m_max, len(masked), n, k, x.dtype),
                                                                    **tg._LARGE["fp8"], ctas_per_sm=0))
        report(f"masked {masked} Mmax {m_max} N{n} K{k}", out, grouped_gemm_masked_ref(x, w, mm, xs, ws))
    for m, n, k in ((4096, 4096, 7168), (333, 2112, 7168), (130, 576, 1536), (128, 24576, 1536),
                    (256, 2112, 7168), (128, 4096, 7168), (200, 7168, 16384)):  # the last three split K
        w, ws = random_weights(1, n, k, fp8=True)
        x, xs = _quant_rows(torch.randn(m, k, device=DEV, dtype=torch.bfloat16))
        out = tg.fp8_block_gemm(x, xs, w[0], ws[0], config=hopper)
        split = tg.dense_config(m, n, k, x.dtype, 132)["SPLIT_K"]
        report(f"dense M{m} N{n} K{k} (split {split})", out, fp8_block_gemm_ref(x, xs, w[0], ws[0]))
    # a CUDA graph captured once, replayed over other segment bounds
    x, xs, w, ws, seg = contiguous_inputs([500, 300, 224], *W13, pad=0)
    out = tg.grouped_gemm_contiguous(x, w, seg, xs, ws, config=hopper)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tg.grouped_gemm_contiguous(x, w, seg, xs, ws, config=hopper)
    for counts in ([1024, 0, 0], [1, 2, 900], [0, 0, 100]):
        seg.copy_(seg_of(counts))
        graph.replay()
        report(f"graph replay counts {counts}", out.clone(), grouped_gemm_contiguous_ref(x, w, seg, xs, ws))
    return ok


# ----------------------------------------------------------------------------- bench


def blockwise_cublas(x, xs, w, ws):
    """cuBLAS's block-scaled FP8 GEMM through ``torch.nn.functional.scaled_mm`` (1x128 activation
    groups, 128x128 weight blocks), in the first scale layout this torch accepts and gets right;
    None where it has none."""
    import torch.nn.functional as F

    if not hasattr(F, "scaled_mm") or not hasattr(F, "ScalingType"):
        return None, "no torch.nn.functional.scaled_mm"
    st = F.ScalingType
    ref = fp8_block_gemm_ref(x[:256], xs[:256], w, ws)
    tried = []
    for a_name, sa in (("outer-major", xs.t().contiguous().t()), ("row-major", xs)):
        for b_name, sb in (("ws", ws), ("ws.t()", ws.t()), ("ws.t().contiguous()", ws.t().contiguous()),
                           ("ws contiguous-transposed", ws.t().contiguous().t())):
            try:
                def fn(sa=sa, sb=sb):
                    return F.scaled_mm(x, w.t(), sa, st.BlockWise1x128, sb, st.BlockWise128x128,
                                       output_dtype=torch.bfloat16)

                err = _rel_err(fn()[:256], ref)
                if err < TOL:
                    return fn, f"scale_a {a_name}, scale_b {b_name}"
                tried.append(f"{a_name}/{b_name}: rel err {err:.2g}")
            except Exception as e:  # noqa: BLE001 - each layout is a guess; the reasons are reported
                tried.append(f"{a_name}/{b_name}: {type(e).__name__}: {str(e)[:80]}")
    return None, "; ".join(tried)


def blockwise_per_expert(x, xs, w, ws, seg):
    """``blockwise_cublas`` once per expert (host-known bounds), or None."""
    bounds, calls = seg.tolist(), []
    for e in range(w.shape[0]):
        fn, why = blockwise_cublas(x[bounds[e]:bounds[e + 1]], xs[bounds[e]:bounds[e + 1]], w[e], ws[e])
        if fn is None:
            print(f"cuBLAS block-scaled unavailable: {why}", flush=True)
            return None
        calls.append(fn)
    return lambda: [f() for f in calls]


def gluon_dense(x, xs, w, ws, cfg):
    out = torch.empty(1, 1, x.shape[0], w.shape[0], dtype=torch.bfloat16, device=DEV)
    gh.launch(2, x[None], w[None], out, xs[None], ws[None], x, x.shape[0], cfg)
    return out


def rowwise_grouped(x, w, seg):
    offs = seg[1:].to(torch.int32)
    rs, cs = torch.ones(x.shape[0], device=DEV), torch.ones(w.shape[0], w.shape[1], device=DEV)
    return lambda: torch._scaled_grouped_mm(x, w.transpose(1, 2), rs, cs, offs=offs, out_dtype=torch.bfloat16)


def rowwise_dense(x, w):
    rs, cs = torch.ones(x.shape[0], 1, device=DEV), torch.ones(1, w.shape[0], device=DEV)
    return lambda: torch._scaled_mm(x, w.t(), scale_a=rs, scale_b=cs, out_dtype=torch.bfloat16)


def bench_shapes(prefill_only: bool = False):
    """(name, flops, {path: fn}, inputs) at the reference's per-rank shapes and the suite's own."""
    shapes = []
    # prefill EP32: 16K tokens x top-8 over 32 ranks, 9 slots a rank (256 + 32 redundant): 131,072 rows,
    # as 9 x 14,560 (cuBLAS's block-scaled GEMM wants the rows a multiple of 4)
    per_slot = 14560
    for proj, (n, k) in (("w13", W13), ("w2", W2)):
        counts = [per_slot] * 9
        x, xs, w, ws, seg = contiguous_inputs(counts, n, k)
        paths = {
            "gluon": lambda x=x, w=w, seg=seg, xs=xs, ws=ws: tg.grouped_gemm_contiguous(x, w, seg, xs, ws),
            "triton": lambda x=x, w=w, seg=seg, xs=xs, ws=ws: tg.grouped_gemm_contiguous(x, w, seg, xs, ws,
                                                                                         config=TRITON),
            "torch._scaled_grouped_mm rowwise": rowwise_grouped(x, w, seg),
        }
        blockwise = None if prefill_only else blockwise_per_expert(x, xs, w, ws, seg)
        if blockwise is not None:
            paths["cuBLAS block-scaled scaled_mm per expert"] = blockwise
        shapes.append((f"prefill EP32 {proj}: 9 slots x {per_slot} rows, N{n} K{k}", 2.0 * 9 * per_slot * n * k, paths,
                       (x, xs, w, ws, seg)))
    if prefill_only:
        return shapes
    x, xs, w, ws, seg = contiguous_inputs([4096] * 8, *W13)
    shapes.append(("8 x 4096 rows, N4096 K7168", 2.0 * 8 * 4096 * W13[0] * W13[1], {
        "gluon": lambda x=x, w=w, seg=seg, xs=xs, ws=ws: tg.grouped_gemm_contiguous(x, w, seg, xs, ws),
        "triton": lambda x=x, w=w, seg=seg, xs=xs, ws=ws: tg.grouped_gemm_contiguous(x, w, seg, xs, ws, config=TRITON),
        "torch._scaled_grouped_mm rowwise": rowwise_grouped(x, w, seg)}, None))
    # decode EP72: 256 sequences a GPU x top-8 over 72 ranks, 4 slots a rank (256 + 32 redundant): 4 x 512 rows
    for proj, (n, k) in (("w13", W13), ("w2", W2)):
        x, xs, w, ws, mm = masked_inputs([512] * 4, 512, n, k)
        fused = proj == "w13"
        paths = {
            "triton (small tiles" + (", SiLU fused)" if fused else ")"):
                lambda x=x, w=w, mm=mm, xs=xs, ws=ws, fused=fused: tg.grouped_gemm_masked(
                    x, w, mm, xs, ws, fuse_silu_and_mul=fused, config={"HOPPER": 0}),
            "default, expected_m 512 (gluon" + (" + SiLU pass)" if fused else ")"):
                lambda x=x, w=w, mm=mm, xs=xs, ws=ws, fused=fused: grouped_gemm_masked(
                    x, w, mm, xs, ws, fuse_silu_and_mul=fused, expected_m=512),
        }
        shapes.append((f"decode EP72 masked {proj}: 4 slots x 512 rows, N{n} K{k}", 2.0 * 2048 * n * k, paths, None))
    # low-latency decode at EP 8: 32 local experts, M_max 1024 (128 tokens x 8 ranks), routed rows (mean 32)
    masked = routed_counts(1024)[:32].tolist()
    x, xs, w, ws, mm = masked_inputs(masked, 1024, *W13)
    shapes.append((f"low-latency masked w13: 32 experts x Mmax 1024, {sum(masked)} rows", 2.0 * sum(masked) * W13[0]
                   * W13[1], {
        "triton (small tiles, SiLU fused)": lambda x=x, w=w, mm=mm, xs=xs, ws=ws: tg.grouped_gemm_masked(
            x, w, mm, xs, ws, fuse_silu_and_mul=True, config={"HOPPER": 0}),
        "gluon + SiLU pass": lambda x=x, w=w, mm=mm, xs=xs, ws=ws: _gated(tg.grouped_gemm_masked(
            x, w, mm, xs, ws, config={"HOPPER": 1}), True),
        "default, expected_m 32": lambda x=x, w=w, mm=mm, xs=xs, ws=ws: grouped_gemm_masked(
            x, w, mm, xs, ws, fuse_silu_and_mul=True, expected_m=32)}, None))
    for m, n, k in ((4096, 4096, 7168), (16384, 2112, 7168), (16384, 24576, 1536), (16384, 7168, 16384),
                    # decode ranks' attention projections and shared experts at 256 and 128 rows
                    (256, 2112, 7168), (256, 24576, 1536), (256, 7168, 16384), (256, 4096, 7168), (256, 7168, 2048),
                    (128, 2112, 7168), (128, 24576, 1536), (128, 7168, 16384), (128, 4096, 7168)):
        w, ws = random_weights(1, n, k, fp8=True)
        w, ws = w[0], ws[0]
        x, xs = _quant_rows(torch.randn(m, k, device=DEV, dtype=torch.bfloat16))
        paths = {"gluon": lambda x=x, xs=xs, w=w, ws=ws: tg.fp8_block_gemm(x, xs, w, ws),
                 **({"gluon BLOCK_N 64": lambda x=x, xs=xs, w=w, ws=ws: gluon_dense(x, xs, w, ws, {"BLOCK_N": 64}),
                     "gluon split 2": lambda x=x, xs=xs, w=w, ws=ws: tg.fp8_block_gemm(
                         x, xs, w, ws, config={"SPLIT_K": 2})} if m <= 256 else {}),
                 "triton": lambda x=x, xs=xs, w=w, ws=ws: tg.fp8_block_gemm(x, xs, w, ws, config=TRITON),
                 "torch._scaled_mm rowwise": rowwise_dense(x, w)}
        fn, why = blockwise_cublas(x, xs, w, ws)
        if fn is not None:
            paths["cuBLAS block-scaled scaled_mm"] = fn
        else:
            print(f"cuBLAS block-scaled unavailable: {why}", flush=True)
        shapes.append((f"dense M{m} N{n} K{k}", 2.0 * m * n * k, paths, None))
    return shapes


def bench(results: dict, only: list[str] | None = None) -> None:
    for name, flops, paths, _ in bench_shapes():
        if only and not any(o in name for o in only):
            continue
        row = {}
        for path, fn in paths.items():
            try:
                ms = time_ms(fn, iters=20)
                row[path] = {"ms": ms, "tflops": flops / ms / 1e9}
                print(f"{name:60s} {path:42s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)
            except Exception as e:  # noqa: BLE001 - a path that fails here is reported, not fatal
                row[path] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                print(f"{name:60s} {path:42s} FAILED {row[path]['error']}", flush=True)
        results.setdefault("bench", {})[name] = row
        torch.cuda.empty_cache()


def sweep(results: dict) -> None:
    configs = [dict(OVERLAP=o, STAGES=s, GROUP_M=g) for o in (1, 0) for s in (4, 5, 6) for g in (8,)]
    configs += [dict(GROUP_M=16), dict(GROUP_M=4), dict(BLOCK_N=64, STAGES=6), dict(MMA_REGS=240, LOADER_REGS=24)]
    for name, flops, paths, inputs in bench_shapes(prefill_only=True):
        x, xs, w, ws, seg = inputs
        ref = tg.grouped_gemm_contiguous(x, w, seg, xs, ws, config=TRITON)
        for cfg in configs:
            out = torch.empty(1, x.shape[0], w.shape[1], dtype=torch.bfloat16, device=DEV)
            def fn(cfg=cfg, out=out):
                gh.launch(0, x[None], w, out, xs[None], ws, seg, x.shape[0], cfg)

            try:
                fn()
                err = _rel_err(out[0], ref)
                ms = time_ms(fn, iters=20)
                print(f"sweep {name:55s} {str(cfg):70s} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s err {err:.1e}",
                      flush=True)
                results.setdefault("sweep", []).append({"shape": name, "config": cfg, "ms": ms, "err": err})
            except Exception as e:  # noqa: BLE001
                print(f"sweep {name} {cfg} FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", nargs="*", help="--bench: only the shapes whose names hold one of these")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    ok = True
    if args.check:
        ok = check()
        results["check"] = ok
    if args.bench:
        bench(results, args.only)
    if args.sweep:
        sweep(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
