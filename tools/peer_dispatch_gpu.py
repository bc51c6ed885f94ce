"""Low-latency dispatch and combine on one GPU at DeepSeek-V3's shapes: the peer dispatcher with
every EP rank's buffers on this GPU (one process plays all ranks), beside the torch dispatcher
at EP 1 (which copies its whole ``[E, C, D]`` buffer a call).

    python3 tools/peer_dispatch_gpu.py [--ranks 8] [--tokens 128] [--out results.json]

With the peers on one GPU the rows go HBM to HBM: this times the kernels' own cost (launches,
polls, the row copies at local bandwidth), a floor for the NVLink case, not its figure. Each
timing is a CUDA graph of one round (every rank's dispatch, then every rank's combine), divided
by the ranks; medians of ``--iters`` replays.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from moeserve.distributed.ep_dispatch import TorchLowLatencyDispatcher
from moeserve.distributed.groups import Group
from moeserve.distributed.peer_dispatch import PeerLayout, PeerLowLatencyDispatcher, local_peer_memories

HIDDEN, TOP_K, EXPERTS = 7168, 8, 256


def _inputs(ranks: int, tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    gen = torch.Generator("cuda").manual_seed(seed)
    out = []
    for _ in range(ranks):
        hidden = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").bfloat16()
        ids = torch.rand(tokens, EXPERTS, generator=gen, device="cuda").topk(TOP_K, dim=1).indices
        weights = torch.rand(tokens, TOP_K, generator=gen, device="cuda").softmax(-1)
        out.append((hidden, ids, weights))
    return out


def _graph_ms(fn, iters: int) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peer_round(ranks: int, tokens: int, fp8: bool, iters: int) -> dict[str, float]:
    layout = PeerLayout.for_model(ranks, EXPERTS // ranks, tokens, TOP_K, HIDDEN, torch.bfloat16, fp8)
    memories = local_peer_memories(ranks, layout.nbytes, "cuda")
    dispatchers = [PeerLowLatencyDispatcher(m, layout, fp8, torch.bfloat16) for m in memories]
    inputs = _inputs(ranks, tokens, 0)
    outs = {}

    def dispatch():
        sent = [d.dispatch_a(*x) for d, x in zip(dispatchers, inputs)]
        outs["recv"] = [d.dispatch_b(p) for d, p in zip(dispatchers, sent)]

    dispatch()
    expert_out = [torch.randn(r.hidden.shape, device="cuda").bfloat16() for r, _ in outs["recv"]]

    def round_():
        dispatch()
        back = [d.combine_a(y, h) for d, y, (_, h) in zip(dispatchers, expert_out, outs["recv"])]
        return [d.combine_b(p) for d, p in zip(dispatchers, back)]

    t_dispatch = _graph_ms(dispatch, iters) / ranks
    t_round = _graph_ms(round_, iters) / ranks
    for m in memories:
        m.raise_if_failed()
    row = HIDDEN + 4 * (HIDDEN // 128) if fp8 else 2 * HIDDEN
    return {"dispatch_ms": t_dispatch, "combine_ms": t_round - t_dispatch,
            "dispatch_bytes": tokens * TOP_K * row, "combine_bytes": tokens * TOP_K * 2 * HIDDEN}


def torch_ep1(tokens: int, fp8: bool, iters: int) -> dict[str, float]:
    one = Group(None, 0, 1, [0])
    dispatcher = TorchLowLatencyDispatcher(one, EXPERTS, tokens, fp8=fp8)
    hidden, ids, weights = _inputs(1, tokens, 0)[0]
    recv, handle = dispatcher.dispatch(hidden, ids, weights)
    expert_out = torch.randn(recv.hidden.shape, device="cuda").bfloat16()
    t_dispatch = _graph_ms(lambda: dispatcher.dispatch(hidden, ids, weights), iters)
    t_round = _graph_ms(lambda: dispatcher.combine(expert_out, dispatcher.dispatch(hidden, ids, weights)[1]), iters)
    return {"dispatch_ms": t_dispatch, "combine_ms": t_round - t_dispatch}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for fp8 in (False, True):
        for ranks in args.ranks:
            rows.append({"dispatcher": "peer", "ranks": ranks, "fp8": fp8,
                         **peer_round(ranks, args.tokens, fp8, args.iters)})
            print(json.dumps(rows[-1]), flush=True)
        rows.append({"dispatcher": "torch_ep1", "ranks": 1, "fp8": fp8, **torch_ep1(args.tokens, fp8, args.iters)})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": args.tokens,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
