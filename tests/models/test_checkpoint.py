"""Checkpoint folders: single file, sharded, FP8 with partial blocks, MTP layers, filters, errors."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moeserve.config import ModelConfig
from moeserve.kernels.fp8 import block_quant_fp8
from moeserve.models import checkpoint
from moeserve.models.checkpoint import iter_checkpoint, list_checkpoint_tensors
from moeserve.models.tiny import make_tiny_model


def _stored(model_path: str) -> dict[str, torch.Tensor]:
    """Every tensor in the folder, read straight from the files (the reference)."""
    out = {}
    for name in os.listdir(model_path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_path, name), framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _write_index(folder: Path, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    weight_map = {}
    for fname, tensors in shards.items():
        save_file(tensors, str(folder / fname))
        weight_map.update(dict.fromkeys(tensors, fname))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def cfg(tmp_path_factory: pytest.TempPathFactory) -> ModelConfig:
    """A 2-layer FP8 config with 128x128 blocks, for hand-written folders."""
    return ModelConfig.from_path(make_tiny_model(str(tmp_path_factory.mktemp("cfg")), "v3", fp8=True,
                                                 num_hidden_layers=2))


def test_single_file_yields_every_tensor(tmp_path: Path) -> None:
    path = make_tiny_model(str(tmp_path), "v2-lite")
    cfg = ModelConfig.from_path(path)
    ref = _stored(path)
    assert set(list_checkpoint_tensors(path)) == set(ref)
    assert all(p == os.path.join(path, "model.safetensors") for p in list_checkpoint_tensors(path).values())
    got = dict(iter_checkpoint(path, cfg))
    assert set(got) == set(ref)
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_sharded_folder(tmp_path: Path) -> None:
    path = make_tiny_model(str(tmp_path), "v3", shard_size_mb=0.2)
    files = list_checkpoint_tensors(path)
    assert len(set(files.values())) > 1
    ref = _stored(path)
    got = dict(iter_checkpoint(path, ModelConfig.from_path(path)))
    assert set(got) == set(ref) and all(torch.equal(got[n], ref[n]) for n in ref)


def test_fp8_dequantizes_with_partial_blocks(tmp_path: Path) -> None:
    # hidden 192 and kv_a 48+16: blocks of 128 leave partial edge tiles in both dims.
    dims = {"hidden_size": 192, "num_hidden_layers": 2}
    plain = make_tiny_model(str(tmp_path / "plain"), "v3", seed=7, **dims)
    fp8 = make_tiny_model(str(tmp_path / "fp8"), "v3", fp8=True, seed=7, **dims)
    ref = _stored(plain)
    got = dict(iter_checkpoint(fp8, ModelConfig.from_path(fp8)))

    assert set(got) == set(ref)  # no _scale_inv names come out
    assert got["model.layers.0.self_attn.q_a_proj.weight"].shape == (48, 192)
    quantized = {n for n, t in _stored(fp8).items() if t.dtype == torch.float8_e4m3fn}
    assert "model.layers.1.mlp.experts.0.down_proj.weight" in quantized
    for name, w in ref.items():
        if name in quantized:
            assert got[name].dtype == torch.float32
            err = (got[name] - w).abs()
            assert (err <= w.abs() / 16 + w.abs().max() / 448 * 2**-9).all(), name
        else:  # stored in bf16, not quantized
            torch.testing.assert_close(got[name].float(), w, rtol=2**-8, atol=0)


def test_scale_in_another_shard(tmp_path: Path, cfg: ModelConfig) -> None:
    w = torch.randn(200, 130)
    q, s = block_quant_fp8(w)
    name = "model.layers.0.self_attn.o_proj.weight"
    _write_index(tmp_path, {"a.safetensors": {name: q}, "b.safetensors": {name + "_scale_inv": s}})
    (got_name, got), = iter_checkpoint(str(tmp_path), cfg)
    assert got_name == name
    assert (got - w).norm() <= w.norm() / 16


def test_mtp_layers_are_skipped(tmp_path: Path, cfg: ModelConfig) -> None:
    q, s = block_quant_fp8(torch.randn(64, 64))
    save_file({
        "model.layers.1.self_attn.o_proj.weight": q, "model.layers.1.self_attn.o_proj.weight_scale_inv": s,
        # The MTP layer is the one after the last (2 here, 61 in DeepSeek-V3).
        "model.layers.2.eh_proj.weight": q.clone(), "model.layers.2.eh_proj.weight_scale_inv": s.clone(),
        "model.layers.2.enorm.weight": torch.ones(64),
        "model.layers.12.input_layernorm.weight": torch.ones(64),
        "model.norm.weight": torch.ones(64),
    }, str(tmp_path / "model.safetensors"))
    names = [n for n, _ in iter_checkpoint(str(tmp_path), cfg)]
    assert sorted(names) == ["model.layers.1.self_attn.o_proj.weight", "model.norm.weight"]


def test_wanted_reads_only_accepted_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny_model(str(tmp_path), "v3", fp8=True)
    read: list[str] = []

    class Recorder:
        def __init__(self, f: Any) -> None:
            self.f = f

        def keys(self) -> list[str]:
            return self.f.keys()

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.f.get_tensor(name)

    @contextmanager
    def recording_open(*args: Any, **kwargs: Any) -> Iterator[Recorder]:
        with safe_open(*args, **kwargs) as f:
            yield Recorder(f)

    monkeypatch.setattr(checkpoint, "safe_open", recording_open)
    expert_3 = ".mlp.experts.3."
    got = dict(iter_checkpoint(path, ModelConfig.from_path(path), wanted=lambda n: expert_3 in n))
    assert got and all(expert_3 in n for n in got)
    assert len(got) == 3 * 2  # gate/up/down in the two MoE layers
    assert sorted(read) == sorted([*got, *(n + "_scale_inv" for n in got)])


def test_scale_without_weight_is_an_error(tmp_path: Path, cfg: ModelConfig) -> None:
    save_file({"model.norm.weight": torch.ones(8),
               "model.layers.0.mlp.up_proj.weight_scale_inv": torch.ones(1, 1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight_scale_inv"):
        list(iter_checkpoint(str(tmp_path), cfg))


def test_fp8_weight_without_scale_is_an_error(tmp_path: Path, cfg: ModelConfig) -> None:
    q, _ = block_quant_fp8(torch.randn(8, 8))
    save_file({"model.layers.0.mlp.up_proj.weight": q}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="has no 'model.layers.0.mlp.up_proj.weight_scale_inv'"):
        list(iter_checkpoint(str(tmp_path), cfg))


def test_folder_without_safetensors(tmp_path: Path, cfg: ModelConfig) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        list_checkpoint_tensors(str(tmp_path))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        next(iter_checkpoint(str(tmp_path), cfg))


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    _write_index(tmp_path, {"a.safetensors": {"model.norm.weight": torch.ones(8)}})
    os.remove(tmp_path / "a.safetensors")
    with pytest.raises(ValueError, match="a.safetensors"):
        list_checkpoint_tensors(str(tmp_path))
