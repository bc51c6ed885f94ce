"""The memory planner against hand-computed sizes of the released DeepSeek configs."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from moeserve.planner import PRESETS, Plan, add_plan_args, format_report, plan_from_args, run_plan

V3 = PRESETS["dsv3"]
H, I, MI = V3["hidden_size"], V3["intermediate_size"], V3["moe_intermediate_size"]
MOE_LAYERS = V3["num_hidden_layers"] - V3["first_k_dense_replace"]
REFERENCE_PREFILL = ["--preset", "dsv3", "--world", "32", "--enable-dp-attention", "--moe-dense-tp-size", "1",
                     "--enable-dp-lm-head", "--ep-num-redundant-experts", "32", "--phase", "prefill"]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_plan_args(parser)
    return parser.parse_args(argv)


def make_plan(*argv: str) -> Plan:
    return plan_from_args(parse(list(argv)))


def fp8_linear(out_features: int, in_features: int) -> int:
    return out_features * in_features + 4 * math.ceil(out_features / 128) * math.ceil(in_features / 128)


def fp8_mlp(hidden: int, inter: int) -> int:
    return 2 * fp8_linear(inter, hidden) + fp8_linear(hidden, inter)


def test_v3_prefill_at_ep32_prefers_a_small_dense_tp():
    p = make_plan(*REFERENCE_PREFILL)
    n_param = V3["first_k_dense_replace"] * fp8_mlp(H, I)
    n_hidden = 16384 * H * 2
    assert p.dense.t_star == pytest.approx(math.sqrt(n_param / n_hidden))
    assert p.dense.t_star < 3
    assert p.dense.best in (1, 2)
    assert [r.t for r in p.dense.rows] == [1, 2, 4, 8, 16, 32]
    memory = {t: n_param / t + n_hidden * t for t in (1, 2, 4, 8, 16, 32)}
    assert p.dense.best == min(memory, key=memory.__getitem__)
    assert not p.dense.rows[-1].aligned  # 18432 / 32 = 576, the reference's misalignment
    decode = make_plan("--preset", "dsv3", "--world", "72", "--enable-dp-attention", "--moe-dense-tp-size", "1",
                       "--ep-num-redundant-experts", "32", "--phase", "decode", "--tokens-per-rank", "256")
    assert decode.dense.k == 3
    assert decode.dense.t_star == pytest.approx(math.sqrt(n_param / (4 * 256 * H * 2)))
    assert decode.dense.t_star > p.dense.t_star


@pytest.mark.parametrize("world,redundant", [(32, 0), (32, 32), (64, 0), (72, 32), (8, 0)])
def test_expert_weights_per_rank_scale_as_physical_over_world(world, redundant):
    p = make_plan("--preset", "dsv3", "--world", str(world), "--enable-dp-attention",
                  "--ep-num-redundant-experts", str(redundant))
    assert p.layout.experts_per_rank(p.model) * world == 256 + redundant
    assert p.weights["routed_experts"] == MOE_LAYERS * (256 + redundant) // world * fp8_mlp(H, MI)
    assert p.weights["shared_experts"] == MOE_LAYERS * fp8_mlp(H, MI)  # replicated, whatever the world


@pytest.mark.parametrize("flags,attn_tp", [([], 32), (["--enable-dp-attention", "--dp-size", "8"], 4),
                                           (["--enable-dp-attention"], 1)])
def test_dp_attention_divides_the_attention_sharding(flags, attn_tp):
    p = make_plan("--preset", "dsv3", "--world", "32", "--weight-dtype", "bf16", *flags)
    assert p.layout.attn_tp == attn_tp and p.layout.attn_dp == 32 // attn_tp
    assert p.layout.dense_tp == attn_tp  # the server's default: dense TP = attention TP
    layers, q_lora, heads = V3["num_hidden_layers"], V3["q_lora_rank"], V3["num_attention_heads"]
    replicated = H * q_lora + H * (512 + 64)  # q_a_proj, kv_a_proj_with_mqa
    sharded = q_lora * heads * 192 + 512 * heads * 256 + heads * 128 * H  # q_b, kv_b, o_proj
    assert p.weights["attention_replicated"] == 2 * layers * replicated
    assert p.weights["attention_sharded"] == 2 * layers * sharded // attn_tp
    assert p.weights["lm_head"] == 2 * math.ceil(V3["vocab_size"] / 32) * H  # world TP, no DP LM head


def test_dp_lm_head_splits_over_the_attention_tp_group():
    p = make_plan("--preset", "dsv3", "--world", "32", "--enable-dp-attention", "--dp-size", "8",
                  "--enable-dp-lm-head")
    assert p.layout.lm_head_tp == 4
    assert p.weights["lm_head"] == p.weights["embedding"] == 2 * V3["vocab_size"] // 4 * H


def test_kv_capacity_decreases_with_more_weights():
    plans = [make_plan("--preset", "dsv3", "--world", "32", "--enable-dp-attention", "--moe-dense-tp-size", "1",
                       "--ep-num-redundant-experts", str(r)) for r in (0, 32, 64)]
    weights = [p.weights_total for p in plans]
    tokens = [p.kv_tokens for p in plans]
    assert weights[0] < weights[1] < weights[2]
    assert tokens[0] > tokens[1] > tokens[2] > 0
    for p in plans:
        per_token = V3["num_hidden_layers"] * 576 * 2
        assert p.kv_per_token == per_token
        assert p.kv_tokens == (p.device.budget - p.weights_total - p.activation_peak) // per_token
        assert p.kv_tokens_total == 32 * p.kv_tokens  # DP attention: no duplication


def test_an_fp8_cache_holds_1_93_times_the_tokens():
    """596 bytes a token a layer (576 FP8 values, 5 float32 scales) against 1,152 in BF16, what the
    server's pool takes (``--kv-cache-dtype``, the server's flag and its alias)."""
    base = ["--preset", "dsv3", "--world", "32", "--enable-dp-attention"]
    bf16 = make_plan(*base)
    for name in ("fp8_e4m3", "fp8"):
        fp8 = make_plan(*base, "--kv-cache-dtype", name)
        assert fp8.kv_per_token == V3["num_hidden_layers"] * 596 and fp8.kv_bytes == bf16.kv_bytes
        assert fp8.kv_tokens / bf16.kv_tokens == pytest.approx(1152 / 596, rel=1e-6)  # 1.93x
        assert "fp8_e4m3" in format_report(fp8) and "61 layers x 596 bytes" in format_report(fp8)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_plan(*base, "--kv-cache-dtype", "fp8_e5m2")


def test_attention_tp_replicates_the_latent():
    p = make_plan("--preset", "dsv3", "--world", "16", "--enable-dp-attention", "--dp-size", "2",
                  "--gpu-memory-gb", "141")
    assert p.fits and p.kv_tokens_total == 2 * p.kv_tokens


def test_activations_count_the_dispatch_buffers_and_the_gathered_tokens():
    base = ["--preset", "dsv3", "--world", "72", "--enable-dp-attention", "--ep-num-redundant-experts", "32"]
    decode = make_plan(*base, "--phase", "decode", "--tokens-per-rank", "128")
    assert decode.work.dispatch_mode == "low_latency"
    assert decode.activations["moe"] > 288 * 128 * H  # [E_local, C * N, hidden] at one byte a value
    normal = make_plan(*base, "--phase", "decode", "--tokens-per-rank", "128", "--deepep-mode", "normal")
    assert normal.activations["moe"] < decode.activations["moe"]
    dense = [make_plan(*base, "--moe-dense-tp-size", str(t)).activations["dense_ffn"] for t in (1, 8)]
    assert dense[1] > dense[0]
    tbo = make_plan(*base, "--enable-two-batch-overlap")
    assert tbo.activation_peak < make_plan(*base).activation_peak


def test_an_impossible_layout_does_not_fit(capsys):
    assert run_plan(parse(["--preset", "dsv3", "--world", "1"])) == 1
    out = capsys.readouterr().out
    assert "does not fit by" in out and "KV cache" in out
    assert run_plan(parse(REFERENCE_PREFILL)) == 0
    out = capsys.readouterr().out
    assert "check: fits" in out and "<- best" in out and "t* =" in out


def test_bad_layouts_are_refused():
    with pytest.raises(ValueError, match="do not split"):
        make_plan("--preset", "dsv3", "--world", "72", "--enable-dp-attention")  # 256 % 72
    with pytest.raises(ValueError, match="moe_dense_tp_size"):
        make_plan("--preset", "dsv3", "--world", "32", "--moe-dense-tp-size", "3")
    with pytest.raises(ValueError, match="num_heads"):
        make_plan("--preset", "dsv2-lite", "--world", "32")


def test_model_path_config_and_json_output(tmp_path, capsys):
    cfg = {**PRESETS["dsv2-lite"], "num_hidden_layers": 4}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    rc = run_plan(parse(["--model-path", str(tmp_path), "--world", "8", "--enable-dp-attention",
                         "--moe-dense-tp-size", "2", "--json"]))
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["num_layers"] == 4 and out["model"]["moe_layers"] == 3
    assert out["layout"]["experts_per_rank"] == 8 and out["layout"]["dense_tp"] == 2
    assert out["device"]["weight_dtype"] == "bf16"  # not an FP8 checkpoint
    assert out["fits"] is True and out["kv"]["tokens_per_rank"] > 0
    assert out["weights_bytes"]["total"] == sum(v for k, v in out["weights_bytes"].items()
                                                if k not in ("attention", "total"))
    assert out["dense_tp"]["best"] in [row["t"] for row in out["dense_tp"]["rows"]]
