"""Start-up warm-up: a rank compiles every kernel variant serving can reach before it says ready.

Triton compiles a kernel the first time it is launched with a new set of specialization keys: its
``constexpr`` launch parameters, which the wrappers in ``kernels/triton`` pick from the shapes, and,
for every integer argument, whether it is 1, a multiple of 16 or neither. A compile takes from a
fraction of a second to a few seconds, so a fresh server's first requests waited seconds for a
token that a warm server gives in tens of milliseconds. Before it reports ready each rank therefore
runs forward passes over dummy tokens that reach those variants.

What picks a variant, and so what the passes vary:

- prefill tokens ``T`` (up to the step's token budget): the FP8 GEMMs' row tiles and K splits
  (``dense_config``: 16/32/64-row tiles, then the compute-bound config from 128 rows), the grouped
  GEMM's tile by rows per expert (``T * top_k / experts``), and the row counts every elementwise
  kernel (norm, rope, quantization, routing, expert order, combine) takes as integer arguments;
- the sequences of a prefill: the attention kernel over a cached prefix (a chunk continuing a long
  prompt, a prefix-cache hit) takes their count (FlashAttention runs whole prompts of one length);
- decode batch size ``B`` beyond what the CUDA graphs hold: the MLA decode kernel's split count
  (``decode_config``: about SMs / (head blocks x ``B``), from 32 down to 1), its power of two and
  its row counts, and the GEMMs' as for ``T``;
- DeepSeek-V3.2: its indexer's width (the longest context, past ``index_topk``) and row counts.

Those choices change where a size (or a size times a model constant) crosses a power of two, each
band at least an octave wide, so every batch dimension is enumerated as a ladder (``size_ladder``):
the ends of each octave reach both sides of any boundary inside it, and they are odd and even,
multiples of 16 and 32 and neither. The CUDA graphs' own buckets (decode batch x V3.2 context
bucket, ``executor/cuda_graph.py``) were compiled when they were captured, so only sizes past them
run here.

Every rank runs the same plan together, each pass agreed as a serving step is (``Agreement``: the
scheduler's collectives), so DP groups, the EP dispatch mode, two-batch overlap and the graphs'
buckets are picked exactly as when serving; with several DP groups each pass runs once on every
group (their tokens summed where dense layers and experts gather them) and once on one group alone,
the others idle. With speculative decoding a prefill is followed by the MTP module's pass and a
decode step is a verify step with its MTP and draft passes (``SpecDecoder``'s order).

Nothing is left behind: the dummy requests take scratch pages from an allocator of their own (the
scheduler's and its prefix cache never see them; the slots are written again before any request
reads them), no token leaves the rank, the expert recorder and EPLB's pass clock see none of the
passes (``ModelRunner.unrecorded``), the sampler draws from generators of its own and the default
generators are restored after.

On CPU nothing compiles: one small prefill and one decode keep the path exercised.

Not warmed: torch's own per-shape work (cuDNN attention plans for whole prompts of each length,
cuBLAS heuristics); EP normal dispatch's received row counts, which depend on the routing; DP sums
of unequal group sizes beyond those above; prompts longer than the token budget with chunking off;
a prefill server's KV transfer and an expert rebalance's weight copies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from moeserve.config import EngineConfig
from moeserve.core import DPInfo, ForwardMode, Req, SamplingParams, ScheduleBatch, ScheduledSeq
from moeserve.executor.sampler import Sampler, SamplingInfo

if TYPE_CHECKING:
    from moeserve.executor.model_runner import ModelRunner

CPU_PROMPT = 4  # tokens of the CPU's one prefill, after which it decodes one
DECODE_CONTEXT = 16  # tokens each sequence of a decode pass holds before the decoded one
CHUNK_PREFIX = 64  # the cached prefix of a pass that continues a prompt
BATCHED_PROMPTS = (3, 16)  # sequence counts of the prefills over a cached prefix: another, a multiple of 16


@dataclass(frozen=True)
class WarmupPass:
    """One warm-up step of a DP group: sequence ``i`` computes ``lengths[i]`` new tokens after
    ``prefixes[i]`` cached ones (``EXTEND``), or one new token after them (``DECODE``; a verify
    step of the drafts with speculative decoding). ``group``: the one DP group that runs it, the
    others idle (None: every group)."""

    mode: ForwardMode
    lengths: tuple[int, ...]
    prefixes: tuple[int, ...]
    group: int | None = None

    def new_tokens(self, drafts: int) -> list[int]:
        """Tokens each sequence computes: its new ones, or a verify step's ``1 + drafts``."""
        return list(self.lengths) if self.mode is ForwardMode.EXTEND else [1 + drafts] * len(self.lengths)

    def slots(self, drafts: int) -> list[int]:
        """Cache slots each sequence takes: its prefix, its new tokens and the room of ``drafts``
        MTP draft steps after them."""
        return [p + n + drafts for p, n in zip(self.prefixes, self.new_tokens(drafts))]


