"""Attention for multi-head latent attention (MLA), in its two forms.

- expanded (prefill): the latent is expanded to per-head keys/values, ordinary causal attention
  over the cached prefix plus the new tokens;
- absorbed (decode): ``W_UK`` is folded into the query, so each query attends straight over the
  paged latent cache (``kv_lora_rank`` latent + ``qk_rope_head_dim`` rope key per token) and the
  output stays in latent space until ``W_UV`` is applied. ``mla_decode`` takes one query token
  per sequence, ``mla_verify`` (speculative decoding's verification) several: each sequence's
  last tokens, causal among themselves.

The absorbed forms read the cache as it is stored: in the compute dtype, or in FP8 (``kv_cache``
float8_e4m3fn) with ``kv_scales [slots, ceil(L/128) + 1]`` float32, each row's scale per 128-wide
tile of its latent, then its rope key's (``kernels.fp8.quantize_kv_rows``); a key is then
``value.float() * scale`` in the query's dtype.

``extend_attention``, ``mla_decode`` and ``mla_verify`` hand CUDA tensors to their Triton twins in
``kernels/triton/mla.py``; the ``*_ref`` functions are the torch versions.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moeserve.kernels.backend import use_triton
from moeserve.kernels.fp8 import dequantize_kv_rows


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extend_lens: list[int],
    prefix_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention of new tokens over their sequence's prefix and themselves.

    ``q [T, H, Dqk]`` holds the new tokens of all sequences back to back; ``k [S, H, Dqk]`` and
    ``v [S, H, Dv]`` hold each sequence's whole context (prefix then new tokens) back to back.
    New token ``i`` of a sequence sits at position ``prefix_len + i`` and sees keys
    ``0 .. prefix_len + i``. Returns ``[T, H, Dv]``.
    """
    if use_triton(q):
        if _flash_fits(q, k, extend_lens, prefix_lens):
            return _extend_flash(q, k, v, len(extend_lens), scale)
        from moeserve.kernels.triton import mla as triton_mla

        return triton_mla.extend_attention(q, k, v, extend_lens, prefix_lens, scale)
    return extend_attention_ref(q, k, v, extend_lens, prefix_lens, scale)


def _flash_fits(q: torch.Tensor, k: torch.Tensor, extend_lens: list[int], prefix_lens: list[int]) -> bool:
    """Whole prompts of one length with nothing cached: a plain causal batch, which torch's
    flash attention ran ~1.5x faster than our Triton kernel on the H200 (8 x 1024, 128 heads)."""
    return (q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256 and len(set(extend_lens)) == 1
            and not any(prefix_lens) and q.is_contiguous() and k.is_contiguous())


def _extend_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_seqs: int, scale: float) -> torch.Tensor:
    """``extend_attention`` for ``n_seqs`` equal prompts through ``F.scaled_dot_product_attention``.

    cuDNN's attention takes v narrower than q and k (MLA's 128 against 192); on the H200 that ran
    1.25x faster than flash attention with v zero-padded to 192, the fallback where cuDNN's
    kernel is missing."""
    global _cudnn_attention_ok
    dqk, dv = q.shape[-1], v.shape[-1]
    if dv != dqk and _cudnn_attention_ok:
        try:
            return sdpa_whole_prompts(q, k, v, n_seqs, scale, SDPBackend.CUDNN_ATTENTION)
        except RuntimeError:  # no cuDNN attention for these inputs here: pad v for flash attention
            _cudnn_attention_ok = False
    return sdpa_whole_prompts(q, k, F.pad(v, (0, dqk - dv)), n_seqs, scale)[..., :dv]


