"""The bootstrap server of a prefill server: where its ranks' side channels listen.

Each prefill rank registers (``PUT /register``, with the deployment's token) its attention DP
and TP rank, the layout sizes, its side-channel endpoint and what a decode rank must match (page
size, KV dtype, layer count, model). ``GET /route`` answers the layout and the endpoint of each DP
group's first TP rank (the one that sends), 503 until every rank has registered; ``/health``
answers the same status with this server's ``instance`` id (new at every start: decode ranks
watch it to notice a restart, whose ranks no longer hold their rooms). It runs in the prefill
server's API process, on ``--disaggregation-bootstrap-port``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel


class Registration(BaseModel):
    endpoint: str
    page_size: int
    kv_dtype: str
    num_layers: int
    model: str
    dp_rank: int
    tp_rank: int
    attn_tp_size: int
    attn_dp_size: int


@dataclass
class BootstrapTable:
    """The registered ranks of one prefill server."""

    world: int  # ranks expected
    ranks: dict[tuple[int, int], Registration] = field(default_factory=dict)
    instance: str = field(default_factory=lambda: secrets.token_hex(8))

    def route(self) -> dict | None:
        """The layout and each DP group's sending endpoint, or None until every rank is in."""
        if len(self.ranks) < self.world:
            return None
        first = next(iter(self.ranks.values()))
        endpoints = [self.ranks[(dp, 0)].endpoint for dp in range(first.attn_dp_size)]
        return {"attn_dp_size": first.attn_dp_size, "attn_tp_size": first.attn_tp_size, "endpoints": endpoints,
                "page_size": first.page_size, "kv_dtype": first.kv_dtype, "num_layers": first.num_layers,
                "model": first.model, "instance": self.instance}


def build_bootstrap_app(table: BootstrapTable, token: str) -> FastAPI:
    app = FastAPI(title="moeserve bootstrap")
    expected = f"Bearer {token}".encode()

    @app.put("/register")
    async def register(body: Registration, request: Request) -> Response:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return JSONResponse({"error": {"message": "invalid registration token", "type": "authentication_error",
                                           "param": None, "code": 401}}, status_code=401)
        table.ranks[(body.dp_rank, body.tp_rank)] = body
        return Response(status_code=200)

    @app.get("/route")
    async def route() -> Response:
        answer = table.route()
        if answer is None:
            return JSONResponse({"error": {"message": f"{len(table.ranks)} of {table.world} prefill ranks registered",
                                           "type": "server_error", "param": None, "code": 503}}, status_code=503)
        return JSONResponse(answer)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"instance": table.instance}, status_code=200 if table.route() is not None else 503)

    return app


class BootstrapService:
    """The bootstrap server as a task of the API process's event loop. The port is bound when the
    service is made, so a taken port stops the launch at once with a clear error."""

    def __init__(self, host: str, port: int, world: int, token: str) -> None:
        self.table = BootstrapTable(world)
        try:
            self.sock = socket.create_server((host, port))
        except OSError as exc:
            raise RuntimeError(f"the bootstrap port {host}:{port} cannot be bound ({exc}); "
                               "choose another with --disaggregation-bootstrap-port") from exc
        config = uvicorn.Config(build_bootstrap_app(self.table, token), log_level="warning")
        self.server = _QuietServer(config)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))

    async def stop(self) -> None:
        self.server.should_exit = True
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=5)
        self.sock.close()


class _QuietServer(uvicorn.Server):
    """Leaves signals to the main HTTP server."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
