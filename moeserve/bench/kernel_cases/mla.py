"""Microbenchmark cases: MLA attention (absorbed decode over the paged latent cache, prefill).

Decode caches are scattered: pages of 64 slots in random order, so the row gather is as
irregular as in serving. ``sweep()`` times candidate launch configs of the Triton kernels on
the key shapes, checks each against a torch result and prints the best config per shape::

    python -c "from moeserve.bench.kernel_cases.mla import sweep; sweep()"          # all shapes
    python -c "from moeserve.bench.kernel_cases.mla import sweep; sweep('decode')"  # a subset
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moeserve.bench.kernels import KernelCase, time_ms

LATENT, ROPE = 512, 64  # DeepSeek-V3 kv_lora_rank, qk_rope_head_dim
NOPE, V_DIM = 128, 128  # qk_nope_head_dim, v_head_dim
PAGE_SIZE = 64
DTYPE = torch.bfloat16
SCALE = 1 / math.sqrt(NOPE + ROPE)


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    context: int
    heads: int

    @property
    def name(self) -> str:
        return f"mla_decode bf16 B{self.batch} ctx{self.context} H{self.heads}"

    @property
    def flops(self) -> float:
        return self.batch * self.heads * self.context * (2 * (LATENT + ROPE) + 2 * LATENT)

    @property
    def bytes(self) -> float:
        """Cache rows and their indices read once, the query read and the output written."""
        rows = self.batch * self.context * ((LATENT + ROPE) * 2 + 8)
        return rows + self.batch * self.heads * ((LATENT + ROPE) * 2 + LATENT * 2)


@dataclass(frozen=True)
class ExtendShape:
    seqs: int
    new_tokens: int
    prefix: int
    heads: int

    @property
    def name(self) -> str:
        return f"mla_prefill bf16 {self.seqs}x{self.new_tokens} prefix{self.prefix} H{self.heads}"

    @property
    def visible_pairs(self) -> int:
        """Query-key pairs the causal mask lets through, summed over sequences."""
        n = self.new_tokens
        return self.seqs * (n * self.prefix + n * (n + 1) // 2)

    @property
    def flops(self) -> float:
        return 2 * self.heads * (NOPE + ROPE + V_DIM) * self.visible_pairs

    @property
    def bytes(self) -> float:
        new, ctx = self.seqs * self.new_tokens, self.seqs * (self.prefix + self.new_tokens)
        return 2 * self.heads * (new * (NOPE + ROPE) + ctx * (NOPE + ROPE + V_DIM) + new * V_DIM)


DECODE_COMPUTE = DecodeShape(128, 4096, 128)  # compute-bound: 128 heads share each row
DECODE_MEMORY = DecodeShape(64, 8192, 16)  # bandwidth-bound: 16 heads (TP 8)
DECODE_LONG = DecodeShape(4, 32768, 128)  # few sequences: the split-KV path
PREFILL = ExtendShape(8, 1024, 0, 128)
CHUNKED_PREFILL = ExtendShape(4, 512, 3584, 128)


def paged_indices(lens: list[int], page_size: int = PAGE_SIZE, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(kv_indptr [B+1], kv_indices [total], num_slots)`` int64 on the CPU, each sequence on
    whole pages drawn in random order from one pool, as a page allocator leaves them."""
    pages = [-(-n // page_size) for n in lens]
    order = torch.randperm(sum(pages), generator=torch.Generator().manual_seed(seed))
    offsets = torch.arange(page_size)
    parts, at = [], 0
    for n, n_pages in zip(lens, pages):
        slots = (order[at:at + n_pages, None] * page_size + offsets).flatten()[:n]
        parts.append(slots)
        at += n_pages
    indptr = torch.tensor([0] + list(lens), dtype=torch.int64).cumsum(0)
    indices = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    return indptr, indices, sum(pages) * page_size


def decode_inputs(shape: DecodeShape, seed: int = 0, device: str = "cuda") -> dict:
    """Random bf16 query parts and cache on the GPU; the rope query is a strided view, as in the layer."""
    gen = torch.Generator(device=device).manual_seed(seed)
    indptr, indices, num_slots = paged_indices([shape.context] * shape.batch, seed=seed)
    q = torch.randn(shape.batch, shape.heads, LATENT + ROPE, device=device, generator=gen, dtype=DTYPE)
    cache = torch.randn(num_slots, LATENT + ROPE, device=device, generator=gen, dtype=DTYPE)
    return {"q_latent": q[..., :LATENT], "q_rope": q[..., LATENT:], "kv_cache": cache,
            "kv_indptr": indptr.to(device), "kv_indices": indices.to(device), "scale": SCALE}


def decode_dense_torch(inp: dict, batch: int, context: int) -> torch.Tensor:
    """Baseline: gather every row, then batched matmuls (all sequences of length ``context``)."""
    kv = inp["kv_cache"][inp["kv_indices"]].view(batch, context, LATENT + ROPE)  # [B, s, L+R]
    q = torch.cat([inp["q_latent"], inp["q_rope"]], dim=-1)  # [B, H, L+R]
    scores = torch.bmm(q, kv.transpose(1, 2)).float() * inp["scale"]  # [B, H, s]
    return torch.bmm(scores.softmax(-1).to(kv.dtype), kv[..., :LATENT])  # [B, H, L]


def extend_inputs(shape: ExtendShape, seed: int = 0, device: str = "cuda") -> dict:
    """Packed q/k/v as the layer builds them: q and k contiguous, v a view of the kv projection."""
    gen = torch.Generator(device=device).manual_seed(seed)
    n_new, n_ctx = shape.seqs * shape.new_tokens, shape.seqs * (shape.prefix + shape.new_tokens)
    q = torch.randn(n_new, shape.heads, NOPE + ROPE, device=device, generator=gen, dtype=DTYPE)
    k = torch.randn(n_ctx, shape.heads, NOPE + ROPE, device=device, generator=gen, dtype=DTYPE)
    kv = torch.randn(n_ctx, shape.heads, NOPE + V_DIM, device=device, generator=gen, dtype=DTYPE)
    return {"q": q, "k": k, "v": kv[..., NOPE:], "extend_lens": [shape.new_tokens] * shape.seqs,
            "prefix_lens": [shape.prefix] * shape.seqs, "scale": SCALE}


def extend_sdpa(inp: dict, shape: ExtendShape) -> Callable[[], torch.Tensor]:
    """Baseline: torch SDPA on equal-length sequences, v zero-padded to the qk head dim (flash
    attention wants equal head dims); causal masks aligned to the end when there is a prefix."""
    from torch.nn.attention.bias import causal_lower_right

    b, n, ctx = shape.seqs, shape.new_tokens, shape.prefix + shape.new_tokens
    q = inp["q"].view(b, n, shape.heads, -1).transpose(1, 2)  # [B, H, n, Dqk]
    k = inp["k"].view(b, ctx, shape.heads, -1).transpose(1, 2)
    v = F.pad(inp["v"], (0, NOPE + ROPE - V_DIM)).view(b, ctx, shape.heads, -1).transpose(1, 2)
    if shape.prefix == 0:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=inp["scale"])
    mask = causal_lower_right(n, ctx)
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=inp["scale"])


