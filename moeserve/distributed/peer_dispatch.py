"""Low-latency dispatch that moves only real tokens: each rank writes its tokens into the buffers of
the ranks owning their experts and reads nothing back on the host (``kernels/peer_a2a``), as
DeepEP's low-latency mode does. Over NVLink the buffers are torch symmetric memory
(``symmetric_peer_memory``); ``local_peer_memories`` lets one process play every rank (tests, and
an EP group of one).

The torch low-latency dispatcher sends every rank a whole ``[E_local, C, D]`` block per call,
zeros included; this one sends each (token, choice) row once, so its traffic scales with the
tokens, not with ``C``. Outputs are the torch dispatcher's: ``MaskedDispatchOutput(hidden
[E_local, N * C, D], masked_m [E_local])`` with expert ``e``'s tokens in its first
``masked_m[e]`` rows, source rank 0 first, each source's in token order (the rows behind are not
written), and ``[T, D]`` from ``combine``, summed over the top-k on the source rank.

Buffers: ``SETS`` sets per EP group, shared by every MoE layer (one allocation, as DeepEP's
``Buffer``). A dispatcher takes the sets in turn, call after call, so the two micro-batches of
two-batch overlap, which have a dispatch each in flight at once, never share one; a set is
reused only after the call that last used it has combined, everywhere. Every rank must make the
same calls in the same order (as with any collective).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moeserve.distributed.dispatcher import Dispatcher, MaskedDispatchOutput, received_tokens, token_parts
from moeserve.distributed.groups import Group
from moeserve.kernels import peer_a2a
from moeserve.kernels.combine import topk_weighted_sum
from moeserve.kernels.expert_order import expert_order
from moeserve.kernels.fp8 import FP8_BLOCK

SETS = 2
ALIGN = 256  # bytes between regions
# polls of a missing peer before a wait gives up (each a fraction of a microsecond to a few on
# NVLink): long enough for a slow peer, short enough that a dead one does not hang the GPU forever
MAX_SPINS = 1 << 28


@dataclass(frozen=True)
class PeerLayout:
    """Sizes of the buffer regions (``kernels/peer_a2a``), int32 words throughout."""

    num_ranks: int  # N
    num_local_experts: int  # E_local
    capacity: int  # C: tokens at most per rank per call
    top_k: int  # k
    wa: int  # words of a token's values
    wb: int  # words of its FP8 scales (0 without FP8)
    wc: int  # words of an expert output row

    @classmethod
    def for_model(cls, num_ranks: int, num_local_experts: int, capacity: int, top_k: int, hidden_size: int,
                  dtype: torch.dtype, fp8: bool) -> PeerLayout:
        value_bytes = hidden_size if fp8 else hidden_size * dtype.itemsize
        out_bytes = hidden_size * dtype.itemsize
        if value_bytes % 4 or out_bytes % 4:
            raise ValueError(f"hidden_size {hidden_size} in {dtype} (fp8={fp8}) is not a whole number of 4-byte "
                             "words; the peer all-to-all moves rows as words")
        wb = math.ceil(hidden_size / FP8_BLOCK) if fp8 else 0
        return cls(num_ranks, num_local_experts, capacity, top_k, value_bytes // 4, wb, out_bytes // 4)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        n, e, c = self.num_ranks, self.num_local_experts, self.capacity
        return {"recv_x": (e, n, c, self.wa + self.wb), "recv_src": (e, n, c), "recv_count": (n, e),
                "comb_x": (c * self.top_k, self.wc), "comb_flag": (n,)}

    def offsets(self) -> tuple[dict[str, int], int]:
        """Byte offset of each region in a set, and the set's size."""
        offsets, at = {}, 0
        for name, shape in self.shapes().items():
            offsets[name] = at
            at += -(-math.prod(shape) * 4 // ALIGN) * ALIGN
        return offsets, at

    @property
    def nbytes(self) -> int:
        return SETS * self.offsets()[1]


class PeerMemory:
    """Every EP rank's copy of one byte buffer as this rank reaches it: their addresses, its own
    copy ``local`` as a tensor, and all of them as tensors where this process can address them."""

    def __init__(self, rank: int, addresses: list[int], local: torch.Tensor,
                 buffers: list[torch.Tensor] | None = None) -> None:
        self.rank, self.addresses, self.local, self.buffers = rank, addresses, local, buffers
        self.device, self.nbytes = local.device, local.numel()
        self.error = torch.zeros(1, dtype=torch.int32, device=self.device)  # shared by the dispatchers over this memory
        self._seen = torch.zeros(1, dtype=torch.int32, device="cpu", pin_memory=self.device.type == "cuda")
        self.keep: object = None  # what keeps a mapping alive, where something must
        self._sets: dict[tuple[PeerLayout, int], peer_a2a.PeerSet] = {}  # every layer's dispatcher shares them

    def peer_set(self, layout: PeerLayout, index: int) -> peer_a2a.PeerSet:
        """Buffer set ``index`` laid out as ``layout`` (made once: its address tables live on the device)."""
        key = (layout, index)
        if key not in self._sets:
            self._sets[key] = self._make_set(layout, index)
        return self._sets[key]

    def _make_set(self, layout: PeerLayout, index: int) -> peer_a2a.PeerSet:
        if layout.nbytes > self.nbytes:
            raise ValueError(f"the peer buffers hold {self.nbytes} bytes, the layout needs {layout.nbytes}")
        offsets, size = layout.offsets()
        shapes = layout.shapes()
        base = index * size

        def region(buffer: torch.Tensor, name: str) -> torch.Tensor:
            at = base + offsets[name]
            return buffer[at:at + math.prod(shapes[name]) * 4].view(torch.int32).view(shapes[name])

        tables = {name: torch.tensor([a + base + off for a in self.addresses], dtype=torch.int64, device=self.device)
                  for name, off in offsets.items()}
        local = {name: region(self.local, name) for name in shapes}
        views = None if self.buffers is None else {name: [region(b, name) for b in self.buffers] for name in shapes}
        return peer_a2a.PeerSet(self.rank, self.error, tables, local, views)

    def check(self) -> None:
        """Raise if the error word held an error at the previous call, and copy it to the host again
        without waiting (the engine calls this once a step, whose sampling waits for the copy)."""
        code = int(self._seen)
        if code:
            self._seen.zero_()
            self.error.zero_()
            self._raise(code)
        self._seen.copy_(self.error, non_blocking=True)

    def raise_if_failed(self) -> None:
        """Raise if a wait gave up on a peer since the last call (reads the device: a host sync)."""
        code = int(self.error.item())
        if code:
            self.error.zero_()
            self._raise(code)

    def _raise(self, code: int) -> None:
        what = [w for bit, w in ((peer_a2a.DISPATCH_TIMED_OUT, "dispatch"),
                                 (peer_a2a.COMBINE_TIMED_OUT, "combine")) if code & bit]
        raise RuntimeError(f"EP rank {self.rank}: a peer never signalled during {' and '.join(what)} "
                           "(dead or stuck peer); outputs of that step are garbage")


def local_peer_memories(world_size: int, nbytes: int, device: torch.device | str) -> list[PeerMemory]:
    """One process plays ``world_size`` ranks: rank ``r``'s view of buffers that are all local."""
    device = torch.device(device)
    buffers = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world_size)]
    addresses = [b.data_ptr() for b in buffers]
    return [PeerMemory(r, addresses, buffers[r], buffers) for r in range(world_size)]


