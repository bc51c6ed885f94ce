"""The FP8 KV cache's kernels: the rounding of ``quantize_kv_rows`` and, over an FP8 pool's typed
views, the Triton MLA decode, verification, sparse MLA and indexer scores against the torch
references (which dequantize the same bytes, in fp64 here). CPU checks run through Triton's
interpreter in fp16/fp32 at small shapes; GPU ones in bf16 at DeepSeek-V3.2's. The caches hold
latents whose 128-column tiles and tokens differ in magnitude by orders, so a scale read for the
wrong tile or token shows, and NaN bytes in every slot no sequence holds."""

from __future__ import annotations

import pytest
import torch

from moeserve.cache import KVLayout, MLAKVPool
from moeserve.kernels.fp8 import FP8_MAX, dequantize_kv_rows, quantize_kv_rows
from moeserve.kernels.indexer import select_topk_ref
from moeserve.kernels.mla import mla_verify_ref, sparse_mla
from tests.kernels.accuracy import REL_TOL, poison_allocator, rel_error
from tests.kernels.interpreter import interpreted, run_checks
from tests.kernels.test_triton_mla import _scattered_slots

INTERPRETED = "tests.kernels.test_fp8_kv:run_interpreted_checks"  # prefetched (tests/kernels/interpreter.py)

# the kernels round each dequantized key to the query's dtype before the dots, a rounding more than
# the dtype's own cache has (the references dequantize in fp64)
FP8_TOL = {dtype: 2 * tol for dtype, tol in REL_TOL.items()}
E4M3_HALF_STEP = 2.0 ** -4  # relative rounding of a normal e4m3 value (3 mantissa bits)
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10  # absolute, below 2^-6, in units of the scale


# --- the rounding (torch) --------------------------------------------------------------------------

