"""Owns the model and its KV cache on one device; turns scheduled work into logits."""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch

from moeserve.cache import MLAKVPool, PagePool, kv_capacity_tokens
from moeserve.config import EngineConfig
from moeserve.core import DPInfo, ForwardBatch, ForwardMode, ScheduleBatch
from moeserve.distributed.groups import ParallelGroups
from moeserve.executor.cuda_graph import CudaGraphRunner
from moeserve.distributed.groups import single as single_groups
from moeserve.eplb.placement import ExpertPlacement
from moeserve.layers.moe import MoEOptions
from moeserve.models.deepseek import DeepseekForCausalLM
from moeserve.models.loader import load_checkpoint, load_dummy

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, groups: ParallelGroups | None = None) -> None:
        self.config = config
        self.groups = groups or single_groups()
        self.device = torch.device(config.load.device)
        self.dtype = config.load.torch_dtype(config.model)
        self.model = self._init_model()
        self._init_kv_cache()
        self.graph_runner = self._init_cuda_graphs()

    def _init_model(self) -> DeepseekForCausalLM:
        load, cfg, par = self.config.load, self.config.model, self.config.parallel
        placement = ExpertPlacement.trivial(cfg.num_layers, max(cfg.n_routed_experts, 1), par.ep_world,
                                            par.ep_num_redundant_experts)
        moe = MoEOptions(placement, par.moe_a2a_backend, par.deepep_mode, par.max_dispatch_tokens_per_rank)
        with torch.device(self.device), _default_dtype(self.dtype):
            model = DeepseekForCausalLM(cfg, self.groups, moe)
        if load.load_format == "dummy":
            load_dummy(model, load.seed)
        else:
            if load.model_path is None:
                raise ValueError("model_path is required unless load_format is 'dummy'")
            load_checkpoint(model, load.model_path, self.config.model)
        if self.fp8_weights:
            model.quantize_fp8_()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the bf16 weights just freed
        return model.eval()

    @property
    def fp8_weights(self) -> bool:
        """FP8 when asked, or when the checkpoint is FP8 and the device has FP8 matmuls."""
        load = self.config.load
        fp8_checkpoint = self.config.model.fp8_block is not None and load.load_format != "dummy"
        return load.quantization == "fp8" or (fp8_checkpoint and self.device.type == "cuda")

    def _init_kv_cache(self) -> None:
        model_cfg, cache_cfg = self.config.model, self.config.cache
        page_size = cache_cfg.page_size
        tokens = cache_cfg.max_total_tokens or kv_capacity_tokens(
            self._kv_budget_bytes(), model_cfg.num_layers, model_cfg.kv_cache_dim, self.dtype)
        num_pages = tokens // page_size + 1  # + the padding page
        self.page_pool = PagePool(num_pages, page_size)
        self.kv_pool = MLAKVPool(model_cfg.num_layers, num_pages * page_size, model_cfg.kv_lora_rank,
                                 model_cfg.qk_rope_head_dim, self.dtype, self.device)
        self.max_total_tokens = self.page_pool.capacity * page_size
        logger.info("KV cache: %d tokens in %d pages of %d", self.max_total_tokens, self.page_pool.capacity, page_size)

    def _init_cuda_graphs(self) -> CudaGraphRunner | None:
        """Decode graphs on CUDA for a single rank. With several ranks a step's shapes depend on
        what the other DP ranks run, so those keep launching kernels one by one for now."""
        cfg = self.config
        if self.device.type != "cuda" or cfg.runner.disable_cuda_graph or cfg.parallel.world_size > 1:
            return None
        return CudaGraphRunner(self, cfg.runner.graph_batch_sizes(cfg.scheduler.max_running_requests))

    def _kv_budget_bytes(self) -> int:
        cache_cfg = self.config.cache
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free - total * (1 - cache_cfg.mem_fraction_static))
        return int(cache_cfg.cpu_kv_cache_gb * 2**30)

    def build_batch(self, sched: ScheduleBatch) -> ForwardBatch:
        """Gather token ids, positions and cache slots of the scheduled sequences (vectorized in
        numpy: a decode step of hundreds of long sequences must not cost milliseconds of Python)."""
        seqs, page_size = sched.seqs, self.page_pool.page_size
        starts = np.array([s.start for s in seqs], dtype=np.int64)
        ends = np.array([s.end for s in seqs], dtype=np.int64)
        pages, tok = self._seq_pages(seqs, ends)  # slot of each token of every context, its index
        keep = tok < np.repeat(ends, -(-ends // page_size) * page_size)
        owner = np.repeat(np.arange(len(seqs)), -(-ends // page_size) * page_size)
        slots = pages[keep]  # [sum(end)] the contexts back to back
        new = tok[keep] >= starts[owner[keep]]
        input_ids = [i for s in seqs for i in s.req.fill_slice(s.start, s.end)]
        positions = tok[keep][new]
        dev = self.device
        as_dev = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
        return ForwardBatch(
            mode=sched.mode,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=as_dev(positions), out_cache_loc=as_dev(slots[new]),
            prefix_lens=as_dev(starts), extend_lens=as_dev(ends - starts),
            kv_indptr=as_dev(np.concatenate([[0], np.cumsum(ends)])), kv_indices=as_dev(slots),
            prefix_lens_cpu=starts.tolist(), extend_lens_cpu=(ends - starts).tolist(), kv_pool=self.kv_pool,
        )

    def _seq_pages(self, seqs: list, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every slot of the pages covering each sequence's first ``end`` tokens, and the token
        index inside its sequence that each slot stands for."""
        page_size = self.page_pool.page_size
        n_pages = -(-ends // page_size)
        tables = [np.asarray(s.req.page_table[:n], dtype=np.int64) for s, n in zip(seqs, n_pages.tolist())]
        table = np.concatenate(tables) if tables else np.zeros(0, dtype=np.int64)
        offsets = np.arange(page_size, dtype=np.int64)
        slots = (table[:, None] * page_size + offsets).ravel()
        first_page = np.repeat(np.cumsum(n_pages) - n_pages, n_pages)  # each page's sequence start
        page_in_seq = np.arange(len(table)) - first_page
        tok = (page_in_seq[:, None] * page_size + offsets).ravel()
        return slots, tok

    @torch.inference_mode()
    def forward(self, sched: ScheduleBatch | None, all_logits: bool = False, dp: DPInfo | None = None) -> torch.Tensor:
        """fp32 logits of each sequence's last new token ``[B, V]`` (every token ``[T, V]`` with
        ``all_logits``). ``sched=None`` runs an idle batch: no tokens, but every collective."""
        batch = self.build_batch(sched or ScheduleBatch(ForwardMode.IDLE, []))
        batch.dp = dp
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        hidden = self.model(batch)
        if not all_logits:
            hidden = hidden[batch.last_token_index()]
        return self.model.compute_logits(hidden, batch)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
