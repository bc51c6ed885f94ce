"""DeepSeek-V3's multi-token-prediction module: the released checkpoint layout (``make_tiny_model(mtp=True)``),
loading it into ``DeepseekMTP``, and its forward against a torch reference whose decoder layer is transformers'."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moeserve.cache import KVLayout, MLAKVPool
from moeserve.config import ModelConfig
from moeserve.core import ForwardBatch, ForwardMode, default_dtype
from moeserve.eplb.placement import ExpertPlacement
from moeserve.eplb.recorder import ExpertRecorder
from moeserve.kernels.fp8 import FP8_DTYPE, block_dequant_fp8
from moeserve.layers.moe import MoEOptions
from moeserve.models.deepseek import DeepseekForCausalLM
from moeserve.models.loader import load_checkpoint, load_dummy
from moeserve.models.tiny import make_tiny_model
from moeserve.server.cli import main

MTP = "model.layers.3."  # the tiny models have 3 layers: the MTP module is layer 3
REPEATS = (MTP + "embed_tokens.weight", MTP + "shared_head.head.weight")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Seed 4 with and without the MTP module: float32, bfloat16, FP8."""
    root = tmp_path_factory.mktemp("mtp")
    kinds = {"fp32": {}, "bf16": {"torch_dtype": "bfloat16"}, "fp8": {"fp8": True}}
    out = {}
    for kind, settings in kinds.items():
        for mtp in (True, False):
            name = f"{kind}-{'mtp' if mtp else 'plain'}"
            out[name] = make_tiny_model(str(root / name), "v3", seed=4, mtp=mtp, **settings)
    return out


def stored(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def loaded(path: str, mtp: bool, fp8: bool = False, dtype: torch.dtype = torch.float32) -> DeepseekForCausalLM:
    """The model with every parameter NaN first, so that one the loader leaves alone shows."""
    cfg = ModelConfig.from_path(path)
    with default_dtype(dtype):
        model = DeepseekForCausalLM(cfg, fp8=fp8, mtp=mtp)
    for param in model.parameters():
        param.data.fill_(float("nan"))
    load_checkpoint(model, path, cfg)
    return model


def unfilled(model: torch.nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.float().isnan().any()]


# ---- the checkpoint ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fp32", "fp8"])
def test_checkpoint_has_the_released_layout_and_the_same_model(checkpoints, kind):
    path = checkpoints[f"{kind}-mtp"]
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["num_nextn_predict_layers"] == 1
    with_mtp, plain = stored(path), stored(checkpoints[f"{kind}-plain"])
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "mlp.gate.e_score_correction_bias", "mlp.experts.7.down_proj.weight",
                 "mlp.shared_experts.up_proj.weight", "self_attn.kv_b_proj.weight", "input_layernorm.weight",
                 "post_attention_layernorm.weight"):
        assert MTP + name in with_mtp, name
    assert (MTP + "eh_proj.weight_scale_inv" in with_mtp) == (kind == "fp8")
    assert with_mtp[MTP + "eh_proj.weight"].shape == (64, 128)
    assert torch.equal(with_mtp[REPEATS[0]], with_mtp["model.embed_tokens.weight"])
    assert torch.equal(with_mtp[REPEATS[1]], with_mtp["lm_head.weight"])
    # the model's own tensors are drawn as without the module
    assert {n for n in with_mtp if not n.startswith(MTP)} == set(plain)
    for name, t in plain.items():
        assert torch.equal(with_mtp[name].view(torch.uint8), t.view(torch.uint8)), name


def test_cli_writes_the_mtp_module(tmp_path):
    out = str(tmp_path / "m")
    assert main(["make-tiny-model", out, "--mtp", "--seed", "4"]) == 0
    assert ModelConfig.from_path(out).num_mtp_layers == 1
    assert MTP + "eh_proj.weight" in stored(out)


