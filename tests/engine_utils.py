"""Small helpers for driving the engine's parts directly in tests."""

from __future__ import annotations

import weakref

import torch

from moeserve.cache import PagePool
from moeserve.core import ForwardMode, Req, SamplingParams, ScheduleBatch, ScheduledSeq
from moeserve.executor.model_runner import ModelRunner

_POOLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def pool_of(runner: ModelRunner) -> PagePool:
    """The page allocator of a runner driven without a scheduler (one per runner)."""
    if runner not in _POOLS:
        _POOLS[runner] = runner.new_page_pool()
    return _POOLS[runner]


def new_req(runner: ModelRunner, ids: list[int], rid: str = "r") -> Req:
    """A request holding enough pages for all of ``ids``."""
    req = Req(rid, list(ids), SamplingParams(max_tokens=1))
    pool = pool_of(runner)
    req.page_table = pool.alloc(pool.pages_for(len(ids)))
    return req


def run_extend(runner: ModelRunner, req: Req, start: int, end: int, all_logits: bool = True) -> torch.Tensor:
    """Prefill ``req.fill_ids[start:end]`` over the cached prefix ``[0, start)``."""
    logits = runner.forward(ScheduleBatch(ForwardMode.EXTEND, [ScheduledSeq(req, start, end)]), all_logits)
    req.kv_len = end
    return logits


def run_decode(runner: ModelRunner, reqs: list[Req]) -> torch.Tensor:
    """One absorbed-MLA decode step for the last token of each request."""
    seqs = [ScheduledSeq(r, r.seq_len - 1, r.seq_len) for r in reqs]
    logits = runner.forward(ScheduleBatch(ForwardMode.DECODE, seqs))
    for r in reqs:
        r.kv_len = r.seq_len
    return logits
