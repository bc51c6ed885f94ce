"""HTTP pieces the API server and the PD router share; light (no engine import), as the router is."""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import signal
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

OPEN_PATHS = frozenset({"/health", "/metrics"})  # answered without the API key
# How long the servers keep an idle connection open, and how long the router reuses one: the router
# must drop a pooled connection well before the server may close it, or a request sent on it just
# as the server closes it fails (a ReadError seen under a burst with uvicorn's default of 5 s).
SERVER_KEEP_ALIVE_S = 30
CLIENT_KEEP_ALIVE_S = 10


def error_body(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    kind = kind or ("invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def error_json(status: int, message: str, kind: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind), status_code=status, headers=headers)


class APIKeyAuth:
    """``Authorization: Bearer KEY`` on every path but ``OPEN_PATHS``, compared in constant time.

    Plain ASGI (not ``BaseHTTPMiddleware``), so the app still sees the client's disconnect."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                await error_json(401, "invalid or missing API key", "authentication_error")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class SignalledServer(uvicorn.Server):
    """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, which would end the process with
    the signal's status before the caller cleans up; here the signal only starts the shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def listen(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """An HTTP server's socket, bound before anything else starts: a taken port stops the launch at
    once, and port 0 gets a free port that no other process can be handed meanwhile. With
    ``reuse_port`` other sockets of this user may bind the same port (``SO_REUSEPORT``: API
    workers, among which the kernel spreads the connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, reuse_port=reuse_port)
    except OSError as exc:
        raise RuntimeError(f"cannot listen on {host}:{port} ({exc}); choose another --port") from exc


def write_port_file(path: str, ports: dict[str, int | None]) -> None:
    """``ports`` as JSON at ``path``, whole or not at all (written aside, then renamed)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(ports, f)
    os.replace(tmp, path)
