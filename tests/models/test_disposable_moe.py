"""Freeing the MoE's input and received tokens early (``layers/disposable``) changes no output.

The MoE half of a decoder layer (post-attention norm to combine) needs no KV cache, so the
layer tests drive those ops directly; the engine tests compare greedy tokens with disposal on
against a run with it off. ``python -m tests.models.test_disposable_moe [TOKENS]`` prints the
peak CUDA memory of a DeepSeek-V3-sized MoE stack with disposal off and on.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.core import DPInfo, ForwardBatch, ForwardMode, default_dtype
from moeserve.distributed.dispatcher import LocalDispatcher
from moeserve.distributed.groups import Group, ParallelGroups, single
from moeserve.eplb.placement import ExpertPlacement
from moeserve.layers.disposable import DisposableTensor, disposal_enabled, is_disposed
from moeserve.layers.moe import MoEOptions
from moeserve.models.deepseek import DecoderLayer, LayerState, Op
from moeserve.models.loader import load_dummy
from tests.distributed.ep_workers import run_world
from tests.distributed.layouts import greedy_tokens

# DeepSeek-V3's config.json (the fields moeserve reads), to be shrunk by overrides
V3 = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
    "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "max_position_embeddings": 163840, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
TINY = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2, "first_k_dense_replace": 0}


def v3_config(**overrides: object) -> ModelConfig:
    return ModelConfig.from_dict({**V3, **overrides})


def moe_layers(cfg: ModelConfig, groups: ParallelGroups | None = None, moe: MoEOptions | None = None,
               seed: int = 0) -> nn.ModuleList:
    """Every layer of ``cfg`` (all MoE), with the dummy loader's weights: the same on every EP layout."""
    moe = moe or MoEOptions.single(cfg)
    layers = nn.ModuleList(DecoderLayer(cfg, i, groups or single(), moe) for i in range(cfg.num_layers))
    load_dummy(layers, seed)
    return layers


def moe_half(layer: DecoderLayer) -> list[Op]:
    ops = layer.ops()
    return ops[ops.index(layer.op_post_norm):]


def moe_batch(num_tokens: int, device: torch.device | str | None = None) -> ForwardBatch:
    """A batch carrying only what the MoE ops read: the token count and the dispatch mode."""
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    empty = ids[:0]
    return ForwardBatch(mode=ForwardMode.EXTEND, input_ids=ids, positions=ids, out_cache_loc=ids,
                        prefix_lens=empty, extend_lens=empty, kv_indptr=empty, kv_indices=empty,
                        dp=DPInfo([num_tokens], [1], "normal"))


def _freed(t: torch.Tensor) -> bool:
    return is_disposed(t) and t.untyped_storage().nbytes() == 0