class Agreement(Protocol):
    """How a rank agrees a step with the others (the scheduler's ``Collectives``): (anyone has
    work, what every DP group runs)."""

    def agree(self, batch: ScheduleBatch | None) -> tuple[bool, DPInfo | None]: ...

    def agree_phase(self, batch: ScheduleBatch | None) -> tuple[bool, DPInfo | None]: ...


def size_ladder(limit: int) -> list[int]:
    """Sizes in ``[1, limit]`` that reach every variant a batch dimension picks: 1 and 2, then for
    each octave ``(p/2, p]`` (the last cut at ``limit``) its top, one below it and the two sizes past
    its bottom: both ends of any power-of-two boundary inside the octave, odd and even sizes,
    multiples of 16 and 32 and sizes that are neither (the integer specialization of a size and of
    what it derives, ``T * top_k`` and its 16-row blocks)."""
    sizes, p = {1, 2}, 4
    while p // 2 < limit:
        top = min(p, limit)
        sizes |= {top, top - 1, p // 2 + 1, p // 2 + 2}
        p *= 2
    return sorted(s for s in sizes if 1 <= s <= limit)


def plan_passes(config: EngineConfig, device_type: str, dp_size: int, graph_max_bs: int | None,
                capacity_pages: int) -> list[WarmupPass]:
    """A rank's warm-up passes, in order, for ``config`` (the scheduler's: its token budget and
    batch cap are the limits). On CUDA, prefill passes (a decode server: one small one) then decode
    passes past the largest batch a CUDA graph replays, ``graph_max_bs`` (a prefill server: none),
    each on every DP group and, with ``dp_size`` > 1, on one group alone; elsewhere one small prefill
    and one decode. Passes that need more than ``capacity_pages`` KV pages, or a sequence longer
    than the context length, are left out."""
    if device_type != "cuda":
        passes = [WarmupPass(ForwardMode.EXTEND, (CPU_PROMPT,), (0,)),
                  WarmupPass(ForwardMode.DECODE, (1,), (CPU_PROMPT,))]
    else:
        role = config.disagg.disaggregation_mode
        prefill = prefill_passes(config) if role != "decode" else [WarmupPass(ForwardMode.EXTEND, (CPU_PROMPT,), (0,))]
        decode = decode_passes(config, graph_max_bs) if role != "prefill" else []
        passes = with_lone_groups(prefill + decode, dp_size)
    drafts, page_size = config.spec.num_drafts, config.cache.page_size
    return [p for p in passes if max(p.slots(drafts)) <= config.context_length
            and sum(-(-s // page_size) for s in p.slots(drafts)) <= capacity_pages]


def prefill_passes(config: EngineConfig) -> list[WarmupPass]:
    """Whole prompts of every size of the ladder up to the step's token budget; a chunk continuing
    a cached prefix and batches of unequal prompts (the prefix-attention kernel's sequence counts);
    for a sparse model (V3.2) the ladder again after ``index_topk`` cached tokens (its indexer)."""
    sched, extend = config.scheduler, ForwardMode.EXTEND
    budget = min(sched.chunked_prefill_size if sched.chunked_prefill_size > 0 else sched.max_prefill_tokens,
                 config.context_length)
    passes = [WarmupPass(extend, (t,), (0,)) for t in size_ladder(budget)]
    passes.append(WarmupPass(extend, (min(CHUNK_PREFIX, budget),), (CHUNK_PREFIX,)))
    for n in BATCHED_PROMPTS:
        if n <= sched.max_running_requests and n * (n + 1) // 2 <= budget:
            passes.append(WarmupPass(extend, tuple(range(1, n + 1)), (CHUNK_PREFIX,) + (0,) * (n - 1)))
    topk = config.model.index_topk
    if topk and topk < config.context_length:
        passes += [WarmupPass(extend, (t,), (topk,)) for t in size_ladder(min(budget, config.context_length - topk))]
    return passes


def decode_passes(config: EngineConfig, graph_max_bs: int | None) -> list[WarmupPass]:
    """Decode steps of every batch size of the ladder up to the running-request cap that no CUDA
    graph replays (past ``graph_max_bs``; all without graphs); for a sparse model (V3.2) the same
    with one sequence past ``index_topk`` too, at an indexer width that is a multiple of 16 and at
    one that is not."""
    sizes = [b for b in size_ladder(config.scheduler.max_running_requests) if graph_max_bs is None or b > graph_max_bs]
    contexts = [DECODE_CONTEXT]
    topk = config.model.index_topk
    if topk:
        widest = -(-topk // 16) * 16 + 16  # the width is the longest sequence: its prefix and the new token
        contexts += [widest, widest + 1]
    return [WarmupPass(ForwardMode.DECODE, (1,) * b, (context - 1,) + (DECODE_CONTEXT - 1,) * (b - 1))
            for context in contexts for b in sizes]


def with_lone_groups(passes: list[WarmupPass], dp_size: int) -> list[WarmupPass]:
    """With several DP groups each pass twice: on every group, then on one alone (the groups in
    turn), so the sizes where the groups' tokens are gathered are both sums and single counts."""
    if dp_size == 1:
        return passes
    return [q for i, p in enumerate(passes) for q in (p, dataclasses.replace(p, group=i % dp_size))]


def warm_up(runner: ModelRunner, config: EngineConfig, agreement: Agreement) -> int:
    """Run this rank's warm-up (``plan_passes`` of ``config``, the scheduler's), every rank of the
    engine at once; returns when its kernels are done, with the number of passes."""
    passes = plan_passes(config, runner.device.type, runner.groups.dp_size, graph_max_bs(runner),
                         agreed_capacity(runner))
    run_passes(runner, agreement, passes)
    return len(passes)


def graph_max_bs(runner: ModelRunner) -> int | None:
    """The largest decode batch (a verify step's, with speculative decoding) a CUDA graph replays;
    None: no graph does."""
    graphs = runner.verify_graphs if runner.config.spec.enabled else runner.graph_runner
    return graphs.max_bs if graphs is not None else None


def agreed_capacity(runner: ModelRunner) -> int:
    """KV pages every rank has (the fewest of any): the ranks' plans must be the same, and each sizes
    its cache from the memory it found free."""
    pages = torch.tensor([runner.num_pages - 1])
    world = runner.groups.cpu_world
    if world.size > 1:
        dist.all_reduce(pages, op=dist.ReduceOp.MIN, group=world.group)
    return int(pages)


def run_passes(runner: ModelRunner, agreement: Agreement, passes: Iterable[WarmupPass]) -> None:
    """Run ``passes``, each on this rank if its DP group takes part, idle otherwise, and leave no
    trace (the module's docstring)."""
    steps = _Steps(runner, agreement)
    dp_rank = runner.groups.dp_rank
    with torch.random.fork_rng(devices=[runner.device] if runner.device.type == "cuda" else []), runner.unrecorded():
        for p in passes:
            steps.run(p if p.group in (None, dp_rank) else None)
    if steps.pages.num_used:
        raise RuntimeError(f"warm-up left {steps.pages.num_used} KV pages in use")
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)


class _Steps:
    """Runs warm-up passes: each one's dummy requests on scratch pages, agreed with the other
    ranks, through the model (and with speculative decoding the MTP module's passes after it), its
    logits sampled once per kind of step; then the pages back."""

    def __init__(self, runner: ModelRunner, agreement: Agreement) -> None:
        self.runner, self.agreement = runner, agreement
        self.pages = runner.new_page_pool()
        self.drafts = runner.config.spec.num_drafts
        self.sampler = Sampler()
        self.sampled: set[ForwardMode] = set()

    def run(self, shape: WarmupPass | None) -> None:
        batch = self._batch(shape) if shape is not None else None
        try:
            if self.drafts:
                self._speculative(batch)
            else:
                anyone, dp = self.agreement.agree(batch)
                if anyone:
                    self._sample(batch, self.runner.forward(batch, dp=dp))
        finally:
            for seq in batch.seqs if batch is not None else []:
                self.pages.free(seq.req.page_table)

    def _batch(self, shape: WarmupPass) -> ScheduleBatch:
        """Dummy requests of ``shape`` on scratch pages (``plan_passes`` kept those that fit)."""
        vocab, seqs = self.runner.config.model.vocab_size, []
        for i, (prefix, new, slots) in enumerate(zip(shape.prefixes, shape.new_tokens(self.drafts),
                                                     shape.slots(self.drafts))):
            req = Req(f"warmup-{i}", [(7 * t + 3) % vocab for t in range(slots)], SamplingParams(max_tokens=1))
            req.page_table = self.pages.alloc(self.pages.pages_for(slots))
            seqs.append(ScheduledSeq(req, prefix, prefix + new))
        mode = shape.mode if shape.mode is ForwardMode.EXTEND or not self.drafts else ForwardMode.VERIFY
        return ScheduleBatch(mode, seqs)

    def _speculative(self, batch: ScheduleBatch | None) -> None:
        """The model's pass, the MTP module's over the same positions (each reads the next token),
        then ``drafts - 1`` draft steps of one token a sequence, each agreed (``SpecDecoder.run``)."""
        runner = self.runner
        anyone, dp = self.agreement.agree(batch)
        if not anyone:
            return
        logits, hidden = runner.forward_with_hidden(batch, dp)  # [T, D]: every token's
        self._sample(batch, logits)
        mtp = None if batch is None else ScheduleBatch(batch.mode, [
            ScheduledSeq(s.req, s.start, s.end, s.req.fill_slice(s.start + 1, s.end + 1)) for s in batch.seqs])
        anyone, dp = self.agreement.agree_phase(mtp)
        if not anyone:
            return
        _, hidden = runner.forward_mtp(mtp, hidden, dp)
        hidden = hidden[_last_rows(mtp, hidden.device)] if mtp is not None else hidden[:0]  # [B, D]
        for step in range(1, self.drafts):
            draft = None if batch is None else ScheduleBatch(ForwardMode.DECODE, [
                ScheduledSeq(s.req, s.end - 1 + step, s.end + step, [3]) for s in batch.seqs])
            anyone, dp = self.agreement.agree_phase(draft)
            if not anyone:
                return
            _, hidden = runner.forward_mtp(draft, hidden, dp)

    def _sample(self, batch: ScheduleBatch | None, logits: torch.Tensor) -> None:
        """The sampler over the step's first rows, once per kind of step: a greedy row, a seeded
        top-k / top-p / min-p row with logprobs, a row with penalties, a logit bias and a banned
        token (its torch kernels load on first use). Each row draws from a generator of its own."""
        if batch is None or batch.mode in self.sampled:
            return
        self.sampled.add(batch.mode)
        history = batch.seqs[0].req.prompt_ids[:8]
        params = [SamplingParams(temperature=0),
                  SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, logprobs=2, seed=0),
                  SamplingParams(temperature=1.0, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
                                 logit_bias={0: 1.0}, seed=1)][:logits.shape[0]]
        infos = [SamplingInfo(p, None if p.seed is None else torch.Generator().manual_seed(p.seed), history, [],
                              banned=[1] if p.logit_bias else []) for p in params]
        self.sampler.sample(logits[:len(infos)], infos)


def _last_rows(batch: ScheduleBatch, device: torch.device) -> torch.Tensor:
    """The row of each sequence's last token in the batch's flat token dimension ``[B]``."""
    return torch.tensor([s.end - s.start for s in batch.seqs], device=device).cumsum(0) - 1