def _if_it_runs(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor] | None:
    """``fn`` if one call succeeds (a baseline the installed torch may not support), else None."""
    try:
        fn()
    except RuntimeError:
        return None
    return fn


def _decode_case(shape: DecodeShape) -> KernelCase:
    from moeserve.kernels.mla import mla_decode

    inp = decode_inputs(shape)
    return KernelCase(shape.name, lambda: mla_decode(**inp, page_size=PAGE_SIZE), shape.flops, shape.bytes,
                      baseline=lambda: decode_dense_torch(inp, shape.batch, shape.context),
                      baseline_name="torch gather+bmm", notes="pages of 64 in random order")


def _extend_case(shape: ExtendShape) -> KernelCase:
    from moeserve.kernels.mla import extend_attention

    inp = extend_inputs(shape)
    return KernelCase(shape.name, lambda: extend_attention(**inp), shape.flops, shape.bytes,
                      baseline=_if_it_runs(extend_sdpa(inp, shape)), baseline_name="torch sdpa (v padded)",
                      notes="flops count visible query-key pairs only")


def cases() -> list[KernelCase]:
    return [_decode_case(s) for s in (DECODE_COMPUTE, DECODE_MEMORY, DECODE_LONG)] + \
        [_extend_case(s) for s in (PREFILL, CHUNKED_PREFILL)]


