"""Mixture of experts: routed experts through grouped GEMMs, plus always-on shared experts."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.distributed.dispatcher import Dispatcher, MaskedDispatchOutput, RecvTokens, make_dispatcher
from moeserve.distributed.emulated import EmulatedDispatcher, EmulatedEP
from moeserve.distributed.groups import ParallelGroups
from moeserve.distributed.peer_dispatch import make_peer_dispatcher
from moeserve.eplb.placement import ExpertLocation, ExpertPlacement
from moeserve.eplb.recorder import ExpertRecorder
from moeserve.kernels import fp8
from moeserve.kernels.grouped_gemm import grouped_gemm_contiguous, grouped_gemm_masked
from moeserve.layers.disposable import dispose
from moeserve.layers.gate import Gate
from moeserve.layers.linear import Slot, frozen, frozen_fp8
from moeserve.layers.mlp import MLP


class Experts(nn.Module):
    """This rank's physical expert slots as stacked weights: ``w13 [E_local, 2I, D]`` (gate then
    up) and ``w2 [E_local, D, I]``. Slot ``j`` holds logical expert ``logical_ids[j]``, filled from
    the checkpoint's per-expert tensors; a logical expert with several replicas here fills each."""

    def __init__(self, logical_ids: list[int], num_logical: int, hidden_size: int, intermediate_size: int,
                 fp8: bool = False, layer_id: int = 0) -> None:
        super().__init__()
        self.logical_ids, self.num_logical, self.layer_id = logical_ids, num_logical, layer_id
        self.num_experts, self.intermediate_size = len(logical_ids), intermediate_size
        # FP8: per-expert 128x128 block scales [E, ceil(N/128), ceil(K/128)] beside each stack
        self.w13_scale_inv: nn.Parameter | None = None
        self.w2_scale_inv: nn.Parameter | None = None
        if fp8:
            self.w13, self.w13_scale_inv = frozen_fp8(self.num_experts, 2 * intermediate_size, hidden_size)
            self.w2, self.w2_scale_inv = frozen_fp8(self.num_experts, hidden_size, intermediate_size)
        else:
            self.w13 = frozen(self.num_experts, 2 * intermediate_size, hidden_size)
            self.w2 = frozen(self.num_experts, hidden_size, intermediate_size)

    def checkpoint_slots(self) -> dict[str, list[Slot]]:
        inter = self.intermediate_size
        slots: dict[str, list[Slot]] = {}
        for e in range(self.num_logical):  # every logical name is known, held here or not
            for part in ("gate_proj", "up_proj", "down_proj"):
                slots[f"{e}.{part}.weight"] = []
        for j, e in enumerate(self.logical_ids):
            slots[f"{e}.gate_proj.weight"].append((self.w13, (j, slice(0, inter)), ()))
            slots[f"{e}.up_proj.weight"].append((self.w13, (j, slice(inter, 2 * inter)), ()))
            slots[f"{e}.down_proj.weight"].append((self.w2, (j,), ()))
        return slots

    def stacks(self) -> dict[str, torch.Tensor]:
        """Every stacked tensor with one row per slot (weights, and FP8 scales): what moves with an
        expert when a rebalance gives its slot to another."""
        named = {"w13": self.w13, "w2": self.w2, "w13_scale_inv": self.w13_scale_inv,
                 "w2_scale_inv": self.w2_scale_inv}
        return {name: t.data for name, t in named.items() if t is not None}

    def fill_dummy(self, seed: int) -> None:
        """Random weights that depend only on (seed, layer, logical expert): replicas of an expert,
        on any rank, and a rebalance's fresh copy of it hold the same values."""
        for slot, logical in enumerate(self.logical_ids):
            gen = torch.Generator(device=self.w13.device).manual_seed(dummy_expert_seed(seed, self.layer_id, logical))
            for weight, scale in ((self.w13, self.w13_scale_inv), (self.w2, self.w2_scale_inv)):
                values = torch.empty(weight.shape[1:], dtype=torch.float32, device=weight.device)
                values.normal_(0.0, 0.02, generator=gen)
                if scale is None:
                    weight.data[slot].copy_(values)
                else:
                    q, s = fp8.block_quant_fp8(values, (fp8.FP8_BLOCK, fp8.FP8_BLOCK))
                    weight.data[slot].copy_(q)
                    scale.data[slot].copy_(s)

    def forward(self, recv: RecvTokens) -> torch.Tensor:
        """Output in the input's layout: contiguous ``hidden [M, D] -> [M, D]`` (padding rows
        stay zero) or masked ``hidden [E, M_max, D] -> [E, M_max, D]`` (rows at or past
        ``masked_m[e]`` zero). ``E`` is this module's expert count (the local experts under EP).
        Tokens dispatched in FP8 (``recv.hidden_scale`` set) go to the first GEMM as they are, and the
        output takes the dtype they had (``recv.out_dtype``)."""
        if recv.hidden_scale is not None and self.w13_scale_inv is None:
            raise ValueError("FP8-dispatched tokens need FP8 expert weights; dispatch in the model's dtype")
        h = self._gemm(recv, recv.hidden, self.w13, self.w13_scale_inv, gated=True,
                       x_scale=recv.hidden_scale)  # silu(gate) * up [..., I]
        # the received tokens ([T * k, D] at the peak) are read no more; freed now when the dispatcher
        # allowed it (a ``DisposableTensor``), so the second GEMM's output does not stack on them
        dispose(recv.hidden, keep=(h,))
        return self._gemm(recv, h, self.w2, self.w2_scale_inv)

    def _gemm(self, recv: RecvTokens, x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None,
              gated: bool = False, x_scale: torch.Tensor | None = None) -> torch.Tensor:
        fp8_args = {}
        if w_scale is not None:  # FP8 weights: activations per 1x128 group, quantized here unless they came so
            if x_scale is None:
                out_dtype = x.dtype
                x, x_scale = fp8.per_token_group_quant_fp8(x, fp8.FP8_BLOCK)
            else:
                out_dtype = recv.out_dtype
            fp8_args = {"x_scale": x_scale, "w_scale": w_scale, "out_dtype": out_dtype}
        if isinstance(recv, MaskedDispatchOutput):
            return grouped_gemm_masked(x, w, recv.masked_m, **fp8_args, fuse_silu_and_mul=gated,
                                       expected_m=recv.expected_m)
        return grouped_gemm_contiguous(x, w, recv.seg_indptr, **fp8_args, tail_rows=recv.tail_rows,
                                       fuse_silu_and_mul=gated)


