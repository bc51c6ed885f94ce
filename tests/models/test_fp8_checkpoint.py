"""An FP8 block-quantized checkpoint against transformers holding the dequantized weights."""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import load_file, save_file

from moeserve import LLM, SamplingParams
from moeserve.models.tiny import make_tiny_model
from tests.hf_models import hf_greedy, load_hf_model

BLOCK = 128


def _dequant_reference(w_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Block by block, written out plainly: the independent side of the comparison."""
    out = torch.empty(w_fp8.shape, dtype=torch.float32)
    for i in range(math.ceil(w_fp8.shape[0] / BLOCK)):
        for j in range(math.ceil(w_fp8.shape[1] / BLOCK)):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            out[rows, cols] = w_fp8[rows, cols].float() * scale_inv[i, j].item()
    return out


def _dequantized_copy(src: str, dst: str) -> str:
    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    plain = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        plain[name] = _dequant_reference(t, scale) if scale is not None else t.float()
    save_file(plain, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config")
    config["torch_dtype"] = config["dtype"] = "float32"
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


def test_fp8_checkpoint_matches_dequantized_reference(tmp_path):
    # 160 and 192 are not multiples of 128: every weight has full and partial edge blocks.
    fp8_path = make_tiny_model(str(tmp_path / "fp8"), preset="v3", fp8=True, seed=3, hidden_size=160,
                               intermediate_size=192, initializer_range=0.1)
    tensors = load_file(os.path.join(fp8_path, "model.safetensors"))
    assert tensors["model.layers.0.mlp.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (2, 2)
    hf = load_hf_model(_dequantized_copy(fp8_path, str(tmp_path / "plain")))

    llm = LLM(fp8_path, dtype="float32", page_size=4, max_total_tokens=512)
    prompt = torch.randint(2, 260, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref_logits = hf(torch.tensor([prompt])).logits[0, -1]
    from tests.engine_utils import new_req, run_extend
    got = run_extend(llm.runner, new_req(llm.runner, prompt), 0, len(prompt))[-1]
    assert (got - ref_logits).abs().max() <= 1e-4 * ref_logits.abs().max()

    out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(hf, prompt, 32)
