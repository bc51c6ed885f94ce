"""Engine rank processes: where they listen, how they start, how they stop.

Rank ``r`` runs one scheduler + model runner. The first rank of each attention-TP group (the
DP group's leader) pulls that group's requests from the API process and pushes its tokens back;
the addresses follow from ``--dist-init-addr`` so that ranks on other nodes can find them.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import time
from dataclasses import dataclass

from moeserve.config import EngineConfig, ParallelConfig

READY_TIMEOUT_S = 1800


@dataclass(frozen=True)
class RankAddresses:
    dist_init: str  # host:port of torch.distributed's rendezvous
    output: str  # every leader pushes TokenOutputs here
    inputs: tuple[str, ...]  # DP group d's leader pulls requests from inputs[d]

    @classmethod
    def derive(cls, par: ParallelConfig) -> RankAddresses:
        """Ports ``p+1`` (outputs) and ``p+2+d`` (inputs) next to the rendezvous port ``p``.

        Without ``--dist-init-addr``, ``p`` is the start of a run of ports that are all free now.
        """
        dist_init = par.dist_init_addr or f"127.0.0.1:{free_port_run(2 + par.attn_dp_size)}"
        host, port = dist_init.rsplit(":", 1)
        base = int(port)
        inputs = tuple(f"tcp://{host}:{base + 2 + d}" for d in range(par.attn_dp_size))
        return cls(dist_init, f"tcp://{host}:{base + 1}", inputs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int, attempts: int = 64) -> int:
    """A port ``p`` such that ``p .. p+n-1`` can all be bound now.

    The kernel's free port says nothing about its neighbours, which other processes' outgoing
    connections take from the same range; each candidate run is bound whole, then released.
    """
    for _ in range(attempts):
        base = free_port()
        with contextlib.ExitStack() as held:
            try:
                for port in range(base, base + n):
                    held.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:  # taken, or past 65535
                continue
            return base
    raise RuntimeError(f"no run of {n} free ports found on 127.0.0.1 in {attempts} tries")


class RankProcesses:
    """This node's engine ranks, spawned (a forked CUDA or OpenMP runtime is not safe)."""

    def __init__(self, config: EngineConfig, addrs: RankAddresses) -> None:
        from moeserve.scheduler.event_loop import run_rank

        par = config.parallel
        ctx = mp.get_context("spawn")
        first = par.node_rank * par.ranks_per_node
        self.procs, self._ready = [], []
        for rank in range(first, first + par.ranks_per_node):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=run_rank, args=(config, rank, addrs, child_end),
                               name=f"moeserve-rank{rank}", daemon=True)
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self._ready.append(parent_end)

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict:
        """Block until every rank reports ready; the first rank's info (KV capacity …)."""
        deadline, infos = time.monotonic() + timeout, []
        for proc, conn in zip(self.procs, self._ready):
            while not conn.poll(0.2):
                if not proc.is_alive():
                    raise RuntimeError(f"{proc.name} exited during start-up (code {proc.exitcode})")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the engine was not ready after {timeout:.0f} s")
            try:
                status, info = conn.recv()
            except EOFError:
                proc.join(1)
                raise RuntimeError(f"{proc.name} exited during start-up (code {proc.exitcode})") from None
            if status != "ready":
                raise RuntimeError(f"{proc.name} failed to start:\n{info}")
            infos.append(info)
        return infos[0]

    def dead(self) -> str | None:
        """A description of the first rank that exited, or None while all run."""
        for proc in self.procs:
            if not proc.is_alive():
                return f"{proc.name} exited (code {proc.exitcode})"
        return None

    def stop(self, grace_s: float = 5.0) -> None:
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(max(deadline - time.monotonic(), 0))
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs:
            proc.join(grace_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
