"""Several API worker processes on one port (``--api-workers`` N > 1): the front end of a node.

One API process tokenizes, detokenizes and streams every request itself, and a few hundred
streams at engine speed fill it (each token is a detokenizer step, a JSON chunk and a socket write
in Python). With N workers each request lives in one of them from its HTTP request to its last
chunk, so that work divides N ways:

```
clients ─HTTP─> port P (SO_REUSEPORT: the kernel spreads connections over the workers)
                  ├─ API worker 0 ─┐  each: FastAPI + its own EngineClient (tokenize, DP choice,
                  ├─ API worker 1 ─┤  detokenize, stream), its own ZMQ sockets
                  └─ …             │
DP leader d: one PULL connected to every worker's input d ─┘  one PUSH per worker: each step, one
             message per worker with the new tokens of all of that worker's requests
supervisor (this module, the launching process): starts the ranks and the workers, says "ready"
             or "dead" to every worker, runs a prefill server's bootstrap service, stops them all
```

What the workers share: the port, the ranks, the stored responses (``ResponseStore`` in a file)
and the numbering of expert controls (one counter, so every rank runs them in one order). What
each keeps to itself: its DP load-balancing view (its own requests), its ``--max-queued-requests``
count and its ``/metrics`` (a scrape reaches one worker; the engine's gauges are whole in each, the
request counters are that worker's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from multiprocessing.sharedctypes import Synchronized

from moeserve.config import EngineConfig, ServerConfig
from moeserve.disagg.bootstrap import BootstrapService
from moeserve.scheduler.ranks import RankAddresses, RankProcesses, name_process
from moeserve.server.api import ServerState
from moeserve.server.engine_client import EngineClient
from moeserve.server.http import listen, write_port_file
from moeserve.server.launch import WATCHDOG_INTERVAL_S, http_server, log_startup, server_tokenizer
from moeserve.server.metrics import Metrics
from moeserve.server.responses import ResponseStore

logger = logging.getLogger(__name__)
BIND_TIMEOUT_S = 120  # a worker imports the API and loads the tokenizer before it binds
STOP_TIMEOUT_S = 15  # a worker's graceful shutdown takes at most uvicorn's 5 s and a socket close


class Supervisor:
    """A worker's view of the supervising process: "ready" (with the ranks' info) or "dead"
    (with the reason) arrive on ``conn``; a closed pipe means the supervisor is gone."""

    POLL_S = 0.05

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.info: dict | None = None
        self.reason: str | None = None

    def _drain(self) -> None:
        try:
            while self.reason is None and self.conn.poll():
                kind, value = self.conn.recv()
                if kind == "ready":
                    self.info = value
                else:
                    self.reason = value
        except (EOFError, OSError):
            self.reason = self.reason or "the server's supervising process is gone"

    async def ready(self) -> dict:
        while self.info is None:
            self._drain()
            if self.reason is not None:
                raise RuntimeError(self.reason)
            await asyncio.sleep(self.POLL_S)
        return self.info

    def dead(self) -> str | None:
        self._drain()
        return self.reason


def run_worker(index: int, engine_config: EngineConfig, server_config: ServerConfig, addrs: RankAddresses,
               port: int, counter: Synchronized, store_path: str, conn: Connection) -> None:
    """Entry point of API worker ``index``: bind the shared port, say "bound", serve until told
    otherwise. Exits 1 when the engine failed."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s api{index} %(levelname)s %(message)s")
    name_process(f"moeserve-api{index}")
    listener = listen(server_config.host, port, reuse_port=True)
    tokenizer = server_tokenizer(engine_config, server_config)

    def next_control() -> int:
        with counter.get_lock():
            counter.value += 1
            return counter.value

    client = EngineClient(tokenizer, Metrics(server_config.served_model_name), addrs,
                          engine_config.parallel.load_balance_method,
                          route_by_room=engine_config.disagg.disaggregation_mode == "prefill", worker=index,
                          next_control=next_control)
    state = ServerState(client, tokenizer, engine_config, server_config, kv_capacity=0, starting=True,
                        responses=ResponseStore(store_path))
    conn.send(("bound", None))
    try:
        http_server(state, Supervisor(conn), listener, write_ports=False).run(sockets=[listener])
    finally:
        client.close()
        listener.close()
        state.responses.close()
    sys.exit(1 if state.failure else 0)


