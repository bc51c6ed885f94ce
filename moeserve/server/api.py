"""The HTTP API: FastAPI app with OpenAI-compatible and native endpoints.

What a client sends is bounded before it costs anything: the body size (``--max-request-bytes``),
the queue (``--max-queued-requests`` when set, counted per engine request the moment an HTTP
request is admitted; by default requests queue in the engine, where ``--queue-timeout`` may bound
their wait), the prompt length (a cheap lower bound before tokenizing; long texts are tokenized
off the event loop). Every error has the OpenAI envelope ``{"error": {...}}``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import moeserve
from moeserve.config import EngineConfig, ServerConfig
from moeserve.core import BootstrapInfo, SamplingParams
from moeserve.models.tokenizer import Tokenizer
from moeserve.scheduler.validation import check_request
from moeserve.server import openai_serving as oai
from moeserve.server import responses as resp
from moeserve.server.engine_client import EngineClient, EngineError, Ticket
from moeserve.server.http import APIKeyAuth, error_body, error_json
from moeserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from moeserve.server.responses import ResponsesRequest

DISCONNECT_POLL_S = 0.2
# texts up to this many characters are tokenized on the event loop (well under a millisecond);
# longer ones in a worker thread, where the tokenizer releases the GIL
INLINE_TOKENIZE_CHARS = 4096


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
    tokenize_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize"))
    responses: resp.ResponseStore = field(default_factory=resp.ResponseStore)  # stored /v1/responses answers
    starting: bool = False  # the engine is loading or warming up: /health answers 503, requests 503 too

    async def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        tokenizer = self.text_tokenizer()
        if not prompt:
            raise APIError(400, "prompt is empty")
        self.check_text_length(prompt)
        return await self.off_loop(len(prompt), tokenizer.encode, prompt)

    async def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                          template_kwargs: dict[str, Any] | None = None) -> list[int]:
        tokenizer = self.text_tokenizer()
        size = sum(len(m["content"] or "") for m in messages)
        kwargs = dict(template_kwargs or {})
        prompt = kwargs.pop("add_generation_prompt", True)
        try:
            text = await self.off_loop(size, functools.partial(tokenizer.render_chat, messages, prompt, tools, **kwargs))
        except Exception as exc:  # the template refused the conversation (roles, order …)
            raise APIError(400, f"messages: {exc}") from exc
        self.check_text_length(text)
        return await self.off_loop(len(text), tokenizer.encode, text, False)

    def text_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids")
        return self.tokenizer

    def check_text_length(self, text: str) -> None:
        """Refuse, without tokenizing, a text that must have more tokens than the context holds."""
        least, context = self.tokenizer.min_tokens(text), self.engine.context_length
        if least >= context:
            raise APIError(400, f"prompt has at least {least} tokens ({len(text)} characters), "
                                f"the context length is {context}")

    async def off_loop(self, size: int, fn: Callable, *args: Any) -> Any:
        if size <= INLINE_TOKENIZE_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn, *args)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        try:
            check_request(prompt_ids, params, self.engine, self.kv_capacity, self.tokenizer is not None)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    def bootstrap(self, body: Any, index: int) -> BootstrapInfo | None:
        """Where the other server of job ``index`` is; None on a monolithic server (which ignores
        the fields). A prefill or decode server refuses a request without them."""
        if not self.engine.disagg.enabled:
            return None
        try:
            info = body.bootstrap(index)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        if info is None:
            raise APIError(400, f"a {self.engine.disagg.disaggregation_mode} server needs bootstrap_host, "
                                "bootstrap_port and bootstrap_room (send requests through the PD router)")
        return info

    def check_model(self, model: str | None) -> None:
        """A 404 ``model_not_found`` (OpenAI's answer) for a model this server does not serve."""
        known = {self.server.served_model_name, self.engine.load.model_path}
        if model is not None and model not in known:
            raise APIError(404, f"model {model!r} is not served here; use {self.server.served_model_name!r}",
                           "model_not_found")

    def model_card(self) -> dict:
        return {"id": self.server.served_model_name, "object": "model", "created": int(time.time()),
                "owned_by": "moeserve", "root": self.engine.load.model_path,
                "max_model_len": self.engine.context_length}

    def admit(self, places: int) -> Ticket:
        """Queue places for ``places`` engine requests, taken now, before any await: a burst of
        requests cannot pass the limit together."""
        if self.starting:
            raise APIError(503, "the server is starting", "server_error", {"Retry-After": "1"})
        if not self.healthy:
            raise APIError(503, "the engine is not running", "server_error")
        if self.server.max_queued_requests is not None:
            self._check_queue_limit(places, self.server.max_queued_requests)
        return self.client.admit(places)

    def _check_queue_limit(self, places: int, limit: int) -> None:
        if places > limit:
            raise APIError(400, f"this request makes {places} completions (prompts x n); the queue holds at "
                                f"most {limit} (--max-queued-requests)")
        if self.client.queued + places > limit:
            self.client.metrics.refused("queue_full")
            raise APIError(503, f"the queue is full ({limit} requests waiting)", "server_error",
                           {"Retry-After": "1"})


_json = msgspec.json.Encoder()


def sse(payload: dict | str) -> bytes:
    """One server-sent event: ``payload`` as compact UTF-8 JSON (msgspec encodes a chunk several
    times faster than ``json.dumps``: a stream writes one per token), or a literal like [DONE]."""
    data = payload.encode() if isinstance(payload, str) else _json.encode(payload)
    return b"data: " + data + b"\n\n"


async def stream_events(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield sse(event)
    except EngineError as exc:
        yield sse(error_body(exc.status, str(exc), exc.kind))
    except APIError as exc:
        yield sse(error_body(exc.status, exc.message, exc.kind))
    yield sse("[DONE]")


class GuardedStream(StreamingResponse):
    """A streaming response that always runs ``on_close`` and closes its body, even when the
    client left before the first byte (Starlette then never starts the body iterator)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.on_close()


async def until_disconnect(request: Request, work: Awaitable) -> object:
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
    app.add_middleware(BodyLimit, limit=state.server.max_request_bytes, on_refuse=state.client.metrics.refused)
    if state.server.api_key:
        app.add_middleware(APIKeyAuth, api_key=state.server.api_key)  # outermost: before the body is read
    _add_info_routes(app, state)
    _add_generation_routes(app, state)
    _add_expert_routes(app, state)
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
        return error_json(exc.status, str(exc), exc.kind)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own answers (404, 405, a body that is not JSON or not UTF-8 …), in the envelope
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_json(exc.status_code, str(exc.detail), kind, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        return error_json(500, f"internal error: {type(exc).__name__}", "server_error")


class BodyLimit:
    """413 for a body over ``limit`` bytes: at once from its Content-Length, or as soon as the
    bytes received pass it (a chunked upload)."""

    def __init__(self, app: ASGIApp, limit: int, on_refuse: Callable[[str], None]) -> None:
        self.app, self.limit, self.on_refuse = app, limit, on_refuse

    def _too_large(self) -> HTTPException:
        self.on_refuse("body_too_large")
        return HTTPException(413, f"the request body is larger than {self.limit} bytes (--max-request-bytes)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            exc = self._too_large() if declared.isdigit() else HTTPException(400, "bad Content-Length")
            await error_json(exc.status_code, exc.detail)(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise self._too_large()  # FastAPI passes an HTTPException from the body read on
            return message

        await self.app(scope, limited, send)


def _add_info_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if state.healthy and not state.starting else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        ready = state.healthy and not state.starting
        if not ready or state.engine.disagg.enabled:  # a PD server cannot generate alone
            return Response(status_code=200 if ready else 503)
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        try:
            await asyncio.wait_for(oai.collect(state.client.generate([0], params)), timeout=30)
        except (asyncio.TimeoutError, EngineError):
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        state.client.metrics.refused_peers.set(state.client.channel.refusals.count)
        return Response(state.client.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [state.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model_card(model: str) -> dict:
        state.check_model(model)
        return state.model_card()

    @app.get("/version")
    async def version() -> dict:
        return {"version": moeserve.__version__}

    @app.get("/get_server_info")
    async def server_info() -> dict:
        """The settings the server runs with (the API key left out) and the KV capacity it has."""
        settings = {name: dataclasses.asdict(section) for name, section in vars(state.engine).items()
                    if dataclasses.is_dataclass(section) and name != "model"}
        server = {k: v for k, v in dataclasses.asdict(state.server).items() if k != "api_key"}
        return json.loads(json.dumps({"version": moeserve.__version__, "server": server, "engine": settings,
                                      "max_total_tokens": state.kv_capacity,
                                      "model_type": state.engine.model.model_type}, default=str))

    @app.get("/get_model_info")
    async def model_info() -> dict:
        return {"model_path": state.engine.load.model_path, "served_model_name": state.server.served_model_name,
                "vocab_size": state.engine.model.vocab_size, "max_model_len": state.engine.context_length,
                "max_total_tokens": state.kv_capacity, "is_generation": True}

    for prefix in ("", "/v1"):
        app.add_api_route(f"{prefix}/tokenize", _tokenize_route(state), methods=["POST"])
        app.add_api_route(f"{prefix}/detokenize", _detokenize_route(state), methods=["POST"])


def _tokenize_route(state: ServerState) -> Callable[[TokenizeRequest], Awaitable[dict]]:
    async def tokenize(body: TokenizeRequest) -> dict:
        state.check_model(body.model)
        if (body.prompt is None) == (body.text is None):
            raise APIError(400, "give exactly one of prompt and text")
        tokenizer = state.text_tokenizer()
        text = body.prompt if body.prompt is not None else body.text
        state.check_text_length(text)
        ids = await state.off_loop(len(text), tokenizer.encode, text, body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.context_length}
    return tokenize


def _detokenize_route(state: ServerState) -> Callable[[DetokenizeRequest], Awaitable[dict]]:
    async def detokenize(body: DetokenizeRequest) -> dict:
        state.check_model(body.model)
        vocab = state.engine.model.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens: every id must be in [0, {vocab})")
        text = state.text_tokenizer().decode(body.tokens)
        return {"prompt": text, "text": text}  # vLLM's name and SGLang's
    return detokenize


async def _serve(request: Request, state: ServerState, places: int, stream: bool,
                 prepare: Callable[[Ticket], Awaitable[Any]], events: Callable[[Any], AsyncIterator[dict]],
                 whole: Callable[[Any], Awaitable[dict]]) -> Response:
    """Admit, build the engine jobs, then answer with server-sent events when streaming, else one
    JSON body (aborted if the client leaves). The queue places are given back on every path."""
    ticket = state.admit(places)
    streaming = False
    try:
        jobs = await prepare(ticket)
        if stream:
            streaming = True
            return GuardedStream(stream_events(events(jobs)), on_close=ticket.release)
        return JSONResponse(await until_disconnect(request, whole(jobs)))
    finally:
        if not streaming:
            ticket.release()


def _add_generation_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        return await _serve(request, state, oai.completion_places(body), body.stream,
                            lambda ticket: oai.completion_jobs(state, body, ticket),
                            lambda jobs: oai.stream_completion(state, body, jobs),
                            lambda jobs: oai.completion_response(state, body, jobs))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        return await _serve(request, state, body.n, body.stream,
                            lambda ticket: oai.chat_jobs(state, body, ticket),
                            lambda jobs: oai.stream_chat(state, body, jobs),
                            lambda jobs: oai.chat_response(state, body, jobs))

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        state.check_model(body.model)
        try:
            chat = resp.chat_request(state, body)
        except (ValueError, KeyError) as exc:  # pydantic's ValidationError is a ValueError
            raise APIError(400, f"input: {exc}" if isinstance(exc, KeyError) else str(exc)) from exc
        return await _serve(request, state, 1, body.stream,
                            lambda ticket: oai.chat_jobs(state, chat, ticket),
                            lambda jobs: resp.stream(state, body, chat, jobs),
                            lambda jobs: resp.create(state, body, chat, jobs))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict:
        found = resp.retrieve(state, response_id)
        if found is None:
            raise APIError(404, f"response {response_id!r} is not stored here", "not_found_error")
        return found

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        return await _serve(request, state, 1, body.stream,
                            lambda ticket: oai.native_job(state, body, ticket),
                            lambda job: oai.stream_native(state, body, job),
                            lambda job: oai.native_response(state, body, job))


EXPERT_CONTROL_TIMEOUT_S = 600.0  # a rebalance of every layer of a large model, chunk by chunk


def _add_expert_routes(app: FastAPI, state: ServerState) -> None:
    """The expert recorder and placement (SGLang's paths); each runs on every rank at once."""

    async def run(action: str) -> dict:
        answer = await state.client.control(action, EXPERT_CONTROL_TIMEOUT_S)
        if not answer.ok:
            raise APIError(400, answer.message)
        return answer.result

    async def flush() -> dict:
        if state.client.num_in_flight:
            raise APIError(400, f"the cache was not flushed: {state.client.num_in_flight} requests are running")
        return await run("flush_cache")

    app.add_api_route("/flush_cache", flush, methods=["GET", "POST"])
    for path, action in (("/start_expert_distribution_record", "start_record"),
                         ("/stop_expert_distribution_record", "stop_record"),
                         ("/dump_expert_distribution_record", "dump_record"), ("/rebalance_experts", "rebalance")):
        app.add_api_route(path, _control_route(run, action), methods=["POST"])


def _control_route(run: Callable[[str], Awaitable[dict]], action: str) -> Callable[[], Awaitable[dict]]:
    async def route() -> dict:
        return await run(action)

    return route
