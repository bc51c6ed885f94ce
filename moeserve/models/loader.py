"""Fill a model's parameters from a checkpoint folder, or with random values (``dummy``)."""

from __future__ import annotations

import re

import torch
from torch import nn
from tqdm import tqdm

from moeserve.config import ModelConfig
from moeserve.layers.linear import Slot
from moeserve.models.checkpoint import iter_checkpoint, list_checkpoint_tensors

_SCALE_SUFFIX = "_scale_inv"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_slots(model: nn.Module) -> dict[str, list[Slot]]:
    """Map every checkpoint tensor name the model knows to where it goes.

    Modules with a ``checkpoint_slots()`` method (merged or stacked weights) say where their
    checkpoint tensors land; every other parameter takes the tensor of its own name. A name
    mapped to an empty list is known but not held here (e.g. an expert of another rank).
    """
    slots: dict[str, list[Slot]] = {}
    claimed: set[int] = set()
    for mod_name, module in model.named_modules():
        if hasattr(module, "checkpoint_slots"):
            prefix = f"{mod_name}." if mod_name else ""
            for name, dests in module.checkpoint_slots().items():
                slots[prefix + name] = dests
                claimed.update(id(param) for param, _, _ in dests)
    for name, param in model.named_parameters(remove_duplicate=True):
        if id(param) not in claimed:
            slots[name] = [(param, (), ())]
    return slots


def load_checkpoint(model: nn.Module, model_path: str, cfg: ModelConfig) -> None:
    """Copy every tensor of the checkpoint into the model; unknown or missing names are errors."""
    slots = checkpoint_slots(model)
    names = {n for n in list_checkpoint_tensors(model_path)
             if not n.endswith(_SCALE_SUFFIX) and not _is_mtp(n, cfg)}
    unknown = sorted(names - slots.keys())
    if unknown:
        raise ValueError(f"checkpoint {model_path!r} has tensors the model does not know: {_few(unknown)}")
    missing = sorted(n for n in slots.keys() - names if slots[n])
    if missing:
        raise ValueError(f"checkpoint {model_path!r} lacks tensors the model needs: {_few(missing)}")
    wanted = [n for n in names if slots[n]]
    stream = iter_checkpoint(model_path, cfg, wanted=set(wanted).__contains__)
    for name, tensor in tqdm(stream, total=len(wanted), desc="loading weights", unit="tensor",
                             leave=False, disable=len(wanted) < 200):
        for param, dest_index, src_index in slots[name]:
            dest = param.data[dest_index]
            src = tensor[src_index] if _fits(tensor, src_index) else None
            if src is None or dest.shape != src.shape:
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dest.shape)} (from index {src_index})")
            dest.copy_(src)


def load_dummy(model: nn.Module, seed: int) -> None:
    """Random weights of the real shapes, for benchmarks without a checkpoint."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        gen = generators.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith("e_score_correction_bias"):
            param.data.zero_()
        else:
            param.data.normal_(0.0, 0.02, generator=gen)


def _fits(tensor: torch.Tensor, index: tuple) -> bool:
    """Whether ``index`` (slices) lies inside ``tensor``, so a too-small tensor is an error, not a
    silently shorter slice."""
    if len(index) > tensor.dim():
        return False
    return all(not isinstance(i, slice) or i.stop is None or i.stop <= n for i, n in zip(index, tensor.shape))


def _is_mtp(name: str, cfg: ModelConfig) -> bool:
    match = _LAYER.match(name)
    return match is not None and int(match.group(1)) >= cfg.num_layers


def _few(names: list[str], limit: int = 5) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
