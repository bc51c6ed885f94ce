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
from collections.abc import AsyncIterator

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


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Run until SIGINT/SIGTERM (exit 0) or until a rank dies (exit 1).

    Node 0 runs the API process and its ranks; other nodes (``--node-rank`` > 0) run only their
    ranks, which find node 0 through ``--dist-init-addr``.
    """
    engine_config = _with_bootstrap_host(engine_config, server_config.host)
    par, disagg = engine_config.parallel, engine_config.disagg
    if disagg.enabled:
        ensure_secret(disagg.secret_path)
    addrs = RankAddresses.derive(par)
    if par.node_rank > 0:
        return _serve_ranks_only(engine_config, addrs)
    listener = listen(server_config.host, server_config.port)
    bootstrap = _bootstrap_service(engine_config)
    if bootstrap is not None:  # its ranks register at the port really bound (--disaggregation-bootstrap-port 0)
        engine_config = _with_bootstrap_port(engine_config, bootstrap.sock.getsockname()[1])
    tokenizer = server_tokenizer(engine_config, server_config)
    client = EngineClient(tokenizer, Metrics(server_config.served_model_name), addrs, par.load_balance_method,
                          route_by_room=disagg.disaggregation_mode == "prefill")
    logger.info("engine channel: %s (CURVE-authenticated)", ", ".join([addrs.output, *addrs.inputs]))
    state: ServerState | None = None
    try:
        ranks = RankProcesses(engine_config, addrs)
        try:
            info = ranks.wait_ready()
            state = ServerState(client, tokenizer, engine_config, server_config, kv_capacity=info["max_total_tokens"])
            _http_server(state, ranks, bootstrap, listener).run(sockets=[listener])
        finally:
            _ignore_late_signals()
            ranks.stop()
    finally:
        client.close()
        addrs.cleanup()
        listener.close()
        if bootstrap is not None:
            bootstrap.sock.close()
    return 1 if state is None or state.failure else 0


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


def _http_server(state: ServerState, ranks: RankProcesses, bootstrap: BootstrapService | None,
                 listener: socket.socket) -> uvicorn.Server:
    server: uvicorn.Server

    async def watchdog() -> None:
        while (dead := ranks.dead()) is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        if state.healthy:  # not a shutdown we asked for
            state.healthy = False
            state.failure = f"the engine process {dead}"
            logger.error("%s; shutting down", state.failure)
            state.client.fail_all(state.failure)
            server.should_exit = True

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.client.start()
        if bootstrap is not None:
            bootstrap.start()
        guard = asyncio.get_running_loop().create_task(watchdog())
        if state.server.port_file:
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

