"""SiLU-and-mul in the grouped GEMM's epilogue against the GEMM and a separate pass, side by side.

    python3 tools/fused_activation_ab.py [--json PATH]

Run from the repository root on a CUDA machine. On DeepSeek-V3's gate-up projection (256 experts
of 2 x 2048 rows by 7168; tokens routed top-8 at random) it times, device time as ``bench
kernels`` does, the Triton kernel writing ``[gate | up]`` then ``silu_and_mul`` ("unfused", timed
before and after the fused call to show drift) against the kernel with the activation in its
epilogue ("fused"), for the contiguous layout (prefill and decode sizes) and the masked one
(low-latency decode: 32 local experts, rows padded to ``M_max``), bf16 and FP8; and checks that
both give the same values. Last, the two ways of building MLA prefill's k (two copies, one cat).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from moeserve.bench.kernel_cases.gemm import (
    EP_LOCAL,
    EP_RANKS,
    HIDDEN,
    LL_TOKENS,
    N_EXPERTS,
    TOP_K,
    W13,
    random_weights,
    routed_counts,
)
from moeserve.bench.kernels import time_ms
from moeserve.kernels.activation import silu_and_mul
from moeserve.kernels.fp8 import per_token_group_quant_fp8
from moeserve.kernels.triton.gemm import grouped_gemm_contiguous, grouped_gemm_masked


def _ab(name: str, gemm: Callable[..., torch.Tensor], results: dict) -> None:
    """``gemm(fuse_silu_and_mul=...)``: time the unfused form, the fused one, the unfused again."""
    unfused = lambda: silu_and_mul(gemm(fuse_silu_and_mul=False))  # noqa: E731
    fused = lambda: gemm(fuse_silu_and_mul=True)  # noqa: E731
    equal = (unfused() == fused()).float().mean().item()
    first, fused_ms, again = time_ms(unfused, iters=20), time_ms(fused, iters=20), time_ms(unfused, iters=20)
    results[name] = {"unfused_ms": first, "fused_ms": fused_ms, "unfused_again_ms": again, "equal_fraction": equal}
    print(f"{name:45s} unfused {first:7.3f} / {again:7.3f} ms   fused {fused_ms:7.3f} ms   equal {equal:.4f}",
          flush=True)


def gemm_cases(results: dict, fp8: bool) -> None:
    dt = "fp8" if fp8 else "bf16"
    w, ws = random_weights(N_EXPERTS, *W13, fp8)
    for tokens in (8192, 128, 32):
        x = torch.randn(tokens * TOP_K, HIDDEN, device="cuda", dtype=torch.bfloat16)
        xq, xs = per_token_group_quant_fp8(x) if fp8 else (x, None)
        counts = routed_counts(tokens)
        seg = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        _ab(f"{dt} w13 contiguous, {tokens} tokens",
            lambda xq=xq, xs=xs, seg=seg, **kw: grouped_gemm_contiguous(xq, w, seg, xs, ws, **kw), results)
    w_ll, ws_ll = w[:EP_LOCAL], None if ws is None else ws[:EP_LOCAL]
    m_max = LL_TOKENS * EP_RANKS  # rows one expert may receive in low-latency dispatch
    for mean in (32, 128):
        x = torch.randn(EP_LOCAL, m_max, HIDDEN, device="cuda", dtype=torch.bfloat16)
        xq, xs = per_token_group_quant_fp8(x) if fp8 else (x, None)
        masked_m = torch.randint(0, 2 * mean + 1, (EP_LOCAL,), device="cuda", dtype=torch.int32)
        _ab(f"{dt} w13 masked, {EP_LOCAL} x {m_max} rows (mean {mean} live)",
            lambda xq=xq, xs=xs, m=masked_m, **kw: grouped_gemm_masked(xq, w_ll, m, xs, ws_ll, **kw), results)


def k_assembly(results: dict, tokens: int = 8192, heads: int = 128) -> None:
    """MLA prefill's k ``[S, H, 128 + 64]`` from kv_b_proj's output and the shared rope key."""
    kv = torch.randn(tokens, heads, 256, device="cuda", dtype=torch.bfloat16)
    k_rope = torch.randn(tokens, 64, device="cuda", dtype=torch.bfloat16)

    def two_copies() -> torch.Tensor:
        k = kv.new_empty(tokens, heads, 192)
        k[..., :128] = kv[..., :128]
        k[..., 128:] = k_rope.unsqueeze(1)
        return k

    def one_cat() -> torch.Tensor:
        return torch.cat([kv[..., :128], k_rope.unsqueeze(1).expand(-1, heads, -1)], dim=-1)

    assert torch.equal(two_copies(), one_cat())
    results["k assembly"] = {"two_copies_ms": time_ms(two_copies), "cat_ms": time_ms(one_cat)}
    print(f"k of {tokens} tokens x {heads} heads: two copies {results['k assembly']['two_copies_ms']:.3f} ms, "
          f"one cat {results['k assembly']['cat_ms']:.3f} ms")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args()
    torch.manual_seed(0)
    results: dict = {"gpu": torch.cuda.get_device_name()}
    for fp8 in (False, True):
        gemm_cases(results, fp8)
        torch.cuda.empty_cache()
    k_assembly(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
