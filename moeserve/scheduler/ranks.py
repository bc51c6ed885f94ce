"""Engine rank processes: where they listen, how they start, how they stop.

Rank ``r`` runs one scheduler + model runner. The first rank of each attention-TP group (the
DP group's leader) pulls that group's requests from the API process and pushes its tokens back,
over the authenticated sockets of ``channel``.

On one node nothing listens on the network for this: the sockets are IPC paths and the
torch.distributed store a file, all in a private directory (mode 0700) made for the launch.
Across nodes they are TCP ports next to ``--dist-init-addr``, bound to its host only.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import shutil
import tempfile
import time
import weakref
import dataclasses
from dataclasses import dataclass
from multiprocessing import forkserver, reduction
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from moeserve.scheduler.channel import ChannelKeys

if TYPE_CHECKING:  # this module stays light: a launcher starts the ranks' forkserver before importing torch
    from moeserve.config import EngineConfig, ParallelConfig

READY_TIMEOUT_S = 1800
PR_SET_NAME = 15  # prctl(2)
RANK_MODULE = "moeserve.scheduler.event_loop"  # what a rank runs, with everything it imports
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class RankAddresses:
    store: str  # torch.distributed's rendezvous: file://PATH on one node, tcp://host:port across nodes
    output: str  # every leader pushes TokenOutputs here (API worker 0's)
    inputs: tuple[str, ...]  # DP group d's leader pulls requests from inputs[d] (API worker 0's)
    keys: ChannelKeys
    run_dir: str | None = None  # the private directory of a one-node launch
    # the other API workers' (output, inputs) (``--api-workers``): each binds its own, every leader
    # connects to all of them and sends each request's tokens to the worker that sent the request
    more_workers: tuple[tuple[str, tuple[str, ...]], ...] = ()

    @classmethod
    def derive(cls, par: ParallelConfig, api_workers: int = 1) -> RankAddresses:
        """One node: IPC paths in a new private directory, random keys. Several nodes: ports
        ``p+1`` (outputs) and ``p+2+d`` (inputs) next to the rendezvous port ``p`` on its host, and
        keys derived from the shared secret file; API worker ``w`` > 0 uses the same layout
        ``w * (1 + DP groups)`` ports further on.

        The private directory goes with ``cleanup()``, the object's garbage collection or the
        interpreter's exit, whichever comes first (only here: copies sent to the ranks own nothing)."""
        dp = par.attn_dp_size
        if par.nnodes == 1:
            run_dir = tempfile.mkdtemp(prefix="moeserve-")  # 0700: only this user can reach it

            def ends(w: int) -> tuple[str, tuple[str, ...]]:
                tag = "" if w == 0 else f"w{w}-"
                return f"ipc://{run_dir}/{tag}out", tuple(f"ipc://{run_dir}/{tag}in{d}" for d in range(dp))

            (output, inputs), *more = [ends(w) for w in range(api_workers)]
            addrs = cls(f"file://{run_dir}/store", output, inputs, ChannelKeys.generate(), run_dir, tuple(more))
            object.__setattr__(addrs, "_remove", weakref.finalize(addrs, _remove_run_dir, run_dir, os.getpid()))
            return addrs
        host, port = par.dist_init_addr.rsplit(":", 1)

        def tcp_ends(w: int) -> tuple[str, tuple[str, ...]]:
            base = int(port) + w * (1 + dp)
            return f"tcp://{host}:{base + 1}", tuple(f"tcp://{host}:{base + 2 + d}" for d in range(dp))

        (output, inputs), *more = [tcp_ends(w) for w in range(api_workers)]
        return cls(f"tcp://{host}:{port}", output, inputs, _keys_from_file(par.dist_secret_file), None, tuple(more))

    @property
    def num_workers(self) -> int:
        return 1 + len(self.more_workers)

    @property
    def outputs(self) -> tuple[str, ...]:
        """Every API worker's output address, worker 0 first."""
        return (self.output, *(out for out, _ in self.more_workers))

    def inputs_of(self, dp_rank: int) -> tuple[str, ...]:
        """Every API worker's input address for DP group ``dp_rank``."""
        return (self.inputs[dp_rank], *(ins[dp_rank] for _, ins in self.more_workers))

    def worker(self, w: int) -> RankAddresses:
        """The addresses API worker ``w`` binds, as ``output`` and ``inputs``."""
        if w == 0:
            return self
        output, inputs = self.more_workers[w - 1]
        return dataclasses.replace(self, output=output, inputs=inputs, more_workers=())

    def cleanup(self) -> None:
        remove = self.__dict__.get("_remove")
        if remove is not None:
            remove()

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_remove"}  # a finalizer does not pickle


