"""Token dispatchers: route each token's hidden state to the experts it chose, and back.

The interface is DeepEP's: ``dispatch`` returns what the local experts must compute plus a
handle, and ``combine`` uses the handle to bring the expert outputs back to the token order,
weighted and summed over each token's top-k. Each call is split into an issue half (``*_a``,
starts the communication) and a wait half (``*_b``, finishes it) so that two-batch overlap can
run one micro-batch's compute between the halves of the other's communication.

Expert-parallel dispatchers (``ep_dispatch``) send tokens across ranks; ``LocalDispatcher`` is the
single-rank case where every expert is local. ``make_dispatcher`` picks one by name.

Two output layouts, as DeepEP hands tokens to DeepGEMM (see ``kernels/grouped_gemm``):
``DispatchOutput`` (contiguous) and ``MaskedDispatchOutput`` (masked).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from moeserve.distributed.comm import scatter_sizes
from moeserve.distributed.groups import Group
from moeserve.kernels import fp8 as fp8_kernels
from moeserve.kernels.combine import topk_weighted_sum
from moeserve.kernels.expert_order import expert_order


@dataclass
class DispatchOutput:
    """Tokens for the local experts in contiguous layout: ``hidden [M, D]`` with expert ``e``
    owning rows ``seg_indptr[e]:seg_indptr[e+1]`` (``seg_indptr [E_local + 1]`` int64).

    A segment may end in zero padding rows (when the dispatcher aligns segments); its first
    ``tokens_per_expert[e]`` rows are the real ones. ``tokens_per_expert [E_local]`` int64 is
    ``None`` when the dispatcher does not report it.
    """

    hidden: torch.Tensor
    seg_indptr: torch.Tensor
    tokens_per_expert: torch.Tensor | None = None
    tail_rows: bool = True  # False: no rows past seg_indptr[-1] (lets the grouped GEMM skip zeroing them)
    # FP8 dispatch (DeepEP's): ``hidden`` in float8_e4m3fn with its 1x128 group scales, as
    # ``per_token_group_quant_fp8`` gives them, and the dtype the tokens had (the experts' output's)
    hidden_scale: torch.Tensor | None = None
    out_dtype: torch.dtype | None = None


@dataclass
class MaskedDispatchOutput:
    """Tokens for the local experts in masked layout: ``hidden [E_local, M_max, D]`` with expert
    ``e`` using only its first ``masked_m[e]`` rows (``masked_m [E_local]`` int32, on the device);
    rows at or past ``masked_m[e]`` are zero. The shape is fixed, so no host sync is needed.
    ``expected_m``: the rows an expert is expected to hold, known on the host from the shapes
    (as DeepGEMM's masked GEMM takes it); it picks the GEMM's tiles. None: unknown."""

    hidden: torch.Tensor
    masked_m: torch.Tensor
    expected_m: int | None = None
    hidden_scale: torch.Tensor | None = None  # FP8 dispatch, as in ``DispatchOutput``
    out_dtype: torch.dtype | None = None


RecvTokens = DispatchOutput | MaskedDispatchOutput


def token_parts(hidden: torch.Tensor, fp8: bool) -> tuple[torch.Tensor, ...]:
    """What a dispatch sends of each token, as tensors of ``[T, ...]`` rows that move alike:
    ``(hidden,)``; with ``fp8`` its FP8 values (as uint8, which every backend moves) and its fp32
    scales ``[T, ceil(D / 128)]``, quantized once a token (``per_token_group_quant_fp8``)."""
    if not fp8:
        return (hidden,)
    values, scales = fp8_kernels.per_token_group_quant_fp8(hidden, fp8_kernels.FP8_BLOCK)
    return values.view(torch.uint8), scales


def received_tokens(parts: list[torch.Tensor], dtype: torch.dtype) -> dict[str, object]:
    """``token_parts``' tensors, received and laid out -> the output's token fields (``hidden``,
    and for FP8 ``hidden_scale`` and ``out_dtype``, the tokens' dtype before quantization)."""
    if len(parts) == 1:
        return {"hidden": parts[0]}
    return {"hidden": parts[0].view(fp8_kernels.FP8_DTYPE), "hidden_scale": parts[1], "out_dtype": dtype}


class Dispatcher(ABC):
    """Routes tokens to experts and back. ``hidden [T, D]``, ``topk_ids [T, k]`` int64 physical
    expert ids, ``topk_weights [T, k]`` (fp32). ``dispatch``/``combine`` are ``b(a(...))``."""

    # True promises that dispatch has read ``hidden`` (in stream order) when ``dispatch_a``
    # returns, and that the receive buffer it hands back is allocated per call and kept by
    # nothing of the dispatcher's: the caller may then free either early (``layers/disposable``).
    # A backend that hands out views of a persistent buffer leaves it False.
    disposable_buffers: bool = False

    @abstractmethod
    def dispatch_a(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> object:
        """Start sending the tokens; returns a pending object for ``dispatch_b``."""

    @abstractmethod
    def dispatch_b(self, pending: object) -> tuple[RecvTokens, object]:
        """Wait for the tokens -> (the local experts' input, a handle for ``combine``)."""

    @abstractmethod
    def combine_a(self, expert_out: torch.Tensor, handle: object) -> object:
        """Start sending ``expert_out`` (the layout ``dispatch`` produced) back; returns a pending object."""

    @abstractmethod
    def combine_b(self, pending: object) -> torch.Tensor:
        """Wait for the expert outputs -> ``[T, D]``, each token's weighted sum over its top-k."""

    def dispatch(self, hidden: torch.Tensor, topk_ids: torch.Tensor,
                 topk_weights: torch.Tensor) -> tuple[RecvTokens, object]:
        """``hidden [T, D]``, ``topk_ids [T, k]`` (physical expert ids), ``topk_weights [T, k]``."""
        return self.dispatch_b(self.dispatch_a(hidden, topk_ids, topk_weights))

    def combine(self, expert_out: torch.Tensor, handle: object) -> torch.Tensor:
        """``expert_out`` in the layout ``dispatch`` produced -> ``[T, D]``."""
        return self.combine_b(self.combine_a(expert_out, handle))


@dataclass
class LocalHandle:
    position: torch.Tensor  # [T * k]: the dispatched row holding each flat (token, choice)
    topk_weights: torch.Tensor  # [T, k]


class LocalDispatcher(Dispatcher):
    """All ``num_experts`` experts live on this rank: dispatch is a sort by expert id, and the
    halves are trivial (nothing to overlap). No host sync and fixed shapes (``T * k`` rows), so
    it runs inside CUDA graphs; combine sums each token's ``k`` rows in a fixed order, so the
    result does not depend on atomics."""

    disposable_buffers = True  # ``index_select`` copies the tokens into a new buffer

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch_a(self, hidden, topk_ids, topk_weights):
        layout = expert_order(topk_ids.flatten(), self.num_experts)
        recv = DispatchOutput(hidden.index_select(0, layout.order // topk_ids.shape[1]), layout.seg_indptr,
                              layout.counts, tail_rows=False)
        return recv, LocalHandle(layout.position, topk_weights)

    def dispatch_b(self, pending):
        return pending

    def combine_a(self, expert_out, handle):
        return topk_weighted_sum(expert_out, handle.topk_weights, handle.position)

    def combine_b(self, pending):
        return pending


DISPATCH_MODES = ("none", "normal", "low_latency")


def step_dispatch_mode(token_counts: list[int], any_extend: bool, attn_tp_size: int, backend: str,
                       deepep_mode: str, ll_capacity: int) -> str:
    """The dispatch mode of a step all ranks agreed on: ``token_counts`` per DP group, split over
    ``attn_tp_size`` ranks each. ``auto`` takes low-latency for decode steps that fit its buffers."""
    if backend == "none":
        return "none"
    if deepep_mode != "auto":
        return deepep_mode
    per_rank = max(max(scatter_sizes(t, attn_tp_size)) for t in token_counts)  # the largest scattered share
    return "normal" if any_extend or per_rank > ll_capacity else "low_latency"


def make_dispatcher(mode: str, ep: Group, num_local_experts: int, max_dispatch_tokens_per_rank: int,
                    alignment: int = 1, fp8: bool = False) -> Dispatcher:
    """The dispatcher for ``mode``: ``"none"`` (all experts local; needs ``ep.size == 1``),
    ``"normal"`` (prefill; contiguous layout, segments padded to ``alignment`` rows) or
    ``"low_latency"`` (decode; masked layout, at most ``max_dispatch_tokens_per_rank`` tokens
    per rank per call). Choosing per batch ("auto") is the caller's job: all ranks must agree.
    ``fp8``: the EP dispatchers send FP8 tokens with their 1x128 scales (for FP8 experts, which
    would quantize them so anyway: the same numbers at half the bytes)."""
    if mode == "none":
        if ep.size != 1:
            raise ValueError(f"dispatch mode 'none' needs an EP group of one rank, got {ep.size}")
        return LocalDispatcher(num_local_experts)
    # imported here so that other backends (DeepEP) can sit beside it without import costs
    from moeserve.distributed.ep_dispatch import TorchLowLatencyDispatcher, TorchNormalDispatcher

    if mode == "normal":
        return TorchNormalDispatcher(ep, num_local_experts, alignment, fp8)
    if mode == "low_latency":
        return TorchLowLatencyDispatcher(ep, num_local_experts, max_dispatch_tokens_per_rank, fp8)
    raise ValueError(f"unknown dispatch mode {mode!r}; choose from {DISPATCH_MODES}")
