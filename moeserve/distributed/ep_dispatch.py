"""Expert-parallel token dispatchers over ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Names used throughout: ``N`` EP ranks, ``E_local`` experts per rank, ``E = N * E_local``
physical experts; physical expert ``g`` lives on EP rank ``g // E_local`` as local expert
``g % E_local`` (``eplb/placement``). ``T`` tokens on this rank, top-``k`` experts each,
hidden size ``D``, ``C = max_dispatch_tokens_per_rank``.

- ``TorchNormalDispatcher`` (prefill, high throughput): exchanges counts (one host sync), then
  variable-size ``all_to_all_single``; contiguous layout, segments optionally aligned.
- ``TorchLowLatencyDispatcher`` (decode): fixed ``[E, C, D]`` buffers and equal splits, every
  shape known ahead, no host sync, so a CUDA graph can capture it; masked layout.

Both apply the routing weights on the source rank with ``LocalDispatcher``'s arithmetic
(``kernels.combine.topk_weighted_sum``), so a token's output matches the single-rank engine's to rounding of
the expert GEMMs. With ``fp8`` (for FP8 experts) both send each token as DeepEP does: its values in
float8_e4m3fn and one fp32 scale per 1x128 group (``per_token_group_quant_fp8``, which the experts
would apply anyway): the values as bytes and the scales, two tensors moved alike; the output
carries them as ``hidden`` and ``hidden_scale``. Combine sends BF16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moeserve.distributed.dispatcher import (
    Dispatcher,
    DispatchOutput,
    MaskedDispatchOutput,
    received_tokens,
    token_parts,
)
from moeserve.distributed.groups import Group
from moeserve.kernels.combine import topk_weighted_sum
from moeserve.kernels.expert_order import expert_order


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, ep: Group, out_splits: list[int] | None = None,
                in_splits: list[int] | None = None) -> dist.Work | None:
    """Start ``all_to_all_single`` over ``ep`` (a copy for a group of one); returns the work to wait on."""
    if ep.size == 1:
        out.copy_(inp)
        return None
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=ep.group, async_op=True)


def _wait(*works: dist.Work | None) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _exclusive_cumsum(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return torch.cumsum(x, dim) - x


# ---------------------------------------------------------------------------------------------
# normal mode


@dataclass
class NormalHandle:
    """What ``TorchNormalDispatcher.combine`` needs. ``S`` rows sent, ``R`` rows received."""

    position: torch.Tensor  # [S = T * k] int64: the sent row (in physical-expert order) of each flat (token, choice)
    topk_weights: torch.Tensor  # [T, k]
    send_splits: list[int]  # [N]: rows sent to each rank
    recv_splits: list[int]  # [N]: rows received from each rank
    layout_rows: torch.Tensor  # [R] int64: row of the contiguous layout each received row went to
    num_tokens: int  # T


@dataclass
class _NormalDispatchPending:
    recv: list[torch.Tensor]  # ``token_parts``' [R, ...] each, filled once ``works`` complete
    works: list[dist.Work | None]
    recv_counts: torch.Tensor  # [N, E_local] int64: rows from each source rank for each local expert
    tokens_per_expert: torch.Tensor  # [E_local] int64: rows received for each local expert
    seg_indptr: torch.Tensor  # [E_local + 1] int64: aligned segment starts
    num_rows: int  # M = seg_indptr[-1], on the host
    handle: NormalHandle  # ``layout_rows`` still empty
    dtype: torch.dtype  # the tokens' dtype (before FP8 quantization)


@dataclass
class _CombinePending:
    recv: torch.Tensor  # filled once ``work`` completes
    work: dist.Work | None
    handle: object


class TorchNormalDispatcher(Dispatcher):
    """Prefill dispatch: variable-size all-to-all, contiguous layout grouped by local expert.

    Layout of the ``DispatchOutput`` on each rank: local expert ``e`` owns rows
    ``seg_indptr[e]:seg_indptr[e+1]`` of ``hidden [M, D]``; its first ``tokens_per_expert[e]``
    rows are its tokens, from source rank 0 first, then rank 1, ..., each source's rows in that
    source's token order; the rest of the segment is zero padding, so that every segment length
    (and so every ``seg_indptr[e]``) is a multiple of ``alignment`` (DeepGEMM's contiguous layout
    wants 128 on GPU); ``M = seg_indptr[-1]``. An expert with no tokens has an empty segment. With
    ``alignment = 1`` there is no padding. The experts map padding rows to zero (no bias) and
    ``combine`` never reads them.

    ``dispatch_a`` exchanges the ``[N, E_local]`` counts (a blocking collective and one host
    sync of ``2N + 1`` numbers: the splits and the layout's size set the buffers; the segments
    are worked out on the device) and starts the token all-to-all; ``dispatch_b``
    waits for it and scatters the rows into the layout. ``combine_a`` starts the reverse
    all-to-all; ``combine_b`` waits and reduces over the top-k. An idle rank (``T = 0``) takes
    part in every collective like the others and gets ``[0, D]`` back from ``combine``.
    """

    disposable_buffers = True  # sends a copy (``index_select``); the layout is allocated per call

    def __init__(self, ep: Group, num_local_experts: int, alignment: int = 1, fp8: bool = False) -> None:
        if alignment < 1:
            raise ValueError(f"alignment must be positive, got {alignment}")
        self.ep, self.num_local_experts, self.alignment, self.fp8 = ep, num_local_experts, alignment, fp8

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> _NormalDispatchPending:
        """``hidden [T, D]``, ``topk_ids [T, k]`` int64 in ``[0, E)``, ``topk_weights [T, k]`` fp32."""
        n, e_local = self.ep.size, self.num_local_experts
        layout = expert_order(topk_ids.flatten(), n * e_local)  # physical-expert order is destination-rank order
        send_counts = layout.counts.view(n, e_local)
        recv_counts = torch.empty_like(send_counts)
        _wait(_all_to_all(recv_counts, send_counts, self.ep))  # the one count exchange
        tokens_per_expert = recv_counts.sum(0)  # [E_local]
        aligned = -(-tokens_per_expert // self.alignment) * self.alignment
        seg_indptr = torch.cat([aligned.new_zeros(1), torch.cumsum(aligned, 0)])  # [E_local + 1]
        # the one host sync: the all-to-all's splits and the layout's size set the buffers
        host = torch.cat([send_counts.sum(1), recv_counts.sum(1), seg_indptr[-1:]]).tolist()
        send_splits, recv_splits, num_rows = host[:n], host[n:2 * n], host[-1]
        token_index = layout.order // topk_ids.shape[1]  # [S]
        parts = token_parts(hidden, self.fp8)  # FP8: quantized once a token, sent once a choice
        recv = [p.new_empty(sum(recv_splits), p.shape[1]) for p in parts]  # [R, D] (FP8: and [R, G])
        works = [_all_to_all(r, p.index_select(0, token_index), self.ep, recv_splits, send_splits)
                 for r, p in zip(recv, parts)]
        handle = NormalHandle(layout.position, topk_weights, send_splits, recv_splits,
                              layout_rows=token_index.new_empty(0), num_tokens=hidden.shape[0])
        return _NormalDispatchPending(recv, works, recv_counts, tokens_per_expert, seg_indptr, num_rows, handle,
                                      hidden.dtype)

    def dispatch_b(self, pending: _NormalDispatchPending) -> tuple[DispatchOutput, NormalHandle]:
        """-> (``DispatchOutput(hidden [M, D], seg_indptr [E_local + 1] int64,
        tokens_per_expert [E_local] int64)``, handle for ``combine``)."""
        rows = _layout_rows(pending.recv_counts, pending.seg_indptr, pending.recv[0].shape[0])  # [R]
        _wait(*pending.works)
        out = []
        for received in pending.recv:
            out.append(received.new_zeros(pending.num_rows, received.shape[1]))  # [M, D] (FP8: and [M, G])
            out[-1][rows] = received
        pending.handle.layout_rows = rows
        return (DispatchOutput(seg_indptr=pending.seg_indptr, tokens_per_expert=pending.tokens_per_expert,
                               **received_tokens(out, pending.dtype)), pending.handle)

    def combine_a(self, expert_out: torch.Tensor, handle: NormalHandle) -> _CombinePending:
        """``expert_out [M, D]`` in the dispatch layout; starts sending each row back to its source."""
        recv = expert_out.new_empty(sum(handle.send_splits), expert_out.shape[1])  # [S, D]
        back = expert_out.index_select(0, handle.layout_rows)  # [R, D], in received order
        work = _all_to_all(recv, back, self.ep, handle.send_splits, handle.recv_splits)
        return _CombinePending(recv, work, handle)

    def combine_b(self, pending: _CombinePending) -> torch.Tensor:
        """-> ``[T, D]`` in ``expert_out``'s dtype: ``sum_k topk_weights[t, k] * expert_k(hidden[t])``."""
        _wait(pending.work)
        handle = pending.handle  # pending.recv [S, D], rows in the order they were sent
        return topk_weighted_sum(pending.recv, handle.topk_weights, handle.position)


