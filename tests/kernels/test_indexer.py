"""The indexer's top-k selection and sparse MLA against plain dense computations, and their Triton
versions against them."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels import indexer
from moeserve.kernels.indexer import select_topk
from moeserve.kernels.mla import sparse_mla
from tests.kernels.accuracy import REL_TOL, rel_error
from tests.kernels.interpreter import interpreted, run_checks

INTERPRETED = "tests.kernels.test_indexer:run_interpreted_checks"  # prefetched (tests/kernels/interpreter.py)


def _case(seed: int, seq_lens: list[int], extend_lens: list[int], heads: int = 16, dim: int = 24):
    """A paged context per sequence (slots shuffled), index keys, and queries for each new token."""
    gen = torch.Generator().manual_seed(seed)
    n_slots = sum(seq_lens) + 7
    slots = torch.randperm(n_slots, generator=gen)
    indptr = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    kv_indices = slots[:sum(seq_lens)]
    keys = torch.randn(n_slots, dim, generator=gen)
    rows = sum(extend_lens)
    q = torch.randn(rows, heads, dim, generator=gen)
    weights = torch.randn(rows, heads, generator=gen)
    seq_of_row, pos_of_row = [], []
    for seq, (n, e) in enumerate(zip(seq_lens, extend_lens)):
        seq_of_row += [seq] * e
        pos_of_row += range(n - e, n)
    return q, weights, keys, indptr, kv_indices, torch.tensor(seq_of_row), torch.tensor(pos_of_row)


def _dense_topk(q, weights, keys, indptr, kv_indices, seq_of_row, pos_of_row, topk) -> list[set[int]]:
    """Every row scored against its whole causal context at once, written out plainly."""
    out = []
    for row, (seq, pos) in enumerate(zip(seq_of_row.tolist(), pos_of_row.tolist())):
        context = kv_indices[indptr[seq]:indptr[seq] + pos + 1]
        score = torch.zeros(len(context))
        for h in range(q.shape[1]):
            score += weights[row, h] * torch.relu(keys[context] @ q[row, h])
        out.append(set(context[score.topk(min(topk, len(context))).indices].tolist()))
    return out


@pytest.mark.parametrize("chunk", [indexer.SCORE_CHUNK, 1])
def test_selection_is_the_top_k_of_each_rows_causal_context(monkeypatch, chunk):
    """Prefill rows of several lengths (shorter and longer than top-k) and decode rows; scored a row
    at a time (``chunk`` 1) or all at once, the same slots."""
    monkeypatch.setattr(indexer, "SCORE_CHUNK", chunk)
    seq_lens, extend_lens, topk = [40, 9, 25, 31], [40, 9, 1, 6], 11
    case = _case(0, seq_lens, extend_lens)
    got = select_topk(*case, topk, max(seq_lens))
    want = _dense_topk(*case, topk)
    assert got.shape == (sum(extend_lens), topk)
    for row, slots in enumerate(got.tolist()):
        kept = [s for s in slots if s >= 0]
        assert len(kept) == len(set(kept)) == min(topk, int(case[-1][row]) + 1)
        assert slots[len(kept):] == [-1] * (topk - len(kept)), "the kept slots come first"
        assert set(kept) == want[row], row


def test_sparse_mla_is_attention_over_exactly_the_selected_slots():
    gen = torch.Generator().manual_seed(1)
    rows, heads, latent, rope, slots = 5, 3, 32, 16, 50
    q_latent, q_rope = torch.randn(rows, heads, latent, generator=gen), torch.randn(rows, heads, rope, generator=gen)
    cache = torch.randn(slots, latent + rope + 24, generator=gen)[:, :latent + rope]  # a strided view, as V3.2's
    selected = torch.full((rows, 8), -1, dtype=torch.int64)
    picks = [torch.randperm(slots, generator=gen)[:k] for k in (8, 3, 1, 8, 5)]
    for row, p in enumerate(picks):
        selected[row, :len(p)] = p
    got = sparse_mla(q_latent, q_rope, cache, selected, 0.3)
    for row, p in enumerate(picks):  # scores over every slot, all but the selected masked out
        scores = (q_latent[row] @ cache[:, :latent].t() + q_rope[row] @ cache[:, latent:].t()) * 0.3  # [H, slots]
        mask = torch.full((slots,), float("-inf"))
        mask[p] = 0
        want = (scores + mask).softmax(-1) @ cache[:, :latent]
        torch.testing.assert_close(got[row], want)


# ---------------------------------------------------------------------------------------------
# the Triton kernels, against the torch versions: through Triton's interpreter on the CPU (fp32 and
# fp16 at tiny shapes), and in bf16 at DeepSeek-V3.2's shapes on the GPU


def _scores_ref(case, rows: list[int]) -> torch.Tensor:
    """fp64 index scores ``[len(rows), width]`` of the chosen rows, -inf past each row's position."""
    q, weights, keys, indptr, kv_indices, seq_of_row, pos_of_row = case
    width = int((indptr[1:] - indptr[:-1]).max())
    out = torch.full((len(rows), width), float("-inf"), dtype=torch.float64)
    for i, row in enumerate(rows):
        seq, pos = int(seq_of_row[row]), int(pos_of_row[row])
        context = kv_indices[int(indptr[seq]):int(indptr[seq]) + pos + 1].to(keys.device)
        dots = torch.einsum("hd,sd->hs", q[row].double(), keys[context].double()).relu()
        out[i, :pos + 1] = (weights[row].double() @ dots).cpu()
    return out


