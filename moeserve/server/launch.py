"""Start the engine process and the HTTP server; take the whole tree down on exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import signal
import time
from collections.abc import AsyncIterator, Iterator

import uvicorn
from fastapi import FastAPI

from moeserve.config import EngineConfig
from moeserve.models.tokenizer import load_tokenizer
from moeserve.scheduler.event_loop import run_engine
from moeserve.server.api import ServerConfig, ServerState, build_app
from moeserve.server.engine_client import EngineClient
from moeserve.server.metrics import Metrics

logger = logging.getLogger(__name__)
READY_TIMEOUT_S = 1800
WATCHDOG_INTERVAL_S = 0.5


class EngineProcess:
    """One engine process (spawned: a forked CUDA or OpenMP runtime is not safe)."""

    def __init__(self, config: EngineConfig, input_addr: str, output_addr: str) -> None:
        ctx = mp.get_context("spawn")
        self._ready, child_end = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=run_engine, args=(config, input_addr, output_addr, child_end),
                                name="moeserve-engine", daemon=True)
        self.proc.start()
        child_end.close()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while not self._ready.poll(0.2):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine process exited during start-up (code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine was not ready after {timeout:.0f} s")
        status, info = self._ready.recv()
        if status != "ready":
            raise RuntimeError(f"the engine failed to start:\n{info}")
        return info

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    def stop(self, grace_s: float = 5.0) -> None:
        self.proc.join(grace_s)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(grace_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Run until SIGINT/SIGTERM (exit 0) or until the engine dies (exit 1)."""
    tokenizer = load_tokenizer(engine_config.load.tokenizer_path or engine_config.load.model_path)
    client = EngineClient(tokenizer, Metrics(server_config.served_model_name))
    engine = EngineProcess(engine_config, client.input_addr, client.output_addr)
    state: ServerState | None = None
    try:
        info = engine.wait_ready()
        state = ServerState(client, tokenizer, engine_config, server_config, kv_capacity=info["max_total_tokens"])
        _http_server(state, engine).run()
    finally:
        engine.stop()
        client.close()
    return 1 if state is None or state.failure else 0


def _http_server(state: ServerState, engine: EngineProcess) -> uvicorn.Server:
    server: uvicorn.Server

    async def watchdog() -> None:
        while engine.alive:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        if state.healthy:  # not a shutdown we asked for
            state.healthy = False
            state.failure = f"the engine process exited (code {engine.proc.exitcode})"
            logger.error("%s; shutting down", state.failure)
            state.client.fail_all(state.failure)
            server.should_exit = True

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.client.start()
        guard = asyncio.get_running_loop().create_task(watchdog())
        yield
        state.healthy = False
        guard.cancel()
        await state.client.shutdown()

    app = build_app(state, lifespan)
    config = uvicorn.Config(app, host=state.server.host, port=state.server.port, log_level="info",
                            timeout_graceful_shutdown=5)
    server = _Server(config)
    return server


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, which would end this process
    before it stops the engine; here the signal only starts the shutdown and ``serve`` returns."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)