def symmetric_peer_memory(ep: Group, nbytes: int, device: torch.device) -> PeerMemory:
    """This rank's view of a buffer in torch symmetric memory over ``ep`` (collective: every rank
    calls it with the same size). The buffers start zeroed on every rank before any is used."""
    from torch.distributed import _symmetric_memory as symm_mem

    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    buffer.zero_()
    handle = symm_mem.rendezvous(buffer, ep.group)
    handle.barrier()
    torch.cuda.synchronize(device)
    memory = PeerMemory(ep.rank, list(handle.buffer_ptrs), buffer)
    memory.keep = handle  # the peers' mappings live as long as it
    return memory


def make_peer_dispatcher(memories: dict, ep: Group, num_local_experts: int, capacity: int, hidden_size: int,
                         top_k: int, dtype: torch.dtype, fp8: bool, device: torch.device) -> PeerLowLatencyDispatcher:
    """A peer dispatcher over ``ep``. ``memories``: a cache the caller keeps for one model, so
    that every MoE layer shares one buffer (the first call allocates it; collective over ``ep``)."""
    layout = PeerLayout.for_model(ep.size, num_local_experts, capacity, top_k, hidden_size, dtype, fp8)
    if "memory" not in memories:
        if ep.size == 1:  # its own buffers: plain memory
            memories["memory"] = local_peer_memories(1, layout.nbytes, device)[0]
        elif device.type == "cuda":
            memories["memory"] = symmetric_peer_memory(ep, layout.nbytes, device)
        else:
            raise ValueError("moe_a2a_backend symm_mem needs CUDA GPUs (torch symmetric memory) with more than one "
                             "EP rank; use torch on CPU")
    return PeerLowLatencyDispatcher(memories["memory"], layout, fp8, dtype)


@dataclass
class PeerHandle:
    """What ``combine`` needs; every tensor on the device."""

    peers: peer_a2a.PeerSet  # the set this call used
    topk_weights: torch.Tensor  # [T, k]
    start: torch.Tensor | None = None  # [E_local, N] int32 (``receive_tokens``)
    count: torch.Tensor | None = None  # [E_local, N] int32