def check_select_topk(device: str, dtype: torch.dtype, heads: int, dim: int, seq_lens: list[int],
                      extend_lens: list[int], topk: int, budget: int | None = None, seed: int = 0) -> None:
    """The Triton scores match fp64 ones, and the selection keeps, for every row, the ``topk`` best
    of its causal context (up to ties within rounding), kept slots first, ``-1`` after; the index
    keys are the tail of a wider cache row, as in the pool. ``budget`` shrinks the scores held at
    once, so rows go through in groups."""
    from moeserve.kernels.triton import indexer as triton_indexer

    q, weights, keys, indptr, kv_indices, seq_of_row, pos_of_row = _case(seed, seq_lens, extend_lens, heads, dim)
    rows = q.shape[0]
    wide = torch.randn(keys.shape[0], dim + 40)
    wide[:, 40:] = keys
    keys = wide.to(device, dtype)[:, 40:]  # a strided view: the tail of each cache row
    q, weights = q.to(device, dtype), (weights / heads).to(device)
    seq_of_row, pos_of_row = seq_of_row.to(device), pos_of_row.to(device)
    indptr, kv_indices = indptr.to(device), kv_indices.to(device)
    case = (q, weights, keys, indptr, kv_indices, seq_of_row, pos_of_row)
    width = max(seq_lens)
    want = _scores_ref(case, list(range(rows)))
    got = triton_indexer.index_scores(*case, width).double().cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(want)), "scores past a row's position must be -inf"
    finite = torch.isfinite(want)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert (got[finite] - want[finite]).abs().max() <= tol * want[finite].abs().max()
    if budget is not None:
        old, triton_indexer.SCORE_BUDGET = triton_indexer.SCORE_BUDGET, budget
    try:
        selected = triton_indexer.select_topk(*case, topk, width).cpu()
    finally:
        if budget is not None:
            triton_indexer.SCORE_BUDGET = old
    assert selected.shape == (rows, topk)
    position_of = {int(s): i for i, s in enumerate(kv_indices.tolist())}
    for row in range(rows):
        seq, pos = int(seq_of_row[row]), int(pos_of_row[row])
        kept = [s for s in selected[row].tolist() if s >= 0]
        assert len(kept) == len(set(kept)) == min(topk, pos + 1), row
        assert selected[row, len(kept):].eq(-1).all(), "the kept slots come first"
        at = [position_of[s] - int(indptr[seq]) for s in kept]
        assert all(0 <= p <= pos for p in at), "a slot outside the row's causal context"
        scores = want[row, :pos + 1]
        if pos + 1 > topk:  # the kept ones are the best up to rounding
            threshold = scores.topk(topk).values[-1]
            assert scores[at].min() >= threshold - 2 * tol * scores.abs().max(), row