# --------------------------------------------------------------------------------------------
# tuning sweep


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _decode_candidates(shape: DecodeShape) -> list[dict]:
    """Tile shapes, tried with the default split count (``_sweep_decode`` then varies the splits
    of the best three). Configs that fail to compile or launch are reported and skipped; ``WS``
    asks Triton 3.5+ to warp-specialise the key loop (it may refuse gathered loads on Hopper);
    ``PAGED`` reads whole blocks of a page through the copy engine instead of gathering rows;
    ``HOPPER_WS`` takes the Gluon kernel (64-head blocks; tried once, its tiles are fixed)."""
    off = {"LAZY_RESCALE": False, "WS": False, "PAGED": False, "HOPPER_WS": False}
    gluon = {**off, "BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "PAGED": True, "HOPPER_WS": True}
    if shape.heads >= 64:
        tiles = [{**off, "BLOCK_H": 64, "BLOCK_N": n, "num_warps": 8, "num_stages": s, "LAZY_RESCALE": lazy,
                  "PAGED": paged}
                 for n, s, lazy, paged in itertools.product((32, 64), (1, 2, 3), (False, True), (False, True))]
        tiles += [{"BLOCK_H": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, **off},
                  {"BLOCK_H": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2, **off},
                  {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, **off},
                  {**off, "BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "WS": True},
                  {**off, "BLOCK_H": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3, "LAZY_RESCALE": True,
                   "WS": True}]
    else:  # [16, 576] query operands sit in registers (mma.sync): 64-row tiles spill at 4 warps
        tiles = [{"BLOCK_H": 16, "BLOCK_N": n, "num_warps": w, "num_stages": s, **off}
                 for n, w, s in itertools.product((16, 32, 64), (4, 8), (2, 3, 4)) if n < 64 or w == 8]
        tiles += [{"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 2, "num_stages": s, **off} for s in (2, 3)]
        tiles += [{**off, "BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "LAZY_RESCALE": True},
                  {**off, "BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "WS": True}]
        tiles += [{**off, "BLOCK_H": 16, "BLOCK_N": n, "num_warps": w, "num_stages": s, "LAZY_RESCALE": lazy,
                   "PAGED": True}
                  for n, w, s, lazy in itertools.product((16, 32, 64), (4, 8), (2, 3, 4), (False, True))]
    return [gluon] + tiles


def _decode_splits(shape: DecodeShape) -> tuple[int, ...]:
    return (1, 2, 4, 8) if shape.heads >= 64 and shape.batch >= 32 else (2, 4, 8, 16, 32, 64)


def _gather_ceiling(shape: DecodeShape, inp: dict) -> None:
    """Print the read bandwidth of the decode kernel's row gather alone, and of one contiguous
    read of the same cache, beside the copy bandwidth: how far the memory-bound case can go."""
    from moeserve.bench.kernel_cases.gather_probe import gather_read_kernel
    from moeserve.bench.kernels import copy_gbps

    cache, indices = inp["kv_cache"], inp["kv_indices"]
    row = cache.shape[1]
    nbytes = shape.batch * shape.context * (row * cache.element_size() + indices.element_size())
    print(f"{shape.name:44s} copy {copy_gbps(2**28, iters=10):.0f} GB/s; contiguous read (torch.sum) "
          f"{cache.numel() * cache.element_size() / time_ms(lambda: cache.sum(dtype=torch.float32)) / 1e6:.0f} GB/s",
          flush=True)
    for block_n, warps, stages, splits in itertools.product((16, 32, 64), (4, 8), (2, 3, 4), (8, 32)):
        chunk = -(-shape.context // splits // block_n) * block_n
        out = torch.empty(shape.batch * splits * row, device=cache.device)

        def run(block_n=block_n, warps=warps, stages=stages, splits=splits, chunk=chunk, out=out):
            gather_read_kernel[(shape.batch, splits)](cache, indices, out, shape.context, chunk, cache.stride(0),
                                                      LATENT=LATENT, ROPE=ROPE, BLOCK_N=block_n,
                                                      num_warps=warps, num_stages=stages)
        try:
            ms = time_ms(run, warmup=2, iters=10)
        except Exception as e:  # noqa: BLE001 - a config that does not fit is skipped
            print(f"{shape.name:44s} gather N{block_n} w{warps} s{stages} splits{splits}: {type(e).__name__}")
            continue
        print(f"{shape.name:44s} gather-read N{block_n} w{warps} s{stages} splits{splits} {ms:8.4f} ms "
              f"{nbytes / ms / 1e6:6.0f} GB/s", flush=True)


def _extend_candidates() -> list[dict]:
    """One 64-row wgmma per warpgroup (128 rows at 8 warps, 64 at 4); 128-key tiles only with
    two stages (three overflow shared memory at these head dims)."""
    return [{"BLOCK_M": 16 * w, "BLOCK_N": n, "num_warps": w, "num_stages": s}
            for w, n, s in itertools.product((8, 4), (32, 64, 128), (2, 3, 4)) if n < 128 or s == 2]


def _try(fn: Callable[[], torch.Tensor], ref: torch.Tensor, tol: float) -> tuple[float | None, str]:
    """``(ms, note)``: time ``fn`` if it compiles, launches and matches ``ref``."""
    try:
        err = _rel_err(fn(), ref)
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:60] if str(e) else ''}"
    if not err < tol:
        return None, f"wrong: rel err {err:.2e}"
    return time_ms(fn, warmup=3, iters=10), f"rel err {err:.1e}"


def _print_row(shape_name: str, cfg: dict, ms: float | None, note: str, flops: float, nbytes: float) -> None:
    cfg_s = " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in cfg.items())
    if ms is None:
        print(f"{shape_name:44s} {cfg_s:95s} {'-':>8s} {note}", flush=True)
    else:
        print(f"{shape_name:44s} {cfg_s:95s} {ms:8.4f} {flops / ms / 1e9:7.1f} TF/s {nbytes / ms / 1e6:6.0f} GB/s "
              f"{note}", flush=True)


def _sweep_configs(name: str, run: Callable[[dict], torch.Tensor], ref: torch.Tensor, configs: list[dict],
                   flops: float, nbytes: float, tol: float) -> list[tuple[float, dict]]:
    timed = []
    for cfg in configs:
        ms, note = _try(lambda cfg=cfg: run(cfg), ref, tol)
        _print_row(name, cfg, ms, note, flops, nbytes)
        if ms is not None:
            timed.append((ms, cfg))
    return sorted(timed, key=lambda t: t[0])


def _sweep_decode(shape: DecodeShape, device: str = "cuda") -> tuple[float, dict] | None:
    from moeserve.kernels.triton import mla as triton_mla
    from moeserve.kernels.triton import mla_hopper

    inp = decode_inputs(shape, seed=1, device=device)
    upcast = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inp.items()}
    ref = decode_dense_torch(upcast, shape.batch, shape.context)
    del upcast
    row_bytes = inp["kv_cache"].shape[1] * inp["kv_cache"].element_size()
    hopper = mla_hopper.decode_supported(inp["q_latent"], inp["kv_cache"], PAGE_SIZE)
    base = triton_mla.decode_config(shape.batch, shape.heads, row_bytes, inp["q_latent"].device, PAGE_SIZE, hopper)

    def run(cfg: dict) -> torch.Tensor:
        return triton_mla.mla_decode(**inp, page_size=PAGE_SIZE, config=cfg)

    if shape.heads < 64:
        _gather_ceiling(shape, inp)
    tiles = [{**t, "num_kv_splits": base["num_kv_splits"]} for t in _decode_candidates(shape)]
    best_tiles = _sweep_configs(shape.name, run, ref, tiles, shape.flops, shape.bytes, 2e-2)[:3]
    splits = [{**cfg, "num_kv_splits": s} for _, cfg in best_tiles for s in _decode_splits(shape)
              if s != cfg["num_kv_splits"]]
    timed = sorted(best_tiles + _sweep_configs(shape.name, run, ref, splits, shape.flops, shape.bytes, 2e-2),
                   key=lambda t: t[0])
    return timed[0] if timed else None


def _sweep_extend(shape: ExtendShape, device: str = "cuda") -> tuple[float, dict] | None:
    from moeserve.kernels.mla import extend_attention_ref
    from moeserve.kernels.triton import mla as triton_mla

    inp = extend_inputs(shape, seed=1, device=device)
    ref = extend_attention_ref(inp["q"].float(), inp["k"].float(), inp["v"].float(), inp["extend_lens"],
                               inp["prefix_lens"], inp["scale"])

    def run(cfg: dict) -> torch.Tensor:
        return triton_mla.extend_attention(**inp, config=cfg)

    timed = _sweep_configs(shape.name, run, ref, _extend_candidates(), shape.flops, shape.bytes, 2e-2)
    sdpa = _if_it_runs(extend_sdpa(inp, shape))
    if sdpa is not None:
        sdpa_ms = time_ms(sdpa, warmup=3, iters=10)
        print(f"{shape.name:44s} {'torch sdpa (v padded)':95s} {sdpa_ms:8.4f} "
              f"{shape.flops / sdpa_ms / 1e9:7.1f} TF/s", flush=True)
    if shape.prefix == 0:
        for name, fn in _sdpa_variants(inp, shape):
            ms, note = _try(fn, ref, 2e-2)
            print(f"{shape.name:44s} {name:95s} {'-' if ms is None else f'{ms:8.4f}'} "
                  f"{'' if ms is None else f'{shape.flops / ms / 1e9:7.1f} TF/s'} {note}", flush=True)
    return timed[0] if timed else None


def _sdpa_variants(inp: dict, shape: ExtendShape) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """Whole-prompt attention through torch SDPA, ``[T, H, Dv]`` in and out as the layer needs it
    (layout changes and padding counted): the engine's path (cuDNN, else v padded for flash), then
    each SDPA backend given v as it is (128 wide against 192-wide q and k)."""
    from torch.nn.attention import SDPBackend

    from moeserve.kernels.mla import _extend_flash, sdpa_whole_prompts

    q, k, v, scale, n_seqs = inp["q"], inp["k"], inp["v"], inp["scale"], shape.seqs
    variants = [("engine path (cuDNN with v as it is, else flash with v padded)",
                 lambda: _extend_flash(q, k, v, n_seqs, scale))]
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION):
        variants.append((f"sdpa {backend.name.lower()}, v unpadded",
                         lambda b=backend: sdpa_whole_prompts(q, k, v, n_seqs, scale, b)))
    return variants


def sweep(only: str | None = None) -> dict[str, dict]:
    """Time candidate configs on the benchmark shapes whose name contains ``only``; print one
    row per config and the best per shape; return ``{shape name: best config}``."""
    if not torch.cuda.is_available():
        raise SystemExit("the sweep needs a CUDA device")
    shapes: list[tuple[str, Callable[[], tuple[float, dict] | None]]] = \
        [(s.name, lambda s=s: _sweep_decode(s)) for s in (DECODE_COMPUTE, DECODE_MEMORY, DECODE_LONG)] + \
        [(s.name, lambda s=s: _sweep_extend(s)) for s in (PREFILL, CHUNKED_PREFILL)]
    best = {}
    start = time.perf_counter()
    for name, fn in shapes:
        if only is not None and only not in name:
            continue
        found = fn()
        torch.cuda.empty_cache()
        if found is not None:
            best[name] = found[1]
            print(f"BEST {name}: {found[0]:.4f} ms {found[1]}", flush=True)
        print(f"(sweep at {time.perf_counter() - start:.0f} s)", flush=True)
    return best