def _layout_rows(recv_counts: torch.Tensor, seg_indptr: torch.Tensor, num_recv: int) -> torch.Tensor:
    """Row of the contiguous layout for each received row -> ``[R]`` int64.

    ``recv_counts [N, E_local]``: the received rows are blocks ``(source, expert)`` in row-major
    order; block ``(s, e)`` starts at ``seg_indptr[e] + sum_{s' < s} recv_counts[s', e]``.
    """
    counts = recv_counts.flatten()  # [N * E_local]
    block_in = _exclusive_cumsum(counts)  # where each block starts among the received rows
    block_out = seg_indptr[:-1].unsqueeze(0) + _exclusive_cumsum(recv_counts, dim=0)  # [N, E_local]
    shift = torch.repeat_interleave(block_out.flatten() - block_in, counts, output_size=num_recv)
    return torch.arange(num_recv, device=counts.device) + shift


# ---------------------------------------------------------------------------------------------
# low-latency mode


@dataclass
class LowLatencyHandle:
    """What ``TorchLowLatencyDispatcher.combine`` needs; every tensor lives on the device."""

    topk_ids: torch.Tensor  # [T, k] int64
    topk_weights: torch.Tensor  # [T, k]
    slots: torch.Tensor  # [T, k] int64: row of (token, expert) in the C-row block sent to that expert
    layout_rows: torch.Tensor  # [E_local, N * C] int64: masked-layout row of each received (source, slot)


