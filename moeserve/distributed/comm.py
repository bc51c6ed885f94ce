"""Collectives over a ``Group`` for token layouts whose sizes differ by rank.

Every rank knows every rank's token count (the step's agreement puts them in the batch), so
padding to the largest is decided locally and no size exchange is needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeserve.distributed.groups import Group

# torch 2.13 renamed the flat collectives; older releases (GPU images) only have the old names
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_flat(out: torch.Tensor, x: torch.Tensor, group: Group) -> None:
    """``out [size * len(x), ...]`` <- every rank's ``x`` in rank order."""
    _all_gather_flat(out, x.contiguous(), group=group.group)


def all_gather_tokens(x: torch.Tensor, group: Group, counts: list[int]) -> torch.Tensor:
    """Concatenate every group rank's ``x [counts[i], ...]`` in rank order -> ``[sum(counts), ...]``."""
    pad = max(counts)
    if group.size == 1 or pad == 0:  # every rank knows the counts, so all skip an empty collective together
        return x
    buf = x.new_empty((group.size * pad, *x.shape[1:]))
    all_gather_flat(buf, _pad_rows(x, pad), group)
    return torch.cat([buf[i * pad:i * pad + n] for i, n in enumerate(counts)])


def reduce_scatter_tokens(x: torch.Tensor, group: Group, counts: list[int]) -> torch.Tensor:
    """Sum ``x [sum(counts), ...]`` over the group and keep this rank's rows ``[counts[rank], ...]``."""
    pad = max(counts)
    if group.size == 1 or pad == 0:
        return x
    parts, start = [], 0
    for n in counts:
        parts.append(_pad_rows(x[start:start + n], pad))
        start += n
    out = x.new_empty((pad, *x.shape[1:]))
    _reduce_scatter_flat(out, torch.cat(parts), group=group.group)
    return out[:counts[group.rank]]


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if group.size > 1:
        dist.all_reduce(x, group=group.group)
    return x


def all_gather_last_dim(x: torch.Tensor, group: Group) -> torch.Tensor:
    """``x [N, d]`` on every rank (the same ``N``) -> ``[N, d * size]`` (vocab shards side by side)."""
    if group.size == 1:
        return x
    if x.shape[0] == 0:
        return x.new_empty((0, x.shape[1] * group.size))
    buf = x.new_empty((group.size * x.shape[0], *x.shape[1:]))
    all_gather_flat(buf, x, group)
    return torch.cat(buf.chunk(group.size), dim=-1)


def scatter_sizes(total: int, parts: int) -> list[int]:
    """How ``total`` tokens split into ``parts`` contiguous slices (the first ones larger)."""
    base, extra = divmod(total, parts)
    return [base + (i < extra) for i in range(parts)]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x.contiguous()
    pad = x.new_zeros((rows - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad])


def broadcast_bytes(data: bytes, group: Group) -> bytes:
    """The group leader's ``data`` on every rank (a CPU group; others pass anything, e.g. b"").

    Host-side messages travel as bytes their receivers decode against a schema, never as pickles.
    """
    if group.size == 1:
        return data
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=group.leader, group=group.group)
    n = int(size)
    if n == 0:
        return b""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if group.first else torch.empty(n, dtype=torch.uint8)
    dist.broadcast(buf, src=group.leader, group=group.group)
    return buf.numpy().tobytes()