def check_sparse_mla(device: str, dtype: torch.dtype, heads: int, counts: list[int], topk: int,
                     latent: int = 32, rope: int = 16, launch_rows: int | None = None) -> None:
    """Triton sparse MLA equals the torch version (computed in fp64) for rows keeping ``counts``
    slots each, over a cache whose rows carry an index key after the latent (a strided view), with
    NaN in every slot no row keeps."""
    from moeserve.kernels.triton import mla as triton_mla

    gen = torch.Generator().manual_seed(len(counts))
    slots = max(counts) * 3 + 5
    cache = torch.randn(slots, latent + rope + 24, generator=gen)
    selected = torch.full((len(counts), topk), -1, dtype=torch.int64)
    for row, n in enumerate(counts):
        selected[row, :n] = torch.randperm(slots, generator=gen)[:n]
    cache[~torch.isin(torch.arange(slots), selected)] = float("nan")
    q_latent = torch.randn(len(counts), heads, latent, generator=gen)
    q_rope = torch.randn(len(counts), heads, rope, generator=gen)
    want = sparse_mla(q_latent.double(), q_rope.double(), cache.double()[:, :latent + rope], selected, 0.25)
    to = lambda t: t.to(device, dtype)
    got = triton_mla.sparse_mla(to(q_latent), to(q_rope), to(cache)[:, :latent + rope], selected.to(device), 0.25,
                                launch_rows=launch_rows)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert rel_error(got.double().cpu(), want) < REL_TOL[dtype]


f16, f32 = torch.float16, torch.float32
INTERPRETED_CHECKS = {
    "scores_and_selection_fp32": lambda: check_select_topk("cpu", f32, 16, 32, [70, 9, 40, 33], [70, 9, 1, 5], 12),
    "selection_in_row_groups": lambda: check_select_topk("cpu", f32, 16, 32, [70, 40], [30, 4], 12, budget=100),
    "odd_heads_and_dims_fp16": lambda: check_select_topk("cpu", f16, 5, 24, [300, 20], [3, 20], 17, seed=1),
    "sparse_mla_fp32": lambda: check_sparse_mla("cpu", f32, 4, [8, 3, 1, 8, 5], 8),
    "sparse_mla_fp16_sized_as_more_rows": lambda: check_sparse_mla("cpu", f16, 3, [40, 17, 2], 40, launch_rows=64),
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
@pytest.mark.parametrize("seq_lens, extend_lens", [([5000, 2100, 300], [1, 1, 1]),  # decode
                                                   ([9000, 3000], [600, 3000]),  # prefill, with a prefix
                                                   ([4100] * 3, [2, 2, 2])])  # verify
def test_selection_at_v32_shapes_gpu(seq_lens: list[int], extend_lens: list[int]) -> None:
    check_select_topk("cuda", torch.bfloat16, 64, 128, seq_lens, extend_lens, 2048)


@pytest.mark.gpu
def test_selection_in_row_groups_gpu() -> None:
    check_select_topk("cuda", torch.bfloat16, 64, 128, [6000, 5000], [700, 1], 2048, budget=6000 * 33)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_sparse_mla_at_v3_dims_gpu(heads: int) -> None:
    check_sparse_mla("cuda", torch.bfloat16, heads, [2048, 2048, 700, 1, 2048], 2048, latent=512, rope=64)
