"""The engine rank process: receive requests, agree with the other ranks, step, send tokens.

Every iteration all ranks run the same collectives in the same order: the DP group's leader
shares the messages it received with its attention-TP peers; all ranks exchange what they are
about to run (``agree``); if anyone has work every rank runs a forward pass, an idle one when it
has nothing, so the MoE all-to-alls and TP gathers never wait on an absent peer.
"""

from __future__ import annotations

import bisect
import gc
import logging
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
import zmq

from moeserve.config import EngineConfig, RunnerConfig
from moeserve.core import DPInfo, FinishReason, Req, ScheduleBatch
from moeserve.distributed.comm import all_gather_flat, broadcast_bytes
from moeserve.distributed.dispatcher import step_dispatch_mode
from moeserve.distributed.groups import Group, ParallelGroups, build_groups, init_world
from moeserve.distributed.groups import single as single_groups
from moeserve.eplb.manager import EplbManager
from moeserve.executor.model_runner import ModelRunner
from moeserve.executor.overlap import split_batch
from moeserve.executor.sampler import SampleOutput
from moeserve.executor.warmup import warm_up
from moeserve.models.tokenizer import load_tokenizer
from moeserve.scheduler.channel import RANK_LINGER_MS, RANK_SEND_TIMEOUT_MS, connect
from moeserve.scheduler.controls import ExpertControls
from moeserve.scheduler.io import (
    AbortInput,
    Codec,
    ControlOutput,
    EngineInput,
    EngineStats,
    ExpertControlInput,
    GenerateInput,
    ShutdownInput,
    TokenBatch,
    TokenOutput,
)
from moeserve.scheduler.ranks import RankAddresses
from moeserve.scheduler.roles import make_role
from moeserve.scheduler.scheduler import Collectives, Detokenizer, Scheduler, with_dispatch_cap
from moeserve.scheduler.speculative import Verdict

logger = logging.getLogger(__name__)
IDLE_POLL_MS = 50
PENDING_POLL_MS = 2  # nothing to compute, but transfers of the role to watch
STATS_INTERVAL_S = 0.05


def agree(groups: ParallelGroups, batch: ScheduleBatch | None, backend: str, deepep_mode: str,
          ll_capacity: int, controls_seen: int = 0, keep_going: bool = False,
          overlap: RunnerConfig | None = None, graph_sizes: list[int] | None = None) -> tuple[DPInfo | None, int]:
    """Share every DP group's plan: (the step, None when no rank has work and none must
    ``keep_going`` (an expert rebalance under way: it moves on between passes); the newest control
    that every rank has received). Picks the step's MoE mode, and with two-batch ``overlap`` whether
    the step splits in two micro-batches and every group's two halves (one collective for all).
    With decode ``graph_sizes`` (several ranks), a decode step everywhere replays the graph of one
    bucket on every rank (``decode_graph_bucket``), captured whole."""
    split = split_batch(batch, overlap.tbo_token_distribution_threshold) if overlap else None
    mine = torch.tensor([batch.num_tokens if batch else 0, batch.num_logit_rows if batch else 0,
                         int(batch is not None and not batch.mode.is_decode), int(batch is not None), controls_seen,
                         *(split.sizes if split else (0, 0, 0, 0))])
    rows = mine.view(1, -1)
    if groups.world.size > 1:
        gathered = torch.zeros(groups.world.size * mine.numel(), dtype=mine.dtype)
        all_gather_flat(gathered, mine, groups.cpu_world)
        rows = gathered.view(groups.world.size, -1)
    controls_ready = int(rows[:, 4].min())
    table = rows[::groups.attn_tp.size].tolist()  # one row per DP group, from its first rank
    if not any(row[3] for row in table) and not keep_going:
        return None, controls_ready
    tokens, seqs, any_extend = [r[0] for r in table], [r[1] for r in table], any(r[2] for r in table)
    bucket = decode_graph_bucket(seqs, any_extend, graph_sizes)
    if bucket is not None:  # the graph's shapes and mode, whatever this step's own sizes would pick
        mode = step_dispatch_mode([bucket] * len(table), False, groups.attn_tp.size, backend, deepep_mode, ll_capacity)
        return DPInfo(tokens, seqs, mode, any_extend=False, graph_bucket=bucket), controls_ready
    mode = step_dispatch_mode(tokens, any_extend, groups.attn_tp.size, backend, deepep_mode, ll_capacity)
    halves = None
    if overlap is not None and max(tokens) >= overlap.tbo_min_tokens:
        halves = (DPInfo([r[5] for r in table], [r[6] for r in table], mode),
                  DPInfo([r[7] for r in table], [r[8] for r in table], mode))
    return DPInfo(tokens, seqs, mode, halves, any_extend), controls_ready


