"""Owns the model and its KV cache on one device; turns scheduled work into logits."""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator

import numpy as np
import torch

from moeserve.cache import KVLayout, MLAKVPool, PagePool, kv_capacity_tokens
from moeserve.config import EngineConfig
from moeserve.core import DPInfo, ForwardBatch, ForwardMode, ScheduleBatch, default_dtype
from moeserve.distributed.comm import scatter_sizes
from moeserve.distributed.dispatcher import step_dispatch_mode
from moeserve.distributed.groups import ParallelGroups
from moeserve.distributed.groups import single as single_groups
from moeserve.eplb import files
from moeserve.eplb.algorithm import trivial_phy2log
from moeserve.eplb.manager import EplbManager
from moeserve.eplb.placement import ExpertPlacement
from moeserve.eplb.recorder import ALL_TOKENS, ExpertRecorder
from moeserve.executor import overlap
from moeserve.executor.cuda_graph import CudaGraphRunner, MtpGraphs, VerifyGraphs
from moeserve.executor.expert_weights import make_expert_weights
from moeserve.layers.moe import MoEOptions
from moeserve.models.checkpoint import model_fingerprint
from moeserve.models.deepseek import DeepseekForCausalLM
from moeserve.models.loader import load_checkpoint, load_dummy
from moeserve.models.registry import model_class

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, groups: ParallelGroups | None = None) -> None:
        self.config = config
        self.groups = groups or single_groups()
        self.device = torch.device(config.load.device)
        self.dtype = config.load.torch_dtype(config.model)
        started = time.perf_counter()
        self.model = self._init_model()
        self._plain_ops = self.model.operations()
        self.tbo_min_tokens = config.runner.tbo_min_tokens  # alone, a step this large overlaps
        self.eplb = self._init_eplb()
        # seconds by start-up phase: the model built and loaded (with EPLB's copy of the experts), graphs captured
        self.startup_s = {"weights": self._seconds_since(started)}
        self._init_kv_cache()
        self.verify_graphs: VerifyGraphs | None = None  # speculative decoding's, with its MTP graphs
        self.mtp_graphs: dict[int, MtpGraphs] = {}  # by tokens a sequence
        started = time.perf_counter()
        self.graph_runner = self._init_cuda_graphs()
        self.startup_s["graphs"] = self._seconds_since(started)
        if self.eplb is not None and config.eplb.enable_eplb:  # online rebalancing plans from what it
            self.eplb.recorder.start()  # records: from the first pass on (not the graphs' warm-up)

    def _init_model(self) -> DeepseekForCausalLM:
        load, cfg = self.config.load, self.config.model
        self.moe_options = moe = self._moe_options()
        with torch.device(self.device), default_dtype(self.dtype):
            model = model_class(cfg)(cfg, self.groups, moe, fp8=self.fp8_weights, mtp=self.config.spec.enabled)
        if load.load_format == "dummy":
            load_dummy(model, load.seed)
        else:
            if load.model_path is None:
                raise ValueError("model_path is required unless load_format is 'dummy'")
            load_checkpoint(model, load.model_path, self.config.model)
        return model.eval()

    def _seconds_since(self, started: float) -> float:
        """Seconds from ``started`` to when the device has done what was queued (loads are asynchronous)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def _moe_options(self) -> MoEOptions:
        par = self.config.parallel
        return MoEOptions(self._initial_placement(), par.moe_a2a_backend, par.deepep_mode,
                          par.max_dispatch_tokens_per_rank, self.config.eplb.ep_dispatch_algorithm, self._make_recorder())

    def _initial_placement(self) -> ExpertPlacement:
        cfg, par, eplb = self.config.model, self.config.parallel, self.config.eplb
        num_logical = max(cfg.n_routed_experts, 1)
        num_physical = num_logical + eplb.ep_num_redundant_experts
        if num_physical % par.ep_world:
            raise ValueError(f"ep_num_redundant_experts: {num_physical} physical experts ({num_logical} logical + "
                             f"{eplb.ep_num_redundant_experts} redundant) do not divide over {par.ep_world} EP ranks")
        phy2log = files.initial_phy2log(eplb.init_expert_location, cfg.num_layers, num_logical, num_physical,
                                        par.ep_world, max(cfg.n_group, 1), par.nnodes)
        if self.config.spec.enabled:  # the MTP module's MoE is layer num_layers: a row of its own, never rebalanced
            phy2log = torch.cat([phy2log, trivial_phy2log(1, num_logical, num_physical)])
        return ExpertPlacement.from_phy2log(phy2log, num_logical, par.ep_world)

    def _make_recorder(self) -> ExpertRecorder | None:
        cfg, eplb = self.config.model, self.config.eplb
        if eplb.recorder_mode is None or cfg.n_routed_experts == 0:
            return None
        num_logical = cfg.n_routed_experts
        return ExpertRecorder(eplb.recorder_mode, cfg.num_layers, num_logical,
                              num_logical + eplb.ep_num_redundant_experts,
                              eplb.expert_distribution_recorder_buffer_size, self.device)

    def _init_eplb(self) -> EplbManager | None:
        """The recorder's collective side and, with ``--enable-eplb``, online rebalancing (stage 1:
        where moved expert weights come from)."""
        recorder, cfg, eplb = self.moe_options.recorder, self.config.model, self.config.eplb
        if recorder is None:
            return None
        layers = [layer for layer in range(cfg.num_layers) if cfg.is_moe_layer(layer)]
        stacks = {layer: self.model.model.layers[layer].mlp.experts.stacks() for layer in layers}
        fetch = None
        if eplb.enable_eplb:
            source = make_expert_weights(self.config, layers, self.fp8_weights, self.dtype, self.device)
            fetch = source.fetch
        meta = {"model": model_fingerprint(self.config)}
        return EplbManager(eplb, self.moe_options.location, recorder, stacks, fetch, self.groups.world,
                           self.groups.ep.rank, layers, max(cfg.n_group, 1), self.config.parallel.nnodes, meta)

    @contextlib.contextmanager
    def unrecorded(self) -> Iterator[None]:
        """Forward passes outside serving's record (the start-up warm-up): EPLB's pass clock does
        not move (no rebalance or metric falls due) and the expert recorder counts nothing. A
        recorder that was recording starts again after, as at start-up: from nothing recorded."""
        eplb, recorder = self.eplb, self.moe_options.recorder
        if recorder is None:
            yield
            return
        recording = recorder.recording
        recorder.stop()
        self.eplb = None
        try:
            yield
        finally:
            self.eplb = eplb
            if recording:
                recorder.start()

    @property
    def fp8_weights(self) -> bool:
        """FP8 when asked, or when the checkpoint is FP8 and the device has FP8 matmuls."""
        load = self.config.load
        fp8_checkpoint = self.config.model.fp8_block is not None and load.load_format != "dummy"
        return load.quantization == "fp8" or (fp8_checkpoint and self.device.type == "cuda")

    def _init_kv_cache(self) -> None:
        model_cfg, cache_cfg = self.config.model, self.config.cache
        page_size = cache_cfg.page_size
        # the MTP module's decoder layer, when it drafts, has a cache layer of its own after the model's
        layers = model_cfg.num_layers + (1 if self.config.spec.enabled else 0)
        layout = KVLayout.for_model(model_cfg, cache_cfg.kv_cache_dtype, self.dtype)
        tokens = cache_cfg.max_total_tokens or kv_capacity_tokens(self._kv_budget_bytes(), layers, layout)
        # pages of ``page_size`` slots, + the padding page 0; the scheduler's ``PagePool`` hands them out
        self.num_pages, self.page_size = tokens // page_size + 1, page_size
        if self.num_pages < 2:
            raise ValueError(f"the KV cache needs at least 2 pages, got {self.num_pages}")
        self.kv_pool = MLAKVPool(layout, layers, self.num_pages * page_size, self.device)
        self.max_total_tokens = (self.num_pages - 1) * page_size
        logger.info("KV cache: %d tokens in %d pages of %d, %s (%d bytes a token a layer)", self.max_total_tokens,
                    self.num_pages - 1, page_size, layout.name, layout.row_bytes)

    def new_page_pool(self) -> PagePool:
        """An allocator over this runner's KV pages: the scheduler's, or a benchmark's that drives
        the runner directly."""
        return PagePool(self.num_pages, self.page_size)

    def _init_cuda_graphs(self) -> CudaGraphRunner | None:
        """Decode graphs on CUDA (with speculative decoding on one rank: verify and MTP graphs
        instead, whose steps replace decode's). With several ranks (``cuda_graph_multi_rank``)
        every rank captures the same buckets, each with every DP group at the bucket's size, and
        the step agreement has all ranks replay one bucket together (``DPInfo.graph_bucket``);
        only buckets whose dispatch needs no host sync (none, or low-latency within its buffers)
        are captured. ``debug_eager_graphs`` runs the buckets eagerly instead of capturing them
        (the padding and the agreement, on any device)."""
        cfg = self.config
        eager = cfg.runner.debug_eager_graphs
        if (self.device.type != "cuda" and not eager) or cfg.runner.disable_cuda_graph:
            return None
        if cfg.eplb.recorder_mode == "per_token":  # its token streams are kept per step, outside a graph
            return None
        sizes = [b for b in cfg.runner.graph_batch_sizes(cfg.scheduler.max_running_requests) if self._graph_fits(b)]
        if not sizes:
            return None
        if cfg.parallel.world_size > 1:
            if cfg.spec.enabled or not (cfg.runner.cuda_graph_multi_rank or eager):  # several ranks: opt-in
                return None
            return CudaGraphRunner(self, sizes, dp_of=self.graph_dp, eager=eager)
        if cfg.spec.enabled:
            if eager:
                return None
            width, pool = cfg.spec.num_drafts + 1, torch.cuda.graph_pool_handle()
            self.verify_graphs = VerifyGraphs(self, sizes, width, pool).capture_all()
            for w in sorted({width, 1} if cfg.spec.num_drafts > 1 else {width}, reverse=True):
                self.mtp_graphs[w] = MtpGraphs(self, sizes, w, pool).capture_all()
            return None
        # the recorder's ``valid`` counts a bucket's first rows: one pass, not two micro-batches
        overlap_from = (self.tbo_min_tokens if cfg.runner.enable_two_batch_overlap and self.moe_options.recorder is None
                        else None)
        return CudaGraphRunner(self, sizes, overlap_from, eager=eager)

    def _graph_fits(self, bucket: int) -> bool:
        """Whether a decode graph of ``bucket`` sequences a DP group can be captured: its MoE
        dispatch needs no host sync (none, or low-latency within its buffers)."""
        par = self.config.parallel
        if par.world_size > 1:
            mode = self.graph_dp(bucket).moe_mode
        else:  # one rank runs the one mode it has, or the normal one (``ForwardBatch.dp_info``)
            mode = "none" if par.moe_a2a_backend == "none" else par.deepep_mode.replace("auto", "normal")
        share = max(scatter_sizes(bucket, self.groups.attn_tp.size))
        return mode == "none" or (mode == "low_latency" and share <= par.max_dispatch_tokens_per_rank)

    def graph_dp(self, bucket: int) -> DPInfo:
        """A decode graph's step with several ranks: every DP group at ``bucket`` sequences."""
        par = self.config.parallel
        counts = [bucket] * self.groups.dp_size
        mode = step_dispatch_mode(counts, False, self.groups.attn_tp.size, par.moe_a2a_backend, par.deepep_mode,
                                  par.max_dispatch_tokens_per_rank)
        return DPInfo(counts, list(counts), mode, any_extend=False, graph_bucket=bucket)

    def _kv_budget_bytes(self) -> int:
        cache_cfg = self.config.cache
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free - total * (1 - cache_cfg.mem_fraction_static))
        return int(cache_cfg.cpu_kv_cache_gb * 2**30)

    def build_batch(self, sched: ScheduleBatch) -> ForwardBatch:
        """Token ids, positions and cache slots of the scheduled sequences. Only the page tables
        cross to the device; the per-token slots are expanded there (a decode step of 128
        sequences of 2K tokens would otherwise spend milliseconds of host time on 262K slots)."""
        seqs, page_size, dev = sched.seqs, self.page_size, self.device
        starts = [s.start for s in seqs]
        ends = [s.end for s in seqs]
        extends = [e - b for b, e in zip(starts, ends)]
        n_pages = [-(-e // page_size) for e in ends]
        table = np.fromiter(itertools.chain.from_iterable(s.req.page_table[:n] for s, n in zip(seqs, n_pages)),
                            dtype=np.int64)
        on_dev = lambda values: torch.tensor(values, dtype=torch.int64, device=dev)
        input_ids = on_dev([i for s in seqs for i in (s.tokens if s.tokens is not None
                                                      else s.req.fill_slice(s.start, s.end))])
        starts_d, ends_d, extends_d = on_dev(starts), on_dev(ends), on_dev(extends)
        kv_indptr = torch.cat([ends_d.new_zeros(1), torch.cumsum(ends_d, 0)])
        page_indptr = on_dev([0] + n_pages).cumsum(0)
        table_d = torch.from_numpy(table).to(dev)

        def slots_of(seq: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            """Cache slot of token ``pos`` of sequence ``seq`` (elementwise)."""
            return table_d[page_indptr[seq] + pos // page_size] * page_size + pos % page_size

        kv_seq, kv_pos = _ragged_positions(ends_d, sum(ends), kv_indptr, torch.zeros_like(ends_d))
        new_seq, positions = _ragged_positions(extends_d, sum(extends), None, starts_d)
        return ForwardBatch(
            mode=sched.mode, input_ids=input_ids, positions=positions, out_cache_loc=slots_of(new_seq, positions),
            prefix_lens=starts_d, extend_lens=extends_d, kv_indptr=kv_indptr, kv_indices=slots_of(kv_seq, kv_pos),
            prefix_lens_cpu=starts, extend_lens_cpu=extends, kv_pool=self.kv_pool, page_size=page_size,
        )

    @torch.inference_mode()
    def forward(self, sched: ScheduleBatch | None, all_logits: bool = False, dp: DPInfo | None = None) -> torch.Tensor:
        """fp32 logits of each sequence's last new token ``[B, V]`` (every token ``[T, V]`` with
        ``all_logits``). ``sched=None`` runs an idle batch: no tokens, but every collective."""
        if self.eplb is not None:
            self.eplb.before_forward()
        if self._overlaps(sched, dp, all_logits):
            batch, logits = self._forward_two(sched, dp)
        else:
            batch = self.build_batch(sched or ScheduleBatch(ForwardMode.IDLE, []))
            batch.dp = dp
            logits = self._forward(batch, all_logits)
        self._after_pass(sched, batch)
        return logits

    def _after_pass(self, sched: ScheduleBatch | None, batch: ForwardBatch) -> None:
        """The expert recorder's end of a step's pass of the model (EPLB); a peer dispatch that gave
        up waiting on a dead EP peer fails the step after it (``PeerMemory.check``: no host sync)."""
        peers = self.moe_options.peer_memory.get("memory")
        if peers is not None:
            peers.check()
        if self.eplb is not None:
            positions = None
            if self.eplb.recorder.mode == "per_token":  # this rank's tokens in the MoE layers
                positions = batch.positions[self.model.layout.my_slice(batch.dp_info())]
            self.eplb.after_forward(sched is not None and sched.mode is ForwardMode.EXTEND, positions)

    def _forward(self, batch: ForwardBatch, all_logits: bool) -> torch.Tensor:
        recorder = self.moe_options.recorder
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            if recorder is not None:  # the bucket's padding rows are not tokens
                recorder.valid.fill_(batch.batch_size)
            return self.graph_runner.replay(batch)
        if recorder is not None:
            recorder.valid.fill_(ALL_TOKENS)
        hidden = self.run_layers(batch)
        if not all_logits:
            hidden = hidden[batch.last_token_index()]
        return self.model.compute_logits(hidden, batch)

    def run_layers(self, batch: ForwardBatch) -> torch.Tensor:
        """The model's operations for one batch (``executor/overlap.run``): hidden states ``[T, D]``."""
        state = self.model.begin(batch)
        overlap.run(self._plain_ops, state, batch)
        return self.model.end(state, batch)

    # ---- speculative decoding ----------------------------------------------------------------------
    @torch.inference_mode()
    def forward_with_hidden(self, sched: ScheduleBatch | None,
                            dp: DPInfo | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The model over a prefill or a verify batch (eager, whole; ``None``: an idle one): fp32
        logits of each sequence's last token (``EXTEND``) or of every token (``VERIFY``), and the
        final-norm hidden state of every token ``[T, D]``, which the MTP module drafts from."""
        if self.eplb is not None:
            self.eplb.before_forward()
        batch = self._spec_batch(sched, dp)
        recorder = self.moe_options.recorder
        if self.verify_graphs is not None and self.verify_graphs.can_run(batch):
            if recorder is not None:  # the bucket's padding rows are not tokens
                recorder.valid.fill_(batch.num_tokens)
            logits, hidden = self.verify_graphs.replay(batch)
        else:
            if recorder is not None:
                recorder.valid.fill_(ALL_TOKENS)
            hidden = self.run_layers(batch)  # [T, D]
            rows = hidden if batch.mode is ForwardMode.VERIFY else hidden[batch.last_token_index()]
            logits = self.model.compute_logits(rows, batch)
        self._after_pass(sched, batch)
        return logits, hidden

    @torch.inference_mode()
    def forward_mtp(self, sched: ScheduleBatch | None, prev_hidden: torch.Tensor, dp: DPInfo | None = None,
                    rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP module over ``sched`` (each position's input token is the one after it, in
        ``ScheduledSeq.tokens``; ``None``: an idle pass) from the model's hidden states
        ``prev_hidden [T, D]`` at those positions: fp32 logits of the rows ``rows`` (one a
        sequence; default each sequence's last position) ``[B, V]`` and the module's hidden states
        ``[T, D]`` (a draft step's ``prev_hidden``)."""
        batch = self._spec_batch(sched, dp)
        graphs = self.mtp_graphs.get(batch.tokens_per_seq)
        if graphs is not None and graphs.can_run(batch):
            hidden = graphs.replay(batch, prev_hidden)
        else:
            hidden = self.model.mtp(batch, prev_hidden, self.model.model.embed_tokens)
        if rows is None:
            rows = batch.last_token_index()
        return self.model.compute_logits(hidden[rows], batch), hidden

    def _spec_batch(self, sched: ScheduleBatch | None, dp: DPInfo | None) -> ForwardBatch:
        batch = self.build_batch(sched or ScheduleBatch(ForwardMode.IDLE, []))
        batch.dp = dp
        return batch

    # ---- two-batch overlap ----------------------------------------------------------------------
    def _overlaps(self, sched: ScheduleBatch | None, dp: DPInfo | None, all_logits: bool) -> bool:
        """With several ranks the agreement decided (``dp.halves``); alone, the batch's size does.
        A decode batch a CUDA graph replays is not split here: its graph was captured overlapped
        or not (``CudaGraphRunner``)."""
        runner = self.config.runner
        recorder = self.moe_options.recorder
        if not runner.enable_two_batch_overlap or all_logits or (recorder is not None and recorder.mode == "per_token"):
            return False  # (per_token keeps one token stream a pass)
        if dp is not None:
            return dp.halves is not None
        if sched is None or sched.num_tokens < self.tbo_min_tokens:
            return False
        return not (self.graph_runner is not None and sched.mode.is_decode
                    and len(sched.seqs) <= self.graph_runner.max_bs)

    def _forward_two(self, sched: ScheduleBatch | None, dp: DPInfo | None) -> tuple[ForwardBatch, torch.Tensor]:
        """The step as two micro-batches over the interleaved operations; logits of every sequence in
        the batch's order (a sequence cut in two samples from its second part)."""
        split = overlap.split_batch(sched, self.config.runner.tbo_token_distribution_threshold)
        batches = (self.build_batch(split.first), self.build_batch(split.second))
        for b, half in zip(batches, dp.halves if dp is not None else (None, None)):
            b.dp = half
            b.launch_batch_size = len(sched.seqs) if sched is not None else None
        if self.moe_options.recorder is not None:
            self.moe_options.recorder.valid.fill_(ALL_TOKENS)
        # one strategy on every rank (an idle one too): their collectives must line up
        extend = dp.any_extend if dp is not None else not sched.mode.is_decode
        hidden = self.run_layers_two(batches, extend)
        rows = [h[b.last_token_index()] for h, b in zip(hidden, batches)]
        if split.cut is not None:  # the cut sequence's first part samples nothing
            rows[0] = torch.cat([rows[0][:split.cut], rows[0][split.cut + 1:]])
        whole = batches[0]
        whole.dp = dp
        return whole, self.model.compute_logits(torch.cat(rows), whole)

    def run_layers_two(self, batches: tuple[ForwardBatch, ForwardBatch], extend: bool) -> tuple[torch.Tensor, ...]:
        """Two micro-batches through the model's operations, interleaved at their yields by the
        prefill (``extend``) or decode strategy: each one's hidden states ``[T_i, D]``."""
        strategy = overlap.PREFILL if extend else overlap.DECODE
        states = (self.model.begin(batches[0]), self.model.begin(batches[1]))
        overlap.run_overlapped(self.model.operations(strategy.name), states, batches, strategy.delta)
        return tuple(self.model.end(s, b) for s, b in zip(states, batches))


def _ragged_positions(lens: torch.Tensor, total: int, indptr: torch.Tensor | None,
                      first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For ``B`` runs of ``lens [B]`` items (``total`` in all), each item's run and its position
    ``first[run] + index in the run``; computed on the device without a host sync."""
    runs = torch.arange(lens.shape[0], device=lens.device)
    seq = torch.repeat_interleave(runs, lens, output_size=total)  # [total]
    if indptr is None:
        indptr = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])
    index = torch.arange(total, device=lens.device) - indptr[seq]
    return seq, first[seq] + index