def dummy_expert_seed(seed: int, layer: int, logical: int) -> int:
    return (seed * 1_000_003 + layer) * 1_000_003 + logical


@dataclass(frozen=True)
class MoEOptions:
    """How routed experts are laid out and reached: placement over EP ranks, how a routed expert
    picks a replica, dispatch modes, and the load recorder (if any)."""

    placement: ExpertPlacement
    a2a_backend: str = "none"  # none | torch | symm_mem | deepep
    deepep_mode: str = "auto"  # normal | low_latency | auto
    max_dispatch_tokens_per_rank: int = 128
    dispatch_algorithm: str = "static"  # static | dynamic | fake (``LayerExpertMap``)
    recorder: ExpertRecorder | None = None
    # one rank of an EP group emulated alone (``bench rank``): local copies stand in for the all-to-all
    emulated: EmulatedEP | None = None
    # the peer buffers of ``symm_mem`` low-latency dispatch, made by the first MoE layer and
    # shared by all (``distributed/peer_dispatch``)
    peer_memory: dict = field(default_factory=dict, compare=False, repr=False)

    @functools.cached_property
    def location(self) -> ExpertLocation:
        """The placement on the device (the default device when first asked), one for all layers."""
        return ExpertLocation(self.placement, torch.get_default_device())

    @classmethod
    def single(cls, cfg: ModelConfig) -> MoEOptions:
        return cls(ExpertPlacement.trivial(cfg.num_layers, max(cfg.n_routed_experts, 1), 1))


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, groups: ParallelGroups, opts: MoEOptions,
                 fp8: bool = False) -> None:
        super().__init__()
        self.layer_id, self.ep, self.placement = layer_id, groups.ep, opts.placement
        self.expert_map = opts.location.layer_map(layer_id, groups.ep.rank, opts.dispatch_algorithm)
        self.recorder = opts.recorder
        self.gate = Gate(cfg)
        local = opts.placement.local_slots(groups.ep.rank)
        logical_ids = opts.placement.phy2log[layer_id, local.start:local.stop].tolist()
        self.experts = Experts(logical_ids, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, fp8,
                               layer_id)
        # replicated on every rank, applied to the rank's own tokens (as with DeepEP)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, fp8=fp8)
            if cfg.n_shared_experts else None
        )
        self._dispatchers = self._make_dispatchers(cfg, opts, len(logical_ids), fp8_experts=fp8)

    def _make_dispatchers(self, cfg: ModelConfig, opts: MoEOptions, num_local: int,
                          fp8_experts: bool) -> dict[str, Dispatcher]:
        # FP8 experts take FP8 tokens: the all-to-all moves them so (DeepEP's FP8 dispatch)
        if opts.emulated is not None:
            mode = "normal" if opts.deepep_mode == "auto" else opts.deepep_mode
            return {mode: EmulatedDispatcher(mode, num_local, opts.emulated, self.layer_id, fp8_experts)}
        if opts.a2a_backend == "none":
            return {"none": make_dispatcher("none", self.ep, num_local, opts.max_dispatch_tokens_per_rank)}
        if opts.a2a_backend == "deepep":
            raise ValueError("moe_a2a_backend deepep needs DeepEP, which is not installed; use torch")
        modes = ["normal", "low_latency"] if opts.deepep_mode == "auto" else [opts.deepep_mode]
        out = {m: make_dispatcher(m, self.ep, num_local, opts.max_dispatch_tokens_per_rank, fp8=fp8_experts)
               for m in modes if m == "normal" or opts.a2a_backend == "torch"}
        if "low_latency" in modes and opts.a2a_backend == "symm_mem":  # built under the model's device and dtype
            out["low_latency"] = make_peer_dispatcher(
                opts.peer_memory, self.ep, num_local, opts.max_dispatch_tokens_per_rank, cfg.hidden_size,
                cfg.num_experts_per_tok, torch.get_default_dtype(), fp8_experts, torch.get_default_device())
        return out

    def dispatcher(self, mode: str) -> Dispatcher:
        """The dispatcher for this step's agreed mode (the only one when there is no choice)."""
        if len(self._dispatchers) == 1:
            return next(iter(self._dispatchers.values()))
        return self._dispatchers[mode]

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden [T, D]`` -> ``(topk_weights [T, k], physical topk_ids [T, k])``."""
        weights, logical = self.gate(hidden)
        physical = self.expert_map.to_physical(logical)
        if self.recorder is not None:
            self.recorder.record(self.layer_id, logical, physical)
        return weights, physical

    def shared(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.shared_experts(hidden) if self.shared_experts is not None else None
