"""The peer all-to-all of low-latency dispatch: every rank writes its tokens straight into the
buffers of the ranks that own their experts, and the expert outputs straight back, as DeepEP's
low-latency kernels do over NVLink. Only real rows move; counts travel on the device, so nothing
waits on the host and a CUDA graph captures it all.

Names: ``N`` EP ranks, ``E_local`` experts per rank, ``C`` tokens at most per rank per call,
``k`` choices per token. A token row is ``W = wa + wb`` int32 words (its values, then its FP8
scales if any); an expert output row is ``wc`` words. One buffer *set* per rank holds:

- ``recv_x [E_local, N, C, W]``: for each local expert and source rank, the rows that source sent
  (its tokens choosing that expert, in its token order);
- ``recv_src [E_local, N, C]``: each such row's flat (token, choice) index ``t * k + j`` at its source;
- ``recv_count [N, E_local]``: what each source sent each local expert, plus one (0: not arrived);
- ``comb_x [C * k, wc]``: expert outputs coming back, row ``t * k + j`` for choice ``j`` of token ``t``;
- ``comb_flag [N]``: 1 once that expert rank has written all its outputs back.

The four steps, each a function here (the Triton version on CUDA, in ``kernels/triton/peer_a2a``;
the torch version for one process playing every rank, e.g. on CPU):

1. ``send_tokens``: each (token, choice) row to its expert's rank, then each rank's counts;
2. ``receive_tokens``: wait for every source's counts, then pack each local expert's rows, source
   0 first, into the masked layout ``[E_local, N * C, W]`` (rows past ``masked_m`` unwritten);
3. ``send_outputs``: each expert output row back to its source's ``comb_x``, then a flag;
4. ``wait_outputs``: wait for every expert rank's flag.

Each step clears what it consumed, so a set is reused once its combine is complete everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.kernels.backend import use_triton

REGIONS = ("recv_x", "recv_src", "recv_count", "comb_x", "comb_flag")
DISPATCH_TIMED_OUT, COMBINE_TIMED_OUT = 1, 2  # bits of a rank's error word


@dataclass
class PeerSet:
    """One buffer set as this rank reaches it.

    ``tables[region]``: ``[N]`` int64 on the device, the address of every rank's copy of the
    region; ``local[region]``: this rank's copy as a tensor; ``views[region]``: every rank's copy
    as a tensor, where this process can address them all (one process playing every rank), else
    ``None``. ``error [1]`` int32: this rank's error word.
    """

    rank: int
    error: torch.Tensor
    tables: dict[str, torch.Tensor]
    local: dict[str, torch.Tensor]
    views: dict[str, list[torch.Tensor]] | None = None

    def torch_views(self) -> dict[str, list[torch.Tensor]]:
        if self.views is None:
            raise ValueError("the torch version of the peer all-to-all needs every rank's buffers in this "
                             "process; across processes it runs in Triton on CUDA")
        return self.views


def send_tokens(ps: PeerSet, a: torch.Tensor, b: torch.Tensor | None, topk_ids: torch.Tensor, slots: torch.Tensor,
                send_counts: torch.Tensor, e_local: int, cap: int) -> None:
    """Step 1. ``a [T, wa]`` and ``b [T, wb]`` (or None) int32: the token rows; ``topk_ids [T, k]``
    int64 physical experts; ``slots [T, k]`` int64: the row of (token, choice) among the tokens
    this rank sends that expert; ``send_counts [N * E_local]`` int32 or int64: tokens sent each expert."""
    if use_triton(a):
        from moeserve.kernels.triton import peer_a2a

        peer_a2a.send_tokens(a, b, topk_ids, slots, send_counts, ps.tables, ps.rank, e_local, cap)
        return
    views, rank = ps.torch_views(), ps.rank
    row = torch.cat([a, b], 1) if b is not None else a
    flat = torch.arange(topk_ids.numel(), dtype=torch.int32, device=a.device)
    for dst, (recv_x, recv_src) in enumerate(zip(views["recv_x"], views["recv_src"])):
        sel = (topk_ids.flatten() // e_local == dst).nonzero().squeeze(1)
        e, slot = topk_ids.flatten()[sel] % e_local, slots.flatten()[sel]
        recv_x[e, rank, slot] = row[sel // topk_ids.shape[1]]
        recv_src[e, rank, slot] = flat[sel]
        views["recv_count"][dst][rank] = send_counts[dst * e_local:(dst + 1) * e_local] + 1


def receive_tokens(ps: PeerSet, e_local: int, cap: int, wa: int, wb: int,
                   max_spins: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor,
                                            torch.Tensor]:
    """Step 2 -> ``(out_a [E_local, N * C, wa], out_b [E_local, N * C, wb] or None, masked_m [E_local],
    start [E_local, N], count [E_local, N])``, all int32: expert ``e``'s first ``masked_m[e]`` rows are
    its tokens, source ``s``'s at rows ``start[e, s] .. + count[e, s]``. Gives up after ``max_spins``
    polls of a missing count (``DISPATCH_TIMED_OUT`` in the error word; the count taken as 0)."""
    if use_triton(ps.error):
        from moeserve.kernels.triton import peer_a2a

        return peer_a2a.receive_tokens(ps.tables, ps.error, ps.rank, e_local, cap, wa, wb, max_spins)
    views = ps.torch_views()
    flags = views["recv_count"][ps.rank]  # [N, E_local]
    ps.error |= (flags == 0).any().int() * DISPATCH_TIMED_OUT
    count = (flags - 1).clamp(min=0).t().contiguous()  # [E_local, N]
    start = torch.cumsum(count, 1, dtype=torch.int32) - count
    n_ranks = count.shape[1]
    valid = torch.arange(cap, device=count.device) < count.unsqueeze(-1)  # [E_local, N, C]
    e, s, i = valid.nonzero(as_tuple=True)
    rows = views["recv_x"][ps.rank][e, s, i]  # [R, W]
    out = rows.new_zeros(e_local, n_ranks * cap, wa + wb)
    out[e, start[e, s] + i] = rows
    out_b = out[..., wa:].contiguous() if wb else None
    return out[..., :wa].contiguous(), out_b, count.sum(1, dtype=torch.int32), start, count


def send_outputs(ps: PeerSet, y: torch.Tensor, start: torch.Tensor, count: torch.Tensor, cap: int) -> None:
    """Step 3. ``y [E_local, N * C, wc]`` int32: the experts' outputs in the masked layout;
    ``start``, ``count`` as ``receive_tokens`` gave them."""
    if use_triton(y):
        from moeserve.kernels.triton import peer_a2a

        peer_a2a.send_outputs(y, start, count, ps.tables, ps.rank, cap)
        return
    views, rank = ps.torch_views(), ps.rank
    e_local, n_ranks = count.shape
    valid = torch.arange(cap, device=count.device) < count.unsqueeze(-1)  # [E_local, N, C]
    for src in range(n_ranks):
        e, i = valid[:, src].nonzero(as_tuple=True)
        flat = views["recv_src"][rank][e, src, i].long()
        views["comb_x"][src][flat] = y[e, start[e, src].long() + i]
    views["recv_count"][rank].zero_()
    for flags in views["comb_flag"]:
        flags[rank] = 1


def wait_outputs(ps: PeerSet, max_spins: int) -> None:
    """Step 4: wait for every expert rank's outputs (``COMBINE_TIMED_OUT`` after ``max_spins`` polls)."""
    if use_triton(ps.error):
        from moeserve.kernels.triton import peer_a2a

        peer_a2a.wait_outputs(ps.tables, ps.error, ps.rank, max_spins)
        return
    flags = ps.torch_views()["comb_flag"][ps.rank]
    ps.error |= (flags == 0).any().int() * COMBINE_TIMED_OUT
    flags.zero_()