@dataclass
class _LowLatencyDispatchPending:
    recv: list[torch.Tensor]  # ``token_parts``' [N, E_local, C, ...] each, filled once ``works`` complete
    recv_counts: torch.Tensor  # [N, E_local] int32: tokens from each source rank for each local expert
    works: list[dist.Work | None]
    handle: LowLatencyHandle  # ``layout_rows`` still empty
    dtype: torch.dtype  # the tokens' dtype (before FP8 quantization)


class TorchLowLatencyDispatcher(Dispatcher):
    """Decode dispatch: fixed-size buffers and equal-split all-to-alls, no host synchronisation.

    Every rank sends every rank a ``[E_local, C, D]`` block (so ``[E, C, D]`` in all): for each
    physical expert, the tokens choosing it packed at the front (in token order, a token chosen
    by two experts of one rank sent once per expert), zeros behind; and the ``[E]`` int32 count
    per expert. Received, each local expert's valid rows are compacted on the device (cumsum and
    scatter) into the masked layout ``MaskedDispatchOutput(hidden [E_local, N * C, D],
    masked_m [E_local] int32)``: expert ``e``'s first ``masked_m[e]`` rows are its tokens, from
    source rank 0 first, each source's in token order; the rows behind are zero. ``combine``
    takes ``expert_out [E_local, N * C, D]`` in that layout back to ``[T, D]``.

    Only tensor shapes steer the code (no ``.item()``, ``.tolist()``, ``nonzero`` or boolean
    indexing), so a CUDA graph can capture dispatch, experts and combine for a fixed ``T``.
    ``T > C`` raises ``ValueError`` (a shape check, no sync): the scheduler must split the batch.
    """

    disposable_buffers = True  # sends a copy (``send``); the masked layout is allocated per call

    def __init__(self, ep: Group, num_local_experts: int, max_dispatch_tokens_per_rank: int,
                 fp8: bool = False) -> None:
        if max_dispatch_tokens_per_rank < 1:
            raise ValueError(f"max_dispatch_tokens_per_rank must be positive, got {max_dispatch_tokens_per_rank}")
        self.ep, self.num_local_experts, self.fp8 = ep, num_local_experts, fp8
        self.capacity = max_dispatch_tokens_per_rank  # C

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> _LowLatencyDispatchPending:
        """``hidden [T, D]`` with ``T <= C``, ``topk_ids [T, k]`` int64 in ``[0, E)``, ``topk_weights [T, k]``."""
        num_tokens = hidden.shape[0]
        if num_tokens > self.capacity:
            raise ValueError(f"{num_tokens} tokens on this rank exceed max_dispatch_tokens_per_rank="
                             f"{self.capacity}; split the batch or raise the limit")
        n, e_local, cap = self.ep.size, self.num_local_experts, self.capacity
        chosen = torch.zeros(num_tokens, n * e_local, dtype=torch.int32, device=hidden.device)
        chosen.scatter_(1, topk_ids, 1)  # [T, E]
        slots = (torch.cumsum(chosen, 0) - 1).gather(1, topk_ids)  # [T, k] token's place in each block
        send_counts = chosen.sum(0, dtype=torch.int32)  # [E]
        recv_counts = torch.empty_like(send_counts)
        works, recv = [_all_to_all(recv_counts, send_counts, self.ep)], []
        for part in token_parts(hidden, self.fp8):  # [T, D] (FP8: uint8 values, then [T, G] scales)
            send = part.new_zeros(n * e_local, cap, part.shape[1])  # [E, C, D]
            send[topk_ids, slots] = part.unsqueeze(1).expand(-1, topk_ids.shape[1], -1)
            recv.append(torch.empty_like(send))
            works.append(_all_to_all(recv[-1], send, self.ep))
        handle = LowLatencyHandle(topk_ids, topk_weights, slots, layout_rows=slots.new_empty(0))
        return _LowLatencyDispatchPending([r.view(n, e_local, cap, r.shape[-1]) for r in recv],
                                          recv_counts.view(n, e_local), works, handle, hidden.dtype)

    def dispatch_b(self, pending: _LowLatencyDispatchPending) -> tuple[MaskedDispatchOutput, LowLatencyHandle]:
        """-> (``MaskedDispatchOutput(hidden [E_local, N * C, D], masked_m [E_local] int32)``, handle)."""
        _wait(*pending.works)
        n, e_local, cap, _ = pending.recv[0].shape
        masked_m = pending.recv_counts.sum(0, dtype=torch.int32)  # [E_local]
        slot = torch.arange(cap, device=masked_m.device)
        valid = (slot < pending.recv_counts.t().unsqueeze(-1)).reshape(e_local, n * cap)  # [E_local, N * C]
        before = torch.cumsum(valid, 1)  # valid rows up to and including each row
        row = torch.arange(n * cap, device=masked_m.device)
        # valid rows to the front in order, the (zero) invalid ones behind: a permutation per expert
        rows = torch.where(valid, before - 1, masked_m.unsqueeze(1) + row - before)  # [E_local, N * C]
        out = []
        for received in pending.recv:
            by_expert = received.transpose(0, 1).reshape(e_local, n * cap, -1)  # [E_local, N * C, D]
            out.append(torch.empty_like(by_expert).scatter_(1, rows.unsqueeze(-1).expand_as(by_expert), by_expert))
        pending.handle.layout_rows = rows
        # every rank sends T * k rows over all N * E_local experts: T * k / E_local an expert, if
        # the other ranks have as many tokens as this one
        tokens, k = pending.handle.topk_ids.shape
        return (MaskedDispatchOutput(masked_m=masked_m, expected_m=-(-tokens * k // e_local),
                                     **received_tokens(out, pending.dtype)), pending.handle)

    def combine_a(self, expert_out: torch.Tensor, handle: LowLatencyHandle) -> _CombinePending:
        """``expert_out [E_local, N * C, D]`` in the masked layout; starts sending it back."""
        e_local, n, cap, dim = self.num_local_experts, self.ep.size, self.capacity, expert_out.shape[-1]
        back = expert_out.gather(1, handle.layout_rows.unsqueeze(-1).expand(-1, -1, dim))  # (source, slot) order
        send = back.view(e_local, n, cap, dim).transpose(0, 1).contiguous()  # [N, E_local, C, D]
        recv = torch.empty_like(send)
        return _CombinePending(recv, _all_to_all(recv, send, self.ep), handle)

    def combine_b(self, pending: _CombinePending) -> torch.Tensor:
        """-> ``[T, D]`` in ``expert_out``'s dtype: ``sum_k topk_weights[t, k] * expert_k(hidden[t])``."""
        _wait(pending.work)
        handle = pending.handle
        cap, dim = pending.recv.shape[2:]
        position = (handle.topk_ids * cap + handle.slots).flatten()  # rows of recv as [N * E_local * C, D]
        return topk_weighted_sum(pending.recv.view(-1, dim), handle.topk_weights, position)
