"""Per-layer timings of DeepSeek-V3.2's indexer on one GPU at the decode shapes of tools/v32_gpu.sh:
the index scores, their top-k, and the whole selection (``select_topk``). Run from the repository
root: ``PYTHONPATH=. python3 tools/indexer_timing.py``."""

import torch

from moeserve.kernels.triton import indexer

HEADS, DIM, TOPK = 64, 128, 2048
SHAPES = [(32, 4096), (32, 131072), (256, 4096), (256, 32768)]  # sequences x cached tokens


def ms(fn, n: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def main() -> None:
    for rows, ctx in SHAPES:
        width = ctx + 8  # bench rank's context length: the graphs' widest bucket
        keys = torch.randn(rows * ctx + 64, DIM, device="cuda", dtype=torch.bfloat16)
        q = torch.randn(rows, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(rows, HEADS, device="cuda")
        indptr = torch.arange(rows + 1, device="cuda") * ctx
        slots = torch.arange(rows * ctx, device="cuda") + 64
        seq, pos = torch.arange(rows, device="cuda"), torch.full((rows,), ctx - 1, device="cuda")
        args = (q, w, keys, indptr, slots, seq, pos)
        scores = indexer.index_scores(*args, width)
        score_ms = ms(lambda a=args, n=width: indexer.index_scores(*a, n))
        topk_ms = ms(lambda s=scores: s.topk(TOPK, dim=-1, sorted=True))
        select_ms = ms(lambda a=args, n=width: indexer.select_topk(*a, TOPK, n))
        gbps = rows * ctx * DIM * 2 / score_ms / 1e6
        print(f"{rows} x {ctx}: scores {score_ms:.3f} ms ({gbps:.0f} GB/s of keys), top-k {topk_ms:.3f} ms, "
              f"select_topk {select_ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