# ---- loading -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_every_mtp_parameter_comes_from_the_checkpoint(checkpoints, kind):
    path = checkpoints[f"{kind}-mtp"]
    model = loaded(path, mtp=True, fp8=kind == "fp8", dtype=torch.bfloat16)
    assert not unfilled(model)
    t, mtp = stored(path), model.mtp
    params = {"enorm.weight": mtp.enorm.weight, "hnorm.weight": mtp.hnorm.weight,
              "shared_head.norm.weight": mtp.shared_head.norm.weight, "eh_proj.weight": mtp.eh_proj.weight,
              "post_attention_layernorm.weight": mtp.layer.post_attention_layernorm.weight,
              "mlp.gate.e_score_correction_bias": mtp.layer.mlp.gate.e_score_correction_bias,
              "self_attn.q_a_proj.weight": mtp.layer.self_attn.q_a_proj.weight}
    for name, got in params.items():
        assert torch.equal(got.view(torch.uint8), t[MTP + name].view(torch.uint8)), name
    w2 = mtp.layer.mlp.experts.w2
    if kind == "fp8":  # stored FP8 weights are kept as they are, scales too
        assert mtp.eh_proj.weight.dtype == FP8_DTYPE
        assert torch.equal(mtp.eh_proj.weight_scale_inv, t[MTP + "eh_proj.weight_scale_inv"])
        w2 = block_dequant_fp8(w2[5], mtp.layer.mlp.experts.w2_scale_inv[5], (128, 128))
        expected = block_dequant_fp8(t[MTP + "mlp.experts.5.down_proj.weight"],
                                     t[MTP + "mlp.experts.5.down_proj.weight_scale_inv"], (128, 128))
        torch.testing.assert_close(w2, expected)
    else:
        assert torch.equal(w2[5], t[MTP + "mlp.experts.5.down_proj.weight"])


def test_mtp_module_holds_no_copy_of_the_embedding_or_head(checkpoints):
    path = checkpoints["fp32-mtp"]
    model, t = loaded(path, mtp=True), stored(path)
    assert sum(p.numel() for p in model.mtp.parameters()) == sum(
        w.numel() for n, w in t.items() if n.startswith(MTP) and n not in REPEATS)
    assert sum(p.numel() for p in model.parameters()) == sum(
        w.numel() for n, w in t.items() if n not in REPEATS)


@pytest.mark.parametrize("kind", ["fp32", "fp8"])
def test_without_mtp_the_same_checkpoint_loads_the_same_model(checkpoints, kind):
    fp8 = kind == "fp8"
    a, b = loaded(checkpoints[f"{kind}-mtp"], mtp=False, fp8=fp8), loaded(checkpoints[f"{kind}-plain"], False, fp8)
    assert a.mtp is None and not unfilled(a)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name, t in sb.items():
        assert torch.equal(sa[name].view(torch.uint8), t.view(torch.uint8)), name


def _without(src: str, dst: str, names: tuple[str, ...]) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "model.safetensors")
    tensors = load_file(path)
    for name in names:
        del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


def test_loader_refuses_a_checkpoint_missing_an_mtp_tensor(checkpoints, tmp_path):
    path = _without(checkpoints["fp32-mtp"], str(tmp_path / "m"), (MTP + "hnorm.weight",))
    with pytest.raises(ValueError, match=MTP.replace(".", r"\.") + "hnorm.weight"):
        loaded(path, mtp=True)
    assert not unfilled(loaded(path, mtp=False))
    # the repeated embedding and head are not needed: the module uses the model's
    path = _without(checkpoints["fp32-mtp"], str(tmp_path / "n"), REPEATS)
    assert not unfilled(loaded(path, mtp=True))


def test_dummy_weights_fill_the_module_and_leave_the_model_as_without_it(checkpoints):
    cfg = ModelConfig.from_path(checkpoints["fp32-mtp"])
    models = [DeepseekForCausalLM(cfg, fp8=True, mtp=mtp) for mtp in (True, False)]
    for model in models:
        for param in model.parameters():
            param.data.fill_(float("nan"))
        load_dummy(model, seed=3)
    assert not unfilled(models[0])
    main_model = {n: t for n, t in models[0].state_dict().items() if not n.startswith("mtp.")}
    assert main_model.keys() == models[1].state_dict().keys()
    for name, t in models[1].state_dict().items():
        assert torch.equal(main_model[name].view(torch.uint8), t.view(torch.uint8)), name


