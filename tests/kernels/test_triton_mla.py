"""Triton MLA attention (absorbed decode and verification over the paged latent cache, varlen
prefill) against the torch references run in fp64.

The ``check_*`` functions hold the comparisons. GPU tests run them in bf16 on DeepSeek-V3 head
dims; one CPU test runs them at tiny shapes (latent 32 + rope 16, qk 32 + 16) through Triton's
interpreter in a subprocess (``TRITON_INTERPRET`` must be set before Triton is imported; the
interpreter's bf16 loads are unreliable, so it gets fp16 and fp32).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeserve.kernels.mla import extend_attention_ref, mla_decode_ref, mla_verify_ref
from tests.kernels.accuracy import REL_TOL, poison_allocator, rel_error
from tests.kernels.interpreter import interpreted, run_checks

INTERPRETED = "tests.kernels.test_triton_mla:run_interpreted_checks"  # prefetched (tests/kernels/interpreter.py)


def _scattered_slots(lens: list[int], page_size: int, spare_pages: int = 3) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(kv_indptr [B+1], kv_indices [total], num_slots)``: each sequence on whole pages taken in
    random order from a pool with a few pages to spare."""
    pages = [-(-n // page_size) for n in lens]
    order = torch.randperm(sum(pages) + spare_pages)
    offsets = torch.arange(page_size)
    parts, at = [], 0
    for n, n_pages in zip(lens, pages):
        parts.append((order[at:at + n_pages, None] * page_size + offsets).flatten()[:n])
        at += n_pages
    indptr = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
    return indptr, torch.cat(parts), (sum(pages) + spare_pages) * page_size


# --- checks (shared by the GPU tests and the interpreter run) -----------------------------------

def _decode_inputs(device: str, dtype: torch.dtype, heads: int, lens: list[int], latent: int, rope: int,
                   page_size: int, index_dtype: torch.dtype, q_per_seq: int = 1,
                   aim: float = 0.0) -> tuple[torch.Tensor, ...]:
    """``(q_latent, q_rope, kv_cache, kv_indptr, kv_indices)`` with ``q_per_seq`` query rows a
    sequence: scattered pages, NaN in every slot no sequence holds; ``q_rope`` a strided view of
    the projected query, as in the layer. ``aim`` adds to each query that many times the key of
    its own token and of the first token hidden from it: a query that sees one token too few or
    too many then misses the reference by far."""
    indptr, indices, num_slots = _scattered_slots(lens, page_size)
    cache = torch.randn(num_slots, latent + rope).to(dtype)
    unused = torch.ones(num_slots, dtype=torch.bool)
    unused[indices] = False
    cache[unused] = float("nan")  # page tails and spare pages: must never reach the output
    indptr, indices, cache = indptr.to(device, index_dtype), indices.to(device, index_dtype), cache.to(device)
    q = torch.randn(len(lens) * q_per_seq, heads, latent + rope + 8, device=device)
    if aim:
        own = torch.tensor([start + n - q_per_seq + j for start, n in zip(indptr.tolist(), lens)
                            for j in range(q_per_seq)], device=device)
        hidden = torch.arange(q.shape[0], device=device) % q_per_seq < q_per_seq - 1  # the last query hides none
        keys = cache[indices[own]].float() + hidden[:, None] * cache[indices[own + hidden]].float()  # [B*Q, L + R]
        q[..., :latent] += aim * keys[:, None, :latent]
        q[..., latent + 8:] += aim * keys[:, None, latent:]
    q = q.to(dtype)
    return q[..., :latent], q[..., latent + 8:], cache, indptr, indices


def check_mla_decode(device: str, dtype: torch.dtype, heads: int, lens: list[int], latent: int = 32, rope: int = 16,
                     page_size: int = 4, scale: float = 0.2, index_dtype: torch.dtype = torch.int64,
                     paged: bool = False, **config) -> None:
    """Inputs from ``_decode_inputs``. ``paged`` tells the kernel the page size (whole blocks
    through the copy engine where the config allows)."""
    from moeserve.kernels.triton import mla

    q_latent, q_rope, cache, indptr, indices = _decode_inputs(device, dtype, heads, lens, latent, rope, page_size,
                                                              index_dtype)
    poison_allocator(device)
    out = mla.mla_decode(q_latent, q_rope, cache, indptr, indices, scale, page_size=page_size if paged else None,
                         config=config or None)
    assert out.shape == q_latent.shape and out.dtype == dtype
    ref = mla_decode_ref(q_latent.double(), q_rope.double(), cache.double(), indptr, indices, scale)
    assert torch.isfinite(ref).all()
    empty = torch.tensor(lens, device=device) == 0
    assert torch.isfinite(out).all() and (out[empty] == 0).all(), "an empty sequence must give zeros"
    assert rel_error(out, ref) < REL_TOL[dtype]


def check_mla_verify(device: str, dtype: torch.dtype, heads: int, lens: list[int], q_per_seq: int, latent: int = 32,
                     rope: int = 16, page_size: int = 4, scale: float = 0.2, index_dtype: torch.dtype = torch.int64,
                     paged: bool = False, aim: float = 1.0, **config) -> None:
    """``mla_verify`` with ``q_per_seq`` queries a sequence, inputs from ``_decode_inputs`` (each
    query aimed at its own token and the first hidden one unless ``aim=0``)."""
    from moeserve.kernels.triton import mla

    q_latent, q_rope, cache, indptr, indices = _decode_inputs(device, dtype, heads, lens, latent, rope, page_size,
                                                              index_dtype, q_per_seq, aim)
    poison_allocator(device)
    out = mla.mla_verify(q_latent, q_rope, cache, indptr, indices, scale, q_per_seq,
                         page_size=page_size if paged else None, config=config or None)
    assert out.shape == q_latent.shape and out.dtype == dtype
    ref = mla_verify_ref(q_latent.double(), q_rope.double(), cache.double(), indptr, indices, scale, q_per_seq)
    assert torch.isfinite(ref).all()
    assert rel_error(out, ref) < REL_TOL[dtype]


def check_verify_one_query_is_decode(device: str, dtype: torch.dtype, heads: int, lens: list[int],
                                     page_size: int | None = None, **config) -> None:
    """One query a sequence is decode, bitwise, whole and as a part sized as the whole batch."""
    from moeserve.kernels.triton import mla

    q_latent, q_rope, cache, indptr, indices = _decode_inputs(device, dtype, heads, lens, 32, 16, page_size or 16,
                                                              torch.int64)
    for rows, launch_batch in ((slice(None), None), (slice(1, None), len(lens))):
        args = (q_latent[rows], q_rope[rows], cache, indptr[rows.start or 0:], indices, 0.2)
        options = {"page_size": page_size, "config": config or None, "launch_batch": launch_batch}
        assert torch.equal(mla.mla_verify(*args, 1, **options), mla.mla_decode(*args, **options))


def check_verify_part_of_a_batch(device: str, dtype: torch.dtype, heads: int, lens: list[int], q_per_seq: int,
                                 latent: int = 32, rope: int = 16, page_size: int | None = None) -> None:
    """Default launch parameters: the whole batch against the reference, then each part of it
    (whole sequences, the second with an offset ``kv_indptr``), told the whole batch's size in
    sequences, gets bitwise the whole's rows."""
    from moeserve.kernels.triton import mla

    q_latent, q_rope, cache, indptr, indices = _decode_inputs(device, dtype, heads, lens, latent, rope, page_size or 16,
                                                              torch.int64, q_per_seq, aim=1.0)
    whole = mla.mla_verify(q_latent, q_rope, cache, indptr, indices, 0.2, q_per_seq, page_size=page_size)
    ref = mla_verify_ref(q_latent.double(), q_rope.double(), cache.double(), indptr, indices, 0.2, q_per_seq)
    assert rel_error(whole, ref) < REL_TOL[dtype]
    half = len(lens) // 2
    for lo, hi in ((0, half), (half, len(lens))):
        rows = slice(lo * q_per_seq, hi * q_per_seq)
        part = mla.mla_verify(q_latent[rows], q_rope[rows], cache, indptr[lo:hi + 1], indices, 0.2, q_per_seq,
                              page_size=page_size, launch_batch=len(lens))
        assert torch.equal(part, whole[rows])


def check_extend_attention(device: str, dtype: torch.dtype, heads: int, extend_lens: list[int],
                           prefix_lens: list[int], qk_dims: tuple[int, int] = (32, 16), v_dim: int = 32,
                           scale: float = 0.15, **config) -> None:
    """``q`` a view of a wider tensor, ``k`` contiguous, ``v`` a view of the kv projection, as in the layer."""
    from moeserve.kernels.triton import mla

    n_new, n_ctx = sum(extend_lens), sum(extend_lens) + sum(prefix_lens)
    qk_dim = sum(qk_dims)
    q = torch.randn(n_new, heads, qk_dim + 16, device=device).to(dtype)[..., :qk_dim]
    k = torch.randn(n_ctx, heads, qk_dim, device=device).to(dtype)
    v = torch.randn(n_ctx, heads, qk_dims[0] + v_dim, device=device).to(dtype)[..., qk_dims[0]:]
    poison_allocator(device)
    out = mla.extend_attention(q, k, v, extend_lens, prefix_lens, scale, config=config or None)
    assert out.shape == (n_new, heads, v_dim) and out.dtype == dtype
    ref = extend_attention_ref(q.double(), k.double(), v.double(), extend_lens, prefix_lens, scale)
    assert rel_error(out, ref) < REL_TOL[dtype]


# --- GPU ------------------------------------------------------------------------------------------

gpu = pytest.mark.gpu
bf16 = torch.bfloat16


def _random_lens(batch: int, longest: int, seed: int) -> list[int]:
    """Random lengths with a length-1 sequence and a long one among them."""
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, longest, (batch,), generator=gen).tolist()
    lens[0], lens[-1] = 1, longest
    return lens


@gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("config", [{}, {"num_kv_splits": 1}, {"num_kv_splits": 7}, {"num_kv_splits": 64},
                                    {"LAZY_RESCALE": True, "num_kv_splits": 3}, {"BLOCK_H": 16, "BLOCK_N": 16}])
def test_mla_decode_gpu(heads: int, config: dict) -> None:
    torch.manual_seed(heads)
    lens = _random_lens(16, 3000, heads)
    check_mla_decode("cuda", bf16, heads, lens, latent=512, rope=64, page_size=64, scale=0.07, **config)


@gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("config", [{}, {"PAGED": True}, {"num_kv_splits": 1}, {"num_kv_splits": 5},
                                    {"PAGED": True, "HOPPER_WS": False},
                                    {"LAZY_RESCALE": True, "PAGED": True, "HOPPER_WS": False},
                                    {"BLOCK_N": 16, "num_kv_splits": 3, "PAGED": True}])
@pytest.mark.parametrize("page_size", [16, 64])
def test_mla_decode_paged_gpu(heads: int, config: dict, page_size: int) -> None:
    """Whole blocks through the copy engine (where the page size is a multiple of BLOCK_N), with
    lengths that end mid-page and NaN in the rest of the page."""
    torch.manual_seed(heads + page_size)
    lens = _random_lens(16, 3000, heads)
    lens[1] = page_size + 3
    check_mla_decode("cuda", bf16, heads, lens, latent=512, rope=64, page_size=page_size, scale=0.07, paged=True,
                     **config)


@gpu
@pytest.mark.parametrize("splits", [1, 2, 3, 40])
@pytest.mark.parametrize("heads", [128, 16])
def test_mla_decode_hopper_kernel_edges(splits: int, heads: int) -> None:
    """The warp-specialised Gluon kernel (64-head blocks, 64-slot pages): empty sequences and
    splits, lengths around block edges, NaN past each sequence's end, padded head blocks."""
    from moeserve.kernels.triton import mla_hopper

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for Hopper")
    torch.manual_seed(splits + heads)
    cache = torch.empty(64, 576, device="cuda", dtype=bf16)
    q = torch.empty(1, heads, 512, device="cuda", dtype=bf16)
    assert mla_hopper.decode_supported(q, cache, 64, 64, 64)
    config = {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "PAGED": True, "HOPPER_WS": True, "num_kv_splits": splits}
    check_mla_decode("cuda", bf16, heads, [0, 1, 2, 0, 63, 64, 65, 128, 129, 700], latent=512, rope=64, page_size=64,
                     scale=0.07, paged=True, **config)
    check_mla_decode("cuda", bf16, heads, [4000, 3, 2500], latent=512, rope=64, page_size=128, scale=0.5, paged=True,
                     index_dtype=torch.int32, **config)


@gpu
@pytest.mark.parametrize("config", [{}, {"num_kv_splits": 40}, {"LAZY_RESCALE": True}])
def test_mla_decode_gpu_edges(config: dict) -> None:
    """Empty sequences, more splits than tokens, int32 indices, peaked scores (large max jumps)."""
    torch.manual_seed(3)
    check_mla_decode("cuda", bf16, 128, [0, 1, 2, 0, 65, 7], latent=512, rope=64, page_size=16, scale=0.07,
                     index_dtype=torch.int32, **config)
    check_mla_decode("cuda", bf16, 16, [0, 0], latent=512, rope=64, **config)
    check_mla_decode("cuda", bf16, 8, [300, 1, 77], latent=512, rope=64, page_size=64, scale=0.5, **config)


@gpu
@pytest.mark.parametrize("dtype", [bf16, torch.float32])
def test_small_model_dims_gpu(dtype: torch.dtype) -> None:
    """The test models' dims (latent 32 + rope 16, qk 16 + 16, v 16, 4 heads) and padded odd ones."""
    torch.manual_seed(2)
    check_mla_decode("cuda", dtype, 4, [1, 30, 0, 200], latent=32, rope=16)
    check_mla_decode("cuda", dtype, 2, [7, 100], latent=8, rope=2)
    check_extend_attention("cuda", dtype, 4, [9, 1, 40], [0, 5, 70], qk_dims=(16, 16), v_dim=16)
    check_extend_attention("cuda", dtype, 2, [9, 1, 40], [0, 5, 70], qk_dims=(4, 2), v_dim=4)


@gpu
@pytest.mark.parametrize(("heads", "page_size"), [(128, None), (128, 64), (16, 64)])
def test_mla_decode_dispatch_and_cuda_graph(heads: int, page_size: int | None) -> None:
    """The public function routes CUDA tensors to Triton (to the Gluon kernel when told of
    64-slot pages on Hopper), and a captured call replays correctly on new lengths and slots
    (no host sync inside)."""
    from moeserve.kernels.mla import mla_decode

    torch.manual_seed(5)
    batch, latent, rope, max_tokens = 4, 512, 64, 1024
    cache = torch.randn(4 * max_tokens, latent + rope, device="cuda", dtype=bf16)
    q_latent = torch.randn(batch, heads, latent, device="cuda", dtype=bf16)
    q_rope = torch.randn(batch, heads, rope, device="cuda", dtype=bf16)
    indptr = torch.zeros(batch + 1, dtype=torch.int64, device="cuda")
    indices = torch.zeros(batch * max_tokens, dtype=torch.int64, device="cuda")

    def load(lens: list[int]) -> None:
        ptr, idx, _ = _scattered_slots(lens, page_size or 16)
        indptr.copy_(ptr)
        indices[:idx.numel()].copy_(idx)

    load([5, 1, 300, 1000])
    mla_decode(q_latent, q_rope, cache, indptr, indices, 0.07, page_size=page_size)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mla_decode(q_latent, q_rope, cache, indptr, indices, 0.07, page_size=page_size)
    for lens in ([17, 900, 3, 64], [1000, 1, 1, 2]):
        load(lens)
        graph.replay()
        ref = mla_decode_ref(q_latent.double(), q_rope.double(), cache.double(), indptr, indices, 0.07)
        assert rel_error(out, ref) < REL_TOL[bf16]


@gpu
@pytest.mark.parametrize(("heads", "page_size"), [(128, None), (128, 64), (16, 64)])
def test_mla_decode_part_of_a_batch_sized_as_the_whole(heads: int, page_size: int | None) -> None:
    """Told the whole batch's size, each half of a batch (the second with an offset ``kv_indptr``, as
    a two-batch-overlap micro-batch reads the whole batch's slots) gets bitwise the whole's rows."""
    from moeserve.kernels.mla import mla_decode

    torch.manual_seed(6)
    batch, latent, rope = 6, 512, 64
    lens = [1, 700, 33, 4000, 129, 2048]
    indptr, indices, num_slots = _scattered_slots(lens, page_size or 16)
    indptr, indices = indptr.cuda(), indices.cuda()
    cache = torch.randn(num_slots, latent + rope, device="cuda", dtype=bf16)
    q_latent = torch.randn(batch, heads, latent, device="cuda", dtype=bf16)
    q_rope = torch.randn(batch, heads, rope, device="cuda", dtype=bf16)
    whole = mla_decode(q_latent, q_rope, cache, indptr, indices, 0.07, page_size=page_size)
    for lo, hi in ((0, 3), (3, 6)):
        part = mla_decode(q_latent[lo:hi], q_rope[lo:hi], cache, indptr[lo:hi + 1], indices, 0.07,
                          page_size=page_size, launch_batch=batch)
        assert torch.equal(part, whole[lo:hi])


def _verify_lens(batch: int, longest: int, q_per_seq: int, seed: int) -> list[int]:
    """``_random_lens`` for ``q_per_seq`` queries a sequence: none shorter, two of just that length."""
    lens = [max(n, q_per_seq) for n in _random_lens(batch, longest, seed)]
    lens[0] = lens[batch // 2] = q_per_seq
    return lens


@gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("q_per_seq", [2, 3])
@pytest.mark.parametrize("config", [{}, {"num_kv_splits": 1}, {"num_kv_splits": 7},
                                    {"LAZY_RESCALE": True, "num_kv_splits": 3}, {"BLOCK_H": 16, "BLOCK_N": 16}])
def test_mla_verify_gpu(heads: int, q_per_seq: int, config: dict) -> None:
    torch.manual_seed(heads + q_per_seq)
    lens = _verify_lens(16, 3000, q_per_seq, heads)
    check_mla_verify("cuda", bf16, heads, lens, q_per_seq, latent=512, rope=64, page_size=64, scale=0.07, **config)
    check_mla_verify("cuda", bf16, heads, lens, q_per_seq, latent=512, rope=64, page_size=64, scale=0.07, aim=0.0,
                     **config)


@gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("q_per_seq", [2, 3])
@pytest.mark.parametrize("config", [{}, {"PAGED": True}, {"PAGED": True, "num_kv_splits": 1},
                                    {"BLOCK_N": 16, "num_kv_splits": 3, "PAGED": True},
                                    {"BLOCK_H": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2, "PAGED": True,
                                     "HOPPER_WS": True}])
@pytest.mark.parametrize("page_size", [16, 64])
def test_mla_verify_paged_gpu(heads: int, q_per_seq: int, config: dict, page_size: int) -> None:
    """Whole page blocks through the copy engine, with queries ending mid-page and NaN in the rest
    of the page; Hopper's tiles asked for explicitly still take the Triton kernels (the Gluon
    kernel has one query a sequence)."""
    torch.manual_seed(heads + q_per_seq + page_size)
    lens = _verify_lens(16, 3000, q_per_seq, heads)
    lens[1] = page_size + 3
    check_mla_verify("cuda", bf16, heads, lens, q_per_seq, latent=512, rope=64, page_size=page_size, scale=0.07,
                     paged=True, **config)


@gpu
def test_mla_verify_is_not_for_the_hopper_kernel() -> None:
    from moeserve.kernels.triton import mla_hopper

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for Hopper")
    q, cache = torch.empty(1, 128, 512, device="cuda", dtype=bf16), torch.empty(64, 576, device="cuda", dtype=bf16)
    assert mla_hopper.decode_supported(q, cache, 64) and mla_hopper.decode_supported(q, cache, 64, q_per_seq=1)
    assert not mla_hopper.decode_supported(q, cache, 64, q_per_seq=2)


@gpu
@pytest.mark.parametrize(("heads", "page_size"), [(128, None), (128, 64), (16, 64), (16, None)])
def test_mla_verify_one_query_is_decode_gpu(heads: int, page_size: int | None) -> None:
    """Through the public functions, the Gluon kernel included where it applies."""
    from moeserve.kernels.mla import mla_decode, mla_verify

    torch.manual_seed(7)
    lens = _random_lens(12, 3000, heads)
    q_latent, q_rope, cache, indptr, indices = _decode_inputs("cuda", bf16, heads, lens, 512, 64, page_size or 16,
                                                              torch.int64)
    args = (q_latent, q_rope, cache, indptr, indices, 0.07)
    assert torch.equal(mla_verify(*args, 1, page_size=page_size), mla_decode(*args, page_size=page_size))
    part = (q_latent[4:], q_rope[4:], cache, indptr[4:], indices, 0.07)
    assert torch.equal(mla_verify(*part, 1, page_size=page_size, launch_batch=12),
                       mla_decode(*part, page_size=page_size, launch_batch=12))
    check_verify_one_query_is_decode("cuda", bf16, heads, lens, page_size, num_kv_splits=5)


@gpu
@pytest.mark.parametrize(("heads", "page_size"), [(128, None), (128, 64), (16, 64)])
@pytest.mark.parametrize("q_per_seq", [2, 3])
def test_mla_verify_part_of_a_batch_sized_as_the_whole(heads: int, page_size: int | None, q_per_seq: int) -> None:
    torch.manual_seed(8)
    check_verify_part_of_a_batch("cuda", bf16, heads, [q_per_seq, 700, 33, 4000, 129, 2048], q_per_seq, latent=512,
                                 rope=64, page_size=page_size)


@gpu
@pytest.mark.parametrize(("heads", "page_size"), [(128, 64), (16, None)])
def test_mla_verify_dispatch_and_cuda_graph(heads: int, page_size: int | None) -> None:
    """The public function routes CUDA tensors to Triton, and a captured call replays correctly on
    new lengths and slots (no host sync inside)."""
    from moeserve.kernels.mla import mla_verify

    torch.manual_seed(9)
    batch, q_per_seq, latent, rope, max_tokens = 4, 3, 512, 64, 1024
    cache = torch.randn(4 * max_tokens, latent + rope, device="cuda", dtype=bf16)
    q_latent = torch.randn(batch * q_per_seq, heads, latent, device="cuda", dtype=bf16)
    q_rope = torch.randn(batch * q_per_seq, heads, rope, device="cuda", dtype=bf16)
    indptr = torch.zeros(batch + 1, dtype=torch.int64, device="cuda")
    indices = torch.zeros(batch * max_tokens, dtype=torch.int64, device="cuda")

    def load(lens: list[int]) -> None:
        ptr, idx, _ = _scattered_slots(lens, page_size or 16)
        indptr.copy_(ptr)
        indices[:idx.numel()].copy_(idx)

    def run() -> torch.Tensor:
        return mla_verify(q_latent, q_rope, cache, indptr, indices, 0.07, q_per_seq, page_size=page_size)

    load([5, 3, 300, 1000])
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for lens in ([17, 900, 3, 64], [1000, 3, 4, 5]):
        load(lens)
        graph.replay()
        ref = mla_verify_ref(q_latent.double(), q_rope.double(), cache.double(), indptr, indices, 0.07, q_per_seq)
        assert rel_error(out, ref) < REL_TOL[bf16]


@gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("config", [{}, {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
                                    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 1}])
def test_extend_attention_gpu(heads: int, config: dict) -> None:
    torch.manual_seed(heads)
    extend = _random_lens(12, 700, heads) + [1, 256, 129, 0]
    prefix = torch.randint(0, 1500, (len(extend),)).tolist()
    prefix[:3] = [0, 0, 2000]
    check_extend_attention("cuda", bf16, heads, extend, prefix, qk_dims=(128, 64), v_dim=128, scale=0.07, **config)


@gpu
def test_extend_attention_dispatch() -> None:
    from moeserve.kernels.mla import extend_attention

    torch.manual_seed(0)
    q = torch.randn(40, 16, 192, device="cuda", dtype=bf16)
    k = torch.randn(50, 16, 192, device="cuda", dtype=bf16)
    v = torch.randn(50, 16, 128, device="cuda", dtype=bf16)
    out = extend_attention(q, k, v, [30, 10], [0, 10], 0.07)
    ref = extend_attention_ref(q.double(), k.double(), v.double(), [30, 10], [0, 10], 0.07)
    assert rel_error(out, ref) < REL_TOL[bf16]


# --- input validation (CPU, no launch) ------------------------------------------------------------

def test_wrappers_reject_bad_inputs() -> None:
    pytest.importorskip("triton")
    from moeserve.kernels.triton import mla

    q_lat, q_rope, cache = torch.randn(2, 16, 32), torch.randn(2, 16, 16), torch.randn(64, 48)
    indptr, indices = torch.tensor([0, 3, 5]), torch.arange(5)
    with pytest.raises(ValueError, match="kv_cache"):
        mla.mla_decode(q_lat, q_rope, torch.randn(64, 40), indptr, indices, 1.0)
    with pytest.raises(ValueError, match="scale"):
        mla.mla_decode(q_lat, q_rope, cache, indptr, indices, -1.0)
    with pytest.raises(ValueError, match="share"):
        mla.mla_decode(q_lat.half(), q_rope, cache, indptr, indices, 1.0)
    with pytest.raises(ValueError, match="last dim"):
        mla.mla_decode(q_lat.transpose(1, 2).contiguous().transpose(1, 2), q_rope, cache, indptr, indices, 1.0)
    with pytest.raises(ValueError, match="kv_indptr"):
        mla.mla_decode(q_lat, q_rope, cache, indptr[:2], indices, 1.0)
    with pytest.raises(ValueError, match="config"):
        mla.mla_decode(q_lat, q_rope, cache, indptr, indices, 1.0, config={"BLOCK_K": 16})
    with pytest.raises(ValueError, match="q_per_seq"):
        mla.mla_verify(q_lat[:1].expand(3, -1, -1), q_rope[:1].expand(3, -1, -1), cache, indptr, indices, 1.0, 2)
    with pytest.raises(ValueError, match="q_per_seq"):
        mla.mla_verify(q_lat, q_rope, cache, indptr, indices, 1.0, 0)
    with pytest.raises(ValueError, match="kv_indptr"):
        mla.mla_verify(q_lat, q_rope, cache, indptr, indices, 1.0, 2)  # 2 rows: one sequence, not two

    q, k, v = torch.randn(6, 2, 48), torch.randn(10, 2, 48), torch.randn(10, 2, 32)
    with pytest.raises(ValueError, match="lengths sum"):
        mla.extend_attention(q, k, v, [3, 3], [2, 1], 1.0)
    with pytest.raises(ValueError, match="shapes disagree"):
        mla.extend_attention(q, k, torch.randn(9, 2, 32), [3, 3], [2, 2], 1.0)
    with pytest.raises(ValueError, match="share"):
        mla.extend_attention(q, k.half(), v, [3, 3], [2, 2], 1.0)
    with pytest.raises(ValueError, match="one extend and prefix length"):
        mla.extend_attention(q, k, v, [3, 3], [4], 1.0)


def test_split_head_dim() -> None:
    pytest.importorskip("triton")
    from moeserve.kernels.triton.mla import split_head_dim

    assert split_head_dim(192) == (128, 64)
    assert split_head_dim(576) == (512, 64)
    assert split_head_dim(128) == (64, 64)
    assert split_head_dim(48) == (32, 16)
    assert split_head_dim(224) == (128, 128)  # 128 + 96, padded
    assert split_head_dim(40) == (32, 16)
    assert split_head_dim(6) == (16, 16)


# --- the interpreter run (CPU) --------------------------------------------------------------------

f16, f32 = torch.float16, torch.float32
TINY = {"BLOCK_H": 16, "BLOCK_N": 16}
INTERPRETED_CHECKS = {
    "decode_one_split": lambda: check_mla_decode("cpu", f16, 16, [1, 37, 0, 20], num_kv_splits=1, **TINY),
    "decode_three_splits": lambda: check_mla_decode("cpu", f16, 16, [1, 37, 0, 20], num_kv_splits=3, **TINY),
    "decode_more_splits_than_tokens": lambda: check_mla_decode("cpu", f16, 16, [1, 37, 0, 20], num_kv_splits=40,
                                                               **TINY),
    "decode_padded_heads_fp32": lambda: check_mla_decode("cpu", f32, 8, [5, 16, 33], index_dtype=torch.int32,
                                                         num_kv_splits=2, **TINY),
    "decode_peaked_scores": lambda: check_mla_decode("cpu", f32, 16, [70, 3], scale=1.5, num_kv_splits=2, **TINY),
    "decode_lazy_rescale": lambda: check_mla_decode("cpu", f32, 16, [70, 3, 0], scale=1.5, num_kv_splits=2,
                                                    LAZY_RESCALE=True, **TINY),
    "decode_lazy_rescale_one_split": lambda: check_mla_decode("cpu", f16, 16, [50, 1], scale=0.6, num_kv_splits=1,
                                                              LAZY_RESCALE=True, **TINY),
    "decode_default_config": lambda: check_mla_decode("cpu", f16, 16, [9, 40]),
    "decode_paged": lambda: check_mla_decode("cpu", f16, 16, [1, 37, 0, 20], page_size=16, paged=True,
                                             num_kv_splits=3, PAGED=True, **TINY),
    "decode_paged_lazy_fp32": lambda: check_mla_decode("cpu", f32, 8, [70, 3, 0, 32], page_size=32, paged=True,
                                                       scale=1.5, num_kv_splits=2, LAZY_RESCALE=True, PAGED=True,
                                                       **TINY),
    "decode_paged_one_split": lambda: check_mla_decode("cpu", f16, 3, [17, 2, 48], page_size=16, paged=True,
                                                       index_dtype=torch.int32, num_kv_splits=1, PAGED=True, **TINY),
    "decode_paged_small_pages_gather": lambda: check_mla_decode("cpu", f16, 16, [9, 40], page_size=4, paged=True,
                                                                PAGED=True, **TINY),
    "decode_padded_dims": lambda: check_mla_decode("cpu", f32, 2, [9, 40, 0], latent=24, rope=8, num_kv_splits=3,
                                                   **TINY),
    "decode_padded_dims_one_split": lambda: check_mla_decode("cpu", f16, 3, [17, 2], latent=8, rope=2,
                                                             num_kv_splits=1, **TINY),
    "verify_q2_three_splits": lambda: check_mla_verify("cpu", f16, 16, [2, 37, 5, 20], 2, num_kv_splits=3, **TINY),
    "verify_q2_random_queries": lambda: check_mla_verify("cpu", f32, 16, [2, 37, 5, 20], 2, aim=0.0,
                                                         num_kv_splits=3, **TINY),
    "verify_q4_one_split_fp32": lambda: check_mla_verify("cpu", f32, 8, [4, 19, 33], 4, index_dtype=torch.int32,
                                                         num_kv_splits=1, **TINY),
    "verify_q3_more_splits_than_tokens": lambda: check_mla_verify("cpu", f16, 16, [3, 20], 3, num_kv_splits=24,
                                                                  **TINY),
    "verify_q3_lazy_rescale": lambda: check_mla_verify("cpu", f32, 16, [70, 3, 9], 3, scale=1.5, num_kv_splits=2,
                                                       LAZY_RESCALE=True, **TINY),
    "verify_q2_padded_dims": lambda: check_mla_verify("cpu", f32, 2, [9, 40, 2], 2, latent=24, rope=8,
                                                      num_kv_splits=3, **TINY),
    "verify_paged_q2": lambda: check_mla_verify("cpu", f16, 16, [2, 37, 5, 20], 2, page_size=16, paged=True,
                                                num_kv_splits=3, PAGED=True, **TINY),
    "verify_paged_q3_lazy_fp32": lambda: check_mla_verify("cpu", f32, 8, [70, 3, 32], 3, page_size=32, paged=True,
                                                          scale=1.5, num_kv_splits=2, LAZY_RESCALE=True, PAGED=True,
                                                          **TINY),
    "verify_paged_q4_one_split": lambda: check_mla_verify("cpu", f16, 3, [17, 4, 48], 4, page_size=16, paged=True,
                                                          index_dtype=torch.int32, num_kv_splits=1, PAGED=True,
                                                          **TINY),
    "verify_one_query_is_decode": lambda: check_verify_one_query_is_decode("cpu", f16, 16, [1, 37, 0, 20],
                                                                           num_kv_splits=3, **TINY),
    "verify_one_query_is_decode_paged": lambda: check_verify_one_query_is_decode("cpu", f16, 16, [1, 37, 0, 20],
                                                                                 page_size=16, num_kv_splits=3,
                                                                                 PAGED=True, **TINY),
    # 18 rows of one head block: 15 splits on the interpreter's 132 "SMs", 29 if a part sized itself, 32 (capped)
    # if launch_batch were taken as rows; the long contexts' chunks differ with the split count
    "verify_part_of_a_batch": lambda: check_verify_part_of_a_batch("cpu", f16, 4, [3, 1000, 5, 3, 9, 600], 3),
    "extend": lambda: check_extend_attention("cpu", f16, 2, [5, 17, 1, 0, 20], [0, 9, 30, 4, 0],
                                             BLOCK_M=16, BLOCK_N=16),
    "extend_block_m_32": lambda: check_extend_attention("cpu", f16, 2, [5, 17, 1, 0, 20], [0, 9, 30, 4, 0],
                                                        BLOCK_M=32, BLOCK_N=16),
    "extend_block_n_32": lambda: check_extend_attention("cpu", f32, 1, [33, 2], [15, 0], BLOCK_M=16, BLOCK_N=32),
    "extend_pow2_qk_dim": lambda: check_extend_attention("cpu", f32, 3, [18, 6], [0, 0], qk_dims=(16, 16),
                                                         v_dim=16, BLOCK_M=16, BLOCK_N=16),
    "extend_padded_dims": lambda: check_extend_attention("cpu", f32, 2, [7, 20], [12, 3], qk_dims=(16, 4), v_dim=12,
                                                         BLOCK_M=16, BLOCK_N=16),
    "extend_tiny_dims": lambda: check_extend_attention("cpu", f16, 2, [5, 9], [0, 4], qk_dims=(4, 2), v_dim=4,
                                                       BLOCK_M=16, BLOCK_N=16),
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


@pytest.mark.gpu
@pytest.mark.parametrize("cudnn", [True, False])
def test_equal_prompts_without_prefix_take_flash_attention(cudnn: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through cuDNN with v as it is, and through the fallback (flash attention, v padded)."""
    from moeserve.kernels import mla
    from moeserve.kernels.mla import _flash_fits, extend_attention, extend_attention_ref

    monkeypatch.setattr(mla, "_cudnn_attention_ok", cudnn)

    gen = torch.Generator(device="cuda").manual_seed(5)
    n_seqs, n, heads = 3, 97, 16
    q = torch.randn(n_seqs * n, heads, 192, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(n_seqs * n, heads, 192, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(n_seqs * n, heads, 256, device="cuda", dtype=torch.bfloat16, generator=gen)[..., 128:]
    assert _flash_fits(q, k, [n] * n_seqs, [0] * n_seqs)
    out = extend_attention(q, k, v, [n] * n_seqs, [0] * n_seqs, 0.1)
    ref = extend_attention_ref(q.float(), k.float(), v.float(), [n] * n_seqs, [0] * n_seqs, 0.1)
    assert ((out.float() - ref).norm() / ref.norm()) < 1e-2


def test_hopper_kernel_compiles_for_sm90() -> None:
    """The Gluon decode kernel builds for Hopper without a GPU (Triton's bundled ptxas), with
    shared memory within the H100/H200 limit and no register spills."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from moeserve.kernels.triton import mla_hopper

    def desc(block: list[int]) -> str:
        return f"tensordesc<bf16[{block[0]}, {block[1]}],{gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)!r}>"

    fn = mla_hopper._mla_decode_wide_kernel
    signature = {"q_latent": "*bf16", "q_rope": "*bf16", "desc_latent": desc([64, 256]), "desc_rope": desc([64, 64]),
                 "kv_indptr": "*i64", "kv_indices": "*i64", "out": "*fp32", "lse": "*fp32", "num_heads": "i32",
                 "num_splits": "i32", "qk_scale": "fp32", "SINGLE_SPLIT": "constexpr"}
    signature.update({name: "i64" for name in fn.arg_names if name.startswith("stride")})
    aligned = {(fn.arg_names.index(n),): [["tt.divisibility", 16]]
               for n in ("q_latent", "q_rope", "kv_indptr", "kv_indices", "out", "lse")}
    src = GluonASTSource(fn=fn, signature=signature, constexprs={"SINGLE_SPLIT": False}, attrs=aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert kernel.metadata.shared <= 232448  # 227 KB: the most one block may have on Hopper
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "k.ptx"
        ptx.write_text(kernel.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(ptx) + ".cubin"],
                             capture_output=True, text=True, check=True).stderr
    assert "0 bytes spill stores" in log, log
    assert kernel.asm["ptx"].count("wgmma.mma_async") > 0 and "cp.async.bulk.tensor" in kernel.asm["ptx"]
