"""Start the engine process and the HTTP server; take the whole tree down on exit."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import uvicorn
from fastapi import FastAPI

from moeserve.config import EngineConfig
from moeserve.disagg.bootstrap import BootstrapService
from moeserve.disagg.secret import ensure_secret, read_secret
from moeserve.disagg.transfer.protocol import bootstrap_token
from moeserve.models.tokenizer import Tokenizer, load_tokenizer
from moeserve.scheduler.ranks import RankAddresses, RankProcesses
from moeserve.server.api import ServerConfig, ServerState, build_app
from moeserve.server.engine_client import EngineClient
from moeserve.server.http import SERVER_KEEP_ALIVE_S, SignalledServer, listen, write_port_file
from moeserve.server.metrics import Metrics

logger = logging.getLogger(__name__)
WATCHDOG_INTERVAL_S = 0.5


def serve(engine_config: EngineConfig, server_config: ServerConfig,
          ranks_factory: Callable[[EngineConfig, RankAddresses], RankProcesses] = RankProcesses) -> int:
    """Run until SIGINT/SIGTERM (exit 0) or until a rank dies (exit 1).

    Node 0 runs the API process (or, with ``--api-workers`` N > 1, N API worker processes on one
    port and a supervising process) and its ranks; other nodes (``--node-rank`` > 0) run only
    their ranks, which find node 0 through ``--dist-init-addr``. The HTTP port answers from the
    start: ``/health`` says 503 until the ranks report ready (weights loaded, graphs captured,
    kernels warmed), then 200. ``ranks_factory`` starts the ranks (``bench frontend`` puts scripted
    ones in their place).
    """
    engine_config = _with_bootstrap_host(engine_config, server_config.host)
    par, disagg = engine_config.parallel, engine_config.disagg
    if disagg.enabled:
        ensure_secret(disagg.secret_path)
    addrs = RankAddresses.derive(par, server_config.api_workers)
    if par.node_rank > 0:
        return _serve_ranks_only(engine_config, addrs)
    listener = listen(server_config.host, server_config.port, reuse_port=server_config.api_workers > 1)
    bootstrap = _bootstrap_service(engine_config)
    if bootstrap is not None:  # its ranks register at the port really bound (--disaggregation-bootstrap-port 0)
        engine_config = _with_bootstrap_port(engine_config, bootstrap.sock.getsockname()[1])
    logger.info("engine channel: %s (CURVE-authenticated)",
                ", ".join([*addrs.outputs, *(a for d in range(par.attn_dp_size) for a in addrs.inputs_of(d))]))
    try:
        if server_config.api_workers == 1:
            return _serve_one_process(engine_config, server_config, addrs, listener, bootstrap, ranks_factory)
        from moeserve.server.workers import serve_workers

        return serve_workers(engine_config, server_config, addrs, listener, bootstrap, ranks_factory)
    finally:
        addrs.cleanup()
        listener.close()
        if bootstrap is not None:
            bootstrap.sock.close()


def _serve_one_process(engine_config: EngineConfig, server_config: ServerConfig, addrs: RankAddresses,
                       listener: socket.socket, bootstrap: BootstrapService | None,
                       ranks_factory: Callable[[EngineConfig, RankAddresses], RankProcesses]) -> int:
    """The API in this process, its ranks beside it."""
    tokenizer = server_tokenizer(engine_config, server_config)
    client = EngineClient(tokenizer, Metrics(server_config.served_model_name), addrs,
                          engine_config.parallel.load_balance_method,
                          route_by_room=engine_config.disagg.disaggregation_mode == "prefill")
    state = ServerState(client, tokenizer, engine_config, server_config, kv_capacity=0, starting=True)
    try:
        ranks = ranks_factory(engine_config, addrs)
        try:
            http_server(state, LocalRanks(ranks), listener, bootstrap).run(sockets=[listener])
        finally:
            _ignore_late_signals()
            ranks.stop()
    finally:
        client.close()
        state.responses.close()
    return 1 if state.failure else 0


def _with_bootstrap_host(config: EngineConfig, host: str) -> EngineConfig:
    """This server's bootstrap server listens on its HTTP host (its ranks reach it there)."""
    reachable = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return dataclasses.replace(config, disagg=dataclasses.replace(config.disagg, bootstrap_host=reachable))


def _with_bootstrap_port(config: EngineConfig, port: int) -> EngineConfig:
    return dataclasses.replace(config, disagg=dataclasses.replace(config.disagg, disaggregation_bootstrap_port=port))


def _bootstrap_service(config: EngineConfig) -> BootstrapService | None:
    disagg = config.disagg
    if disagg.disaggregation_mode != "prefill":
        return None
    token = bootstrap_token(read_secret(disagg.secret_path))
    return BootstrapService(disagg.bootstrap_host, disagg.disaggregation_bootstrap_port, config.parallel.world_size,
                            token)