@pytest.mark.parametrize(("latent_dim", "rope_dim"), [(512, 64), (32, 16), (160, 8)])
def test_round_trip_error_is_one_e4m3_rounding(latent_dim: int, rope_dim: int) -> None:
    """Every value comes back within half an e4m3 step of itself (relative; absolute below the
    normal range) under its tile's scale, the tile's largest exactly; a zero row stays zero."""
    gen = torch.Generator().manual_seed(latent_dim)
    tiles = -(-latent_dim // 128)
    latent = torch.randn(50, latent_dim, generator=gen) * 10.0 ** torch.randint(-3, 3, (50, 1), generator=gen)
    rope = torch.randn(50, rope_dim, generator=gen) * 30
    latent[7], rope[7] = 0, 0
    values, scales = quantize_kv_rows(latent, rope)
    assert values.dtype == torch.float8_e4m3fn and values.shape == (50, latent_dim + rope_dim)
    assert scales.dtype == torch.float32 and scales.shape == (50, tiles + 1)
    back = dequantize_kv_rows(values, scales, latent_dim, torch.float32)
    exact = torch.cat([latent, rope], -1)
    col_scale = torch.cat([scales[:, :-1].repeat_interleave(128, -1)[:, :latent_dim],
                           scales[:, -1:].expand(-1, rope_dim)], -1)
    bound = torch.maximum(exact.abs() * E4M3_HALF_STEP, col_scale * E4M3_SUBNORMAL_HALF_STEP)
    assert ((back - exact).abs() <= bound * (1 + 1e-6)).all()
    assert torch.equal(back[7], torch.zeros_like(back[7])) and (scales[7] > 0).all()
    top = exact.abs().amax(-1).argmax()
    assert (values[top].float().abs().max() == FP8_MAX)
    assert dequantize_kv_rows(values, scales, latent_dim, torch.bfloat16).dtype == torch.bfloat16


# --- the FP8 cache the kernels read -----------------------------------------------------------------

def _fp8_pool(device: str, num_slots: int, used: torch.Tensor, latent: int, rope: int,
              index_dim: int = 0) -> MLAKVPool:
    """One layer, each token's latent tiles and rope key of their own magnitudes; NaN bytes in every
    slot not in ``used``, scales included."""
    gen = torch.Generator().manual_seed(num_slots)
    pool = MLAKVPool(KVLayout(latent, rope, index_dim, torch.float8_e4m3fn), 1, num_slots, device)
    tile_scale = 4.0 ** torch.randint(-2, 3, (num_slots, -(-latent // 128)), generator=gen)
    values = torch.randn(num_slots, latent, generator=gen) * tile_scale.repeat_interleave(128, -1)[:, :latent]
    rope_values = torch.randn(num_slots, rope, generator=gen) * 4.0 ** torch.randint(-2, 3, (num_slots, 1),
                                                                                       generator=gen)
    slots = torch.arange(num_slots, device=device)
    pool.write(0, slots, values.to(device), rope_values.to(device))
    if index_dim:
        pool.write_index(0, slots, torch.randn(num_slots, index_dim, generator=gen).to(device))
    unused = torch.ones(num_slots, dtype=torch.bool)
    unused[used.cpu()] = False
    pool.buffer[0, unused.to(device)] = 0xFF  # NaN in e4m3 and in float32: must never reach an output
    return pool


def check_fp8_verify(device: str, dtype: torch.dtype, heads: int, lens: list[int], q_per_seq: int = 1,
                     latent: int = 32, rope: int = 16, page_size: int | None = None, seed: int = 0,
                     **config) -> None:
    """Triton ``mla_verify`` (decode at ``q_per_seq`` 1) over an FP8 pool against the torch version
    in fp64; ``page_size`` tells the kernel of the pages the slots lie on (an FP8 cache is gathered
    all the same)."""
    from moeserve.kernels.triton import mla

    torch.manual_seed(seed)
    indptr, indices, num_slots = _scattered_slots(lens, page_size or 4)
    pool = _fp8_pool(device, num_slots, indices, latent, rope)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(lens) * q_per_seq, heads, latent + rope + 8, generator=gen).to(device, dtype)
    q_latent, q_rope = q[..., :latent], q[..., latent + 8:]  # strided views, as in the layer
    indptr, indices = indptr.to(device), indices.to(device)
    cache, scales = pool.layer(0), pool.layer_scales(0)
    poison_allocator(device)
    out = mla.mla_verify(q_latent, q_rope, cache, indptr, indices, 0.3, q_per_seq, kv_scales=scales,
                         page_size=page_size, config=config or None)
    assert out.shape == q_latent.shape and out.dtype == dtype
    ref = mla_verify_ref(q_latent.double(), q_rope.double(), cache, indptr, indices, 0.3, q_per_seq, scales)
    assert torch.isfinite(ref).all()
    assert rel_error(out, ref) < FP8_TOL[dtype]


def check_fp8_sparse_mla(device: str, dtype: torch.dtype, heads: int, counts: list[int], topk: int,
                         latent: int = 32, rope: int = 16) -> None:
    """Triton sparse MLA over an FP8 pool (index keys after the latent, as V3.2's) against the torch
    version in fp64."""
    from moeserve.kernels.triton import mla

    gen = torch.Generator().manual_seed(len(counts))
    num_slots = max(counts) * 3 + 5
    selected = torch.full((len(counts), topk), -1, dtype=torch.int64)
    for row, n in enumerate(counts):
        selected[row, :n] = torch.randperm(num_slots, generator=gen)[:n]
    pool = _fp8_pool(device, num_slots, selected[selected >= 0].unique(), latent, rope, index_dim=32)
    q_latent = torch.randn(len(counts), heads, latent, generator=gen).to(device, dtype)
    q_rope = torch.randn(len(counts), heads, rope, generator=gen).to(device, dtype)
    cache, scales, selected = pool.layer(0), pool.layer_scales(0), selected.to(device)
    got = mla.sparse_mla(q_latent, q_rope, cache, selected, 0.25, kv_scales=scales)
    want = sparse_mla(q_latent.double().cpu(), q_rope.double().cpu(), cache.cpu(), selected.cpu(), 0.25,
                      kv_scales=scales.cpu())
    assert got.dtype == dtype and rel_error(got.cpu(), want) < FP8_TOL[dtype]


def check_fp8_index_scores(device: str, dtype: torch.dtype, heads: int, dim: int, seq_lens: list[int],
                           extend_lens: list[int], topk: int) -> None:
    """Triton index scores over FP8 keys (each times its scale) against the torch version in
    fp64, and a selection of as many slots from each row's causal context."""
    from moeserve.kernels.triton import indexer

    torch.manual_seed(dim)
    indptr, indices, num_slots = _scattered_slots(seq_lens, 4)
    pool = _fp8_pool(device, num_slots, indices, 32, 16, index_dim=dim)
    keys, key_scales = pool.index_keys(0), pool.index_scales(0)
    gen = torch.Generator().manual_seed(dim)
    rows = sum(extend_lens)
    q = torch.randn(rows, heads, dim, generator=gen).to(device, dtype)
    weights = (torch.randn(rows, heads, generator=gen) / heads).to(device)
    seq_of_row = torch.tensor([s for s, e in enumerate(extend_lens) for _ in range(e)], device=device)
    pos_of_row = torch.tensor([p for n, e in zip(seq_lens, extend_lens) for p in range(n - e, n)], device=device)
    case = (q, weights, keys, indptr.to(device), indices.to(device), seq_of_row, pos_of_row)
    got = indexer.index_scores(*case, max(seq_lens), index_scales=key_scales).double().cpu()
    want = torch.full_like(got, float("-inf"))
    for row in range(rows):
        seq, pos = int(seq_of_row[row]), int(pos_of_row[row])
        context = indices[int(indptr[seq]):int(indptr[seq]) + pos + 1].to(device)
        dots = torch.einsum("hd,sd->hs", q[row].double(), keys[context].double()).relu()
        want[row, :pos + 1] = (weights[row].double() @ dots * key_scales[context].double()).cpu()
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got[finite] - want[finite]).abs().max() <= tol * want[finite].abs().max()
    position_of = {int(s): i for i, s in enumerate(indices.tolist())}
    triton_pick = indexer.select_topk(*case, topk, max(seq_lens), key_scales).cpu()
    torch_pick = select_topk_ref(q, weights, keys, indptr, indices.to(device), seq_of_row.tolist(),
                                 pos_of_row.tolist(), topk, key_scales).cpu()
    for row in range(rows):  # both keep the best of the row's context, up to ties within rounding
        seq, pos = int(seq_of_row[row]), int(pos_of_row[row])
        scores = want[row, :pos + 1]
        threshold = scores.topk(min(topk, pos + 1)).values[-1] - 2 * tol * scores.abs().max()
        for picked in (triton_pick[row], torch_pick[row]):
            kept = [position_of[s] - int(indptr[seq]) for s in picked.tolist() if s >= 0]
            assert len(kept) == min(topk, pos + 1) and scores[kept].min() >= threshold, row


f16, f32 = torch.float16, torch.float32
TINY = {"BLOCK_H": 16, "BLOCK_N": 16}
INTERPRETED_CHECKS = {
    "decode_three_splits": lambda: check_fp8_verify("cpu", f16, 16, [1, 37, 0, 20], num_kv_splits=3, **TINY),
    "decode_one_split_padded_heads_fp32": lambda: check_fp8_verify("cpu", f32, 5, [17, 2, 40], num_kv_splits=1,
                                                                   **TINY),
    "decode_two_tiles_padded_latent": lambda: check_fp8_verify("cpu", f32, 4, [9, 30], latent=160, rope=8,
                                                               num_kv_splits=2, **TINY),
    "decode_told_of_pages": lambda: check_fp8_verify("cpu", f16, 16, [9, 40], page_size=16, num_kv_splits=2,
                                                     PAGED=True, **TINY),
    "verify_q3_lazy_rescale": lambda: check_fp8_verify("cpu", f32, 16, [3, 33, 9], 3, num_kv_splits=2,
                                                       LAZY_RESCALE=True, **TINY),
    "sparse_mla_fp16": lambda: check_fp8_sparse_mla("cpu", f16, 3, [8, 3, 1, 8], 8),
    "index_scores_and_selection_fp32": lambda: check_fp8_index_scores("cpu", f32, 16, 32, [70, 9, 33], [70, 1, 5],
                                                                      12),
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


def test_the_triton_wrappers_refuse_mismatched_scales() -> None:
    pytest.importorskip("triton")
    from moeserve.kernels.triton import indexer, mla

    pool = _fp8_pool("cpu", 8, torch.arange(8), 32, 16, index_dim=16)
    q_latent, q_rope = torch.randn(1, 4, 32), torch.randn(1, 4, 16)
    indptr, indices = torch.tensor([0, 3]), torch.arange(3)
    with pytest.raises(ValueError, match="kv_scales"):
        mla.mla_decode(q_latent, q_rope, pool.layer(0), indptr, indices, 1.0, kv_scales=pool.layer_scales(0)[:, :1])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mla.mla_decode(q_latent, q_rope, pool.layer(0), indptr, indices, 1.0)  # FP8 values without their scales
    with pytest.raises(ValueError, match="index_scales"):
        indexer.select_topk(torch.randn(1, 2, 16), torch.randn(1, 2), pool.index_keys(0), indptr, indices,
                            torch.tensor([0]), torch.tensor([2]), 2, 3)


@pytest.mark.parametrize("heads", [128, 16])
def test_fp8_decode_kernel_compiles_for_sm90(heads: int) -> None:
    """The row gather with FP8 dequantization builds for Hopper without a GPU, at the launch
    parameters decode takes for DeepSeek-V3's dims, within the shared memory a block may have
    (gathering each column's scale instead took 272 KB at 64 heads x 64 tokens)."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moeserve.kernels.triton import mla

    cfg = mla.decode_config(256, heads, 576, torch.device("cpu"), page_size=64)
    fn = mla._mla_decode_split_kernel
    constexprs = {"LATENT": 512, "ROPE": 64, "BLOCK_L": 512, "BLOCK_R": 64, "BLOCK_H": cfg["BLOCK_H"],
                  "BLOCK_N": cfg["BLOCK_N"], "SINGLE_SPLIT": False, "LAZY_RESCALE": cfg["LAZY_RESCALE"],
                  "DOT_PRECISION": "tf32", "WS": False, "Q_PER_SEQ": 1, "HAS_LENS": False, "SCALE_TILES": 4,
                  "SCALE_W": 128}
    types = {"q_latent": "*bf16", "q_rope": "*bf16", "kv_cache": "*fp8e4nv", "kv_scales": "*fp32", "out": "*fp32",
             "lse": "*fp32", "num_heads": "i32", "num_splits": "i32", "qk_scale": "fp32"}
    signature = {name: "constexpr" if name in constexprs else types.get(name, "i64") for name in fn.arg_names}
    signature.update({name: "*i64" for name in ("kv_indptr", "kv_indices", "kv_lens")})
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]})
    assert kernel.metadata.shared <= 232448  # 227 KB: the most one block may have on Hopper
    assert "e4m3" in kernel.asm["ptx"]


# --- GPU ---------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
bf16 = torch.bfloat16


@gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("config", [{}, {"num_kv_splits": 1}, {"num_kv_splits": 7}, {"BLOCK_H": 16, "BLOCK_N": 16}])
def test_fp8_decode_at_v3_dims_gpu(heads: int, config: dict) -> None:
    """Told of 64-slot pages, as the engine tells it: the FP8 cache still goes to the row gather
    (not the Gluon kernel nor the copy engine's page blocks)."""
    check_fp8_verify("cuda", bf16, heads, [1, 700, 0, 3000, 129, 64], latent=512, rope=64, page_size=64, **config)


@gpu
@pytest.mark.parametrize("q_per_seq", [2, 3])
def test_fp8_verify_at_v3_dims_gpu(q_per_seq: int) -> None:
    check_fp8_verify("cuda", bf16, 128, [q_per_seq, 700, 33, 3000], q_per_seq, latent=512, rope=64, page_size=64)


@gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_fp8_sparse_mla_at_v3_dims_gpu(heads: int) -> None:
    check_fp8_sparse_mla("cuda", bf16, heads, [2048, 700, 1, 2048], 2048, latent=512, rope=64)


@gpu
def test_fp8_index_scores_at_v32_shapes_gpu() -> None:
    check_fp8_index_scores("cuda", bf16, 64, 128, [5000, 2100, 300], [1, 600, 1], 2048)


@gpu
def test_fp8_decode_dispatch_and_cuda_graph() -> None:
    """The public function routes an FP8 pool's views to Triton, and a captured call replays on
    new slots (no host sync inside)."""
    from moeserve.kernels.mla import mla_decode

    torch.manual_seed(4)
    lens = [5, 1, 300, 1000]
    indptr, indices, num_slots = _scattered_slots(lens, 64)
    pool = _fp8_pool("cuda", num_slots, torch.arange(num_slots), 512, 64)
    q = torch.randn(4, 128, 576, device="cuda", dtype=bf16)
    indices = indices.cuda()
    args = (q[..., :512], q[..., 512:], pool.layer(0), indptr.cuda(), indices, 0.07)
    mla_decode(*args, kv_scales=pool.layer_scales(0), page_size=64)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(*args, kv_scales=pool.layer_scales(0), page_size=64)
    indices.copy_(_scattered_slots(lens, 64)[1])  # the same pages, in another order
    graph.replay()
    ref = mla_verify_ref(*(a.double() for a in args[:2]), *args[2:], 1, pool.layer_scales(0))
    assert rel_error(out, ref) < FP8_TOL[bf16]
