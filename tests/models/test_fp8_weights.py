"""FP8 weights kept in FP8: ``quantization="fp8"`` and FP8 checkpoints loaded without dequantizing."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from moeserve import LLM, SamplingParams
from moeserve.config import build_engine_config
from moeserve.executor.model_runner import ModelRunner
from moeserve.kernels.fp8 import FP8_DTYPE, block_dequant_fp8
from moeserve.models.tiny import make_tiny_model
from moeserve.models.tiny_chat import embedded_model_path, held_out_prompts, is_correct
from tests.engine_utils import new_req, run_extend


def _runner(path: str, device: str = "cpu", **settings) -> ModelRunner:
    return ModelRunner(build_engine_config(path, dtype="float32", page_size=4, max_total_tokens=256,
                                           device=device, **settings))


def test_quantize_keeps_projections_and_experts_in_fp8(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"), preset="v3", seed=0, initializer_range=0.1)
    runner = _runner(path, quantization="fp8")
    layer = runner.model.model.layers[1]  # a MoE layer
    for linear in (layer.self_attn.q_a_proj, layer.self_attn.o_proj, layer.mlp.shared_experts.down_proj):
        assert linear.weight.dtype == FP8_DTYPE and linear.weight_scale_inv.dtype == torch.float32
    assert layer.mlp.experts.w13.dtype == FP8_DTYPE
    assert layer.mlp.experts.w13_scale_inv.shape[0] == layer.mlp.experts.num_experts
    # absorbed MLA reads kv_b_proj's halves in the model dtype; the router and the head stay too
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.float32
    assert layer.mlp.gate.weight.dtype == torch.float32
    assert runner.model.lm_head.weight.dtype == torch.float32



def test_fp8_linear_is_the_block_scaled_product():
    from moeserve.kernels.fp8 import per_token_group_dequant_fp8, per_token_group_quant_fp8
    from moeserve.layers.linear import Linear

    gen = torch.Generator().manual_seed(0)
    linear = Linear(300, 200, bias=True)  # partial 128-blocks both ways
    linear.weight.data = torch.randn(200, 300, generator=gen)
    linear.bias.data = torch.randn(200, generator=gen)
    x = torch.randn(5, 7, 300, generator=gen)
    plain = linear(x)
    linear.quantize_fp8_()
    got = linear(x)
    x_q = per_token_group_dequant_fp8(*per_token_group_quant_fp8(x))
    ref = x_q @ block_dequant_fp8(linear.weight, linear.weight_scale_inv).t() + linear.bias
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    assert 1e-3 < ((got - plain).norm() / plain.norm()) < 0.06  # e4m3: a few percent, not zero


def test_fp8_logits_stay_close_on_a_trained_model():
    # a trained model, not a random one: random tiny models amplify the e4m3 noise of one
    # projection into tens of percent of their logits
    quantized, plain = _runner(embedded_model_path(), quantization="fp8"), _runner(embedded_model_path())
    ids = torch.randint(2, 200, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    got = run_extend(quantized, new_req(quantized, ids), 0, len(ids))
    ref = run_extend(plain, new_req(plain, ids), 0, len(ids))
    assert not torch.equal(got, ref)  # the FP8 path really ran
    assert (got - ref).norm() / ref.norm() < 0.15


def test_fp8_checkpoint_values_are_kept_exactly(tmp_path):
    # 256-wide dims: whole 128x128 blocks, so re-quantizing the loaded weight must give back the
    # stored FP8 values and scales
    path = make_tiny_model(str(tmp_path / "fp8"), preset="v3", fp8=True, seed=2, hidden_size=256,
                           intermediate_size=256, initializer_range=0.1)
    stored = load_file(os.path.join(path, "model.safetensors"))
    runner = _runner(path, quantization="fp8")
    down = runner.model.model.layers[0].mlp.down_proj
    w, s = stored["model.layers.0.mlp.down_proj.weight"], stored["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert torch.equal(down.weight.view(torch.uint8), w.view(torch.uint8))
    torch.testing.assert_close(down.weight_scale_inv, s, rtol=1e-6, atol=0)
    torch.testing.assert_close(block_dequant_fp8(down.weight, down.weight_scale_inv), block_dequant_fp8(w, s))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_chat_model_still_solves_its_task(device):
    items = held_out_prompts(24, seed=11)
    with LLM(embedded_model_path(), quantization="fp8", device=device, max_total_tokens=4096) as llm:
        outs = [llm.chat([{"role": "user", "content": q}], SamplingParams(max_tokens=16, temperature=0))
                for q, _ in items]
    correct = sum(is_correct(q, o.text) for (q, _), o in zip(items, outs))
    assert correct >= 21, f"{correct}/24 correct with FP8 weights"


def test_unaligned_stacks_are_quantized_once_whole(tmp_path):
    # intermediate 192: gate and up meet inside a 128-row block of the stacked gate_up weight,
    # so that weight is gathered in fp32 first; hidden 160 gives partial blocks everywhere
    path = make_tiny_model(str(tmp_path / "fp8"), preset="v3", fp8=True, seed=4, hidden_size=160,
                           intermediate_size=192, initializer_range=0.1)
    stored = load_file(os.path.join(path, "model.safetensors"))
    dequant = lambda name: block_dequant_fp8(stored[name], stored[name + "_scale_inv"])  # noqa: E731
    runner = _runner(path, quantization="fp8")
    gate_up = runner.model.model.layers[0].mlp.gate_up_proj
    assert gate_up.weight.dtype == FP8_DTYPE
    got = block_dequant_fp8(gate_up.weight, gate_up.weight_scale_inv)
    ref = torch.cat([dequant("model.layers.0.mlp.gate_proj.weight"), dequant("model.layers.0.mlp.up_proj.weight")])
    rel = (got - ref).norm() / ref.norm()
    assert 0 < rel < 0.05, rel  # re-quantized on another block grid: e4m3 rounding, no more


def test_dummy_weights_in_fp8(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"), preset="v3", seed=0)
    runner = _runner(path, quantization="fp8", load_format="dummy")
    experts = runner.model.model.layers[1].mlp.experts
    assert experts.w13.dtype == FP8_DTYPE and experts.w13_scale_inv.abs().min() > 0  # every block filled
    ids = list(range(2, 30))
    assert torch.isfinite(run_extend(runner, new_req(runner, ids), 0, len(ids))).all()
