"""Low-latency dispatch and combine as direct writes into the peers' buffers, in Triton (torch
versions and the contracts in ``kernels/peer_a2a.py``).

Every rank's buffers are reached through tables of base addresses, one entry per EP rank (``[N]``
int64 on the device): over NVLink, torch symmetric memory's mappings of the peers' buffers; in one
process (tests), plain tensors standing for the other ranks. An address loaded from a table is
cast to a typed pointer and written like any other. Rows move as int32 words, whatever they hold.

Ordering: a sender's rows are plain stores of one kernel; its signal is a release atomic at system
scope in the next kernel on the stream (after the rows are complete), and the receiver polls with
acquire atomics before it reads a row. A poll gives up after ``max_spins`` rounds and sets a bit
of the rank's error word instead of hanging the GPU on a dead peer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # words of a row moved per step (4 KiB)
ROWS = 4  # rows a receiving or combining program moves


@triton.jit
def _peer(table, rank, ty: tl.constexpr):
    """Rank ``rank``'s buffer from an address table, as a ``ty`` pointer."""
    return tl.load(table + rank).to(tl.pointer_type(ty))


@triton.jit
def _copy_row(dst, src, words, BLOCK: tl.constexpr):
    for start in range(0, words, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        keep = offs < words
        tl.store(dst + offs, tl.load(src + offs, mask=keep), mask=keep)


@triton.jit
def _poll(ptrs, keep, want, max_spins, error_ptr, error_bit):
    """Values at ``ptrs`` (lanes off in ``keep`` read as ``want``) once all are at least ``want``,
    or after ``max_spins`` rounds with ``error_bit`` set in the error word."""
    v = tl.where(keep, tl.atomic_add(ptrs, 0, mask=keep, sem="acquire", scope="sys"), want)
    spins = 0
    while (tl.min(v, 0) < want) & (spins < max_spins):
        v = tl.where(keep, tl.atomic_add(ptrs, 0, mask=keep, sem="acquire", scope="sys"), want)
        spins += 1
    if tl.min(v, 0) < want:
        tl.atomic_or(error_ptr, error_bit)
    return v


@triton.jit
def _send_tokens_kernel(a_ptr, b_ptr, ids_ptr, slots_ptr, x_table, src_table, rank, k, e_local, n_ranks, cap,
                        wa, wb, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # one (token, choice)
    token = pid // k
    expert = tl.load(ids_ptr + pid)
    dst_rank = expert // e_local
    block = ((expert - dst_rank * e_local) * n_ranks + rank) * cap + tl.load(slots_ptr + pid)  # int64
    row = _peer(x_table, dst_rank, tl.int32) + block * (wa + wb)
    _copy_row(row, a_ptr + token * wa, wa, BLOCK)
    if HAS_B:
        _copy_row(row + wa, b_ptr + token * wb, wb, BLOCK)
    tl.store(_peer(src_table, dst_rank, tl.int32) + block, pid)


@triton.jit
def _signal_counts_kernel(counts_ptr, count_table, rank, e_local, BLOCK_E: tl.constexpr):
    dst_rank = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    keep = e < e_local
    counts = tl.load(counts_ptr + dst_rank * e_local + e, mask=keep, other=0)
    flags = _peer(count_table, dst_rank, tl.int32) + rank * e_local + e
    tl.atomic_xchg(flags, (counts + 1).to(tl.int32), mask=keep, sem="release", scope="sys")


@triton.jit
def _receive_tokens_kernel(x_table, count_table, out_a, out_b, masked_m_ptr, start_ptr, count_ptr, error_ptr,
                           rank, e_local, n_ranks, cap, wa, wb, max_spins,
                           HAS_B: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # one (local expert, source rank)
    e = pid // n_ranks
    source = pid - e * n_ranks
    lanes = tl.arange(0, BLOCK_N)
    flags = _peer(count_table, rank, tl.int32) + lanes * e_local + e  # every source's count for expert e
    counts = _poll(flags, lanes < n_ranks, 1, max_spins, error_ptr, 1) - 1  # [BLOCK_N]
    start = tl.sum(tl.where(lanes < source, counts, 0), 0)
    count = tl.sum(tl.where(lanes == source, counts, 0), 0)
    first = tl.program_id(1) * ROWS
    if first == 0:
        tl.store(start_ptr + pid, start)
        tl.store(count_ptr + pid, count)
        if source == 0:
            tl.store(masked_m_ptr + e, tl.sum(counts, 0))
    received = _peer(x_table, rank, tl.int32) + (pid * cap).to(tl.int64) * (wa + wb)
    out_row = (e * n_ranks * cap + start).to(tl.int64)
    for i in range(first, tl.minimum(first + ROWS, count)):
        _copy_row(out_a + (out_row + i) * wa, received + i * (wa + wb), wa, BLOCK)
        if HAS_B:
            _copy_row(out_b + (out_row + i) * wb, received + i * (wa + wb) + wa, wb, BLOCK)


@triton.jit
def _send_outputs_kernel(y_ptr, start_ptr, count_ptr, src_table, out_table, count_table, rank, e_local, n_ranks,
                         cap, wc, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)  # one (local expert, source rank)
    e = pid // n_ranks
    source = pid - e * n_ranks
    start = tl.load(start_ptr + pid)
    count = tl.load(count_ptr + pid)
    first = tl.program_id(1) * ROWS
    if first == 0:  # the count is read (by the receive kernel, done): clear it for the next dispatch
        tl.store(_peer(count_table, rank, tl.int32) + source * e_local + e, 0)
    flat = _peer(src_table, rank, tl.int32) + pid * cap  # (token, choice) of each row, at the source
    back = _peer(out_table, source, tl.int32)
    out_row = (e * n_ranks * cap + start).to(tl.int64)
    for i in range(first, tl.minimum(first + ROWS, count)):
        _copy_row(back + tl.load(flat + i).to(tl.int64) * wc, y_ptr + (out_row + i) * wc, wc, BLOCK)


@triton.jit
def _signal_done_kernel(flag_table, rank, n_ranks, BLOCK_N: tl.constexpr):
    lanes = tl.arange(0, BLOCK_N)
    keep = lanes < n_ranks
    flags = tl.load(flag_table + lanes, mask=keep, other=0).to(tl.pointer_type(tl.int32)) + rank
    tl.atomic_xchg(flags, 1, mask=keep, sem="release", scope="sys")


@triton.jit
def _wait_done_kernel(flag_table, error_ptr, rank, n_ranks, max_spins, BLOCK_N: tl.constexpr):
    lanes = tl.arange(0, BLOCK_N)
    keep = lanes < n_ranks
    flags = _peer(flag_table, rank, tl.int32) + lanes
    _poll(flags, keep, 1, max_spins, error_ptr, 2)
    tl.store(flags, 0, mask=keep)  # cleared for the next combine into this buffer set


def send_tokens(a: torch.Tensor, b: torch.Tensor | None, topk_ids: torch.Tensor, slots: torch.Tensor,
                send_counts: torch.Tensor, tables: dict[str, torch.Tensor], rank: int, e_local: int,
                cap: int) -> None:
    num_rows, n_ranks = topk_ids.numel(), tables["recv_x"].shape[0]
    wa, wb = a.shape[1], 0 if b is None else b.shape[1]
    if num_rows:
        _send_tokens_kernel[(num_rows,)](a, a if b is None else b, topk_ids, slots, tables["recv_x"],
                                         tables["recv_src"], rank, topk_ids.shape[1], e_local, n_ranks, cap, wa, wb,
                                         HAS_B=b is not None, BLOCK=BLOCK)
    _signal_counts_kernel[(n_ranks,)](send_counts, tables["recv_count"], rank, e_local,
                                      BLOCK_E=triton.next_power_of_2(e_local))


def receive_tokens(tables: dict[str, torch.Tensor], error: torch.Tensor, rank: int, e_local: int, cap: int,
                   wa: int, wb: int, max_spins: int) -> tuple[torch.Tensor, ...]:
    n_ranks = tables["recv_x"].shape[0]
    device = error.device
    out_a = torch.empty(e_local, n_ranks * cap, wa, dtype=torch.int32, device=device)
    out_b = torch.empty(e_local, n_ranks * cap, wb, dtype=torch.int32, device=device) if wb else None
    masked_m = torch.empty(e_local, dtype=torch.int32, device=device)
    start = torch.empty(e_local, n_ranks, dtype=torch.int32, device=device)
    count = torch.empty_like(start)
    grid = (e_local * n_ranks, triton.cdiv(cap, ROWS))
    _receive_tokens_kernel[grid](tables["recv_x"], tables["recv_count"], out_a, out_a if out_b is None else out_b,
                                 masked_m, start, count, error, rank, e_local, n_ranks, cap, wa, wb, max_spins,
                                 HAS_B=out_b is not None, ROWS=ROWS, BLOCK_N=triton.next_power_of_2(n_ranks),
                                 BLOCK=BLOCK)
    return out_a, out_b, masked_m, start, count


def send_outputs(y: torch.Tensor, start: torch.Tensor, count: torch.Tensor, tables: dict[str, torch.Tensor],
                 rank: int, cap: int) -> None:
    e_local, n_ranks = start.shape
    _send_outputs_kernel[(e_local * n_ranks, triton.cdiv(cap, ROWS))](
        y, start, count, tables["recv_src"], tables["comb_x"], tables["recv_count"], rank, e_local, n_ranks, cap,
        y.shape[-1], ROWS=ROWS, BLOCK=BLOCK)
    _signal_done_kernel[(1,)](tables["comb_flag"], rank, n_ranks, BLOCK_N=triton.next_power_of_2(n_ranks))


def wait_outputs(tables: dict[str, torch.Tensor], error: torch.Tensor, rank: int, max_spins: int) -> None:
    n_ranks = tables["comb_flag"].shape[0]
    _wait_done_kernel[(1,)](tables["comb_flag"], error, rank, n_ranks, max_spins,
                            BLOCK_N=triton.next_power_of_2(n_ranks))
