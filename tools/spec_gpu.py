"""Speculative decoding (NEXTN) on one GPU, DeepSeek-V3 shapes: the verify step next to a plain decode
step, and the decode tokens/s they imply at given acceptance rates, in one run.

    python tools/spec_gpu.py --num-layers 4 --batch 32 128 --context 2048 --json spec_gpu.json

One runner (random FP8 weights, the MTP module as the released one's shapes) and one scheduler hold
``B`` requests of ``--context`` tokens. The timed steps alternate, over the same requests:

- plain: a decode step (a CUDA graph of the model, one token a sequence);
- NEXTN: a whole speculative step as the scheduler runs it: the verify of ``S + 1`` tokens a
  sequence, the MTP module's pass over them and ``S - 1`` draft steps, each a CUDA graph, and the
  host's judging of the chains between them.

Random weights keep almost no draft, but a step's work does not depend on what is kept (the verify
is as wide, the MTP passes as many), so the acceptance rates below are applied to the measured
times: with each draft kept with probability ``a`` independently of the others, a chain of ``S``
emits ``1 + a + ... + a^S`` tokens a step. The components (verify, MTP pass, draft step) are timed
alone as CUDA-graph replays; the MLA verify kernel alone against decode's, as a share of the copy
bandwidth or the matmul rate measured at the start of the run.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from moeserve.config import engine_config_for
from moeserve.core import ForwardMode, SamplingParams, ScheduleBatch, ScheduledSeq
from moeserve.executor.cuda_graph import CudaGraphRunner
from moeserve.executor.model_runner import ModelRunner
from moeserve.planner import preset_config
from moeserve.scheduler.scheduler import Scheduler

CUDA = torch.cuda.is_available()
RATES = (0.6, 0.8, 0.9)


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def wall_ms(fn, repeats: int) -> float:
    """Median wall time of ``fn()`` in ms, from an idle device to its end."""
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a chain of ``drafts`` emits per step when each draft is kept with probability ``rate``."""
    return sum(rate ** k for k in range(drafts + 1))


def kernel_rows(batches: list[int], context: int, widths: list[int]) -> list[dict]:
    """The MLA kernel alone, one query a sequence (decode) and ``w`` (verify), CUDA-graph replays."""
    from moeserve.bench.kernel_cases.mla import PAGE_SIZE, DecodeShape, decode_inputs
    from moeserve.bench.kernels import graph_ms, measure_ceilings, share_of_ceiling
    from moeserve.kernels.triton import mla

    ceil = measure_ceilings()
    rows = []
    for batch in batches:
        shape = DecodeShape(batch, context, 128)
        inp = decode_inputs(shape)
        for w in widths:
            q_lat = inp["q_latent"].repeat_interleave(w, 0)
            q_rope = inp["q_rope"].repeat_interleave(w, 0)

            def call(w=w, q_lat=q_lat, q_rope=q_rope, inp=inp):
                return mla.mla_verify(q_lat, q_rope, inp["kv_cache"], inp["kv_indptr"], inp["kv_indices"],
                                      inp["scale"], w, page_size=PAGE_SIZE)

            ms = graph_ms(call)
            flops = shape.flops * w
            nbytes = shape.bytes + batch * (w - 1) * 128 * (576 + 512) * 2  # the extra queries and outputs
            bound, share = share_of_ceiling(flops, nbytes, ms, ceil)
            rows.append({"batch": batch, "context": context, "queries_per_seq": w, "ms": ms,
                         "bound": bound, "share_of_ceiling": share, "tflops": flops / ms / 1e9,
                         "gbps": nbytes / ms / 1e6})
        del inp
    return [{"copy_gbps": ceil.copy_gbps, "bf16_tflops": ceil.bf16_tflops}] + rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--batch", type=int, nargs="+", default=[32, 128])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, nargs="+", default=[1, 2], help="draft tokens a step (S), a runner each")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true", help="a tiny random model on this device (a smoke test)")
    p.add_argument("--profile", action="store_true",
                   help="also print the device time by kernel of a decode pass and of a draft step (eager)")
    args = p.parse_args()
    results = {"gpu": torch.cuda.get_device_name() if CUDA else "cpu", "date": time.strftime("%Y-%m-%d"),
               "args": vars(args), "steps": {}}
    for s in args.steps:
        results["steps"][s] = run_steps(args, s)
        gc.collect()  # the runner and its graphs refer to each other
        if CUDA:
            torch.cuda.empty_cache()
    if CUDA and not args.tiny:
        results["kernel"] = kernel_rows(args.batch, args.context, [1] + [s + 1 for s in args.steps])
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def run_steps(args: argparse.Namespace, num_drafts: int) -> list[dict]:
    """For each batch size: the plain and speculative step times and what they imply."""
    model = preset_config("dsv3", args.num_layers) if not args.tiny else _tiny()
    top = max(args.batch)
    extra = 8 * args.repeats * (num_drafts + 1) + 64
    config = engine_config_for(model, load_format="dummy", device="cuda" if CUDA else "cpu",
                               quantization="fp8" if CUDA and not args.tiny else None,
                               max_total_tokens=top * (args.context + extra), max_running_requests=top,
                               chunked_prefill_size=16384, max_prefill_tokens=16384,
                               speculative_algorithm="NEXTN", speculative_num_steps=num_drafts,
                               disable_cuda_graph=not CUDA)
    runner = ModelRunner(config)
    # the baseline's decode graphs on the same runner (speculation replaces decode steps)
    runner.graph_runner = CudaGraphRunner(runner, config.runner.graph_batch_sizes(top)) if CUDA else None
    rows = []
    for batch in args.batch:
        sched = Scheduler(config, runner)
        spec = sched.spec
        gen = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, model.vocab_size, (batch, args.context), generator=gen).tolist()
        params = SamplingParams(max_tokens=min(extra, config.context_length - args.context), temperature=0,
                                ignore_eos=True)
        reqs = [sched.add_request(f"r{i}", ids, params) for i, ids in enumerate(prompts)]
        while len(sched.decode) < batch:
            sched.step()
        assert all(r.rid in spec.drafts for r in reqs)

        def plain_step():
            sched.spec = None
            sched.step()

        def spec_step():
            sched.spec = spec
            for r in reqs:  # after plain steps: drafts for the request's new position (any tokens do)
                spec.drafts.setdefault(r.rid, [0] * num_drafts)
            sched.step()

        plain_step(), spec_step()  # warm up both
        if args.profile and batch == max(args.batch):
            print(host_profile(spec_step, "speculative step"))
            print(host_profile(plain_step, "plain step"))
        times = {"plain": [], "spec": []}
        for _ in range(3):  # alternate, so drift hits both alike
            times["plain"].append(wall_ms(plain_step, args.repeats))
            times["spec"].append(wall_ms(spec_step, args.repeats))
        plain_ms, spec_ms = statistics.median(times["plain"]), statistics.median(times["spec"])
        parts = component_ms(sched, runner, reqs, num_drafts, args.repeats, args.profile and batch == max(args.batch))
        implied = {str(a): {"tokens_per_step": expected_tokens(a, num_drafts),
                            "tok_s": batch * expected_tokens(a, num_drafts) / spec_ms * 1e3,
                            "speedup": expected_tokens(a, num_drafts) * plain_ms / spec_ms} for a in RATES}
        rows.append({"batch": batch, "context": args.context, "num_drafts": num_drafts,
                     "plain_step_ms": plain_ms, "plain_tok_s": batch / plain_ms * 1e3, "spec_step_ms": spec_ms,
                     "components_ms": parts, "measured_accept_length": spec.accept_length, "implied": implied})
        print(json.dumps(rows[-1]), flush=True)
        for r in reqs:
            sched.abort(r.rid)
    return rows


