"""moeserve beside transformers on one model, one device, one run (``moeserve bench compare-hf``).

Both engines run the same ``ModelConfig`` with the same random weights: moeserve draws them
(its dummy loader) and transformers' ``DeepseekV3ForCausalLM`` is built on the meta device and
handed views of moeserve's storage, so the weights exist once (DeepSeek-V3's per-layer shapes
at 4 layers are ~72 GB in bf16: two copies would not fit one H200). The layouts agree
everywhere (transformers 5 stacks experts as ``gate_up_proj [E, 2I, D]`` and
``down_proj [E, D, I]``, as moeserve does); a split of moeserve's stacked ``gate_up_proj`` of
dense MLPs is a view too. Only a layout that differs would be copied.

Measured, for each (batch, context): the decode step time of each engine, transformers with a
``DynamicCache`` filled by prefill to ``context`` tokens (in groups of sequences, so filling it
does not run out of memory before decode does); and for each (batch x input) the prefill time of
each engine, transformers asked for the last token's logits only, as moeserve computes them. Beside
them: the roofline step time (``moeserve.bench.roofline``) at the copy bandwidth and matmul rate
measured in the same run. A cell that runs out of device memory says "OOM" and the run goes on.
Decode times are medians over ``--decode-steps`` steps after two untimed ones (moeserve: after a
whole untimed pass); every call is timed from a synchronised device to greedy tokens on the host.

transformers runs as its defaults have it for DeepSeek-V3 in 5.17: SDPA attention (over the
latent cache it expands to per-head keys and values every step) and ``grouped_mm`` experts;
``--hf-attn-implementation eager`` picks its plain-matmul attention instead.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import re
import statistics
import sys
import time
import typing
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from moeserve.bench import roofline as rl
from moeserve.bench.kernels import Ceilings
from moeserve.bench.one_batch import (
    add_model_args,
    admit,
    bench_one_batch,
    describe,
    engine_config_from_args,
    environment,
    random_prompts,
    release,
    sync,
)
from moeserve.config import EngineConfig, ModelConfig, default_page_size
from moeserve.core import ForwardMode, ScheduleBatch, ScheduledSeq
from moeserve.executor.model_runner import ModelRunner
from moeserve.models.loader import checkpoint_slots

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
CHECK_SHAPE = (2, 16)  # prompts of the same-logits check, batch x length


def add_compare_hf_args(p: argparse.ArgumentParser) -> None:
    """Add the ``bench compare-hf`` flags to ``p``."""
    add_model_args(p, preset="dsv3", num_layers=4)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 128], help="decode batch sizes")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 2048], help="decode context lengths")
    p.add_argument("--prefill", type=_batch_by_len, nargs="*", default=[(8, 1024)], metavar="BxI",
                   help="prefill shapes, batch x input length (default 8x1024)")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per cell (median)")
    p.add_argument("--hf-attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    p.add_argument("--hf-experts-implementation", default=None,
                   help="transformers' experts kernel (default: its own, grouped_mm)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the report here")


def _batch_by_len(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not BATCHxLEN, e.g. 8x1024")
    return int(match[1]), int(match[2])


# ---------------------------------------------------------------------------- the transformers model


def hf_config(m: ModelConfig) -> typing.Any:
    """transformers' ``DeepseekV3Config`` of ``m`` (no MTP layers: moeserve runs none)."""
    from transformers import DeepseekV3Config

    if m.model_type != "deepseek_v3" or m.router != "noaux_tc" or m.moe_layer_freq != 1:
        raise ValueError("compare-hf runs DeepSeek-V3 models (noaux_tc router, an MoE layer after each dense one)")
    r = m.rope
    rope = {"rope_type": r.kind, "rope_theta": r.theta}
    if r.kind == "yarn":
        rope.update(factor=r.factor, original_max_position_embeddings=r.original_max_position,
                    beta_fast=r.beta_fast, beta_slow=r.beta_slow, mscale=r.mscale, mscale_all_dim=r.mscale_all_dim)
    return DeepseekV3Config(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        moe_intermediate_size=m.moe_intermediate_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_heads, n_shared_experts=m.n_shared_experts,
        n_routed_experts=m.n_routed_experts, routed_scaling_factor=m.routed_scaling_factor,
        kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank, qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim, qk_nope_head_dim=m.qk_nope_head_dim, n_group=m.n_group,
        topk_group=m.topk_group, num_experts_per_tok=m.num_experts_per_tok,
        first_k_dense_replace=m.first_k_dense_replace, norm_topk_prob=m.norm_topk_prob,
        max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.rms_norm_eps,
        rope_parameters=rope, rope_interleave=r.interleave, attention_bias=m.attention_bias,
        tie_word_embeddings=m.tie_word_embeddings, num_mtp_layers=0, pad_token_id=None,
        bos_token_id=m.bos_token_id, eos_token_id=list(m.eos_token_ids) or None,
    )


