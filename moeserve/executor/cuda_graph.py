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
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from moeserve.core import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from moeserve.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

PADDING_SLOT = 0  # in page 0, which the page pool never hands out


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, batch_sizes: list[int], overlap_from: int | None = None) -> None:
        self.runner = runner
        self.batch_sizes = sorted(set(batch_sizes))
        self.overlap_from = overlap_from  # buckets this large run as two micro-batches (None: none)
        self.max_bs = self.batch_sizes[-1]
        self._init_buffers(runner.device, runner.kv_pool.num_slots + self.max_bs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self._capture_all()

    def _init_buffers(self, device: torch.device, max_kv_tokens: int) -> None:
        zeros = lambda n: torch.zeros(n, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.out_cache_loc = zeros(self.max_bs), zeros(self.max_bs), zeros(self.max_bs)
        self.prefix_lens, self.extend_lens = zeros(self.max_bs), zeros(self.max_bs) + 1
        self.kv_indptr = zeros(self.max_bs + 1)
        self.kv_indices = zeros(max_kv_tokens)
        self.steps = torch.arange(self.max_bs + 1, device=device)

    def can_run(self, batch: ForwardBatch) -> bool:
        return batch.mode.is_decode and 0 < batch.batch_size <= self.max_bs

    def overlapped(self, bs: int) -> bool:
        """Whether bucket ``bs`` is captured as two micro-batches."""
        return self.overlap_from is not None and bs >= max(self.overlap_from, 2)

    def _static_batch(self, lo: int, hi: int, launch: int | None = None) -> ForwardBatch:
        """Rows ``lo:hi`` of the buffers as a decode batch; a later part's ``kv_indptr`` does not
        start at 0, which the kernels allow (they read each sequence's bounds)."""
        n = hi - lo
        return ForwardBatch(
            mode=ForwardMode.DECODE, input_ids=self.input_ids[lo:hi], positions=self.positions[lo:hi],
            out_cache_loc=self.out_cache_loc[lo:hi], prefix_lens=self.prefix_lens[lo:hi],
            extend_lens=self.extend_lens[lo:hi], kv_indptr=self.kv_indptr[lo:hi + 1], kv_indices=self.kv_indices,
            prefix_lens_cpu=[0] * n, extend_lens_cpu=[1] * n, kv_pool=self.runner.kv_pool,
            page_size=self.runner.page_size,  # the padding slot is token 0 of page 0
            launch_batch_size=launch,
        )

    def _run(self, bs: int) -> torch.Tensor:
        """The logits of bucket ``bs`` (a row a sequence), whole or as two micro-batches."""
        runner, whole = self.runner, self._static_batch(0, bs)
        if not self.overlapped(bs):
            return runner.model.compute_logits(runner.run_layers(whole), whole)
        half = (bs + 1) // 2  # as ``overlap.split_batch`` halves a decode batch
        parts = (self._static_batch(0, half, launch=bs), self._static_batch(half, bs, launch=bs))
        return runner.model.compute_logits(torch.cat(runner.run_layers_two(parts, extend=False)), whole)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # largest first: the smaller graphs reuse the first one's memory pool
        for bs in tqdm(reversed(self.batch_sizes), total=len(self.batch_sizes), desc="capturing CUDA graphs",
                       unit="graph", leave=False):
            self._capture(bs)
        logger.info("captured %d decode CUDA graphs for batch sizes up to %d", len(self.graphs), self.max_bs)

    def _capture(self, bs: int) -> None:
        self.kv_indptr[:bs + 1].copy_(self.steps[:bs + 1])  # every dummy sequence: the padding slot
        self.kv_indices[:bs].fill_(PADDING_SLOT)
        self.out_cache_loc[:bs].fill_(PADDING_SLOT)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile kernels and warm up libraries outside the capture
            for _ in range(2):
                self._run(bs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits[bs] = self._run(bs)
        self.graphs[bs] = graph

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        """fp32 logits ``[B, V]`` of a decode batch of ``B <= max_bs`` sequences."""
        n = batch.batch_size
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        for static, live in ((self.input_ids, batch.input_ids), (self.positions, batch.positions),
                             (self.out_cache_loc, batch.out_cache_loc)):
            static[:n].copy_(live)
            static[n:bs].fill_(PADDING_SLOT if static is self.out_cache_loc else 0)
        total = batch.kv_indices.shape[0]
        self.kv_indices[:total].copy_(batch.kv_indices)
        self.kv_indices[total:total + bs - n].fill_(PADDING_SLOT)
        self.kv_indptr[:n + 1].copy_(batch.kv_indptr)
        self.kv_indptr[n + 1:bs + 1] = batch.kv_indptr[n] + self.steps[1:bs - n + 1]
        self.graphs[bs].replay()
        return self.logits[bs][:n].clone()  # the next replay overwrites the captured output
