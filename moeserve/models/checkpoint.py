"""Reading Hugging Face checkpoint folders: which file holds each tensor, and streaming them out.

FP8 checkpoints (DeepSeek-V3 as released) store a block-quantized ``<name>`` with a sibling
``<name>_scale_inv``; they come out of ``iter_checkpoint`` dequantized, or as ``QuantizedWeight``
when the model keeps FP8 weights.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open

from moeserve.config import EngineConfig, ModelConfig
from moeserve.kernels.fp8 import FP8_DTYPE, block_dequant_fp8

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class QuantizedWeight:
    """An FP8 checkpoint tensor as stored: ``fp8 [N, K]`` e4m3 and ``scale_inv`` per ``block``."""

    fp8: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.fp8.shape

    def dequantize(self) -> torch.Tensor:
        return block_dequant_fp8(self.fp8, self.scale_inv, self.block)
SCALE_SUFFIX = "_scale_inv"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def list_checkpoint_tensors(model_path: str) -> dict[str, str]:
    """Map each tensor name in the folder to the path of the safetensors file that holds it.

    Reads ``model.safetensors.index.json`` when present (sharded checkpoints), else the headers
    of every ``*.safetensors`` file in the folder.
    """
    index_path = os.path.join(model_path, INDEX_FILE)
    if os.path.isfile(index_path):
        return _read_index(model_path, index_path)
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"model_path {model_path!r} has no *.safetensors files (nor {INDEX_FILE})")
    names: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name in names:
                    raise ValueError(f"tensor {name!r} appears in both {names[name]!r} and {path!r}")
                names[name] = path
    return names


def iter_checkpoint(
    model_path: str, cfg: ModelConfig, wanted: Callable[[str], bool] = lambda name: True, keep_fp8: bool = False,
    include_mtp: bool = False,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield ``(name, tensor)`` for each weight of the model, one tensor read at a time.

    Only names that ``wanted`` accepts are read (a rank loads what it owns). MTP layers
    (``model.layers.{i}`` with ``i >= cfg.num_layers``) are skipped unless ``include_mtp``. FP8
    weights are dequantized to float32 with their ``_scale_inv`` and ``cfg.fp8_block``
    (``keep_fp8``: yielded as stored, in a ``QuantizedWeight``); ``_scale_inv`` tensors are never
    yielded alone. Other tensors keep their stored dtype.
    """
    files = list_checkpoint_tensors(model_path)
    _check_scales_have_weights(files)
    names = [n for n in files if not n.endswith(SCALE_SUFFIX) and (include_mtp or not _is_mtp(n, cfg))
             and wanted(n)]
    for path, group in _group_by_file(names, files).items():
        with safe_open(path, framework="pt") as f:
            for name in group:
                yield name, _read_weight(f, path, name, files, cfg, keep_fp8)


def _read_weight(f: safe_open, path: str, name: str, files: dict[str, str], cfg: ModelConfig,
                 keep_fp8: bool = False) -> torch.Tensor | QuantizedWeight:
    """Read ``name`` from ``f`` (the open file at ``path``), dequantizing it when it is FP8."""
    tensor = f.get_tensor(name)
    scale_name = name + SCALE_SUFFIX
    is_fp8 = tensor.dtype == FP8_DTYPE
    if scale_name not in files:
        if is_fp8:
            raise ValueError(f"FP8 tensor {name!r} has no {scale_name!r} in the checkpoint")
        return tensor
    if not is_fp8:
        raise ValueError(f"{scale_name!r} scales {name!r}, which is {tensor.dtype}, not float8_e4m3fn")
    if cfg.fp8_block is None:
        raise ValueError(f"{name!r} is FP8 but config.json has no quantization_config.weight_block_size")
    weight = QuantizedWeight(tensor, _read_scale(f, path, scale_name, files), cfg.fp8_block)
    return weight if keep_fp8 else weight.dequantize()


def _read_scale(f: safe_open, path: str, scale_name: str, files: dict[str, str]) -> torch.Tensor:
    # A scale usually sits in its weight's shard, but an index may put it in another one.
    if files[scale_name] == path:
        return f.get_tensor(scale_name)
    with safe_open(files[scale_name], framework="pt") as other:
        return other.get_tensor(scale_name)


def _check_scales_have_weights(files: dict[str, str]) -> None:
    for name in files:
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) not in files:
            raise ValueError(f"{name!r} has no weight {name.removesuffix(SCALE_SUFFIX)!r} in the checkpoint")


def _is_mtp(name: str, cfg: ModelConfig) -> bool:
    """DeepSeek-V3 ships its multi-token-prediction module as the layer after the last one."""
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= cfg.num_layers


def _group_by_file(names: list[str], files: dict[str, str]) -> dict[str, list[str]]:
    """Names grouped by file, files in sorted order, so each file is opened once."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(files[name], []).append(name)
    return dict(sorted(groups.items()))


def _read_index(model_path: str, index_path: str) -> dict[str, str]:
    with open(index_path) as f:
        weight_map = json.load(f).get("weight_map")
    if not weight_map:
        raise ValueError(f"{index_path!r} has no weight_map")
    names = {name: os.path.join(model_path, fname) for name, fname in weight_map.items()}
    for path in sorted(set(names.values())):
        if not os.path.isfile(path):
            raise ValueError(f"{index_path!r} refers to {os.path.basename(path)!r}, which is not in {model_path!r}")
    return names


def model_fingerprint(config: EngineConfig) -> str:
    """The same for two servers of one model: its config and the names and sizes of its weight files
    (random weights: the config and the seed)."""
    load = config.load
    h = hashlib.sha256(json.dumps(config.model.__dict__, sort_keys=True, default=str).encode())
    if load.load_format == "dummy" or load.model_path is None:
        h.update(f"dummy:{load.seed}".encode())
    else:
        for name in sorted(os.listdir(load.model_path)):
            if name.endswith((".safetensors", ".json")):
                h.update(f"{name}:{os.path.getsize(os.path.join(load.model_path, name))}".encode())
    return h.hexdigest()[:16]