def sdpa_whole_prompts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n_seqs: int, scale: float,
                       backend: SDPBackend | None = None) -> torch.Tensor:
    """Causal SDPA over ``n_seqs`` equal prompts packed in ``q, k [T, H, Dqk]``, ``v [T, H, Dv]``
    -> ``[T, H, Dv]``; ``backend`` pins torch's kernel (else torch picks)."""
    n_tokens, heads = q.shape[:2]

    def batched(t: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [n_seqs, H, T / n_seqs, D]
        return t.view(n_seqs, n_tokens // n_seqs, heads, t.shape[-1]).transpose(1, 2)

    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(n_tokens, heads, v.shape[-1])  # [T, H, Dv]


_cudnn_attention_ok = True


def extend_attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    extend_lens: list[int],
    prefix_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Torch version of ``extend_attention``: one sequence at a time, softmax in fp32."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    q_start = kv_start = 0
    for n_new, n_prefix in zip(extend_lens, prefix_lens):
        n_kv = n_prefix + n_new
        qs = q[q_start:q_start + n_new]  # [t, H, D]
        ks, vs = k[kv_start:kv_start + n_kv], v[kv_start:kv_start + n_kv]
        scores = torch.einsum("thd,shd->hts", qs, ks) * scale  # [H, t, s]
        query_pos = torch.arange(n_prefix, n_kv, device=q.device)[:, None]
        visible = torch.arange(n_kv, device=q.device)[None, :] <= query_pos  # [t, s]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = scores.float().softmax(-1).to(vs.dtype)
        out[q_start:q_start + n_new] = torch.einsum("hts,shd->thd", probs, vs)
        q_start += n_new
        kv_start += n_kv
    return out


def mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    *,
    kv_scales: torch.Tensor | None = None,
    page_size: int | None = None,
    launch_batch: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA over the paged latent cache; one query token per sequence.

    ``q_latent [B, H, L]`` (query nope part already multiplied by ``W_UK``), ``q_rope [B, H, R]``,
    ``kv_cache [slots, L + R]`` (latent then rope key), sequence ``b`` reading the slots
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]``. Returns ``[B, H, L]`` in latent space; a
    sequence with no tokens gets zeros. ``page_size``, when given, promises that the slots lie
    on pages of that size (token ``t`` at ``page * page_size + t % page_size``); the GPU kernel
    then reads blocks of consecutive rows whole instead of row by row. ``launch_batch`` sizes the
    GPU kernel's launch (its split of each context) as for a batch of that many sequences, so a
    part of a batch gets bitwise the rows the whole would. ``kv_scales``: an FP8 cache's (module
    docstring).
    """
    return mla_verify(q_latent, q_rope, kv_cache, kv_indptr, kv_indices, scale, 1, kv_scales=kv_scales,
                      page_size=page_size, launch_batch=launch_batch)


def mla_verify(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    q_per_seq: int,
    *,
    kv_scales: torch.Tensor | None = None,
    page_size: int | None = None,
    launch_batch: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA over the paged latent cache; ``Q = q_per_seq`` query tokens per sequence.

    ``q_latent [B*Q, H, L]`` and ``q_rope [B*Q, H, R]`` hold sequence ``b``'s queries in rows
    ``b*Q .. b*Q + Q - 1``; ``kv_indptr [B + 1]`` and ``kv_indices`` give each sequence's whole
    context as in ``mla_decode``, the Q new tokens included (their cache rows already written).
    The queries are the context's last Q tokens, causal: query ``j`` of a sequence of ``n``
    tokens attends its first ``n - Q + j + 1`` (none, giving zeros, where ``n`` < Q breaks the
    contract). Returns ``[B*Q, H, L]``. With ``Q = 1`` this is ``mla_decode``, bitwise.
    ``kv_scales`` and ``page_size`` as in ``mla_decode``; ``launch_batch`` counts sequences, as
    there: the GPU kernel's split of each context is sized for ``launch_batch * Q`` query rows,
    the programs such a launch has.
    """
    if use_triton(q_latent):
        from moeserve.kernels.triton import mla as triton_mla

        return triton_mla.mla_verify(q_latent, q_rope, kv_cache, kv_indptr, kv_indices, scale, q_per_seq,
                                     kv_scales=kv_scales, page_size=page_size, launch_batch=launch_batch)
    return mla_verify_ref(q_latent, q_rope, kv_cache, kv_indptr, kv_indices, scale, q_per_seq, kv_scales)


def mla_decode_ref(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch version of ``mla_decode``: one sequence at a time, softmax in fp32."""
    return mla_verify_ref(q_latent, q_rope, kv_cache, kv_indptr, kv_indices, scale, 1, kv_scales)


def mla_verify_ref(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    scale: float,
    q_per_seq: int,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch version of ``mla_verify``: one query row at a time over its visible prefix (an FP8
    cache's rows dequantized to the query's dtype), softmax in fp32."""
    if q_per_seq < 1 or q_latent.shape[0] != (kv_indptr.shape[0] - 1) * q_per_seq:
        raise ValueError(f"{q_latent.shape[0]} query rows for {kv_indptr.shape[0] - 1} sequences of "
                         f"{q_per_seq} queries")
    latent_dim = q_latent.shape[-1]
    out = q_latent.new_empty(q_latent.shape)
    bounds = kv_indptr.tolist()
    for row in range(q_latent.shape[0]):
        b, j = divmod(row, q_per_seq)
        end = max(bounds[b + 1] - (q_per_seq - 1 - j), bounds[b])  # the later queries' tokens are hidden
        slots = kv_indices[bounds[b]:end]
        kv = kv_cache[slots]  # [s, L + R]
        if kv_scales is not None:
            kv = dequantize_kv_rows(kv, kv_scales[slots], latent_dim, q_latent.dtype)
        latent, rope = kv[:, :latent_dim], kv[:, latent_dim:]
        scores = (q_latent[row] @ latent.t() + q_rope[row] @ rope.t()) * scale  # [H, s]
        probs = scores.float().softmax(-1).to(latent.dtype)
        out[row] = probs @ latent
    return out


def sparse_mla(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
    *,
    kv_scales: torch.Tensor | None = None,
    launch_rows: int | None = None,
) -> torch.Tensor:
    """Absorbed MLA of each query row over its own set of cache slots (DeepSeek-V3.2's sparse
    attention): ``q_latent [T, H, L]``, ``q_rope [T, H, R]``, ``kv_cache [slots, L + R]`` (FP8 with
    ``kv_scales``) as in ``mla_decode``, ``selected [T, K]`` the slots of row ``t``, the kept ones
    first and ``-1`` after them. Returns ``[T, H, L]``; each row is ``mla_decode`` of a sequence made of its
    slots, and the GPU runs the same kernel, reading each row's slots up to its count (no host
    sync). ``launch_rows`` sizes the GPU launch as for a batch of that many rows (``launch_batch``
    of ``mla_decode``)."""
    if use_triton(q_latent):
        from moeserve.kernels.triton import mla as triton_mla

        step = 1 << 15  # query rows per launch (a grid axis holds 65,535)
        parts = [triton_mla.sparse_mla(q_latent[i:i + step], q_rope[i:i + step], kv_cache, selected[i:i + step],
                                       scale, kv_scales=kv_scales, launch_rows=launch_rows)
                 for i in range(0, q_latent.shape[0], step)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    valid = selected >= 0
    indptr = torch.zeros(selected.shape[0] + 1, dtype=torch.int64, device=selected.device)
    torch.cumsum(valid.sum(dim=1), dim=0, out=indptr[1:])
    return mla_decode(q_latent, q_rope, kv_cache, indptr, selected[valid], scale, kv_scales=kv_scales)
