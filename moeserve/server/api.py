"""The HTTP API: FastAPI app with OpenAI-compatible and native endpoints."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moeserve.config import EngineConfig
from moeserve.core import SamplingParams
from moeserve.models.tokenizer import Tokenizer
from moeserve.scheduler.scheduler import check_request
from moeserve.server import openai_serving as oai
from moeserve.server.engine_client import EngineClient, EngineError
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest

DISCONNECT_POLL_S = 0.2


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str = "default"
    max_queued_requests: int = 256

    def __post_init__(self) -> None:
        if self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


@dataclass
class ServerState:
    client: EngineClient
    tokenizer: Tokenizer | None
    engine: EngineConfig
    server: ServerConfig
    kv_capacity: int
    healthy: bool = True
    failure: str | None = None  # why the server stopped serving, when it was not asked to

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids")
        if not prompt:
            raise APIError(400, "prompt is empty")
        return self.tokenizer.encode(prompt)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            check_request(prompt_ids, params, self.engine, self.kv_capacity, self.tokenizer is not None)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def check_model(self, model: str | None) -> None:
        known = {self.server.served_model_name, self.engine.load.model_path}
        if model is not None and model not in known:
            raise APIError(400, f"model {model!r} is not served here; use {self.server.served_model_name!r}")

    def admit(self) -> None:
        if not self.healthy:
            raise APIError(503, "the engine is not running", "service_unavailable")
        if self.client.num_queued >= self.server.max_queued_requests:
            raise APIError(503, f"the queue is full ({self.server.max_queued_requests} requests waiting)",
                           "service_unavailable", {"Retry-After": "1"})


def error_json(status: int, message: str, kind: str = "invalid_request_error",
               headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


async def stream_events(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield sse(event)
    except (EngineError, APIError) as exc:
        yield sse({"error": {"message": str(exc), "type": "invalid_request_error"}})
    yield sse("[DONE]")


async def until_disconnect(request: Request, work: asyncio.Future) -> object:
    """Await ``work``; cancel it (which aborts its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            raise APIError(499, "client disconnected")
    return task.result()


def build_app(state: ServerState, lifespan: Callable[[FastAPI], AbstractAsyncContextManager] | None = None) -> FastAPI:
    app = FastAPI(title="moeserve", version="0.1.0", lifespan=lifespan)
    app.state.moeserve = state
    _install_error_handlers(app)
    _install_auth(app, state.server.api_key)
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
                            for e in exc.errors())
        return error_json(400, f"invalid request: {details}")

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_json(exc.status, exc.message, exc.kind, exc.headers)

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, exc: EngineError) -> JSONResponse:
        return error_json(400, str(exc))


def _install_auth(app: FastAPI, api_key: str | None) -> None:
    if not api_key:
        return
    open_paths = {"/health", "/metrics"}

    @app.middleware("http")
    async def check_key(request: Request, call_next):
        if request.url.path not in open_paths and request.headers.get("authorization") != f"Bearer {api_key}":
            return error_json(401, "invalid or missing API key", "authentication_error")
        return await call_next(request)


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.healthy else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if not state.healthy:
            return Response(status_code=503)
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        try:
            await asyncio.wait_for(oai.collect(state.client.generate([0], params)), timeout=30)
        except (asyncio.TimeoutError, EngineError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.client.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": state.server.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "moeserve", "root": state.engine.load.model_path,
                "max_model_len": state.engine.context_length}
        return {"object": "list", "data": [card]}

    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {"model_path": state.engine.load.model_path, "served_model_name": state.server.served_model_name,
                "vocab_size": state.engine.model.vocab_size, "max_model_len": state.engine.context_length,
                "max_total_tokens": state.kv_capacity, "is_generation": True}


async def _respond(request: Request, stream: bool, events: Callable[[], AsyncIterator[dict]],
                   whole: Callable[[], Awaitable[dict]]) -> Response:
    """Server-sent events when streaming, else one JSON body (aborted if the client leaves)."""
    if stream:
        return StreamingResponse(stream_events(events()), media_type="text/event-stream")
    return JSONResponse(await until_disconnect(request, whole()))


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.admit()
        state.check_model(body.model)
        jobs = oai.completion_jobs(state, body)
        return await _respond(request, body.stream, lambda: oai.stream_completion(state, body, jobs),
                              lambda: oai.completion_response(state, body, jobs))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        state.admit()
        state.check_model(body.model)
        jobs = oai.chat_jobs(state, body)
        return await _respond(request, body.stream, lambda: oai.stream_chat(state, body, jobs),
                              lambda: oai.chat_response(state, body, jobs))

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        state.admit()
        ids, params = oai.native_job(state, body)
        return await _respond(request, body.stream, lambda: oai.stream_native(state, body, ids, params),
                              lambda: oai.native_response(state, body, ids, params))