def test_mtp_moe_has_a_placement_row_of_its_own_and_records_nothing(checkpoints):
    cfg = ModelConfig.from_path(checkpoints["fp32-mtp"])
    with pytest.raises(ValueError, match="placement needs a row"):
        DeepseekForCausalLM(cfg, moe=MoEOptions.single(cfg), mtp=True)
    recorder = ExpertRecorder("stat", cfg.num_layers, 8, 10, 4, "cpu")
    moe = MoEOptions(ExpertPlacement.trivial(cfg.num_layers + 1, 8, 1, num_redundant=2), recorder=recorder)
    model = DeepseekForCausalLM(cfg, moe=moe, mtp=True)
    assert model.mtp.layer.mlp.experts.logical_ids == [*range(8), 0, 1]
    assert model.model.layers[1].mlp.recorder is recorder and model.mtp.layer.mlp.recorder is None
    no_mtp = ModelConfig.from_path(checkpoints["fp32-plain"])
    with pytest.raises(ValueError, match="no MTP module"):
        DeepseekForCausalLM(no_mtp, mtp=True)


# ---- forward -------------------------------------------------------------------------------------


def prefill_batch(cfg: ModelConfig, ids: list[int]) -> ForwardBatch:
    """One sequence prefilled from position 0 into cache slots 1.. (slot 0 is the padding slot)."""
    n = len(ids)
    slots = torch.arange(1, n + 1)
    pool = MLAKVPool(KVLayout.for_model(cfg, "auto", torch.float32), cfg.num_layers + 1, n + 1, "cpu")
    return ForwardBatch(mode=ForwardMode.EXTEND, input_ids=torch.tensor(ids), positions=torch.arange(n),
                        out_cache_loc=slots, prefix_lens=torch.tensor([0]), extend_lens=torch.tensor([n]),
                        kv_indptr=torch.tensor([0, n]), kv_indices=slots, prefix_lens_cpu=[0],
                        extend_lens_cpu=[n], kv_pool=pool)


def one_layer_hf_model(path: str, dst: str):
    """The MTP module's decoder layer as transformers' one-layer DeepSeek-V3, whose final norm is
    ``shared_head.norm`` and whose embedding and head are the module's repeats of the model's."""
    from tests.hf_models import load_hf_model

    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    moe = hf["first_k_dense_replace"] <= hf["num_hidden_layers"]
    hf.update(num_hidden_layers=1, first_k_dense_replace=0 if moe else 1, num_nextn_predict_layers=0)
    renames = {REPEATS[0]: "model.embed_tokens.weight", REPEATS[1]: "lm_head.weight",
               MTP + "shared_head.norm.weight": "model.norm.weight"}
    tensors = {}
    for name, t in stored(path).items():
        if name in renames:
            tensors[renames[name]] = t
        elif name.startswith(MTP) and not name.startswith(tuple(MTP + n for n in ("enorm", "hnorm", "eh_proj"))):
            tensors["model.layers.0." + name.removeprefix(MTP)] = t
    os.makedirs(dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(hf, f)
    return load_hf_model(dst)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("mlp", ["moe", "dense"])
def test_forward_matches_a_torch_reference(tmp_path, mlp):
    pytest.importorskip("transformers")
    dense = {"first_k_dense_replace": 4} if mlp == "dense" else {}
    path = make_tiny_model(str(tmp_path / "m"), "v3", seed=2, mtp=True, initializer_range=0.1, **dense)
    model = loaded(path, mtp=True)
    cfg, t = model.cfg, stored(path)
    assert model.mtp.layer.is_moe == (mlp == "moe")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(2, cfg.vocab_size, (9,), generator=gen).tolist()
    prev_hidden = torch.randn(len(ids), cfg.hidden_size, generator=gen)  # [T, D]

    batch = prefill_batch(cfg, ids)
    with torch.inference_mode():
        got = model.mtp(batch, prev_hidden, model.model.embed_tokens)
        got_logits = model.mtp_logits(got, batch)

    hf = one_layer_hf_model(path, str(tmp_path / "hf"))
    tokens = rms_norm(t["model.embed_tokens.weight"][ids], t[MTP + "enorm.weight"])
    x = torch.cat([tokens, rms_norm(prev_hidden, t[MTP + "hnorm.weight"])], -1) @ t[MTP + "eh_proj.weight"].T
    with torch.no_grad():
        out = hf(inputs_embeds=x[None], output_hidden_states=True)
    ref, ref_logits = out.hidden_states[-1][0], out.logits[0]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_logits, ref_logits, rtol=1e-4, atol=1e-4)
    # its keys and values went to cache layer num_layers, the model's layers' are untouched
    buffer = batch.kv_pool.buffer
    assert (buffer[:cfg.num_layers] == 0).all() and (buffer[cfg.num_layers, 1:] != 0).any(-1).all()