def _remove_run_dir(run_dir: str, owner_pid: int) -> None:
    if os.getpid() == owner_pid:  # not from a forked child that inherited the finalizer
        shutil.rmtree(run_dir, ignore_errors=True)


def _keys_from_file(path: str) -> ChannelKeys:
    with open(path, "rb") as f:
        secret = f.read().strip()
    try:
        return ChannelKeys.from_secret(secret)
    except ValueError as exc:
        raise ValueError(f"dist_secret_file {path!r}: {exc}") from None


def rank_context(device: str) -> BaseContext:
    """How rank processes start. On CUDA each is spawned, a fresh interpreter (a forked CUDA runtime
    is not safe). On CPU they fork from a server process that imported the engine once and never
    ran a thread or OpenMP pool (``forkserver``): a rank starts in a fraction of a second instead of
    importing torch and the engine again, which is most of a small model's start-up."""
    if device == "cuda":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([RANK_MODULE])  # read when the server first starts
    return ctx


def prestart_ranks(device: str) -> None:
    """Start the ranks' forkserver now (on CPU), so that its imports run while the caller does its own."""
    if device != "cuda":
        rank_context(device)
        forkserver.ensure_running()


class _Stdio:
    """The launching process's stdout and stderr, as they are at the launch, for a rank: a forkserver's
    are the ones it had when it started (another test's capture, another log). Pickled as descriptors
    the child receives (``multiprocessing.reduction.DupFd``)."""

    def __reduce__(self) -> tuple:
        return _attach_stdio, (reduction.DupFd(1), reduction.DupFd(2))


def _attach_stdio(out: object, err: object) -> None:
    for fd, dup in ((1, out), (2, err)):
        received = dup.detach()  # spawned: the same descriptor, passed down
        if received != fd:
            os.dup2(received, fd)
            os.close(received)


def _start_rank(env: dict[str, str], stdio: None, *args: object) -> None:
    """A rank's entry: the launching process's environment and standard streams as they are now (the
    streams are attached when ``stdio`` is unpickled), then ``run_rank``."""
    os.environ.clear()
    os.environ.update(env)
    name_process(f"moeserve-rank{args[1]}")
    from moeserve.scheduler.event_loop import run_rank

    run_rank(*args)


def name_process(name: str) -> None:
    """``name`` as the process's name in ``ps``, ``top`` and ``/proc/PID/comm`` (Linux; 15 bytes): a
    forked rank's command line is its forkserver's."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the name is only cosmetic
        pass


class RankProcesses:
    """This node's engine ranks, each a process of its own (``rank_context``).

    ``stop()``, the object's garbage collection or the interpreter's exit stops them (``stop_ranks``)."""

    def __init__(self, config: EngineConfig, addrs: RankAddresses) -> None:
        par = config.parallel
        ctx = rank_context(config.load.device)
        first = par.node_rank * par.ranks_per_node
        self.procs: list[BaseProcess] = []
        self._ready: list[Connection] = []
        # before the first start: ranks started by a constructor that then fails are stopped too
        self._stop = weakref.finalize(self, stop_ranks, self.procs, self._ready, STOP_GRACE_S, os.getpid())
        for rank in range(first, first + par.ranks_per_node):
            parent_end, child_end = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_start_rank, args=(dict(os.environ), _Stdio(), config, rank, addrs, child_end),
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

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """``stop_ranks``; a second call does nothing."""
        state = self._stop.detach()
        if state is not None:
            _, _, (procs, ready, _, pid), _ = state
            stop_ranks(procs, ready, grace_s, pid)


def stop_ranks(procs: list[BaseProcess], ready: list[Connection], grace_s: float, owner_pid: int) -> None:
    """Wait up to ``grace_s`` for the ranks to exit (a rank told to shut down does), then terminate
    them, then kill what is left: at most about ``3 * grace_s`` in all. ``RankProcesses``' finalizer:
    it holds the processes, never that object, and does nothing in a forked child."""
    if os.getpid() != owner_pid:
        return
    for conn in ready:
        conn.close()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0))
        if proc.is_alive():
            proc.kill()
            proc.join(grace_s)