def decode_graph_bucket(seq_counts: list[int], any_extend: bool, graph_sizes: list[int] | None) -> int | None:
    """The decode graph every rank replays this step: the smallest bucket that holds the largest
    DP group's batch (None: no graphs, a prefill somewhere, an idle step, or too large a batch)."""
    if not graph_sizes or any_extend or not 0 < max(seq_counts) <= graph_sizes[-1]:
        return None
    return graph_sizes[bisect.bisect_left(graph_sizes, max(seq_counts))]


def from_leader(tp: Group, codec: Codec, value: object) -> object:
    """The attention-TP leader's ``value`` on every rank of its group ``tp``, as bytes checked
    against ``codec``'s schema (it cannot fail to decode unless the ranks disagree on code)."""
    if tp.size == 1:
        return value
    msg = codec.decode([broadcast_bytes(codec.encode(value) if tp.first else b"", tp)])
    if msg is None:
        raise RuntimeError(f"a message from the group leader did not decode: {codec.last_error}")
    return msg


class RankCollectives(Collectives):
    """A rank process's collectives, over its parallel ``groups``: the step agreement over the
    world, which also runs the expert ``controls`` every rank holds by then, at that same step;
    the attention-TP leader's samples and verdicts; minima over the attention-TP group."""

    def __init__(self, config: EngineConfig, groups: ParallelGroups, controls: ExpertControls,
                 eplb: EplbManager | None, graph_sizes: list[int] | None) -> None:
        self.groups, self.parallel = groups, config.parallel
        self.controls, self.eplb = controls, eplb
        self.overlap = config.runner if config.runner.enable_two_batch_overlap else None
        self.graph_sizes = graph_sizes  # the decode graphs every rank replays together (None: none)
        self._sample_codec, self._verdict_codec = Codec(SampleOutput), Codec(Verdict)

    def agree(self, batch: ScheduleBatch | None) -> tuple[bool, DPInfo | None]:
        par, eplb = self.parallel, self.eplb  # the eplb's state is the same on every rank (passes, agreed controls)
        dp, controls_ready = agree(self.groups, batch, par.moe_a2a_backend, par.deepep_mode,
                                   par.max_dispatch_tokens_per_rank, self.controls.seen,
                                   eplb is not None and eplb.busy, self.overlap, self.graph_sizes)
        self.controls.run(controls_ready)  # every rank at this same step
        return dp is not None, dp

    def agree_phase(self, batch: ScheduleBatch | None) -> tuple[bool, DPInfo | None]:
        par = self.parallel
        dp, _ = agree(self.groups, batch, par.moe_a2a_backend, par.deepep_mode, par.max_dispatch_tokens_per_rank)
        return dp is not None, dp

    def sample_sync(self, out: SampleOutput) -> SampleOutput:
        return from_leader(self.groups.cpu_attn_tp, self._sample_codec, out)

    def verdict_sync(self, verdict: Verdict) -> Verdict:
        return from_leader(self.groups.cpu_attn_tp, self._verdict_codec, verdict)

    def tp_min(self, values: list[int]) -> list[int]:
        tp = self.groups.cpu_attn_tp
        if tp.size == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=tp.group)
        return t.tolist()


