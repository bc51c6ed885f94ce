"""Decode under CUDA graphs: one graph per batch-size bucket, replayed over the paged cache.

A decode step is hundreds of small kernel launches; replaying a captured graph removes the
host's launch cost. Each bucket's graph reads fixed device buffers (token ids, positions, cache
slots, ``kv_indptr``/``kv_indices``); a step copies its batch into them, pads up to the bucket
with dummy sequences of one token that read and write the reserved padding slot 0, replays, and
returns the first rows of the captured logits. Every kernel on the path takes its sizes from
device tensors, so the same graph serves any context lengths.

With two-batch overlap, buckets of at least ``overlap_from`` sequences are captured as two
micro-batches of half the bucket each (the decode strategy of ``executor/overlap.py``), sized
for their kernels' launches as the whole bucket, so they give the rows a whole-bucket graph would.

With several ranks (data-parallel attention, expert parallelism), every rank captures the same
buckets with every DP group at the bucket's size (``dp_of``: the collectives' shapes), and each
decode step the ranks agree on one bucket (``DPInfo.graph_bucket``, the smallest holding the
largest DP group's batch): every rank pads to it and replays, an idle rank with padding only.
The dispatch inside must need no host sync: the MoE layers run low-latency dispatch (or none).

A sparse-attention model (DeepSeek-V3.2) sizes its indexer's scores by the widest context in the
step; a graph fixes that width, so its graphs are per (batch bucket, context bucket): contexts up
to ``index_topk`` (no selection: dense MLA), then widths growing 4x up to the context length
(``context_buckets``). A step replays the smallest context bucket holding its longest sequence.

Speculative decoding's steps have graphs of their own (``VerifyGraphs``, ``MtpGraphs``): every
sequence carries the same ``width`` of new tokens (a verify step's last token and drafts; the MTP
module's pass over them; a draft step's one), so a bucket is ``width`` rows a sequence and its
padding sequences are ``width`` tokens on the padding slot. The graph sets of one runner share a
memory pool: they never replay at once, and each keeps its outputs alive.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from moeserve.core import DPInfo, ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from moeserve.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PADDING_SLOT = 0  # in page 0, which the page pool never hands out
CONTEXT_GROWTH = 4  # a sparse model's context buckets: index_topk, then 4x wider each up to the context length


def context_buckets(index_topk: int | None, context_length: int) -> list[int | None]:
    """The widths a sparse model's graphs are captured at, smallest first (``[None]``: a dense
    model, whose graphs take every length from device tensors). A last bucket less than twice its
    predecessor replaces it."""
    if not index_topk:
        return [None]
    buckets = [index_topk]
    while buckets[-1] < context_length:
        buckets.append(min(buckets[-1] * CONTEXT_GROWTH, context_length))
    if len(buckets) > 2 and buckets[-1] < 2 * buckets[-2]:
        del buckets[-2]
    return buckets


Key = tuple[int, int | None]  # a graph's batch bucket and context bucket


class GraphBuckets:
    """Graphs of one kind of step, a bucket of batch sizes each: the static buffers, the padding,
    the capture and the replay. A subclass runs the step (``_run``) over the buffers."""

    mode = ForwardMode.DECODE
    name = "decode"

    def __init__(self, runner: ModelRunner, batch_sizes: list[int], width: int = 1,
                 pool: tuple | None = None, dp_of: Callable[[int], DPInfo] | None = None,
                 eager: bool = False) -> None:
        self.runner, self.width = runner, width
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_bs = self.batch_sizes[-1]
        cfg = runner.config
        self.context_buckets = context_buckets(cfg.model.index_topk, cfg.context_length)
        self._init_buffers(runner.device, runner.kv_pool.num_slots + self.max_bs * width)
        self.graphs: dict[Key, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[Key, tuple[torch.Tensor, ...]] = {}
        self.replays = 0
        # several ranks: a bucket's step with every DP group at its size; the agreement picks the bucket
        self.dp_of = dp_of
        self.eager = eager  # run each bucket's step over the buffers instead of capturing it
        self.pool = pool if pool is not None or eager else torch.cuda.graph_pool_handle()

    def _init_buffers(self, device: torch.device, max_kv_tokens: int) -> None:
        zeros = lambda n: torch.zeros(n, dtype=torch.int64, device=device)
        rows = self.max_bs * self.width
        self.input_ids, self.positions, self.out_cache_loc = zeros(rows), zeros(rows), zeros(rows)
        self.prefix_lens, self.extend_lens = zeros(self.max_bs), zeros(self.max_bs) + self.width
        self.kv_indptr = zeros(self.max_bs + 1)
        self.kv_indices = zeros(max_kv_tokens)
        self.steps = torch.arange(self.max_bs + 1, device=device) * self.width

    def can_run(self, batch: ForwardBatch) -> bool:
        if not self.can_hold(batch):
            return False
        if self.dp_of is not None:  # several ranks replay together what they agreed (an idle rank too)
            return batch.dp is not None and batch.dp.graph_bucket is not None
        return (batch.mode is self.mode and 0 < batch.batch_size <= self.max_bs
                and batch.num_tokens == batch.batch_size * self.width)

    def _static_batch(self, lo: int, hi: int, context: int | None, launch: int | None = None) -> ForwardBatch:
        """Sequences ``lo:hi`` of the buffers as a batch whose contexts are at most ``context``
        (None: any); a later part's ``kv_indptr`` does not start at 0, which the kernels allow
        (they read each sequence's bounds)."""
        n, w = hi - lo, self.width
        return ForwardBatch(
            mode=self.mode, input_ids=self.input_ids[lo * w:hi * w], positions=self.positions[lo * w:hi * w],
            out_cache_loc=self.out_cache_loc[lo * w:hi * w], prefix_lens=self.prefix_lens[lo:hi],
            extend_lens=self.extend_lens[lo:hi], kv_indptr=self.kv_indptr[lo:hi + 1], kv_indices=self.kv_indices,
            prefix_lens_cpu=[0] * n, extend_lens_cpu=[w] * n, kv_pool=self.runner.kv_pool,
            page_size=self.runner.page_size,  # the padding slot is token 0 of page 0
            launch_batch_size=launch, dp=self.dp_of(n) if self.dp_of is not None else None, context_bucket=context,
        )

    def _run(self, bs: int, context: int | None) -> tuple[torch.Tensor, ...]:
        """The step over bucket ``(bs, context)``'s buffers; its outputs, ``width`` rows a sequence
        or one."""
        raise NotImplementedError

    @torch.inference_mode()
    def capture_all(self) -> GraphBuckets:
        # largest first: the smaller graphs reuse the first one's memory
        keys = [(bs, ctx) for bs in reversed(self.batch_sizes) for ctx in reversed(self.context_buckets)]
        for key in tqdm(keys, desc=f"capturing {self.name} CUDA graphs", unit="graph", leave=False):
            self._capture(key)
        contexts = "" if self.context_buckets == [None] else f" and contexts up to {self.context_buckets}"
        logger.info("captured %d %s CUDA graphs for batch sizes up to %d%s", len(self.graphs), self.name, self.max_bs,
                    contexts)
        return self

    def _capture(self, key: Key) -> None:
        if self.eager:
            return
        bs = key[0]
        rows = bs * self.width
        self.kv_indptr[:bs + 1].copy_(self.steps[:bs + 1])  # every dummy sequence: the padding slot
        self.kv_indices[:rows].fill_(PADDING_SLOT)
        self.out_cache_loc[:rows].fill_(PADDING_SLOT)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile kernels and warm up libraries outside the capture
            for _ in range(2):
                self._run(*key)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.outputs[key] = self._run(*key)
        self.graphs[key] = graph

    def load(self, batch: ForwardBatch) -> Key:
        """Copy ``batch`` into the buffers, padded with dummy sequences up to its bucket (with several
        ranks, the agreed one); the bucket and the context bucket of its longest sequence."""
        n, w = batch.batch_size, self.width
        if self.dp_of is not None:
            bs = batch.dp.graph_bucket
        else:
            bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        for static, live in ((self.input_ids, batch.input_ids), (self.positions, batch.positions),
                             (self.out_cache_loc, batch.out_cache_loc)):
            static[:n * w].copy_(live)
            static[n * w:bs * w].fill_(PADDING_SLOT if static is self.out_cache_loc else 0)
        total = batch.kv_indices.shape[0]
        self.kv_indices[:total].copy_(batch.kv_indices)
        self.kv_indices[total:total + (bs - n) * w].fill_(PADDING_SLOT)
        self.kv_indptr[:n + 1].copy_(batch.kv_indptr)
        self.kv_indptr[n + 1:bs + 1] = batch.kv_indptr[n] + self.steps[1:bs - n + 1]
        longest = max(batch.seq_lens_cpu, default=0)
        return bs, next(c for c in self.context_buckets if c is None or c >= longest)

    def can_hold(self, batch: ForwardBatch) -> bool:
        """Whether some context bucket holds the batch's longest sequence."""
        last = self.context_buckets[-1]
        return last is None or max(batch.seq_lens_cpu, default=0) <= last

    def play(self, key: Key, rows: int) -> tuple[torch.Tensor, ...]:
        """Replay bucket ``key``; the first ``rows`` rows of each output, copied (the next replay
        overwrites the captured outputs)."""
        if self.eager:
            self.outputs[key] = self._run(*key)
        else:
            self.graphs[key].replay()
        self.replays += 1
        return tuple(out[:rows].clone() for out in self.outputs[key])


class CudaGraphRunner(GraphBuckets):
    """Decode steps: the logits of each sequence's token."""

    def __init__(self, runner: ModelRunner, batch_sizes: list[int], overlap_from: int | None = None,
                 pool: tuple | None = None, dp_of: Callable[[int], DPInfo] | None = None,
                 eager: bool = False) -> None:
        super().__init__(runner, batch_sizes, 1, pool, dp_of, eager)
        self.overlap_from = overlap_from  # buckets this large run as two micro-batches (None: none)
        self.capture_all()

    def overlapped(self, bs: int) -> bool:
        """Whether bucket ``bs`` is captured as two micro-batches."""
        return self.overlap_from is not None and bs >= max(self.overlap_from, 2)

    def _run(self, bs: int, context: int | None) -> tuple[torch.Tensor, ...]:
        """The logits of bucket ``bs`` (a row a sequence), whole or as two micro-batches."""
        runner, whole = self.runner, self._static_batch(0, bs, context)
        if not self.overlapped(bs):
            return (runner.model.compute_logits(runner.run_layers(whole), whole),)
        half = (bs + 1) // 2  # as ``overlap.split_batch`` halves a decode batch
        parts = (self._static_batch(0, half, context, launch=bs), self._static_batch(half, bs, context, launch=bs))
        return (runner.model.compute_logits(torch.cat(runner.run_layers_two(parts, extend=False)), whole),)

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits ``[B, V]`` of a decode batch of ``B <= max_bs`` sequences."""
        return self.play(self.load(batch), batch.batch_size)[0]


class VerifyGraphs(GraphBuckets):
    """Speculative verify steps of ``width`` tokens a sequence: fp32 logits and final-norm hidden
    states of every token."""

    mode = ForwardMode.VERIFY
    name = "verify"

    def _run(self, bs: int, context: int | None) -> tuple[torch.Tensor, ...]:
        batch = self._static_batch(0, bs, context)
        hidden = self.runner.run_layers(batch)
        return self.runner.model.compute_logits(hidden, batch), hidden

    def replay(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        return self.play(self.load(batch), batch.num_tokens)


class MtpGraphs(GraphBuckets):
    """The MTP module over ``width`` positions a sequence (``width > 1``: the positions a verify
    step judged, in ``VERIFY`` mode; 1: a draft step) from the model's hidden states there, held in
    a buffer of their own: the module's hidden states (its logits are taken outside, of the rows
    that draft)."""

    name = "MTP"

    def __init__(self, runner: ModelRunner, batch_sizes: list[int], width: int = 1,
                 pool: tuple | None = None) -> None:
        super().__init__(runner, batch_sizes, width, pool)
        self.mode = ForwardMode.VERIFY if width > 1 else ForwardMode.DECODE
        cfg = runner.config.model
        self.prev_hidden = torch.zeros(self.max_bs * width, cfg.hidden_size, dtype=runner.dtype, device=runner.device)

    def _run(self, bs: int, context: int | None) -> tuple[torch.Tensor, ...]:
        model = self.runner.model
        return (model.mtp(self._static_batch(0, bs, context), self.prev_hidden[:bs * self.width],
                          model.model.embed_tokens),)

    def replay(self, batch: ForwardBatch, prev_hidden: torch.Tensor) -> torch.Tensor:
        key, rows = self.load(batch), batch.num_tokens
        self.prev_hidden[:rows].copy_(prev_hidden)
        self.prev_hidden[rows:key[0] * self.width].zero_()
        return self.play(key, rows)[0]