def serve_workers(engine_config: EngineConfig, server_config: ServerConfig, addrs: RankAddresses,
                  listener: socket.socket, bootstrap: BootstrapService | None,
                  ranks_factory: Callable[[EngineConfig, RankAddresses], RankProcesses] = RankProcesses) -> int:
    """Start the ranks (``ranks_factory``) and ``--api-workers`` workers, supervise them; exit
    status as ``serve``."""
    ctx = mp.get_context("spawn")  # a fresh interpreter each: this process has threads (ZMQ, tqdm …)
    counter = ctx.Value("q", 0)
    with tempfile.TemporaryDirectory(prefix="moeserve-api-") as shared:
        ranks = ranks_factory(engine_config, addrs)
        workers: list[tuple[SpawnProcess, Connection]] = []
        try:
            for w in range(server_config.api_workers):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=run_worker, name=f"moeserve-api{w}", args=(
                    w, engine_config, server_config, addrs.worker(w), listener.getsockname()[1], counter,
                    os.path.join(shared, "responses.sqlite"), theirs))
                proc.start()
                theirs.close()
                workers.append((proc, mine))
            return asyncio.run(_supervise(ranks, workers, listener, bootstrap, server_config.port_file))
        finally:
            _stop_workers(workers)
            ranks.stop()


async def _supervise(ranks: RankProcesses, workers: list[tuple[SpawnProcess, Connection]], listener: socket.socket,
                     bootstrap: BootstrapService | None, port_file: str | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    port = listener.getsockname()[1]
    reason = await _wait_bound(workers, stop)
    if reason is None and not stop.is_set():
        listener.close()  # the workers hold the port now; a connection must not land on this socket
        if port_file:
            write_port_file(port_file, {"port": port,
                                        "bootstrap_port": bootstrap.sock.getsockname()[1] if bootstrap else None})
        if bootstrap is not None:
            bootstrap.start()
        reason = await _watch(ranks, workers, stop)
    if reason is not None:
        logger.error("%s; shutting down", reason)
        for _, conn in workers:
            with contextlib.suppress(OSError):
                conn.send(("dead", reason))
    if bootstrap is not None:
        await bootstrap.stop()
    return 1 if reason is not None else 0


async def _wait_bound(workers: list[tuple[SpawnProcess, Connection]], stop: asyncio.Event) -> str | None:
    """Wait until every worker has bound the port (or ``stop``); why not, or None."""
    deadline = asyncio.get_running_loop().time() + BIND_TIMEOUT_S
    for w, (proc, conn) in enumerate(workers):
        while not conn.poll():
            if stop.is_set():
                return None
            if not proc.is_alive():
                return f"API worker {w} exited during start-up (code {proc.exitcode})"
            if asyncio.get_running_loop().time() > deadline:
                return f"API worker {w} did not start within {BIND_TIMEOUT_S} s"
            await asyncio.sleep(0.05)
        conn.recv()
    return None


async def _watch(ranks: RankProcesses, workers: list[tuple[SpawnProcess, Connection]],
                 stop: asyncio.Event) -> str | None:
    """Tell the workers when the ranks are ready; return why the server must stop (None: asked to)."""
    ready = asyncio.get_running_loop().run_in_executor(None, ranks.wait_ready)
    announced = False
    while not stop.is_set():
        if ready.done() and not announced:
            if ready.exception() is not None:
                return f"the engine failed to start: {ready.exception()}"
            log_startup(ready.result())
            for _, conn in workers:
                conn.send(("ready", ready.result()))
            announced = True
        if (dead := ranks.dead()) is not None:
            return f"the engine process {dead}"
        for w, (proc, _) in enumerate(workers):
            if not proc.is_alive():
                return f"API worker {w} exited (code {proc.exitcode})"
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), WATCHDOG_INTERVAL_S)
    return None


def _stop_workers(workers: list[tuple[SpawnProcess, Connection]]) -> None:
    """SIGTERM to every worker still running (each shuts down gracefully), killed past the timeout."""
    for proc, _ in workers:
        if proc.is_alive():
            proc.terminate()
    for proc, conn in workers:
        proc.join(STOP_TIMEOUT_S)
        if proc.is_alive():
            proc.kill()
            proc.join()
        conn.close()
