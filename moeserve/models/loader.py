"""Fill a model's parameters from a checkpoint folder, or with random values (``dummy``)."""

from __future__ import annotations

import re

import torch
from torch import nn
from tqdm import tqdm

from moeserve.config import ModelConfig
from moeserve.kernels.fp8 import FP8_BLOCK, FP8_DTYPE, block_quant_fp8
from moeserve.layers.linear import Slot
from moeserve.models.checkpoint import QuantizedWeight, iter_checkpoint, list_checkpoint_tensors

_SCALE_SUFFIX = "_scale_inv"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_slots(model: nn.Module) -> dict[str, list[Slot]]:
    """Map every checkpoint tensor name the model knows to where it goes.

    Modules with a ``checkpoint_slots()`` method (merged or stacked weights) say where their
    checkpoint tensors land; every other parameter takes the tensor of its own name. A name
    mapped to an empty list is known but not held here (e.g. an expert of another rank). A module
    with a ``checkpoint_prefix`` is stored under that prefix instead of its path in the model
    (DeepSeek's MTP module, ``mtp.`` here, is ``model.layers.{N}.`` in the checkpoint).
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
        if id(param) not in claimed and not name.endswith(_SCALE_SUFFIX):  # scales come with their weight
            slots[name] = [(param, (), ())]
    return _stored_names(model, slots)


def _stored_names(model: nn.Module, slots: dict[str, list[Slot]]) -> dict[str, list[Slot]]:
    """``slots`` under the checkpoint's names: the path of a module with a ``checkpoint_prefix``
    replaced by that prefix (the innermost such module's, when they nest)."""
    renames = sorted(((f"{n}.", m.checkpoint_prefix) for n, m in model.named_modules()
                      if n and hasattr(m, "checkpoint_prefix")), key=lambda r: len(r[0]), reverse=True)
    if not renames:
        return slots
    stored = {}
    for name, dests in slots.items():
        path, prefix = next(((p, c) for p, c in renames if name.startswith(p)), ("", ""))
        stored[prefix + name[len(path):]] = dests
    return stored


def load_checkpoint(model: nn.Module, model_path: str, cfg: ModelConfig, partial: bool = False) -> None:
    """Copy every tensor of the checkpoint into the model; unknown or missing names are errors.
    MTP layers the model does not hold (all of them, without its MTP module) are skipped.
    ``partial``: ``model`` holds only some of the checkpoint (a module named like a part of the
    model, e.g. one layer's experts): the others are skipped."""
    slots = checkpoint_slots(model)
    held = {int(m.group(1)) for n in slots if (m := _LAYER.match(n))}
    names = {n for n in list_checkpoint_tensors(model_path)
             if not n.endswith(_SCALE_SUFFIX) and not _unheld_mtp(n, cfg, held) and (not partial or n in slots)}
    unknown = sorted(names - slots.keys())
    if unknown:
        raise ValueError(f"checkpoint {model_path!r} has tensors the model does not know: {_few(unknown)}")
    missing = sorted(n for n in slots.keys() - names if slots[n])
    if missing:
        raise ValueError(f"checkpoint {model_path!r} lacks tensors the model needs: {_few(missing)}")
    wanted = [n for n in names if slots[n]]
    staged = _fp8_staging(slots)
    stream = iter_checkpoint(model_path, cfg, wanted=set(wanted).__contains__, include_mtp=True,
                             keep_fp8=any(p.dtype == FP8_DTYPE for p in model.parameters()))
    for name, tensor in tqdm(stream, total=len(wanted), desc="loading weights", unit="tensor",
                             leave=False, disable=len(wanted) < 200):
        for param, dest_index, src_index in slots[name]:
            if not _fits(tensor, src_index) or param.data[dest_index].shape != _sliced_shape(tensor, src_index):
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(param.data[dest_index].shape)} (from index {src_index})")
            if id(param) in staged:
                staged[id(param)][1][dest_index].copy_(_plain(tensor)[src_index])
            elif param.dtype == FP8_DTYPE:
                _copy_fp8(param, dest_index, src_index, tensor)
            else:
                param.data[dest_index].copy_(_plain(tensor)[src_index])
    for param, stage in staged.values():
        _quantize_into(param, stage)