def run_moe_stack(layers: nn.ModuleList, hidden: torch.Tensor, residual: torch.Tensor,
                  expect_freed: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE halves of ``layers`` over ``[T, D]`` tokens -> (hidden, residual). With
    ``expect_freed`` set, checks that the MoE input is freed (or not) right after the shared
    experts and the received tokens right after the experts."""
    state, batch = LayerState(hidden, hidden[:0], hidden[:0], residual), moe_batch(hidden.shape[0], hidden.device)
    for layer in layers:
        recv = None
        for op in moe_half(layer):
            if op == layer.op_moe_experts:
                recv = state.recv.hidden
            op(state, batch)
            if expect_freed is not None and op == layer.op_shared_experts:
                assert _freed(state.hidden) == expect_freed, f"layer {layer.layer_id}: MoE input"
            if expect_freed is not None and op == layer.op_moe_experts:
                assert _freed(recv) == expect_freed, f"layer {layer.layer_id}: dispatch output"
    return state.hidden, state.residual


def _inputs(num_tokens: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, dim, generator=g), torch.randn(num_tokens, dim, generator=g)


# ---------------------------------------------------------------------------------------------
# one process, LocalDispatcher


@pytest.mark.parametrize("shared_experts", [1, 0])
def test_moe_stack_output_unchanged_by_disposal(shared_experts):
    layers = moe_layers(v3_config(**TINY, n_shared_experts=shared_experts))
    hidden, residual = _inputs(11, 64, seed=shared_experts)
    with torch.inference_mode():
        with disposal_enabled(False):
            expected = run_moe_stack(layers, hidden, residual, expect_freed=False)
        got = run_moe_stack(layers, hidden, residual, expect_freed=True)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_dispatcher_without_disposable_buffers_frees_nothing(monkeypatch):
    layers = moe_layers(v3_config(**TINY))
    hidden, residual = _inputs(5, 64, seed=2)
    with torch.inference_mode(), disposal_enabled(False):
        expected = run_moe_stack(layers, hidden, residual)
    monkeypatch.setattr(LocalDispatcher, "disposable_buffers", False)
    with torch.inference_mode():
        got = run_moe_stack(layers, hidden, residual, expect_freed=False)
    assert torch.equal(got[0], expected[0])


def test_reading_the_disposed_moe_input_raises():
    layer = moe_layers(v3_config(**TINY))[1]
    hidden, residual = _inputs(5, 64, seed=3)
    state, batch = LayerState(hidden, hidden[:0], hidden[:0], residual), moe_batch(5)
    ops = moe_half(layer)
    for op in ops[:ops.index(layer.op_shared_experts) + 1]:
        op(state, batch)
    with pytest.raises(RuntimeError, match="'layer 1 MoE input' was disposed"):
        layer.op_shared_experts(state, batch)  # an op reordered after the free fails loudly


def test_greedy_tokens_unchanged_by_disposal(hf_model_path, monkeypatch):
    path = hf_model_path("v3", 0)
    with disposal_enabled(False):
        expected = greedy_tokens(path)
    freed: list[str] = []
    dispose = DisposableTensor.dispose

    def counting_dispose(self: DisposableTensor) -> None:
        dispose(self)
        freed.append(self.label)

    monkeypatch.setattr(DisposableTensor, "dispose", counting_dispose)
    assert greedy_tokens(path) == expected
    assert {label.split(" ", 2)[2] for label in freed} == {"MoE input", "MoE dispatch output"}


# ---------------------------------------------------------------------------------------------
# expert parallelism: real gloo ranks


def check_ep_stack(ep: Group) -> None:
    """On each rank: the EP layers (normal and low-latency dispatch) free their buffers and give
    the single-process layers' output for this rank's tokens (uneven counts)."""
    torch.set_default_dtype(torch.float32)
    cfg = v3_config(**TINY)
    local = moe_layers(cfg)
    hidden, residual = _inputs(7 - 4 * ep.rank, cfg.hidden_size, seed=10 + ep.rank)
    with torch.inference_mode(), disposal_enabled(False):
        expected = run_moe_stack(local, hidden, residual)
    one = Group(None, 0, 1, [ep.rank])
    groups = ParallelGroups(one, one, one, one, ep, one)
    placement = ExpertPlacement.trivial(cfg.num_layers, cfg.n_routed_experts, ep.size)
    for mode in ("normal", "low_latency"):
        moe = MoEOptions(placement, a2a_backend="torch", deepep_mode=mode, max_dispatch_tokens_per_rank=8)
        with torch.inference_mode():
            got = run_moe_stack(moe_layers(cfg, groups, moe), hidden, residual, expect_freed=True)
        what = f"{mode} rank {ep.rank}"
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=lambda m, what=what: f"{what}: {m}")


def test_ep_moe_stack_frees_and_matches_single_process():
    run_world(2, check_ep_stack)


EP_LAYOUTS = {
    "tp2-normal": {"tp_size": 2, "moe_a2a_backend": "torch", "deepep_mode": "normal"},
    "tp2-lowlatency": {"tp_size": 2, "moe_a2a_backend": "torch", "deepep_mode": "low_latency",
                       "max_dispatch_tokens_per_rank": 8},
}


@pytest.fixture(scope="module")
def tokens_without_disposal(hf_model_path):
    with disposal_enabled(False):
        return greedy_tokens(hf_model_path("v3", 0))


@pytest.mark.parametrize("name", list(EP_LAYOUTS))
def test_ep_greedy_tokens_with_disposal_match_single_process_without(hf_model_path, tokens_without_disposal, name):
    """The rank processes run with disposal on (its default)."""
    assert greedy_tokens(hf_model_path("v3", 0), **EP_LAYOUTS[name]) == tokens_without_disposal


# ---------------------------------------------------------------------------------------------
# peak memory on a GPU


def moe_peak_memory(num_tokens: int = 4096, num_layers: int = 3, num_experts: int = 16) -> dict[str, int]:
    """Peak CUDA memory (bytes above what was allocated before) of one pass of ``num_layers``
    DeepSeek-V3-sized MoE halves (hidden 7168, top-8, bf16, LocalDispatcher) over
    ``num_tokens`` prefill tokens, with disposal off and on; ``input``: one MoE input's bytes."""
    cfg = v3_config(num_hidden_layers=num_layers, first_k_dense_replace=0, n_routed_experts=num_experts,
                    num_attention_heads=16)  # attention does not run: few heads keep the set-up light
    moe = MoEOptions.single(cfg)  # the placement is made on the host, as the model runner makes it
    with torch.device("cuda"), default_dtype(torch.bfloat16):
        layers = moe_layers(cfg, moe=moe)
        hidden, residual = (torch.randn(num_tokens, cfg.hidden_size) for _ in range(2))
    peaks, outputs = {"input": hidden.nbytes}, {}
    with torch.inference_mode():
        run_moe_stack(layers, hidden, residual)  # warm-up: kernel compilation, library workspaces
        for name, enabled in (("off", False), ("on", True)):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            with disposal_enabled(enabled):
                outputs[name] = run_moe_stack(layers, hidden, residual, expect_freed=enabled)[0]
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - before
    torch.testing.assert_close(outputs["on"], outputs["off"], rtol=0, atol=0)
    return peaks


@pytest.mark.gpu
def test_disposal_lowers_the_moe_peak_memory():
    peaks = moe_peak_memory()
    print(f"\nMoE stack peak: {peaks['off'] / 2**20:.1f} MiB without disposal, {peaks['on'] / 2**20:.1f} MiB with")
    assert peaks["off"] - peaks["on"] >= peaks["input"]  # at least the MoE input is gone at the experts' peak


if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
    peaks = moe_peak_memory(tokens)
    mib = {k: v / 2**20 for k, v in peaks.items()}
    print(f"{tokens} tokens, MoE input {mib['input']:.1f} MiB: peak {mib['off']:.1f} MiB without disposal, "
          f"{mib['on']:.1f} MiB with ({mib['off'] - mib['on']:.1f} MiB less)")
