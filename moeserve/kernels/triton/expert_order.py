"""The MoE dispatch's layout step in Triton (reference in ``kernels/expert_order.py``), by counting.

Entry ``i`` lands at ``#{j : ids[j] < ids[i]} + #{j < i : ids[j] == ids[i]}``: its rank in a stable
sort. The first ``cdiv(N, BLOCK_I)`` programs each rank ``BLOCK_I`` entries against every entry,
``BLOCK_J`` at a time, and write both ``position`` and its inverse ``order``; the programs after
them each count ``BLOCK_I`` experts' segment starts and sizes in the same loop (``seg_indptr[e] =
#{j : ids[j] < e}``, ``counts[e] = #{j : ids[j] == e}``). No atomics, so the result is
deterministic, and no sort: at decode sizes (a few thousand entries) a one-block radix sort of
64-bit keys takes tens of microseconds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_I, BLOCK_J = 16, 256
_PAD = 2**30  # stands for a missing entry: after every expert id


@triton.jit
def _expert_order_kernel(ids_ptr, order_ptr, position_ptr, seg_ptr, counts_ptr, n, num_experts, entry_programs,
                         BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, PAD: tl.constexpr):
    pid = tl.program_id(0)
    is_entries = pid < entry_programs
    # this program's BLOCK_I entries, or BLOCK_I expert ids (whose segment starts it counts)
    first = tl.where(is_entries, pid, pid - entry_programs) * BLOCK_I
    rows = first + tl.arange(0, BLOCK_I)
    mine = tl.where(is_entries, tl.load(ids_ptr + rows, mask=is_entries & (rows < n), other=PAD).to(tl.int32), rows)
    below = tl.zeros([BLOCK_I], tl.int32)
    tied_before = tl.zeros([BLOCK_I], tl.int32)  # entries: equal ids earlier; experts: entries of that id
    cols = tl.arange(0, BLOCK_J)
    other = tl.load(ids_ptr + cols, mask=cols < n, other=PAD).to(tl.int32)
    for start in range(0, n, BLOCK_J):
        # the next block's load is issued before this block's comparisons, which hide its latency
        nxt = start + BLOCK_J + tl.arange(0, BLOCK_J)
        following = tl.load(ids_ptr + nxt, mask=nxt < n, other=PAD).to(tl.int32)
        below += tl.sum((other[None, :] < mine[:, None]).to(tl.int32), axis=1)
        same = other[None, :] == mine[:, None]
        counted = same & ((cols[None, :] < rows[:, None]) | (pid >= entry_programs))
        tied_before += tl.sum(counted.to(tl.int32), axis=1)
        other = following
        cols = nxt
    if is_entries:
        rank = below + tied_before
        ok = rows < n
        tl.store(position_ptr + rows, rank.to(tl.int64), mask=ok)
        tl.store(order_ptr + rank, rows.to(tl.int64), mask=ok)
    else:
        tl.store(seg_ptr + rows, below.to(tl.int64), mask=rows <= num_experts)
        tl.store(counts_ptr + rows, tied_before.to(tl.int64), mask=rows < num_experts)


def expert_order(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(order, position, seg_indptr, counts)``; see ``moeserve.kernels.expert_order`` (checked there)."""
    if not ids.is_contiguous():
        raise ValueError("ids must be contiguous")
    n = ids.shape[0]
    if n >= _PAD or num_experts >= _PAD:
        raise ValueError(f"expert_order: {n} entries over {num_experts} experts is past the kernel's int32 counts")
    order = torch.empty(n, dtype=torch.int64, device=ids.device)
    position = torch.empty_like(order)
    seg_indptr = torch.empty(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=ids.device)
    entry_programs = triton.cdiv(n, BLOCK_I)
    grid = (entry_programs + triton.cdiv(num_experts + 1, BLOCK_I),)
    _expert_order_kernel[grid](ids, order, position, seg_indptr, counts, n, num_experts, entry_programs,
                               BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J, PAD=_PAD, num_warps=4)
    return order, position, seg_indptr, counts
