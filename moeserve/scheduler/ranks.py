"""Engine rank processes: where they listen, how they start, how they stop.

Rank ``r`` runs one scheduler + model runner. The first rank of each attention-TP group (the
DP group's leader) pulls that group's requests from the API process and pushes its tokens back,
over the authenticated sockets of ``channel``.

On one node nothing listens on the network for this: the sockets are IPC paths and the
torch.distributed store a file, all in a private directory (mode 0700) made for the launch.
Across nodes they are TCP ports next to ``--dist-init-addr``, bound to its host only.
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass

from moeserve.config import EngineConfig, ParallelConfig
from moeserve.scheduler.channel import ChannelKeys

READY_TIMEOUT_S = 1800


@dataclass(frozen=True)
class RankAddresses:
    store: str  # torch.distributed's rendezvous: file://PATH on one node, tcp://host:port across nodes
    output: str  # every leader pushes TokenOutputs here
    inputs: tuple[str, ...]  # DP group d's leader pulls requests from inputs[d]
    keys: ChannelKeys
    run_dir: str | None = None  # the private directory of a one-node launch

    @classmethod
    def derive(cls, par: ParallelConfig) -> RankAddresses:
        """One node: IPC paths in a new private directory, random keys. Several nodes: ports
        ``p+1`` (outputs) and ``p+2+d`` (inputs) next to the rendezvous port ``p`` on its host, and
        keys derived from the shared secret file."""
        if par.nnodes == 1:
            run_dir = tempfile.mkdtemp(prefix="moeserve-")  # 0700: only this user can reach it
            inputs = tuple(f"ipc://{run_dir}/in{d}" for d in range(par.attn_dp_size))
            return cls(f"file://{run_dir}/store", f"ipc://{run_dir}/out", inputs, ChannelKeys.generate(), run_dir)
        host, port = par.dist_init_addr.rsplit(":", 1)
        base = int(port)
        inputs = tuple(f"tcp://{host}:{base + 2 + d}" for d in range(par.attn_dp_size))
        return cls(f"tcp://{host}:{base}", f"tcp://{host}:{base + 1}", inputs, _keys_from_file(par.dist_secret_file))

    def cleanup(self) -> None:
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def _keys_from_file(path: str) -> ChannelKeys:
    with open(path, "rb") as f:
        secret = f.read().strip()
    try:
        return ChannelKeys.from_secret(secret)
    except ValueError as exc:
        raise ValueError(f"dist_secret_file {path!r}: {exc}") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
