"""Two-batch overlap on one GPU, DeepSeek-V3 shapes: the same logits and greedy tokens with overlap on
and off (eager, and decode under CUDA graphs captured as two micro-batches), the decode step's
logits of two half batches against the whole (with the kernels' launches sized as the whole batch,
and without), the peak activation memory of a 16K-token prefill both ways, and the host time of a
decode step through the operation executor against the old loop over the layers.

    python tools/tbo_gpu.py --num-layers 4 --json tbo_gpu.json

One GPU has no all-to-all to hide, so what overlap brings here is the halved activations; its
throughput belongs to several GPUs. Random FP8 weights; eager execution (no CUDA graphs) so that
host time is visible.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from moeserve.config import engine_config_for
from moeserve.core import ForwardMode, SamplingParams, ScheduleBatch, ScheduledSeq
from moeserve.executor import overlap
from moeserve.executor.cuda_graph import CudaGraphRunner
from moeserve.executor.model_runner import ModelRunner
from moeserve.planner import preset_config
from moeserve.scheduler.scheduler import Scheduler

CUDA = torch.cuda.is_available()


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def peak_of(fn) -> tuple[torch.Tensor, int]:
    """``fn()`` and the most device memory it held beyond what was allocated before (0 on the CPU)."""
    if not CUDA:
        return fn(), 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def host_times(fn, repeats: int) -> tuple[float, float]:
    """Median (enqueue time, wall time) of ``fn`` in ms: the host's share, and the whole step."""
    enqueue, wall = [], []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        sync()
        enqueue.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(enqueue), statistics.median(wall)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--prefill-seqs", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=4096)
    p.add_argument("--decode-batch", type=int, default=32)
    p.add_argument("--decode-context", type=int, default=512)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true", help="a tiny random model on this device (a smoke test)")
    args = p.parse_args()
    model = preset_config("dsv3", args.num_layers) if not args.tiny else _tiny()
    tokens = args.prefill_seqs * args.prefill_len
    config = engine_config_for(model, load_format="dummy", device="cuda" if CUDA else "cpu",
                               quantization="fp8" if CUDA else None, page_size=64 if CUDA else 16,
                               max_total_tokens=2 * tokens + 4096, mem_fraction_static=0.6, disable_cuda_graph=True,
                               chunked_prefill_size=tokens, max_prefill_tokens=tokens,
                               enable_two_batch_overlap=True, tbo_min_tokens=2)
    runner = ModelRunner(config)
    sched = Scheduler(config, runner)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.vocab_size, (args.prefill_seqs, args.prefill_len), generator=gen).tolist()
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    reqs = [sched.add_request(f"r{i}", ids, params) for i, ids in enumerate(prompts)]
    prefill = sched.schedule()
    assert prefill.num_tokens == tokens, prefill.num_tokens
    with torch.inference_mode():
        whole, peak_whole = peak_of(lambda: runner._forward(runner.build_batch(prefill), False))
        (_, two), peak_two = peak_of(lambda: runner._forward_two(prefill, None))
    same_argmax = bool((whole.argmax(-1) == two.argmax(-1)).all())
    max_diff = float((whole - two).abs().max())
    for r in reqs:  # their pages back, for the runs below
        sched.abort(r.rid)
    # greedy generation both ways: overlap for every step of at least 2 tokens, or never
    out_on = [r.output_ids for r in _generate(sched, reqs, prefill, runner, overlap=True)]
    out_off = [r.output_ids for r in _generate(sched, reqs, prefill, runner, overlap=False)]
    # the same greedy generation with decode under CUDA graphs, captured whole or as two micro-batches
    graph_out = {}
    for name, overlap_from in (("overlap", 2), ("whole", None)):
        runner.graph_runner = CudaGraphRunner(runner, [1, 2, 4, 8], overlap_from) if CUDA else None
        graph_out[name] = [r.output_ids for r in _generate(sched, reqs, prefill, runner, overlap=False, tag=name)]
        runner.graph_runner = None
    decode = _decode_batch(sched, args.decode_batch, args.decode_context, model.vocab_size)
    with torch.inference_mode():
        fb = runner.build_batch(decode)
        whole_logits = runner.model.compute_logits(runner.run_layers(fb)[fb.last_token_index()], fb)
        halves_diff = {name: float((_halves_logits(runner, decode, hint) - whole_logits).abs().max())
                       for name, hint in (("launch_sized_as_whole", True), ("launch_sized_as_half", False))}
        old = host_times(lambda: runner.model(fb), args.repeats)
        new = host_times(lambda: runner.run_layers(fb), args.repeats)
        old2 = host_times(lambda: runner.model(fb), args.repeats)
    result = {"gpu": torch.cuda.get_device_name() if CUDA else "cpu", "date": time.strftime("%Y-%m-%d"),
              "args": vars(args), "prefill_tokens": tokens,
              "peak_activation_mib": {"whole": peak_whole / 2**20, "overlap": peak_two / 2**20},
              "prefill_logits_same_argmax": same_argmax, "prefill_logits_max_abs_diff": max_diff,
              "greedy_identical": out_on == out_off,
              "greedy_identical_cuda_graphs": graph_out["overlap"] == graph_out["whole"],
              "decode_halves_logits_max_abs_diff": halves_diff,
              "decode_step_ms": {"layer_loop": {"enqueue": old[0], "wall": old[1]},
                                 "executor": {"enqueue": new[0], "wall": new[1]},
                                 "layer_loop_again": {"enqueue": old2[0], "wall": old2[1]}}}
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


def _tiny():
    from moeserve.config import ModelConfig
    from moeserve.models.tiny import _hf_config

    return ModelConfig.from_dict(_hf_config("v3", False, {}))


def _generate(sched: Scheduler, reqs, prefill: ScheduleBatch, runner: ModelRunner, overlap: bool, tag: str = ""):
    """The same requests again, greedy, with every step run whole or as two micro-batches."""
    fresh = [sched.add_request(f"{r.rid}-{overlap}{tag}", r.prompt_ids, r.params) for r in reqs]
    runner.tbo_min_tokens = 2 if overlap else 1 << 62
    while not all(r.finished for r in fresh):
        sched.step()
    return fresh


def _halves_logits(runner: ModelRunner, decode: ScheduleBatch, sized_as_whole: bool) -> torch.Tensor:
    """The decode step's logits from two half batches, their kernels' launches sized as the whole
    batch (as the engine runs them) or as the half."""
    split = overlap.split_batch(decode, 0.48)
    batches = (runner.build_batch(split.first), runner.build_batch(split.second))
    for b in batches:
        b.launch_batch_size = len(decode.seqs) if sized_as_whole else None
    hidden = runner.run_layers_two(batches, extend=False)
    rows = torch.cat([h[b.last_token_index()] for h, b in zip(hidden, batches)])
    return runner.model.compute_logits(rows, batches[0])


def _decode_batch(sched: Scheduler, size: int, context: int, vocab: int) -> ScheduleBatch:
    """``size`` sequences of ``context`` tokens with a page for one more: a decode step to time."""
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for i in range(size):
        req = sched.add_request(f"d{i}", torch.randint(0, vocab, (context,), generator=gen).tolist(),
                                SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        sched.prefill.release(req)
        req.page_table = sched.pages.alloc(sched.pages.pages_for(context + 1))
        req.output_ids.append(0)
        seqs.append(ScheduledSeq(req, context, context + 1))
    return ScheduleBatch(ForwardMode.DECODE, seqs)


if __name__ == "__main__":
    main()