class EngineLoop:
    def __init__(self, config: EngineConfig, groups: ParallelGroups, addrs: RankAddresses | None) -> None:
        self.config, self.groups = config, groups
        self.is_leader = groups.attn_tp.first
        tokenizer = load_tokenizer(config.load.tokenizer_path or config.load.model_path)
        self.runner = ModelRunner(config, groups)
        self.controls = ExpertControls(self.runner.eplb, config.eplb, reply=self._reply_control)
        self.scheduler = self._init_scheduler(tokenizer)
        self.controls.flush = self.scheduler.flush_prefix_cache
        self.codec = Codec(EngineInput)
        self._peer_codec = Codec(list[EngineInput])  # messages the leader shares with its TP peers
        self.outputs: list[zmq.Socket] = []  # one PUSH per API worker (the leader's)
        if self.is_leader and addrs is not None:
            self._init_sockets(addrs, groups.dp_rank)
        self._sent: dict[str, int] = {}  # rid -> output tokens already sent (the leader sends, so only it counts)
        self._owner: dict[str, int] = {}  # rid -> the API worker that sent it (the leader's, as ``_sent``)
        self._control_owner: dict[int, int] = {}  # control seq -> the API worker that sent it
        self._steps, self._last_stats, self._busy = 0, 0.0, False
        self._parent = os.getppid()

    def _init_scheduler(self, tokenizer: Detokenizer) -> Scheduler:
        """This rank's scheduler, in its role, agreeing with the other ranks through ``RankCollectives``."""
        config, groups, runner = self.config, self.groups, self.runner
        graphs = runner.graph_runner
        graph_sizes = graphs.batch_sizes if graphs is not None and groups.world.size > 1 else None
        collectives = RankCollectives(config, groups, self.controls, runner.eplb, graph_sizes)
        role = make_role(config.disagg.disaggregation_mode, config, groups, runner)
        return Scheduler(with_dispatch_cap(config, groups.attn_tp.size), runner, tokenizer, role, collectives)

    def _init_sockets(self, addrs: RankAddresses, dp_rank: int) -> None:
        ctx = zmq.Context.instance()
        # one PULL fair-queues the requests of every API worker; one PUSH per worker takes its tokens back
        self.inputs = connect(ctx, zmq.PULL, addrs.inputs_of(dp_rank), addrs.keys)
        self.outputs = [connect(ctx, zmq.PUSH, out, addrs.keys) for out in addrs.outputs]
        for sock in (self.inputs, *self.outputs):
            sock.linger = RANK_LINGER_MS  # no context end waits forever on a message for a peer that is gone
        for sock in self.outputs:
            sock.sndtimeo = RANK_SEND_TIMEOUT_MS  # ``_send`` retries while the parent lives
        self.poller = zmq.Poller()
        self.poller.register(self.inputs, zmq.POLLIN)
        self.stats_dropped = 0  # stats not sent because the API process was not reading

    def run(self) -> None:
        """Step until a ``ShutdownInput`` arrives or the process that started this rank is gone.

        A rank notices a dead parent at the end of each step, or in ``_send`` when blocked; a peer
        rank that exits makes this rank's next collective fail at once (gloo sees the connection
        close), so no rank outlives its launch by more than about a step and a second. A failure
        after the parent is gone is that, not a fault of this rank's own."""
        try:
            while True:
                messages = self._share(self._receive() if self.is_leader else [])
                if any(isinstance(m, ShutdownInput) for m in messages):
                    return
                for msg in messages:
                    self._handle(msg)
                self._busy = self._step()
                if self.is_leader:
                    self._send_stats()
                if os.getppid() != self._parent:
                    logger.error("the process that started this rank is gone; exiting")
                    return
        except Exception as exc:
            if os.getppid() == self._parent:
                raise
            logger.error("the process that started this rank is gone; exiting (%s)", type(exc).__name__)

    def _step(self) -> bool:
        """One scheduler step; True when it ran a forward pass."""
        reqs = self.scheduler.step()
        if self.is_leader:
            self._send_outputs(reqs)
        self._steps += self.scheduler.ran_forward
        return self.scheduler.ran_forward

    # ---- messages --------------------------------------------------------------------------
    def _receive(self) -> list[object]:
        """Everything waiting on the input socket; waits a little when there is nothing to run.

        A message that does not decode to an engine input is dropped and counted.
        """
        sched = self.scheduler
        timeout = 0 if self._busy or sched.has_work else PENDING_POLL_MS if sched.role.num_pending else IDLE_POLL_MS
        msgs = []
        while self.poller.poll(timeout):
            msg = self.codec.decode(self.inputs.recv_multipart())
            if msg is None:
                logger.warning("dropped a malformed message (%d so far): %s", self.codec.rejected,
                               self.codec.last_error)
            else:
                msgs.append(msg)
            timeout = 0
        return msgs

    def _share(self, msgs: list[object]) -> list[object]:
        """The leader's messages, on every rank of its attention-TP group."""
        return from_leader(self.groups.cpu_attn_tp, self._peer_codec, msgs)

    def _handle(self, msg: object) -> None:
        if isinstance(msg, ExpertControlInput):
            self._control_owner[msg.seq] = msg.reply_to
            self.controls.add(msg)
            return
        if isinstance(msg, AbortInput):
            req = self.scheduler.abort(msg.rid)
            if req is not None and self.is_leader:
                self._send_outputs([req])
            return
        assert isinstance(msg, GenerateInput)
        try:
            self.scheduler.add_request(msg.rid, msg.prompt_ids, msg.params, msg.bootstrap)
        except ValueError as exc:
            self._refuse(msg, str(exc), 400)
            return
        except Exception as exc:  # a per-request failure must not end the rank
            logger.exception("request %s could not be queued", msg.rid)
            self._refuse(msg, f"{type(exc).__name__}: {exc}", 500)
            return
        if self.is_leader:
            self._sent[msg.rid] = 0
            self._owner[msg.rid] = self._worker(msg.reply_to)

    def _reply_control(self, out: ControlOutput) -> None:
        if self.groups.world.rank == 0:  # the leader of DP group 0 answers for all
            self._send(out, worker=self._worker(self._control_owner.pop(out.seq, 0)))

    def _worker(self, reply_to: int) -> int:
        """An API worker index as sent; one this rank has no socket for is worker 0."""
        return reply_to if 0 <= reply_to < len(self.outputs) else 0

    def _refuse(self, msg: GenerateInput, message: str, status: int) -> None:
        if self.is_leader:
            out = TokenOutput(msg.rid, [], finish_reason="error", error=message, error_status=status)
            self._send(TokenBatch([out]), worker=self._worker(msg.reply_to))

    def _send(self, msg: object, wait: bool = True, worker: int = 0) -> bool:
        """Send to API worker ``worker``, waiting while it is behind (back-pressure) but not once
        the process that started this rank is gone: then ``ConnectionAbortedError``, which ends
        ``run``. Without ``wait``, a message that cannot leave at once is dropped (False)."""
        data = self.codec.encode(msg)
        while True:
            try:
                self.outputs[worker].send(data, 0 if wait else zmq.NOBLOCK)
                return True
            except zmq.Again:
                if not wait:
                    return False
                if os.getppid() != self._parent:
                    raise ConnectionAbortedError("the process that started this rank is gone") from None

    def _send_outputs(self, reqs: list[Req]) -> None:
        """One message per API worker per step, with the new tokens of all its requests."""
        per_worker: dict[int, list[TokenOutput]] = {}
        for req in reqs:
            worker = self._owner.get(req.rid, 0)
            per_worker.setdefault(worker, []).append(self._delta(req))
            if req.finished:
                self._owner.pop(req.rid, None)
        for worker, batch in per_worker.items():
            self._send(TokenBatch(batch), worker=worker)

    def _delta(self, req: Req) -> TokenOutput:
        sent = self._sent.get(req.rid, 0)
        out = TokenOutput(req.rid, req.output_ids[sent:], prompt_len=len(req.prompt_ids),
                          cached_tokens=req.cached_tokens)
        if req.params.logprobs is not None:
            out.new_logprobs = req.output_logprobs[sent:]
        if req.params.prompt_logprobs is not None and sent == 0 and (req.output_ids or req.finished):
            out.prompt_logprobs = req.prompt_logprobs
        if req.finished:
            self._sent.pop(req.rid, None)
            out.finish_reason, out.text = req.finish_reason.value, req.text
            if req.finish_reason is FinishReason.ERROR:
                out.error, out.error_status = req.finish_message, req.error_status
        else:
            self._sent[req.rid] = len(req.output_ids)
        return out

    def _send_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < STATS_INTERVAL_S:
            return
        self._last_stats = now
        sched = self.scheduler
        pages = sched.pages
        stats = EngineStats(
            num_running=len(sched.decode) + (sched.prefill.chunked is not None),
            num_waiting=len(sched.prefill.waiting), pages_used=pages.num_used, pages_total=pages.capacity,
            page_size=pages.page_size, retracted=sched.decode.retracted, generation_steps=self._steps,
            dp_rank=self.groups.dp_rank, rejected_messages=self.codec.rejected, pd_queues=sched.role.stats(),
            ended_early=dict(sched.ended_early), pages_cached=pages.num_cached,
            prefix_prompt_tokens=sched.prefill.prompt_tokens, prefix_hit_tokens=sched.prefill.cached_tokens,
        )
        if sched.spec is not None:
            stats.spec_verified, stats.spec_emitted = sched.spec.verified, sched.spec.emitted
        eplb = self.runner.eplb
        if eplb is not None:
            stats.expert_balancedness, stats.expert_rebalances = eplb.stats.balancedness, eplb.stats.rebalances
            stats.expert_max_pause_s = eplb.stats.max_pause_s
        transfers = sched.role.transfer_stats()
        if transfers is not None:
            stats.transfers, stats.transfer_bytes = dict(transfers.transfers), transfers.bytes
            stats.transfer_seconds, stats.transfer_writes = transfers.seconds, transfers.writes
            stats.prefill_peers_lost = transfers.peers_lost
        for worker in range(len(self.outputs)):  # each API worker reports the engine's whole state
            if not self._send(stats, wait=False, worker=worker):  # resent soon: dropped rather than waited for
                self.stats_dropped += 1