def shared_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """transformers' in-memory tensor names -> tensors on moeserve's storage.

    Every checkpoint name moeserve knows maps to one slice of one parameter (``checkpoint_slots``);
    the per-expert names are gathered into transformers' stacked expert tensors.
    """
    weights: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[tuple[int, str], list]] = defaultdict(dict)
    for name, dests in checkpoint_slots(model).items():
        match = _EXPERT.match(name)
        if match:
            experts[match[1]][int(match[2]), match[3]] = dests
        else:
            weights[name] = _slot_view(name, dests)
    for prefix, parts in experts.items():
        weights[prefix + ".gate_up_proj"], weights[prefix + ".down_proj"] = _stacked_experts(prefix, parts)
    return weights


def _slot_view(name: str, dests: list) -> torch.Tensor:
    if len(dests) != 1:
        raise ValueError(f"{name} is held in {len(dests)} places; compare-hf needs one rank and no replicas")
    param, dest_index, _ = dests[0]
    return param.data[dest_index]


def _stacked_experts(prefix: str, parts: dict[tuple[int, str], list]) -> tuple[torch.Tensor, torch.Tensor]:
    """``gate_up_proj [E, 2I, D]`` and ``down_proj [E, D, I]``: moeserve's own stacks when expert
    ``e`` sits in slot ``e`` with gate rows before up rows, else a copy assembled slot by slot."""
    num = 1 + max(e for e, _ in parts)
    gate0 = parts[0, "gate_proj"]
    w13, w2 = gate0[0][0], parts[0, "down_proj"][0][0]
    inter = _slot_view(prefix, gate0).shape[0]
    expected = {(e, "gate_proj"): (w13, (e, slice(0, inter))) for e in range(num)}
    expected |= {(e, "up_proj"): (w13, (e, slice(inter, 2 * inter))) for e in range(num)}
    expected |= {(e, "down_proj"): (w2, (e,)) for e in range(num)}
    same = all(len(parts[key]) == 1 and parts[key][0][0] is param and parts[key][0][1] == index
               for key, (param, index) in expected.items())
    if same and w13.shape[0] == num and w2.shape[0] == num:
        return w13.data, w2.data
    gate_up = torch.stack([torch.cat([_slot_view(prefix, parts[e, "gate_proj"]),
                                      _slot_view(prefix, parts[e, "up_proj"])]) for e in range(num)])
    return gate_up, torch.stack([_slot_view(prefix, parts[e, "down_proj"]) for e in range(num)])


def build_hf_model(model: nn.Module, m: ModelConfig, attn_implementation: str = "sdpa",
                   experts_implementation: str | None = None) -> nn.Module:
    """transformers' ``DeepseekV3ForCausalLM`` of ``m`` on ``model``'s weights (shared, not copied)."""
    from transformers import AutoModelForCausalLM

    weights = shared_weights(model)
    embed = weights["model.embed_tokens.weight"]
    cfg = hf_config(m)
    kwargs: dict[str, typing.Any] = {"dtype": embed.dtype, "attn_implementation": attn_implementation}
    if experts_implementation:
        kwargs["experts_implementation"] = experts_implementation
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg, **kwargs)
    with torch.device(embed.device):  # rope frequencies are computed, not loaded
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hf.config)
    _bind(hf, weights)
    return hf.eval()