def _plain(tensor: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    return tensor.dequantize() if isinstance(tensor, QuantizedWeight) else tensor


def _sliced_shape(tensor: torch.Tensor | QuantizedWeight, index: tuple) -> torch.Size:
    return torch.empty(tensor.shape, device="meta")[index].shape


# FP8 weights are filled block by block: a slot whose region starts and ends on 128-row and
# 128-column block edges takes the checkpoint's FP8 values and scales as they are (or quantizes
# its slice); a weight with any other slot (gate and up stacked at an unaligned boundary, in
# small models) is gathered in fp32 first and quantized once it is whole.


def _fp8_staging(slots: dict[str, list[Slot]]) -> dict[int, tuple[nn.Parameter, torch.Tensor]]:
    staged = {}
    for dests in slots.values():
        for param, dest_index, _ in dests:
            if param.dtype == FP8_DTYPE and _block_region(dest_index, param.shape) is None:
                staged.setdefault(id(param), (param, torch.zeros(param.shape, dtype=torch.float32, device=param.device)))
    return staged


def _block_region(index: tuple, shape: torch.Size) -> tuple[tuple, slice, slice] | None:
    """``index`` into a ``[..., N, K]`` tensor as (leading indices, row blocks, column blocks),
    or None when its rows or columns do not start and end on block edges."""
    full = list(index) + [slice(None)] * (len(shape) - len(index))
    lead, blocks = tuple(full[:-2]), []
    for i, n in zip(full[-2:], shape[-2:]):
        start, stop, step = i.indices(n) if isinstance(i, slice) else (0, 0, 0)
        if not isinstance(i, slice) or step != 1 or start % FP8_BLOCK or (stop % FP8_BLOCK and stop != n):
            return None
        blocks.append(slice(start // FP8_BLOCK, -(-stop // FP8_BLOCK)))
    return lead, blocks[0], blocks[1]


def _copy_fp8(param: nn.Parameter, dest_index: tuple, src_index: tuple, tensor: torch.Tensor | QuantizedWeight) -> None:
    lead, rows, cols = _block_region(dest_index, param.shape)
    src_blocks = _block_region(src_index, tensor.shape)
    as_stored = (isinstance(tensor, QuantizedWeight) and tensor.block == (FP8_BLOCK, FP8_BLOCK)
                 and src_blocks is not None)
    if as_stored:
        values, scales = tensor.fp8[src_index], tensor.scale_inv[src_blocks[1], src_blocks[2]]
    else:
        values, scales = block_quant_fp8(_plain(tensor)[src_index], (FP8_BLOCK, FP8_BLOCK))
    param.data[dest_index].copy_(values)
    param.scale_inv.data[(*lead, rows, cols)].copy_(scales)


def _quantize_into(param: nn.Parameter, stage: torch.Tensor) -> None:
    """Quantize a whole staged weight ``[..., N, K]``, one ``[N, K]`` matrix at a time."""
    for i, matrix in enumerate(stage.view(-1, *stage.shape[-2:])):
        _quantize_into_one(param, i, matrix)


def load_dummy(model: nn.Module, seed: int) -> None:
    """Random weights of the real shapes, for benchmarks without a checkpoint; FP8 weights get
    the block quantization of such random values."""
    generators: dict[torch.device, torch.Generator] = {}
    experts = [m for m in model.modules() if hasattr(m, "fill_dummy")]
    for module in experts:  # by logical expert: every replica, and a rebalance's copy, alike
        module.fill_dummy(seed)
    skip = {id(p) for m in experts for p in m.parameters()}
    for name, param in model.named_parameters():
        if id(param) in skip:
            continue
        gen = generators.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        elif name.endswith("e_score_correction_bias"):
            param.data.zero_()
        elif param.dtype == FP8_DTYPE:
            stage = torch.empty(param.shape[-2:], dtype=torch.float32, device=param.device)
            for i in range(param[..., 0, 0].numel()):  # one [N, K] matrix at a time
                _quantize_into_one(param, i, stage.normal_(0.0, 0.02, generator=gen))
        elif not name.endswith(_SCALE_SUFFIX):
            param.data.normal_(0.0, 0.02, generator=gen)


def _quantize_into_one(param: nn.Parameter, i: int, matrix: torch.Tensor) -> None:
    values, scale = block_quant_fp8(matrix, (FP8_BLOCK, FP8_BLOCK))
    param.data.view(-1, *param.shape[-2:])[i].copy_(values)
    param.scale_inv.data.view(-1, *param.scale_inv.shape[-2:])[i].copy_(scale)


def _fits(tensor: torch.Tensor | QuantizedWeight, index: tuple) -> bool:
    """Whether ``index`` (slices) lies inside ``tensor``, so a too-small tensor is an error, not a
    silently shorter slice."""
    if len(index) > len(tensor.shape):
        return False
    return all(not isinstance(i, slice) or i.stop is None or i.stop <= n for i, n in zip(index, tensor.shape))


def _unheld_mtp(name: str, cfg: ModelConfig, held: set[int]) -> bool:
    """A tensor of an MTP layer (DeepSeek-V3 ships them after the last layer) that the model does
    not hold (``held``: the layer numbers of the names it knows)."""
    match = _LAYER.match(name)
    return match is not None and int(match.group(1)) >= cfg.num_layers and int(match.group(1)) not in held


def _few(names: list[str], limit: int = 5) -> str:
    more = f" (and {len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
