"""The rank loop of an attention-TP group of two gloo ranks, driven with scripted messages: after
every request has finished or been aborted, neither rank holds anything of them."""

from __future__ import annotations

import multiprocessing as mp
import traceback

import pytest

from moeserve.core import SamplingParams
from moeserve.scheduler.io import AbortInput, GenerateInput, ShutdownInput, TokenBatch

STEPS_BEFORE_ABORT = 3


def _worker(rank: int, store: str, model_path: str, results: mp.Queue) -> None:
    try:
        from moeserve.config import build_engine_config
        from moeserve.distributed.groups import build_groups, init_world
        from moeserve.scheduler.event_loop import EngineLoop

        init_world(store, rank, 2, "cpu")
        groups = build_groups(2, rank, attn_tp=2, dense_tp=2, ep_size=1, dp_lm_head=False)
        config = build_engine_config(model_path, tp_size=2, dtype="float32", page_size=4, max_total_tokens=512)
        loop = EngineLoop(config, groups, addrs=None)
        outputs: list = []
        if loop.is_leader:
            loop._receive = _script(outputs)

            def send(msg: object, wait: bool = True, worker: int = 0) -> bool:
                outputs.extend(msg.outputs if isinstance(msg, TokenBatch) else [])
                return True

            loop._send = send
        loop.run()
        finished = sorted(o.rid for o in outputs if o.finish_reason is not None)
        results.put((rank, len(loop._sent), len(loop.scheduler.requests), loop.scheduler.pages.num_used,
                     finished))
    except Exception:
        results.put((rank, traceback.format_exc()))


def _script(outputs: list):
    """The leader's input socket: four requests, an abort of one, then a shutdown once all ended."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    calls = iter(range(10**6))

    def receive() -> list:
        call = next(calls)
        if call == 0:
            return [GenerateInput(f"r{i}", [5 + i, 17, 42, 7], params) for i in range(4)]
        if call == STEPS_BEFORE_ABORT:
            return [AbortInput("r2")]
        done = {o.rid for o in outputs if o.finish_reason is not None}
        return [ShutdownInput()] if len(done) == 4 else []

    return receive


@pytest.mark.timeout(300)
def test_no_rank_of_a_tp_group_keeps_records_of_finished_requests(hf_model_path, tmp_path):
    model_path = hf_model_path("v3", 0)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, f"file://{tmp_path}/store", model_path, results))
             for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(30)
    for row in got:
        assert len(row) == 5, row[1]  # a traceback otherwise
    leader, peer = got
    assert leader[4] == ["r0", "r1", "r2", "r3"]
    for _, sent, requests, pages, _ in got:  # the leader sent them all; the peer sent nothing
        assert (sent, requests, pages) == (0, 0, 0)