def _serve_ranks_only(engine_config: EngineConfig, addrs: RankAddresses) -> int:
    ranks = RankProcesses(engine_config, addrs)
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        ranks.wait_ready()
        logger.info("ranks of node %d ready", engine_config.parallel.node_rank)
        while not stop and ranks.dead() is None:
            time.sleep(WATCHDOG_INTERVAL_S)
    finally:
        ranks.stop(grace_s=1.0 if stop else 5.0)
        _ignore_late_signals()
    # the ranks also end by themselves, cleanly, when node 0 shuts the deployment down
    return 0 if stop or all(p.exitcode == 0 for p in ranks.procs) else 1


def _ignore_late_signals() -> None:
    """The shutdown is under way: a SIGTERM now would only turn a clean exit into a kill (Python
    restores the default handlers while it finalizes, but leaves ignored signals ignored)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


class EngineWatch(Protocol):
    """How an API process learns that the engine is ready, or gone."""

    async def ready(self) -> dict: ...  # the ranks' ready info; raises when they failed to start

    def dead(self) -> str | None: ...  # why the engine stopped, None while it runs


class LocalRanks:
    """The ranks this process started."""

    def __init__(self, ranks: RankProcesses) -> None:
        self.ranks = ranks

    async def ready(self) -> dict:
        return await asyncio.get_running_loop().run_in_executor(None, self.ranks.wait_ready)

    def dead(self) -> str | None:
        dead = self.ranks.dead()
        return None if dead is None else f"the engine process {dead}"


def log_startup(info: dict) -> None:
    """The ranks' start-up time by phase (weights, graphs, warm-up), as rank 0 reported it."""
    phases = info.get("startup_s") or {}
    detail = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items())
    logger.info("engine ready (max_total_tokens %d)%s", info["max_total_tokens"], f": {detail}" if detail else "")


def http_server(state: ServerState, engine: EngineWatch, listener: socket.socket,
                bootstrap: BootstrapService | None = None, write_ports: bool = True) -> uvicorn.Server:
    """The HTTP server of one API process: it answers at once, 503 while ``state.starting``; it
    starts serving when ``engine`` is ready and shuts down, failing every request, when the
    engine dies or fails to start."""
    server: uvicorn.Server

    def fail(reason: str) -> None:
        if state.healthy:  # not a shutdown we asked for
            state.healthy = False
            state.failure = reason
            logger.error("%s; shutting down", reason)
            state.client.fail_all(reason)
            server.should_exit = True

    async def start_then_watch() -> None:
        try:
            info = await engine.ready()
        except Exception as exc:  # a rank failed to start: its error is in the message
            fail(f"the engine failed to start: {exc}")
            return
        state.kv_capacity = info["max_total_tokens"]
        log_startup(info)
        state.starting = False
        while (dead := engine.dead()) is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        fail(dead)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.client.start()
        if bootstrap is not None:
            bootstrap.start()
        guard = asyncio.get_running_loop().create_task(start_then_watch())
        if write_ports and state.server.port_file:
            write_port_file(state.server.port_file, {
                "port": listener.getsockname()[1],
                "bootstrap_port": bootstrap.sock.getsockname()[1] if bootstrap is not None else None})
        yield
        state.healthy = False
        guard.cancel()
        if bootstrap is not None:
            await bootstrap.stop()
        await state.client.shutdown()

    app = build_app(state, lifespan)
    config = uvicorn.Config(app, host=state.server.host, port=state.server.port, log_level="info",
                            timeout_graceful_shutdown=5, timeout_keep_alive=SERVER_KEEP_ALIVE_S)
    server = SignalledServer(config)
    return server


def server_tokenizer(engine_config: EngineConfig, server_config: ServerConfig) -> Tokenizer | None:
    """The API process's tokenizer, with ``--chat-template`` in place of its own; the flags SGLang's
    launch lines carry that change nothing here are said in the log."""
    tokenizer = load_tokenizer(engine_config.load.tokenizer_path or engine_config.load.model_path)
    if server_config.trust_remote_code:
        logger.info("--trust-remote-code: accepted; moeserve runs no code from the checkpoint")
    if server_config.enable_metrics:
        logger.info("--enable-metrics: accepted; /metrics is always served")
    template = server_config.chat_template
    if template is not None:
        if tokenizer is None:
            raise ValueError("chat_template: this model has no tokenizer to apply it with")
        if os.path.isfile(template):
            with open(template) as f:
                template = f.read()
        tokenizer.hf.chat_template = template
        logger.info("chat template: %s", "from " + server_config.chat_template
                    if os.path.isfile(server_config.chat_template) else "given inline")
    return tokenizer