@torch.inference_mode()
def component_ms(sched: Scheduler, runner: ModelRunner, reqs, num_drafts: int, repeats: int,
                 profile: bool = False) -> dict:
    """Each pass of a speculative step alone, over the running requests (graph replays on CUDA)."""
    width = num_drafts + 1
    for r in reqs:
        sched.spec.drafts.setdefault(r.rid, [0] * num_drafts)
    verify = sched.spec.prepare(ScheduleBatch(ForwardMode.DECODE, [ScheduledSeq(r, r.seq_len - 1, r.seq_len)
                                                                    for r in reqs]))
    decode = ScheduleBatch(ForwardMode.DECODE, [ScheduledSeq(r, r.seq_len - 1, r.seq_len) for r in reqs])
    _, hidden = runner.forward_with_hidden(verify)
    mtp = ScheduleBatch(ForwardMode.VERIFY, [ScheduledSeq(r, r.seq_len - 1, r.seq_len - 1 + width,
                                                          tokens=[r.output_ids[-1]] * width) for r in reqs])
    step = ScheduleBatch(ForwardMode.DECODE, [ScheduledSeq(r, r.seq_len, r.seq_len + 1, tokens=[r.output_ids[-1]])
                                              for r in reqs])
    last = torch.arange(len(reqs), device=hidden.device) * width + width - 1
    out = {"decode": wall_ms(lambda: runner.forward(decode), repeats),
           "verify": wall_ms(lambda: runner.forward_with_hidden(verify), repeats),
           "mtp_pass": wall_ms(lambda: runner.forward_mtp(mtp, hidden, rows=last), repeats)}
    if num_drafts > 1:
        out["draft_step"] = wall_ms(lambda: runner.forward_mtp(step, hidden[last]), repeats)
    if profile:
        prev = hidden[last]
        embed = runner.model.model.embed_tokens
        for name, fn in (("decode pass, eager", lambda fb=runner.build_batch(decode): runner.run_layers(fb)),
                         ("draft step, eager", lambda fb=runner.build_batch(step): runner.model.mtp(fb, prev, embed))):
            print(f"--- {name}, {len(reqs)} sequences: device time by kernel over 5 passes")
            print(kernel_table(fn))
    return out


def host_profile(fn, name: str, steps: int = 5, rows: int = 25) -> str:
    """Where the host spends a step (cProfile, by own time; a wait for the device shows in the
    call that syncs)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    sync()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(rows)
    return f"--- {name}: host profile of {steps} steps\n" + out.getvalue()


def kernel_table(fn, rows: int = 18) -> str:
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if CUDA else [])
    with profile(activities=activities) as prof:
        for _ in range(5):
            fn()
        sync()
    key = "self_device_time_total" if CUDA else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60)


def _tiny():
    from moeserve.config import ModelConfig
    from moeserve.models.tiny import _hf_config

    return ModelConfig.from_dict(_hf_config("v3", False, {"num_nextn_predict_layers": 1}))


if __name__ == "__main__":
    main()
