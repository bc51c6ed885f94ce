"""Actions on the expert recorder and placement (and the prefix cache's flush), sent over HTTP and
run by every rank at once.

The API process sends an ``ExpertControlInput`` to every DP group; ranks receive it at different
steps, so each action waits until the step agreement says every rank holds it (the newest ``seq``
all of them have seen), and then runs on all of them at that step: the dump's all-reduce and a
rebalance's passes line up. Rank 0 answers.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable

from moeserve.config import EplbConfig
from moeserve.eplb.manager import EplbManager
from moeserve.scheduler.io import ControlOutput, ExpertControlInput


class ExpertControls:
    def __init__(self, eplb: EplbManager | None, config: EplbConfig, reply: Callable[[ControlOutput], None],
                 flush: Callable[[], int] | None = None) -> None:
        self.eplb, self.config, self.reply = eplb, config, reply
        self.flush = flush  # the scheduler's prefix-cache flush: pages freed, ValueError while requests run
        self.pending: list[ExpertControlInput] = []
        self.seen = 0  # every seq up to this one has been received
        self._ahead: set[int] = set()  # seqs received past a gap

    def add(self, msg: ExpertControlInput) -> None:
        """Several API workers number their controls from one shared counter, so seqs may arrive
        out of order: ``seen`` moves only over an unbroken run, or a rank could run a later control
        before an earlier one it has not received yet."""
        self.pending.append(msg)
        self._ahead.add(msg.seq)
        while self.seen + 1 in self._ahead:
            self.seen += 1
            self._ahead.discard(self.seen)

    def run(self, ready: int) -> None:
        """Run, in order, every pending action up to ``ready`` (the same on every rank)."""
        due = sorted((m for m in self.pending if m.seq <= ready), key=lambda m: m.seq)
        self.pending = [m for m in self.pending if m.seq > ready]
        for msg in due:
            try:
                self._run(msg)
            except ValueError as exc:  # decided alike on every rank: nothing else ran
                self.reply(ControlOutput(msg.seq, False, str(exc)))

    def _run(self, msg: ExpertControlInput) -> None:
        if msg.action == "flush_cache":
            freed = self.flush() if self.flush is not None else 0
            self.reply(ControlOutput(msg.seq, True, result={"pages_freed": freed}))
            return
        eplb = self.eplb
        if eplb is None:
            raise ValueError("the server records no expert load: start it with --expert-distribution-recorder-mode "
                             "or --enable-eplb")
        if msg.action == "start_record":
            eplb.recorder.start()
            self.reply(ControlOutput(msg.seq, True, result={"mode": eplb.recorder.mode}))
        elif msg.action == "stop_record":
            eplb.recorder.stop()
            self.reply(ControlOutput(msg.seq, True, result={"passes": eplb.recorder.num_passes}))
        elif msg.action == "dump_record":
            path = eplb.dump(self.directory)
            self.reply(ControlOutput(msg.seq, True, result={"path": path, "passes": eplb.recorder.num_passes,
                                                            "balancedness": eplb.stats.balancedness}))
        elif msg.action == "stats":
            self.reply(ControlOutput(msg.seq, True, result=eplb.summary()))
        else:
            eplb.request_rebalance(lambda result: self.reply(ControlOutput(msg.seq, True, result=result)))

    @property
    def directory(self) -> str:
        return self.config.expert_distribution_recorder_dir or os.path.join(tempfile.gettempdir(),
                                                                            "moeserve_expert_distribution")
