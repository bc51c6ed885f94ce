"""Torch references of MLA attention against independent formulations: SDPA for the expanded
form, and the absorbed decode and verification against expanded attention over the same latent
cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeserve.kernels.mla import (
    extend_attention,
    extend_attention_ref,
    mla_decode,
    mla_decode_ref,
    mla_verify,
    mla_verify_ref,
)

f64 = torch.float64


def test_extend_attention_ref_matches_sdpa() -> None:
    torch.manual_seed(0)
    heads, extend_lens, prefix_lens = 3, [4, 1, 7, 0], [0, 5, 3, 2]
    q = torch.randn(sum(extend_lens), heads, 24, dtype=f64)
    k = torch.randn(sum(extend_lens) + sum(prefix_lens), heads, 24, dtype=f64)
    v = torch.randn(k.shape[0], heads, 16, dtype=f64)
    out = extend_attention_ref(q, k, v, extend_lens, prefix_lens, 0.3)
    q_at = kv_at = 0
    for n_new, n_prefix in zip(extend_lens, prefix_lens):
        n_kv = n_prefix + n_new
        qs = q[q_at:q_at + n_new].transpose(0, 1)  # [H, t, D]
        ks, vs = k[kv_at:kv_at + n_kv].transpose(0, 1), v[kv_at:kv_at + n_kv].transpose(0, 1)
        visible = torch.ones(n_new, n_kv, dtype=torch.bool).tril(n_prefix)  # causal, aligned to the end
        expected = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(out[q_at:q_at + n_new], expected, rtol=1e-6, atol=1e-6)  # fp32 softmax
        q_at, kv_at = q_at + n_new, kv_at + n_kv
    torch.testing.assert_close(extend_attention(q, k, v, extend_lens, prefix_lens, 0.3), out)  # CPU: the reference


def test_mla_decode_ref_equals_expanded_attention() -> None:
    """Absorbing ``W_UK`` into the query and ``W_UV`` into the output changes nothing."""
    torch.manual_seed(1)
    heads, latent, rope, nope, v_dim, lens = 4, 32, 8, 16, 12, [6, 1, 9]
    w_uk, w_uv = torch.randn(heads, nope, latent, dtype=f64), torch.randn(heads, v_dim, latent, dtype=f64)
    cache = torch.randn(40, latent + rope, dtype=f64)
    slots = torch.randperm(40)[:sum(lens)]
    indptr = torch.tensor([0] + lens).cumsum(0)
    q_nope, q_rope = torch.randn(len(lens), heads, nope, dtype=f64), torch.randn(len(lens), heads, rope, dtype=f64)

    q_latent = torch.einsum("bhn,hnl->bhl", q_nope, w_uk)
    out_latent = mla_decode_ref(q_latent, q_rope, cache, indptr, slots, 0.2)
    absorbed = torch.einsum("bhl,hvl->bhv", out_latent, w_uv)
    torch.testing.assert_close(mla_decode(q_latent, q_rope, cache, indptr, slots, 0.2), out_latent)

    for b, n in enumerate(lens):
        rows = cache[slots[indptr[b]:indptr[b + 1]]]  # [n, L + R]
        k_nope = torch.einsum("sl,hnl->shn", rows[:, :latent], w_uk)
        k = torch.cat([k_nope, rows[:, None, latent:].expand(-1, heads, -1)], dim=-1)
        v = torch.einsum("sl,hvl->shv", rows[:, :latent], w_uv)
        q = torch.cat([q_nope[b], q_rope[b]], dim=-1)[None]  # the newest token: [1, H, nope + R]
        expanded = extend_attention_ref(q, k, v, [1], [n - 1], 0.2)[0]
        torch.testing.assert_close(absorbed[b], expanded, rtol=1e-6, atol=1e-6)


def test_mla_decode_ref_empty_sequence_gives_zeros() -> None:
    q_latent, q_rope = torch.randn(2, 4, 32), torch.randn(2, 4, 8)
    cache = torch.randn(10, 40)
    out = mla_decode_ref(q_latent, q_rope, cache, torch.tensor([0, 0, 3]), torch.tensor([4, 1, 7]), 0.2)
    assert (out[0] == 0).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("q_per_seq", [1, 2, 4])
def test_mla_verify_ref_equals_expanded_attention(q_per_seq: int) -> None:
    """The last Q tokens of each sequence as causal queries: absorbed over the latent cache, as
    expanded attention of Q new tokens over the rest of the context as prefix."""
    torch.manual_seed(2 + q_per_seq)
    heads, latent, rope, nope, v_dim = 4, 32, 8, 16, 12
    lens = torch.randint(q_per_seq, 3 * q_per_seq + 9, (5,)).tolist()
    lens[1] = lens[3] = q_per_seq  # nothing before the new tokens
    w_uk, w_uv = torch.randn(heads, nope, latent, dtype=f64), torch.randn(heads, v_dim, latent, dtype=f64)
    cache = torch.randn(sum(lens) + 7, latent + rope, dtype=f64)
    slots = torch.randperm(cache.shape[0])[:sum(lens)]
    indptr = torch.tensor([0] + lens).cumsum(0)
    rows = len(lens) * q_per_seq
    q_nope, q_rope = torch.randn(rows, heads, nope, dtype=f64), torch.randn(rows, heads, rope, dtype=f64)

    q_latent = torch.einsum("bhn,hnl->bhl", q_nope, w_uk)
    out_latent = mla_verify_ref(q_latent, q_rope, cache, indptr, slots, 0.2, q_per_seq)
    absorbed = torch.einsum("bhl,hvl->bhv", out_latent, w_uv)
    torch.testing.assert_close(mla_verify(q_latent, q_rope, cache, indptr, slots, 0.2, q_per_seq), out_latent)

    for b, n in enumerate(lens):
        kv_rows = cache[slots[indptr[b]:indptr[b + 1]]]  # [n, L + R]
        k_nope = torch.einsum("sl,hnl->shn", kv_rows[:, :latent], w_uk)
        k = torch.cat([k_nope, kv_rows[:, None, latent:].expand(-1, heads, -1)], dim=-1)
        v = torch.einsum("sl,hvl->shv", kv_rows[:, :latent], w_uv)
        queries = slice(b * q_per_seq, (b + 1) * q_per_seq)
        q = torch.cat([q_nope[queries], q_rope[queries]], dim=-1)  # [Q, H, nope + R]
        expanded = extend_attention_ref(q, k, v, [q_per_seq], [n - q_per_seq], 0.2)
        torch.testing.assert_close(absorbed[queries], expanded, rtol=1e-6, atol=1e-6)


def test_mla_verify_ref_one_query_is_decode() -> None:
    torch.manual_seed(4)
    lens = [3, 1, 12, 0]
    cache = torch.randn(20, 40)
    indptr, slots = torch.tensor([0] + lens).cumsum(0), torch.randperm(20)[:sum(lens)]
    q_latent, q_rope = torch.randn(len(lens), 4, 32), torch.randn(len(lens), 4, 8)
    verify = mla_verify(q_latent, q_rope, cache, indptr, slots, 0.3, 1)
    assert torch.equal(verify, mla_decode_ref(q_latent, q_rope, cache, indptr, slots, 0.3))
    assert torch.equal(verify, mla_decode(q_latent, q_rope, cache, indptr, slots, 0.3))


def test_mla_verify_ref_rejects_rows_not_in_sequences() -> None:
    q_latent, q_rope, cache = torch.randn(5, 4, 32), torch.randn(5, 4, 8), torch.randn(10, 40)
    with pytest.raises(ValueError, match="query rows"):
        mla_verify_ref(q_latent, q_rope, cache, torch.tensor([0, 3, 6]), torch.arange(6), 0.2, 2)