def _bind(hf: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Point every meta parameter and buffer of ``hf`` at the tensor of its name."""
    wanted = {n: t for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta}
    missing = sorted(wanted.keys() - weights.keys())
    unused = sorted(weights.keys() - dict(hf.named_parameters()).keys() - dict(hf.named_buffers()).keys())
    if missing or unused:
        raise ValueError(f"weights do not match transformers' model: missing {missing[:5]}, unused {unused[:5]}")
    for name, meta in wanted.items():
        tensor = weights[name]
        if tensor.shape != meta.shape:
            raise ValueError(f"{name}: moeserve holds {tuple(tensor.shape)}, transformers wants {tuple(meta.shape)}")
        owner, attr = _owner(hf, name)
        if attr in owner._parameters:
            setattr(owner, attr, nn.Parameter(tensor, requires_grad=False))
        else:
            owner.register_buffer(attr, tensor, persistent=attr not in owner._non_persistent_buffers_set)


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (root.get_submodule(path) if path else root), attr


# ---------------------------------------------------------------------------------- measurements


def same_logits_error(runner: ModelRunner, hf: nn.Module, prompts: list[list[int]]) -> float:
    """Relative L2 distance of the two engines' last-token logits after prefilling ``prompts``."""
    pool = runner.new_page_pool()
    reqs = admit(pool, prompts, 1)
    try:
        ours = runner.forward(ScheduleBatch(ForwardMode.EXTEND, [ScheduledSeq(r, 0, r.seq_len) for r in reqs]))
    finally:
        release(pool, reqs)
    with torch.inference_mode():
        ids = torch.tensor(prompts, device=ours.device)
        theirs = hf(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()
    return float((ours.float() - theirs).norm() / theirs.norm())


@torch.inference_mode()
def hf_prefill_s(hf: nn.Module, prompts: list[list[int]], device: torch.device) -> float:
    """Seconds of one prefill of ``prompts`` (after an untimed one), to the greedy tokens on the host."""
    ids = torch.tensor(prompts, device=device)
    hf(input_ids=ids, use_cache=True, logits_to_keep=1)
    sync(device)
    start = time.perf_counter()
    hf(input_ids=ids, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1).tolist()
    return time.perf_counter() - start


@torch.inference_mode()
def hf_fill_cache(hf: nn.Module, prompts: list[list[int]], max_tokens: int,
                  device: torch.device) -> tuple[typing.Any, torch.Tensor]:
    """A ``DynamicCache`` holding ``prompts`` and their greedy next tokens ``[B]``; the prompts are
    prefilled a group of sequences at a time (at most ``max_tokens`` tokens, at least one sequence)."""
    from transformers import DynamicCache

    rows = max(1, max_tokens // len(prompts[0]))
    ids = torch.tensor(prompts, device=device)
    layers: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    next_ids = []
    for start in range(0, len(prompts), rows):
        out = hf(input_ids=ids[start:start + rows], use_cache=True, logits_to_keep=1)
        next_ids.append(out.logits[:, -1].argmax(-1))
        layers.append([(layer.keys, layer.values) for layer in out.past_key_values.layers])
        del out
    merged = [(torch.cat([g[i][0] for g in layers]), torch.cat([g[i][1] for g in layers]))
              for i in range(len(layers[0]))]
    del layers
    return DynamicCache(ddp_cache_data=merged), torch.cat(next_ids)


@contextlib.contextmanager
def count_experts(hf: nn.Module) -> Iterator[list[int]]:
    """Distinct routed experts each MoE layer picks during the block (one count per call)."""
    counts: list[int] = []
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    hooks = [g.register_forward_hook(lambda mod, inp, out: counts.append(int(out[2].unique().numel())))
             for g in gates]
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


@torch.inference_mode()
def hf_decode(hf: nn.Module, prompts: list[list[int]], steps: int, max_prefill_tokens: int,
              device: torch.device) -> tuple[float, float | None]:
    """(median seconds per decode step over ``steps`` after two untimed ones, distinct experts per
    MoE layer in the first step)."""
    cache, next_ids = hf_fill_cache(hf, prompts, max_prefill_tokens, device)
    times, experts = [], []
    for step in range(steps + 2):
        with count_experts(hf) if step == 0 else contextlib.nullcontext([]) as counts:
            sync(device)
            start = time.perf_counter()
            out = hf(input_ids=next_ids[:, None], past_key_values=cache, use_cache=True, logits_to_keep=1)
            next_ids = out.logits[:, -1].argmax(-1)
            next_ids.tolist()
            elapsed = time.perf_counter() - start
        experts += counts
        if step >= 2:
            times.append(elapsed)
    return statistics.median(times), statistics.mean(experts) if experts else None


def measure_cpu_ceilings() -> Ceilings:
    """A crude stand-in for ``measure_ceilings`` on a CPU: a 64 MiB copy and a 512^3 fp32 matmul."""
    src = torch.randn(2**24)
    dst = torch.empty_like(src)
    a, b = torch.randn(512, 512), torch.randn(512, 512)

    def best(fn: typing.Callable[[], object]) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    copy_s, mm_s = best(lambda: dst.copy_(src)), best(lambda: a @ b)
    tflops = 2 * 512**3 / mm_s / 1e12
    return Ceilings(copy_gbps=2 * src.numel() * 4 / copy_s / 1e9, bf16_tflops=tflops, fp8_tflops=tflops)


# ---------------------------------------------------------------------------------------- the run


@dataclass
class Cell:
    """One shape, both engines. ``length`` is the context (decode) or the input length (prefill);
    times are seconds per decode step or per prefill; ``None`` with an error ("OOM")."""

    kind: str  # "decode" or "prefill"
    batch: int
    length: int
    moeserve_s: float | None
    hf_s: float | None
    roofline_s: float
    roofline_memory_s: float
    roofline_compute_s: float
    roofline_bytes: float
    roofline_flops: float
    experts_uniform: float
    experts_measured: float | None = None  # transformers' routers, first decode step
    roofline_measured_s: float | None = None  # with the measured expert count
    moeserve_error: str | None = None
    hf_error: str | None = None

    @property
    def tokens(self) -> int:
        """Tokens one timed call produces (decode) or consumes (prefill)."""
        return self.batch if self.kind == "decode" else self.batch * self.length

    @property
    def speedup(self) -> float | None:
        """moeserve's throughput over transformers'."""
        return self.hf_s / self.moeserve_s if self.hf_s and self.moeserve_s else None

    @property
    def of_roofline(self) -> float | None:
        """moeserve's time over the roofline time (1 is the floor)."""
        return self.moeserve_s / self.roofline_s if self.moeserve_s else None


@dataclass
class CompareSpec:
    batch_sizes: list[int] = field(default_factory=lambda: [32, 128])
    contexts: list[int] = field(default_factory=lambda: [256, 2048])
    prefill: list[tuple[int, int]] = field(default_factory=lambda: [(8, 1024)])
    decode_steps: int = 16
    max_prefill_tokens: int = 16384
    seed: int = 0

    def kv_tokens(self, page_size: int) -> int:
        """KV slots the largest cell needs (each request rounds up to whole pages)."""
        def slots(batch: int, tokens: int) -> int:
            return batch * -(-tokens // page_size) * page_size
        decode = [slots(b, c + self.decode_steps + 1) for b in self.batch_sizes for c in self.contexts]
        return max(decode + [slots(b, n + 1) for b, n in [*self.prefill, CHECK_SHAPE]])

    @property
    def max_batch(self) -> int:
        return max(self.batch_sizes + [b for b, _ in self.prefill])


def _roofline_cell(kind: str, m: ModelConfig, batch: int, length: int, ceilings: Ceilings,
                   weight_dtype: str, kv_bytes: int) -> Cell:
    work_fn = rl.decode_work if kind == "decode" else rl.prefill_work
    work = work_fn(m, batch, length, weight_dtype, kv_bytes)
    roof = rl.roofline(work, ceilings, weight_dtype)
    return Cell(kind, batch, length, None, None, roof.step_s, roof.memory_s, roof.compute_s, work.bytes,
                work.flops, work.experts_per_layer)


def _attempt(device: torch.device, fn: typing.Callable[..., typing.Any],
             *args: typing.Any) -> tuple[typing.Any, str | None]:
    """``fn(*args)``, or ``(None, "OOM")`` when the device runs out of memory."""
    try:
        result, error = fn(*args), None
    except torch.OutOfMemoryError:
        result, error = None, "OOM"
    # outside the handler, so the failed call's frames and tensors are gone before the cache is emptied
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    return result, error


def measure_moeserve(runner: ModelRunner, cells: list[Cell], spec: CompareSpec) -> None:
    device = torch.device(runner.config.load.device)
    for c in cells:
        output_len = spec.decode_steps + 1 if c.kind == "decode" else 1
        result, c.moeserve_error = _attempt(device, bench_one_batch, runner, c.batch, c.length, output_len,
                                            spec.max_prefill_tokens, spec.seed)
        if result is not None:
            c.moeserve_s = result.decode_step_ms / 1e3 if c.kind == "decode" else result.prefill_s
        print(f"moeserve {c.kind} {c.batch} x {c.length}: {_secs(c.moeserve_s, c.moeserve_error)}",
              file=sys.stderr, flush=True)


def measure_hf(hf: nn.Module, m: ModelConfig, cells: list[Cell], spec: CompareSpec, ceilings: Ceilings,
               weight_dtype: str, kv_bytes: int, device: torch.device) -> None:
    for c in cells:
        prompts = random_prompts(c.batch, c.length, m.vocab_size, spec.seed)
        if c.kind == "prefill":
            c.hf_s, c.hf_error = _attempt(device, hf_prefill_s, hf, prompts, device)
        else:
            res, c.hf_error = _attempt(device, hf_decode, hf, prompts, spec.decode_steps, spec.max_prefill_tokens,
                                       device)
            if res is not None:
                c.hf_s, c.experts_measured = res
            if c.experts_measured is not None:
                work = rl.decode_work(m, c.batch, c.length, weight_dtype, kv_bytes, c.experts_measured)
                c.roofline_measured_s = rl.roofline(work, ceilings, weight_dtype).step_s
        print(f"transformers {c.kind} {c.batch} x {c.length}: {_secs(c.hf_s, c.hf_error)}",
              file=sys.stderr, flush=True)


@dataclass
class CompareReport:
    description: str
    hf_description: str
    ceilings: Ceilings
    same_logits_rel_err: float
    cells: list[Cell]


def compare(runner: ModelRunner, spec: CompareSpec, ceilings: Ceilings, attn_implementation: str = "sdpa",
            experts_implementation: str | None = None) -> CompareReport:
    """Every cell on moeserve, then on transformers over the same weights."""
    import transformers

    cfg = runner.config
    m, device = cfg.model, torch.device(cfg.load.device)
    weight_dtype, kv_bytes = rl.engine_dtypes(cfg)
    if weight_dtype == "fp8":
        raise ValueError("compare-hf compares unquantized weights (transformers runs them as they are)")
    cells = [_roofline_cell("decode", m, b, ctx, ceilings, weight_dtype, kv_bytes)
             for b in spec.batch_sizes for ctx in spec.contexts]
    cells += [_roofline_cell("prefill", m, b, n, ceilings, weight_dtype, kv_bytes) for b, n in spec.prefill]
    measure_moeserve(runner, cells, spec)
    hf, error = _attempt(device, build_hf_model, runner.model, m, attn_implementation, experts_implementation)
    if hf is None:  # only where a layout differs is anything copied; that copy did not fit
        for c in cells:
            c.hf_error = f"{error} (model)"
        return CompareReport(describe(cfg), f"transformers {transformers.__version__}", ceilings, math.nan, cells)
    err = same_logits_error(runner, hf, random_prompts(*CHECK_SHAPE, m.vocab_size, spec.seed + 1))
    measure_hf(hf, m, cells, spec, ceilings, weight_dtype, kv_bytes, device)
    hf_desc = (f"transformers {transformers.__version__} (attention {hf.config._attn_implementation}, "
               f"experts {hf.config._experts_implementation})")
    return CompareReport(describe(cfg), hf_desc, ceilings, err, cells)


# ----------------------------------------------------------------------------------------- report


def _secs(value: float | None, error: str | None) -> str:
    return error or ("-" if value is None else f"{value * 1e3:.3f} ms")


def _cols(cell: Cell, seconds: float | None, error: str | None) -> str:
    if seconds is None:
        return f"{error or '-':>10} {'':>10}"
    return f"{seconds * 1e3:>10.2f} {cell.tokens / seconds:>10.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


_HEADER = (f"{'phase':>7} {'batch':>5} {'len':>5} | {'moeserve ms':>10} {'tok/s':>10} | {'HF ms':>10} "
           f"{'tok/s':>10} | {'speedup':>7} | {'roofline ms':>11} {'mem ms':>8} {'flop ms':>8} | {'vs roofline':>11}")


def format_report(r: CompareReport) -> str:
    c = r.ceilings
    lines = [f"moeserve: {r.description}", f"baseline: {r.hf_description}",
             f"ceilings: copy {c.copy_gbps:.0f} GB/s, matmul {c.bf16_tflops:.3g} TFLOP/s",
             f"same weights: last-token logits differ by {r.same_logits_rel_err:.2e} (relative L2)",
             "speedup = moeserve tokens/s over transformers'; vs roofline = moeserve time over the roofline time",
             _HEADER]
    for cell in r.cells:
        lines.append(f"{cell.kind:>7} {cell.batch:>5} {cell.length:>5} | "
                     f"{_cols(cell, cell.moeserve_s, cell.moeserve_error)} | "
                     f"{_cols(cell, cell.hf_s, cell.hf_error)} | {_ratio(cell.speedup):>7} | "
                     f"{cell.roofline_s * 1e3:>11.2f} {cell.roofline_memory_s * 1e3:>8.2f} "
                     f"{cell.roofline_compute_s * 1e3:>8.2f} | {_ratio(cell.of_roofline):>11}")
    for cell in r.cells:
        if cell.experts_measured is not None:
            lines.append(f"decode {cell.batch} x {cell.length}: experts per MoE layer {cell.experts_uniform:.1f} "
                         f"uniform, {cell.experts_measured:.1f} measured (roofline "
                         f"{cell.roofline_measured_s * 1e3:.2f} ms with it)")
    return "\n".join(lines)


def report_dict(r: CompareReport) -> dict[str, typing.Any]:
    cells = [{**dataclasses.asdict(c), "speedup": c.speedup, "of_roofline": c.of_roofline} for c in r.cells]
    return {"moeserve": r.description, "baseline": r.hf_description, "ceilings": dataclasses.asdict(r.ceilings),
            "same_logits_rel_err": r.same_logits_rel_err, "cells": cells}


def spec_from_args(args: argparse.Namespace) -> CompareSpec:
    return CompareSpec(args.batch_sizes, args.contexts, list(args.prefill), args.decode_steps,
                       args.max_prefill_tokens, args.seed)


def run_compare_hf(args: argparse.Namespace) -> int:
    """``moeserve bench compare-hf``."""
    from moeserve.bench.kernels import measure_ceilings

    spec = spec_from_args(args)
    if args.quantization:
        raise ValueError("compare-hf compares unquantized weights: drop --quantization")
    if args.device == "cuda":
        ceilings = measure_ceilings()  # before the model takes the memory its buffers need
        torch.cuda.empty_cache()
    else:
        ceilings = measure_cpu_ceilings()
    page = args.page_size or default_page_size(args.device)
    config: EngineConfig = engine_config_from_args(args, spec.max_batch, spec.kv_tokens(page))
    runner = ModelRunner(config)
    report = compare(runner, spec, ceilings, args.hf_attn_implementation, args.hf_experts_implementation)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**environment(config), **report_dict(report)}, f, indent=1)
    return 0
