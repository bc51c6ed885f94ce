"""The indexer's top-k selection and sparse MLA against plain dense computations."""

from __future__ import annotations

import pytest
import torch

from moeserve.kernels import indexer
from moeserve.kernels.indexer import select_topk
from moeserve.kernels.mla import sparse_mla


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
    return q, weights, keys, indptr, kv_indices, seq_of_row, pos_of_row


def _dense_topk(q, weights, keys, indptr, kv_indices, seq_of_row, pos_of_row, topk) -> list[set[int]]:
    """Every row scored against its whole causal context at once, written out plainly."""
    out = []
    for row, (seq, pos) in enumerate(zip(seq_of_row, pos_of_row)):
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
    got = select_topk(*case, topk)
    want = _dense_topk(*case, topk)
    assert got.shape == (sum(extend_lens), topk)
    for row, slots in enumerate(got.tolist()):
        kept = [s for s in slots if s >= 0]
        assert len(kept) == len(set(kept)) == min(topk, case[-1][row] + 1)
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
