"""Microbenchmark cases: the memory-bound kernels (RMSNorm, SiLU-and-mul, RoPE, per-token-group FP8
quantization), the router top-k and the dispatch's layout step (``expert_order``, decode sizes), on
DeepSeek-V3 shapes, each against its torch reference.

``cases()`` times the default launch configs; ``sweep()`` times candidate configs per shape,
checks each against the reference, and prints the best, for the tables in ``kernels/triton/``.
The sweep replays each call from a CUDA graph, so small (decode) shapes are timed without the host's
launch overhead, as the engine runs them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moeserve.bench.kernels import KernelCase, copy_gbps, graph_ms, time_ms

TOKENS = (8192, 128)  # a prefill chunk and a decode batch
HIDDEN = 7168
Q_LORA, KV_LORA, ROPE_DIM, HEADS, QK_HEAD = 1536, 512, 64, 128, 192
MOE_INTER, DENSE_INTER = 2048, 18432
N_EXPERTS, N_GROUP, TOPK_GROUP, TOP_K = 256, 8, 4, 8
DTYPE = torch.bfloat16
DEVICE = "cuda"


@dataclass
class Shape:
    """One benchmarked call: ``run(config)`` launches the Triton kernel (``None``: its default
    config), ``ref()`` the torch reference, ``ok(out, ref_out)`` says whether an output is right."""

    name: str
    run: Callable[[dict | None], object]
    ref: Callable[[], object]
    ok: Callable[[object, object], bool]
    bytes: float
    flops: float
    candidates: list[dict]
    in_cases: bool = True


def cases() -> list[KernelCase]:
    return [KernelCase(s.name, (lambda s=s: s.run(None)), s.flops, s.bytes, s.ref, "torch")
            for s in _shapes() if s.in_cases]


def sweep(only: str | None = None, iters: int = 20) -> dict[str, dict]:
    """Time every candidate config of every shape (``only``: a substring of the shape names);
    print a table and the best config per shape, and return ``{shape name: best config}``."""
    copy_bw = copy_gbps(2**29, iters=10)  # 2 GiB
    print(f"copy bandwidth {copy_bw:.0f} GB/s")
    best = {}
    for shape in _shapes():
        if only is not None and only not in shape.name:
            continue
        ref_out = shape.ref()
        results = [("torch", _graph_ms(shape.ref, iters))]
        for cfg in shape.candidates:
            ms = _time_candidate(shape, cfg, ref_out, iters)
            if ms is not None:
                results.append((cfg, ms))
        for cfg, ms in results:
            gbps = shape.bytes / ms / 1e6
            print(f"{shape.name:44s} {cfg!s:36s} {ms * 1e3:9.1f} us {gbps:6.0f} GB/s "
                  f"{100 * gbps / copy_bw:5.1f}%")
        tried = [r for r in results if r[0] != "torch"]
        if tried:
            best[shape.name] = min(tried, key=lambda r: r[1])[0]
            print(f"BEST {shape.name}: {best[shape.name]}")
        torch.cuda.empty_cache()
    return best


def _time_candidate(shape: Shape, cfg: dict, ref_out: object, iters: int) -> float | None:
    try:
        if not shape.ok(shape.run(cfg), ref_out):
            print(f"{shape.name:44s} {cfg!s:36s} WRONG")
            return None
        return _graph_ms(lambda: shape.run(cfg), iters)
    except Exception as e:
        print(f"{shape.name:44s} {cfg!s:36s} FAILED {type(e).__name__}: {str(e)[:80]}")
        return None


def _graph_ms(fn: Callable[[], object], iters: int) -> float:
    """Time of one ``fn()`` replayed from a CUDA graph of 10 calls (eagerly if capture fails)."""
    ms = graph_ms(fn, iters, repeat=10)
    return ms if ms is not None else time_ms(fn, iters=iters)


def _shapes() -> list[Shape]:
    shapes = []
    for t in TOKENS:
        shapes += _norm_shapes(t) + _silu_shapes(t) + _rope_shapes(t) + _quant_shapes(t) + _routing_shapes(t)
    return shapes + _layout_shapes()


# --- relative error checks ------------------------------------------------------------------------

def _close(out: object, ref: object, tol: float = 2e-2) -> bool:
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    for o, r in zip(outs, refs):
        o, r = o.double(), r.double()
        if not torch.isfinite(o).all() or (o - r).norm() > tol * r.norm():
            return False
    return True


def _quant_ok(out: tuple, ref: tuple) -> bool:
    (q, s), (q_ref, s_ref) = out, ref
    return (torch.allclose(s, s_ref, rtol=1e-6, atol=0)
            and (q.float() != q_ref.float()).float().mean().item() < 1e-3)


def _routing_ok(out: tuple, ref: tuple) -> bool:
    (w, ids), (w_ref, ids_ref) = out, ref
    ids, order = ids.sort(-1)
    ids_ref, order_ref = ids_ref.sort(-1)
    same = (ids == ids_ref).all(-1)  # near-ties may legitimately differ on a few tokens
    close = torch.isclose(w.gather(1, order), w_ref.gather(1, order_ref), rtol=1e-5).all(-1)
    return (same & close).float().mean().item() > 0.99


# --- shapes ---------------------------------------------------------------------------------------

def _grid(**axes: list) -> list[dict]:
    return [dict(zip(axes, values)) for values in itertools.product(*axes.values())]


def _norm_shapes(t: int) -> list[Shape]:
    from moeserve.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
    from moeserve.kernels.triton import norm

    shapes = []
    # hidden, q_a (q_lora_rank) and the kv latent, a strided view of kv_a's [T, 576] output
    for dim, row, in_cases in ((HIDDEN, HIDDEN, True), (Q_LORA, Q_LORA, False), (KV_LORA, KV_LORA + ROPE_DIM, False)):
        x = torch.randn(t, row, device=DEVICE, dtype=DTYPE)[:, :dim]
        res = torch.randn(t, dim, device=DEVICE, dtype=DTYPE)
        w = torch.randn(dim, device=DEVICE, dtype=DTYPE)
        n = t * dim
        rows = [1, 2] if dim >= 4096 else [1, 2, 4, 8, 16]
        cands = _grid(BLOCK_R=rows, num_warps=[2, 4, 8, 16] if dim >= 4096 else [1, 2, 4, 8])
        shapes.append(Shape(
            f"rms_norm T={t} D={dim}", lambda c, x=x, w=w: norm.rms_norm(x, w, 1e-6, config=c),
            lambda x=x, w=w: rms_norm_ref(x, w, 1e-6), _close, bytes=2 * n * 2 + dim * 2, flops=4 * n,
            candidates=cands, in_cases=in_cases))
        if dim == HIDDEN:
            shapes.append(Shape(
                f"fused_add_rms_norm T={t} D={dim}",
                lambda c, x=x, r=res, w=w: norm.fused_add_rms_norm(x, r, w, 1e-6, config=c),
                lambda x=x, r=res, w=w: fused_add_rms_norm_ref(x, r, w, 1e-6), _close,
                bytes=4 * n * 2 + dim * 2, flops=5 * n, candidates=cands))
    return shapes


def _silu_shapes(t: int) -> list[Shape]:
    from moeserve.kernels.activation import silu_and_mul_ref
    from moeserve.kernels.triton import activation

    shapes = []
    for inter in (MOE_INTER, DENSE_INTER):
        x = torch.randn(t, 2 * inter, device=DEVICE, dtype=DTYPE)
        n = t * inter
        shapes.append(Shape(
            f"silu_and_mul T={t} I={inter}", lambda c, x=x: activation.silu_and_mul(x, config=c),
            lambda x=x: silu_and_mul_ref(x), _close, bytes=3 * n * 2, flops=4 * n,
            candidates=_grid(BLOCK_I=[256, 512, 1024, 2048, 4096], num_warps=[1, 2, 4, 8])))
    return shapes


def _rope_shapes(t: int) -> list[Shape]:
    from moeserve.kernels.rope import apply_rope_ref
    from moeserve.kernels.triton import rope

    q = torch.randn(t, HEADS, QK_HEAD, device=DEVICE, dtype=DTYPE)
    x = q[..., QK_HEAD - ROPE_DIM:]  # MLA's q_rope: the last 64 of each 192-wide head
    angles = torch.rand(t, ROPE_DIM // 2, device=DEVICE) * 100
    cos, sin = angles.cos(), angles.sin()
    n = t * HEADS * ROPE_DIM
    return [Shape(
        f"apply_rope q T={t} H={HEADS} R={ROPE_DIM}",
        lambda c: rope.apply_rope(x, cos, sin, True, config=c),
        lambda: apply_rope_ref(x, cos, sin, True), _close,
        bytes=2 * n * 2 + 2 * t * (ROPE_DIM // 2) * 4, flops=3 * n,
        candidates=_grid(BLOCK_H=[4, 8, 16, 32, 64, 128], num_warps=[1, 2, 4, 8]))]


def _quant_shapes(t: int) -> list[Shape]:
    from moeserve.kernels.fp8 import per_token_group_quant_fp8_ref
    from moeserve.kernels.triton import quant

    shapes = []
    for k in (HIDDEN, MOE_INTER):
        x = torch.randn(t, k, device=DEVICE, dtype=DTYPE)
        n = t * k
        shapes.append(Shape(
            f"per_token_group_quant_fp8 T={t} K={k}",
            lambda c, x=x: quant.per_token_group_quant_fp8(x, 128, config=c),
            lambda x=x: per_token_group_quant_fp8_ref(x, 128), _quant_ok,
            bytes=n * 2 + n + n // 128 * 4, flops=3 * n,
            candidates=_grid(BLOCK_G=[1, 2, 4, 8, 16, 32], num_warps=[1, 2, 4, 8], DIV_RN=[True, False])))
    return shapes


def _routing_shapes(t: int) -> list[Shape]:
    from moeserve.kernels.routing import select_experts_ref
    from moeserve.kernels.triton import routing

    logits = torch.randn(t, N_EXPERTS, device=DEVICE)
    bias = torch.randn(N_EXPERTS, device=DEVICE) * 0.1
    args = (logits, TOP_K, "noaux_tc", N_GROUP, TOPK_GROUP, bias, True, 2.5)
    return [Shape(
        f"select_experts noaux_tc T={t} E={N_EXPERTS}", lambda c: routing.select_experts(*args, config=c),
        lambda: select_experts_ref(*args), _routing_ok,
        bytes=t * N_EXPERTS * 4 + N_EXPERTS * 4 + t * TOP_K * (4 + 8),
        flops=t * N_EXPERTS * (3 + TOP_K), candidates=_grid(num_warps=[1, 2, 4, 8]))]


def _layout_shapes() -> list[Shape]:
    """The layout step over the 288 physical slots of the reference's decode (256 experts + 32
    redundant), at a two-batch-overlap micro-batch, a decode rank's batch, and the kernel's limit."""
    from moeserve.kernels.expert_order import TRITON_MAX_ROWS, expert_order_ref
    from moeserve.kernels.triton import expert_order

    slots, shapes = N_EXPERTS + 32, []
    for t in (128, 256, TRITON_MAX_ROWS // TOP_K):
        ids = torch.randint(0, slots, (t * TOP_K,), device=DEVICE)
        shapes.append(Shape(
            f"expert_order N={t * TOP_K} E={slots}", lambda c, ids=ids: expert_order.expert_order(ids, slots),
            lambda ids=ids: tuple(vars(expert_order_ref(ids, slots)).values()),
            lambda out, ref: all(torch.equal(a, b) for a, b in zip(out, ref)),
            bytes=ids.numel() * 8 * 3 + (slots * 2 + 1) * 8, flops=float(ids.numel()) ** 2, candidates=[{}]))
    return shapes
