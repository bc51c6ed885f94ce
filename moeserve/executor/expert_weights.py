"""Stage 1 of an expert rebalance (``eplb.manager``): where the weights of a logical expert that a
rank does not hold come from.

- ``HostWeights`` (``--eplb-weights-source host``): every logical expert of every MoE layer read
  once at load into host memory (pinned on CUDA, so stage 2's copies to the device are
  asynchronous);
- ``MmapWeights`` (``mmap``): read from the checkpoint when a rebalance needs it (safetensors maps
  the files, so the page cache is all the host memory it takes);
- ``DummyWeights``: random weights (``--load-format dummy``) have no file; an expert's are made
  again, on the device, from (seed, layer, expert) exactly as at load.

Each gives one expert as ``{stack name: tensor}`` with the rows ``Experts.stacks()`` has per slot
(weights, and FP8 scales with them), read through a one-layer ``Experts`` filled by the model's
own loader, so FP8 checkpoints, quantization and slicing work as at load.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from moeserve.config import EngineConfig
from moeserve.core import default_dtype
from moeserve.layers.moe import Experts
from moeserve.models.loader import load_checkpoint


class ExpertWeights(ABC):
    @abstractmethod
    def fetch(self, layer: int, logical: int) -> dict[str, torch.Tensor]:
        """Logical expert ``logical`` of ``layer``: one row of each stack (on the host, or on the
        device for dummy weights)."""


def _experts_module(config: EngineConfig, layer: int, logical_ids: list[int], fp8: bool) -> nn.Module:
    """A module whose names match the checkpoint's for ``layer``'s experts ``logical_ids``."""
    cfg = config.model
    experts = Experts(logical_ids, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, fp8, layer)
    mlp = nn.Module()
    mlp.experts = experts
    block = nn.Module()
    block.mlp = mlp
    body = nn.Module()
    body.layers = nn.ModuleDict({str(layer): block})
    root = nn.Module()
    root.model = body
    return root


def _read(config: EngineConfig, layer: int, logical_ids: list[int], fp8: bool, dtype: torch.dtype) -> Experts:
    with torch.device("cpu"), default_dtype(dtype):
        root = _experts_module(config, layer, logical_ids, fp8)
    load_checkpoint(root, config.load.model_path, config.model, partial=True)
    return root.model.layers[str(layer)].mlp.experts


class HostWeights(ExpertWeights):
    def __init__(self, config: EngineConfig, layers: list[int], fp8: bool, dtype: torch.dtype, pin: bool) -> None:
        every = list(range(config.model.n_routed_experts))
        self.stacks: dict[int, dict[str, torch.Tensor]] = {}
        for layer in layers:
            stacks = _read(config, layer, every, fp8, dtype).stacks()
            self.stacks[layer] = {k: v.pin_memory() if pin else v for k, v in stacks.items()}

    def fetch(self, layer: int, logical: int) -> dict[str, torch.Tensor]:
        return {name: stack[logical] for name, stack in self.stacks[layer].items()}


class MmapWeights(ExpertWeights):
    def __init__(self, config: EngineConfig, fp8: bool, dtype: torch.dtype) -> None:
        self.config, self.fp8, self.dtype = config, fp8, dtype

    def fetch(self, layer: int, logical: int) -> dict[str, torch.Tensor]:
        stacks = _read(self.config, layer, [logical], self.fp8, self.dtype).stacks()
        return {name: stack[0] for name, stack in stacks.items()}


class DummyWeights(ExpertWeights):
    def __init__(self, config: EngineConfig, fp8: bool, dtype: torch.dtype, device: torch.device) -> None:
        self.config, self.fp8, self.dtype, self.device = config, fp8, dtype, device

    def fetch(self, layer: int, logical: int) -> dict[str, torch.Tensor]:
        cfg = self.config.model
        with torch.device(self.device), default_dtype(self.dtype):
            experts = Experts([logical], cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                              self.fp8, layer)
        experts.fill_dummy(self.config.load.seed)
        return {name: stack[0] for name, stack in experts.stacks().items()}


def make_expert_weights(config: EngineConfig, layers: list[int], fp8: bool, dtype: torch.dtype,
                        device: torch.device) -> ExpertWeights:
    if config.load.load_format == "dummy":
        return DummyWeights(config, fp8, dtype, device)
    if config.eplb.eplb_weights_source == "mmap":
        return MmapWeights(config, fp8, dtype)
    return HostWeights(config, layers, fp8, dtype, pin=device.type == "cuda")
