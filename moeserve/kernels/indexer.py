"""DeepSeek-V3.2's lightning indexer: which earlier tokens each query attends to.

For query token ``t`` and an earlier (or the same) token ``s`` of its sequence the index score is
``Σ_h w[t, h] · ReLU(q[t, h] · k[s])``, one 128-d key per token shared by every index head; each
query keeps the ``topk`` tokens of highest score (DeepSeek-V3.2 report §2.1). A query whose
context holds no more than ``topk`` tokens keeps all of them, so nothing is scored for it and
sparse attention over its selection is dense attention.

``select_topk`` hands CUDA tensors to its Triton twin (``kernels/triton/indexer.py``); its torch
version never holds more than ``SCORE_CHUNK`` scores at once: rows are scored a chunk at a time.
"""

from __future__ import annotations

import torch

from moeserve.kernels.backend import use_triton

# at most this many fp32 scores (rows x index heads x context) exist at once in the torch version
SCORE_CHUNK = 1 << 25


def select_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    seq_of_row: torch.Tensor,
    pos_of_row: torch.Tensor,
    topk: int,
    width: int,
    index_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The cache slots each query row attends to.

    ``q [T, H, D]`` index queries (rope applied); ``weights [T, H]`` fp32 head weights with every
    scale folded in; ``index_cache [slots, D]`` the index keys (FP8: float8_e4m3fn with
    ``index_scales [slots]`` float32, one a key, which factors out of the key's dot products
    since it is positive: ``ReLU(q · k * s) = s · ReLU(q · k)``); sequence ``b``'s context is
    ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]`` in position order; row ``t`` belongs to sequence
    ``seq_of_row[t]`` at position ``pos_of_row[t]`` (int64 ``[T]`` each, on q's device) and sees
    positions ``0 .. pos_of_row[t]``; ``width`` bounds every row's context (the longest sequence,
    known on the host). Returns ``[T, topk]`` int64 slots, the kept ones first (in no given order)
    and ``-1`` after them where a row sees fewer than ``topk``. Scores in fp32.
    """
    if use_triton(q):
        from moeserve.kernels.triton import indexer as triton_indexer

        return triton_indexer.select_topk(q, weights, index_cache, kv_indptr, kv_indices, seq_of_row, pos_of_row,
                                          topk, width, index_scales)
    return select_topk_ref(q, weights, index_cache, kv_indptr, kv_indices, seq_of_row.tolist(), pos_of_row.tolist(),
                           topk, index_scales)


def select_topk_ref(q: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, kv_indptr: torch.Tensor,
                    kv_indices: torch.Tensor, seq_of_row: list[int], pos_of_row: list[int], topk: int,
                    index_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Torch version of ``select_topk``: the rows of one sequence a chunk at a time."""
    n_rows, n_heads = q.shape[:2]
    out = torch.full((n_rows, topk), -1, dtype=torch.int64, device=q.device)
    bounds = kv_indptr.tolist()
    rows_of_seq: dict[int, list[int]] = {}
    for row, (seq, pos) in enumerate(zip(seq_of_row, pos_of_row)):
        if pos < topk:  # the whole causal context: nothing to score
            out[row, :pos + 1] = kv_indices[bounds[seq]:bounds[seq] + pos + 1]
        else:
            rows_of_seq.setdefault(seq, []).append(row)
    for seq, rows in rows_of_seq.items():
        context = kv_indices[bounds[seq]:bounds[seq + 1]]
        keys = index_cache[context].float()  # [S, D]
        key_scales = None if index_scales is None else index_scales[context]  # [S]
        chunk = max(SCORE_CHUNK // (n_heads * keys.shape[0]), 1)
        for start in range(0, len(rows), chunk):
            part = torch.tensor(rows[start:start + chunk], device=q.device)
            scores = index_scores(q[part], weights[part], keys, key_scales)  # [t, S]
            pos = torch.tensor([pos_of_row[r] for r in rows[start:start + chunk]], device=q.device)
            hidden = torch.arange(keys.shape[0], device=q.device)[None, :] > pos[:, None]
            picked = scores.masked_fill(hidden, float("-inf")).topk(topk, dim=-1).indices  # every row sees > topk
            out[part] = context[picked]
    return out


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor,
                 key_scales: torch.Tensor | None = None) -> torch.Tensor:
    """``q [t, H, D]``, ``weights [t, H]``, ``keys [S, D]`` (FP8 with ``key_scales [S]``) -> fp32
    ``[t, S]`` index scores."""
    dots = torch.einsum("thd,sd->ths", q.float(), keys.float()).relu_()  # [t, H, S]
    scores = torch.einsum("th,ths->ts", weights.float(), dots)
    return scores if key_scales is None else scores * key_scales.float()
