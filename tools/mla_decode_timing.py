"""MLA decode on the kernel benchmark's shapes, timed three ways, then by KV split count.

    python3 tools/mla_decode_timing.py [--splits 1 2 4 8 16 32] [--rounds 2]

Run from the repository root on a CUDA machine. For each decode case of ``moeserve bench
kernels`` (pages of 64 slots in random order, the default launch config):

- eager: the device waits for the host between launches (the host's launch cost counts);
- queued: each call behind a spin kernel, so the kernels run back to back (``bench kernels``);
- graph: one call replayed from a CUDA graph (how the engine runs decode).

then the queued time of the Triton kernels' defaults (``triton``: ``HOPPER_WS=False``, what runs
off Hopper) and of each ``--splits`` count. Rates are against the copy and matmul ceilings
measured at the start of the same run. Rounds repeat the whole table, to show the spread.
"""

from __future__ import annotations

import argparse

import torch

from moeserve.bench.kernel_cases.mla import (
    DECODE_COMPUTE,
    DECODE_LONG,
    DECODE_MEMORY,
    PAGE_SIZE,
    DecodeShape,
    decode_inputs,
)
from moeserve.bench.kernels import Ceilings, graph_ms, measure_ceilings, share_of_ceiling, time_ms
from moeserve.kernels.triton import mla


def rate(shape: DecodeShape, ms: float, ceil: Ceilings) -> str:
    """The achieved rate as a share of the ceiling that bounds the case."""
    bound, share = share_of_ceiling(shape.flops, shape.bytes, ms, ceil)
    return f"{100 * share:5.1f}% of {'matmul' if bound == 'compute' else 'copy'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", type=int, nargs="*", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    ceil = measure_ceilings()
    print(f"{torch.cuda.get_device_name()}: copy {ceil.copy_gbps:.0f} GB/s, bf16 matmul {ceil.bf16_tflops:.0f} TFLOP/s")
    for shape in (DECODE_COMPUTE, DECODE_MEMORY, DECODE_LONG):
        inp = decode_inputs(shape)
        for rnd in range(args.rounds):
            configs = [("default", None), ("triton", {"HOPPER_WS": False})]
            configs += [(f"splits {s}", {"num_kv_splits": s}) for s in args.splits]
            for name, cfg in configs:
                def call(cfg: dict | None = cfg, inp: dict = inp) -> torch.Tensor:
                    return mla.mla_decode(**inp, page_size=PAGE_SIZE, config=cfg)

                queued = time_ms(call)
                line = f"round {rnd} {shape.name:36s} {name:9s} queued {queued:.4f} ms ({rate(shape, queued, ceil)})"
                if cfg is None:
                    eager, graph = time_ms(call, queued=False), graph_ms(call)
                    line += f"  eager {eager:.4f} ms ({rate(shape, eager, ceil)})"
                    line += f"  graph {graph:.4f} ms ({rate(shape, graph, ceil)})" if graph else "  graph: no capture"
                print(line, flush=True)
        del inp
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
