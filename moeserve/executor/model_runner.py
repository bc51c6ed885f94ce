"""Owns the model and its KV cache on one device; turns scheduled work into logits."""

from __future__ import annotations

import contextlib
import logging

import torch

from moeserve.cache import MLAKVPool, PagePool, kv_capacity_tokens
from moeserve.config import EngineConfig
from moeserve.core import DPInfo, ForwardBatch, ForwardMode, ScheduleBatch
from moeserve.distributed.groups import ParallelGroups
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
        return model.eval()

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

    def _kv_budget_bytes(self) -> int:
        cache_cfg = self.config.cache
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(free - total * (1 - cache_cfg.mem_fraction_static))
        return int(cache_cfg.cpu_kv_cache_gb * 2**30)

    def build_batch(self, sched: ScheduleBatch) -> ForwardBatch:
        """Gather token ids, positions and cache slots of the scheduled sequences."""
        page_size = self.page_pool.page_size
        offsets = torch.arange(page_size)
        input_ids, out_loc, kv_indices, kv_lens = [], [], [], []
        for seq in sched.seqs:
            pages = torch.tensor(seq.req.page_table, dtype=torch.int64)
            slots = (pages[:, None] * page_size + offsets).flatten()[:seq.end]
            input_ids.extend(seq.req.fill_ids[seq.start:seq.end])
            out_loc.append(slots[seq.start:])
            kv_indices.append(slots)
            kv_lens.append(seq.end)
        prefix = [s.start for s in sched.seqs]
        extend = [s.end - s.start for s in sched.seqs]
        positions = torch.cat([torch.arange(s.start, s.end) for s in sched.seqs]) if sched.seqs else offsets[:0]
        dev = self.device
        return ForwardBatch(
            mode=sched.mode,
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            out_cache_loc=_cat(out_loc).to(dev),
            prefix_lens=torch.tensor(prefix, dtype=torch.int64, device=dev),
            extend_lens=torch.tensor(extend, dtype=torch.int64, device=dev),
            kv_indptr=torch.tensor([0] + kv_lens, dtype=torch.int64).cumsum(0).to(dev),
            kv_indices=_cat(kv_indices).to(dev),
            prefix_lens_cpu=prefix, extend_lens_cpu=extend, kv_pool=self.kv_pool,
        )

    @torch.inference_mode()
    def forward(self, sched: ScheduleBatch | None, all_logits: bool = False, dp: DPInfo | None = None) -> torch.Tensor:
        """fp32 logits of each sequence's last new token ``[B, V]`` (every token ``[T, V]`` with
        ``all_logits``). ``sched=None`` runs an idle batch: no tokens, but every collective."""
        batch = self.build_batch(sched or ScheduleBatch(ForwardMode.IDLE, []))
        batch.dp = dp
        hidden = self.model(batch)
        if not all_logits:
            hidden = hidden[batch.last_token_index()]
        return self.model.compute_logits(hidden, batch)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