@dataclass
class _PeerPending:
    handle: PeerHandle
    dtype: torch.dtype  # the tokens' dtype (before FP8 quantization)
    expected_m: int


class PeerLowLatencyDispatcher(Dispatcher):
    """Decode dispatch over peer writes (module docstring). ``dispatch_a`` writes the rows and
    counts out; ``dispatch_b`` waits for every source and packs the masked layout; ``combine_a``
    writes the outputs back; ``combine_b`` waits and sums over the top-k. No host sync, fixed
    shapes for a fixed ``T``: CUDA graphs capture it. ``T > C`` raises ``ValueError``."""

    disposable_buffers = True  # the send kernel has read the tokens; the masked layout is allocated per call

    def __init__(self, memory: PeerMemory, layout: PeerLayout, fp8: bool, dtype: torch.dtype,
                 max_spins: int = MAX_SPINS) -> None:
        if (layout.wb > 0) != fp8:
            raise ValueError("the layout's scale words must match fp8")
        self.memory, self.layout, self.fp8, self.dtype, self.max_spins = memory, layout, fp8, dtype, max_spins
        self.sets = [memory.peer_set(layout, i) for i in range(SETS)]
        self._calls = 0

    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> _PeerPending:
        """``hidden [T, D]`` with ``T <= C``, ``topk_ids [T, k]`` int64 in ``[0, E)``, ``topk_weights [T, k]``."""
        lay = self.layout
        num_tokens = hidden.shape[0]
        if num_tokens > lay.capacity:
            raise ValueError(f"{num_tokens} tokens on this rank exceed max_dispatch_tokens_per_rank="
                             f"{lay.capacity}; split the batch or raise the limit")
        if hidden.dtype != self.dtype or topk_ids.shape[1] != lay.top_k:
            raise ValueError(f"the peer buffers were laid out for {self.dtype} tokens and top-{lay.top_k}, got "
                             f"{hidden.dtype} and top-{topk_ids.shape[1]}")
        # each (token, choice)'s row among the tokens this rank sends its expert: its place in the
        # stable expert order less the expert's segment start (one kernel on CUDA at these sizes)
        order = expert_order(topk_ids.flatten(), lay.num_ranks * lay.num_local_experts)
        slots = order.position.view_as(topk_ids) - order.seg_indptr[topk_ids]  # [T, k]
        words = [p.contiguous().view(torch.int32) for p in token_parts(hidden, self.fp8)]
        peers = self.sets[self._calls % SETS]
        self._calls += 1
        peer_a2a.send_tokens(peers, words[0], words[1] if self.fp8 else None, topk_ids, slots, order.counts,
                             lay.num_local_experts, lay.capacity)
        # every rank sends T * k rows over all experts: T * k / E_local an expert, at equal loads
        expected = -(-num_tokens * lay.top_k // lay.num_local_experts)
        return _PeerPending(PeerHandle(peers, topk_weights), hidden.dtype, expected)

    def dispatch_b(self, pending: _PeerPending) -> tuple[MaskedDispatchOutput, PeerHandle]:
        """-> (``MaskedDispatchOutput(hidden [E_local, N * C, D], masked_m [E_local] int32)``, handle)."""
        lay, handle = self.layout, pending.handle
        out_a, out_b, masked_m, handle.start, handle.count = peer_a2a.receive_tokens(
            handle.peers, lay.num_local_experts, lay.capacity, lay.wa, lay.wb, self.max_spins)
        parts = [out_a.view(torch.uint8 if self.fp8 else pending.dtype)]
        if out_b is not None:
            parts.append(out_b.view(torch.float32))
        return (MaskedDispatchOutput(masked_m=masked_m, expected_m=pending.expected_m,
                                     **received_tokens(parts, pending.dtype)), handle)

    def combine_a(self, expert_out: torch.Tensor, handle: PeerHandle) -> PeerHandle:
        """``expert_out [E_local, N * C, D]`` in the masked layout; writes each row back to its source."""
        if expert_out.dtype != self.dtype:
            raise ValueError(f"the combine buffers hold {self.dtype} rows, got {expert_out.dtype}")
        words = expert_out.contiguous().view(torch.int32)
        peer_a2a.send_outputs(handle.peers, words, handle.start, handle.count, self.layout.capacity)
        return handle

    def combine_b(self, handle: PeerHandle) -> torch.Tensor:
        """-> ``[T, D]`` in the tokens' dtype: ``sum_k topk_weights[t, k] * expert_k(hidden[t])``."""
        peer_a2a.wait_outputs(handle.peers, self.max_spins)
        num_tokens, k = handle.topk_weights.shape
        rows = handle.peers.local["comb_x"].view(self.dtype)[:num_tokens * k]  # [T * k, D], (token, choice) order
        return topk_weighted_sum(rows, handle.topk_weights)