def run_rank(config: EngineConfig, rank: int, addrs: RankAddresses, ready: Connection) -> None:
    """Entry point of rank ``rank``; reports ``("ready", info)`` or ``("error", text)``."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; the launching process decides when ranks stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    use_triton_cache(config.runner)
    try:
        groups = _init_distributed(config, rank, addrs)
        loop = EngineLoop(config, groups, addrs)
        startup_s = warm_up_rank(loop)
    except Exception:
        ready.send(("error", traceback.format_exc()))
        return
    ready.send(("ready", {"max_total_tokens": loop.runner.max_total_tokens, "startup_s": startup_s}))
    ready.close()
    try:
        loop.run()
    finally:
        loop.scheduler.role.close()
        if loop.runner.graph_runner is not None:
            logging.info("decode CUDA graphs replayed %d times", loop.runner.graph_runner.replays)
    # a CUDA graph that captured NCCL kernels holds its communicator open: free the graphs (the
    # model runner's) before the process group, or tearing NCCL down waits for them forever
    del loop
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def use_triton_cache(runner: RunnerConfig) -> None:
    """``--triton-cache-dir``: this process's compiled kernels go there (Triton reads
    ``TRITON_CACHE_DIR`` when it compiles, so before the first kernel is enough)."""
    if runner.triton_cache_dir is not None:
        os.environ["TRITON_CACHE_DIR"] = os.path.abspath(runner.triton_cache_dir)


def warm_up_rank(loop: EngineLoop) -> dict[str, float]:
    """Compile the kernels serving can reach (``executor/warmup.py``; not with
    ``--skip-server-warmup``), every rank together; this rank's start-up seconds by phase (weights,
    graphs, warm-up), logged."""
    phases, warmup = dict(loop.runner.startup_s), "skipped (--skip-server-warmup)"
    if not loop.config.runner.skip_server_warmup:
        started = time.perf_counter()
        passes = warm_up(loop.runner, loop.scheduler.config, loop.scheduler.collectives)
        phases["warmup"] = time.perf_counter() - started
        warmup = f"{phases['warmup']:.1f} s ({passes} passes)"
    logger.info("start-up: weights %.1f s, graphs %.1f s, warm-up %s", phases["weights"], phases["graphs"], warmup)
    return phases


def _init_distributed(config: EngineConfig, rank: int, addrs: RankAddresses) -> ParallelGroups:
    par = config.parallel
    if par.world_size == 1:
        return single_groups()
    device = config.load.device
    if device != "cuda":  # ranks sharing the cores: more threads than cores makes every collective wait
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // par.ranks_per_node))
    # NCCL for the device tensors; build_groups adds gloo twins for the host-side agreement
    init_world(addrs.store, rank, par.world_size, device, local_rank=rank % par.ranks_per_node)
    return build_groups(par.world_size, rank, par.attn_tp_size, par.dense_tp_size, par.ep_world,
                        par.enable_dp_lm_head)
