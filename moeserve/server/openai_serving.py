"""Turn OpenAI-style requests into engine jobs, and engine chunks into OpenAI-style responses."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moeserve.core import BootstrapInfo, SamplingParams, TokenLogprob
from moeserve.server.engine_client import Chunk, Ticket
from moeserve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest, token_biases
from moeserve.server.reasoning import ReasoningParser, Split
from moeserve.server.tool_calls import ToolCallDelta, ToolCallParser, call_grammar

if TYPE_CHECKING:
    from moeserve.server.api import ServerState


@dataclass
class Job:
    """One engine request: choice ``index`` of the response."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams
    ticket: Ticket | None = None  # the queue places of the HTTP request this job belongs to
    bootstrap: BootstrapInfo | None = None  # the other server of a disaggregated request


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    # with a reasoning parser: the text split in two, and the tokens generated while reasoning
    parser: ReasoningParser | None = None
    reasoning: str = ""
    content: str = ""
    reasoning_tokens: int = 0
    tools: ToolCallParser | None = None  # with tools: the calls parsed out of the content
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass
class Piece:
    """What a chunk adds to a chat choice: reasoning, content and tool-call deltas."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


def _api_error(message: str) -> Exception:
    from moeserve.server.api import APIError

    return APIError(400, message)


def _params(state: ServerState, body: Any, ids: list[int], max_tokens: int | None, logprobs: int | None,
            choice: int) -> SamplingParams:
    if max_tokens is None:
        max_tokens = max(state.engine.context_length - len(ids), 1)
    try:
        params = body.sampling_params(max_tokens, logprobs, choice)
    except ValueError as exc:
        raise _api_error(str(exc)) from exc
    state.check(ids, params)
    return params


# ---- building jobs -------------------------------------------------------------------------
def completion_places(body: CompletionRequest) -> int:
    """How many engine requests a completion request makes (prompts x n), counted before tokenizing."""
    return len(_prompt_list(body.prompt)) * body.n


async def completion_jobs(state: ServerState, body: CompletionRequest, ticket: Ticket) -> list[Job]:
    jobs = []
    scoring_only = body.echo and body.max_tokens == 0  # the prompt's logprobs, nothing generated
    for p_index, prompt in enumerate(_prompt_list(body.prompt)):
        ids = await state.encode(prompt)
        for choice in range(body.n):
            params = _params(state, body, ids, 1 if scoring_only else body.max_tokens, body.logprobs, choice)
            if body.echo and body.logprobs is not None:
                params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
                state.check(ids, params)
            index = p_index * body.n + choice
            jobs.append(Job(index, p_index, ids, params, ticket, state.bootstrap(body, index)))
    return jobs


def _echoed(state: ServerState, body: CompletionRequest, job: Job, result: Result) -> Result:
    """``echo``: the prompt's text (and, with ``logprobs``, its logprobs: none for its first
    token) before the completion's; with ``max_tokens: 0`` the completion left out."""
    if not body.echo:
        return result
    prompt = _prompt_list(body.prompt)[job.prompt_index]
    text = prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt, False) if state.tokenizer else ""
    out = dataclasses.replace(result, text=text + result.text, logprobs=[*(result.prompt_logprobs or []),
                                                                         *result.logprobs])
    if body.max_tokens == 0:
        out = dataclasses.replace(out, text=text, logprobs=list(result.prompt_logprobs or []), token_ids=[],
                                  finish_reason="length")
    return out


def _prompt_list(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise _api_error("prompt is empty")
    if all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt)


async def chat_jobs(state: ServerState, body: ChatCompletionRequest, ticket: Ticket) -> list[Job]:
    if state.tokenizer is None:
        raise _api_error("this model has no tokenizer, so it has no chat template")
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    mode, parser = body.tool_mode, state.server.tool_call_parser
    if mode != "none" and parser is None:
        raise _api_error("tools need the server started with --tool-call-parser (deepseekv3, deepseekv31, "
                         "deepseekv32); or send tool_choice: none")
    kwargs = dict(body.chat_template_kwargs or {})
    if body.continue_final_message:
        if body.messages[-1].role != "assistant":
            raise _api_error("continue_final_message needs the last message to be the assistant's")
        kwargs.update(continue_final_message=True, add_generation_prompt=False)
    elif not body.add_generation_prompt:
        kwargs["add_generation_prompt"] = False
    ids = await state.encode_chat([m.for_template() for m in body.messages], tools, kwargs)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    jobs = []
    for c in range(body.n):
        params = _params(state, body, ids, max_tokens, logprobs, c)
        if mode != "none":  # the format's tags may be special tokens: keep them for the parser
            params = dataclasses.replace(params, skip_special_tokens=False, **_tool_grammar(state, body, tools))
            state.check(ids, params)
        jobs.append(Job(c, 0, ids, params, ticket, state.bootstrap(body, c)))
    return jobs


def _tool_grammar(state: ServerState, body: ChatCompletionRequest, tools: list[dict[str, Any]]) -> dict[str, str]:
    """``tool_choice`` required or named: a grammar that makes the output a valid call."""
    mode = body.tool_mode
    if mode not in ("required", "named"):
        return {}
    if body.grammar():
        raise _api_error(f"tool_choice {mode} and {next(iter(body.grammar()))} both constrain the output: give one")
    if state.engine.scheduler.grammar_backend != "xgrammar":
        raise _api_error(f"tool_choice {mode} needs the server's --grammar-backend xgrammar")
    try:
        return {"ebnf": call_grammar(state.server.tool_call_parser, tools,
                                     body.tool_choice.name if mode == "named" else None,
                                     several=mode == "required" and body.parallel_tool_calls)}
    except ValueError as exc:
        raise _api_error(f"tool_choice: {exc}") from exc
    except Exception as exc:  # xgrammar could not take a function's parameters schema
        raise _api_error(f"tools: a function's parameters could not be compiled: {exc}") from exc


_NATIVE_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


async def native_job(state: ServerState, body: GenerateRequest, ticket: Ticket) -> Job:
    if (body.text is None) == (body.input_ids is None):
        raise _api_error("give exactly one of text and input_ids")
    ids = await state.encode(body.text if body.text is not None else body.input_ids)
    settings = {_NATIVE_NAMES.get(k, k): v for k, v in body.sampling_params.items()}
    settings.setdefault("max_tokens", 128)
    if body.priority:
        settings["priority"] = body.priority
    if body.return_logprob:
        settings["logprobs"] = body.top_logprobs_num
        if body.logprob_start_len >= 0:
            settings["prompt_logprobs"] = body.top_logprobs_num
    if isinstance(settings.get("json_schema"), dict):
        settings["json_schema"] = json.dumps(settings["json_schema"])
    try:
        if "logit_bias" in settings:
            settings["logit_bias"] = token_biases(settings["logit_bias"])
        params = SamplingParams(**settings)
    except TypeError as exc:
        raise _api_error(f"sampling_params: {exc}") from exc
    except ValueError as exc:
        raise _api_error(f"sampling_params.{exc}") from exc
    state.check(ids, params)
    return Job(0, 0, ids, params, ticket, state.bootstrap(body, 0))


# ---- running jobs --------------------------------------------------------------------------
async def collect(chunks: AsyncIterator[Chunk], result: Result | None = None) -> Result:
    result = result or Result()
    async for chunk in chunks:
        add_chunk(result, chunk)
    return result


def add_chunk(result: Result, chunk: Chunk) -> Piece | None:
    """Add ``chunk`` to ``result``; with a reasoning or tool-call parser, what of it is reasoning,
    what answer and what tool calls (None: no parser, all of it is text)."""
    result.text += chunk.text
    result.token_ids += chunk.token_ids
    result.logprobs += chunk.logprobs
    result.finish_reason = chunk.finish_reason
    result.prompt_tokens = chunk.prompt_tokens
    result.cached_tokens = chunk.cached_tokens
    if chunk.prompt_logprobs is not None:
        result.prompt_logprobs = chunk.prompt_logprobs
    if result.parser is None and result.tools is None:
        return None
    split = Split("", chunk.text)
    if result.parser is not None:
        if result.parser.in_reasoning:  # the tokens that close the reasoning count as reasoning too
            result.reasoning_tokens += len(chunk.token_ids)
        split = result.parser.feed(chunk.text)
        if chunk.finish_reason is not None:
            rest = result.parser.finish()
            split = Split(split.reasoning + rest.reasoning, split.content + rest.content)
    piece = Piece(split.reasoning, split.content)
    if result.tools is not None:
        parsed = result.tools.feed(split.content)
        if chunk.finish_reason is not None:
            parsed += result.tools.finish()
            if result.tools.calls and chunk.finish_reason == "stop":
                result.finish_reason = "tool_calls"
        piece.content, piece.calls = parsed.content, parsed.calls
    result.reasoning += piece.reasoning
    result.content += piece.content
    return piece


def new_result(state: ServerState, body: Any) -> Result:
    """A result to collect into: split by ``--reasoning-parser`` unless the request asks not to,
    with the tool calls parsed out when the request has tools."""
    name = state.server.reasoning_parser
    tools = (ToolCallParser(state.server.tool_call_parser)
             if getattr(body, "tool_mode", "none") != "none" and state.server.tool_call_parser else None)
    return Result(parser=ReasoningParser(name) if name and getattr(body, "separate_reasoning", False) else None,
                  tools=tools)


async def run_all(state: ServerState, jobs: list[Job], body: Any = None) -> list[Result]:
    """Run every job concurrently; if one fails or the caller is cancelled, cancel the rest."""
    tasks = [asyncio.ensure_future(collect(state.client.generate(j.prompt_ids, j.params, j.ticket, j.bootstrap),
                                           new_result(state, body)))
             for j in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def merged(state: ServerState, jobs: list[Job]) -> AsyncIterator[tuple[Job, Chunk]]:
    """Chunks of all jobs as they arrive, interleaved."""
    if len(jobs) == 1:  # the common stream: straight from its generator, without a task and queue per token
        job = jobs[0]
        async for chunk in state.client.generate(job.prompt_ids, job.params, job.ticket, job.bootstrap):
            yield job, chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for chunk in state.client.generate(job.prompt_ids, job.params, job.ticket, job.bootstrap):
                queue.put_nowait((job, chunk, None))
        except Exception as exc:
            queue.put_nowait((job, None, exc))

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        remaining = len(jobs)
        while remaining:
            job, chunk, error = await queue.get()
            if error is not None:
                raise error
            remaining -= chunk.finish_reason is not None
            yield job, chunk
    finally:
        for task in tasks:
            task.cancel()


def usage_of(jobs: list[Job], results: list[Result]) -> dict[str, Any]:
    """Token counts as OpenAI reports them: each prompt once however many choices it had, with the
    part of it the prefix cache held (``prompt_tokens_details.cached_tokens``)."""
    prompts = {j.prompt_index: r for j, r in zip(jobs, results)}
    prompt = sum(r.prompt_tokens for r in prompts.values())
    completion = sum(len(r.token_ids) for r in results)
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in prompts.values())}}
    if any(r.parser is not None for r in results):
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(r.reasoning_tokens for r in results)}
    return usage


def _header(kind: str, state: ServerState, prefix: str) -> dict[str, Any]:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": state.server.served_model_name}


def _token_str(state: ServerState, token_id: int) -> str:
    return state.tokenizer.decode([token_id], skip_special_tokens=False) if state.tokenizer else str(token_id)


# ---- completions ---------------------------------------------------------------------------
def _completion_logprobs(state: ServerState, logprobs: list[TokenLogprob | None],
                         prompt_ids: list[int] = ()) -> dict[str, Any]:
    """OpenAI's legacy logprobs; an echoed prompt's first token (``None``) has no logprob."""
    ids = [prompt_ids[0] if lp is None else lp.token_id for lp in logprobs]
    return {
        "tokens": [_token_str(state, i) for i in ids],
        "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
        "top_logprobs": [None if lp is None else {_token_str(state, t): v for t, v in lp.top} for lp in logprobs],
    }


def _completion_choice(state: ServerState, body: CompletionRequest, job: Job, text: str,
                       logprobs: list[TokenLogprob | None], finish: str | None) -> dict[str, Any]:
    lp = _completion_logprobs(state, logprobs, job.prompt_ids) if body.logprobs is not None else None
    return {"index": job.index, "text": text, "logprobs": lp, "finish_reason": finish}


async def completion_response(state: ServerState, body: CompletionRequest, jobs: list[Job]) -> dict[str, Any]:
    results = [_echoed(state, body, j, r) for j, r in zip(jobs, await run_all(state, jobs))]
    choices = [_completion_choice(state, body, j, r.text, r.logprobs, r.finish_reason)
               for j, r in zip(jobs, results)]
    return {**_header("text_completion", state, "cmpl"), "choices": choices, "usage": usage_of(jobs, results)}


async def stream_completion(state: ServerState, body: CompletionRequest, jobs: list[Job]) -> AsyncIterator[dict]:
    header = _header("text_completion", state, "cmpl")
    results = [Result() for _ in jobs]
    async for job, chunk in merged(state, jobs):
        first = not results[job.index].token_ids
        add_chunk(results[job.index], chunk)
        part = Result(text=chunk.text, logprobs=chunk.logprobs, prompt_logprobs=chunk.prompt_logprobs)
        if first:  # the echoed prompt comes before the first tokens
            part = _echoed(state, body, job, part)
        elif body.echo and body.max_tokens == 0:
            continue
        choice = _completion_choice(state, body, job, part.text, part.logprobs,
                                    chunk.finish_reason and ("length" if body.echo and body.max_tokens == 0
                                                             else chunk.finish_reason))
        # an extension (vLLM's too): the ids, so a client sees progress while the text is held back
        # (an unfinished UTF-8 character, a possible stop string, a skipped special token)
        choice["token_ids"] = chunk.token_ids
        yield {**header, "choices": [choice], **_running_usage(body, jobs, results)}
    if body.stream_options and body.stream_options.include_usage:
        yield {**header, "choices": [], "usage": usage_of(jobs, results)}


# ---- chat completions ----------------------------------------------------------------------
def _chat_logprobs(state: ServerState, logprobs: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, value: float) -> dict[str, Any]:
        token = _token_str(state, token_id)
        return {"token": token, "logprob": value, "bytes": list(token.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs]}


async def chat_response(state: ServerState, body: ChatCompletionRequest, jobs: list[Job]) -> dict[str, Any]:
    results = await run_all(state, jobs, body)
    choices = [{"index": j.index, "message": _message(r),
                "logprobs": _chat_logprobs(state, r.logprobs) if body.logprobs else None,
                "finish_reason": r.finish_reason} for j, r in zip(jobs, results)]
    return {**_header("chat.completion", state, "chatcmpl"), "choices": choices, "usage": usage_of(jobs, results)}


def _message(r: Result) -> dict[str, Any]:
    if r.parser is None and r.tools is None:
        return {"role": "assistant", "content": r.text}
    message = {"role": "assistant", "content": r.content or None}
    if r.parser is not None:
        message["reasoning_content"] = r.reasoning or None
    if r.tools is not None and r.tools.calls:
        message["tool_calls"] = r.tools.calls
    return message


def _delta(chunk: Chunk, piece: Piece | None) -> dict[str, Any]:
    if piece is None:
        return {"content": chunk.text} if chunk.text or chunk.finish_reason is None else {}
    delta: dict[str, Any] = {}
    if piece.reasoning:
        delta["reasoning_content"] = piece.reasoning
    if piece.content or (not piece.reasoning and not piece.calls and chunk.finish_reason is None):
        delta["content"] = piece.content
    if piece.calls:
        delta["tool_calls"] = [c.as_openai() for c in piece.calls]
    return delta


async def stream_chat(state: ServerState, body: ChatCompletionRequest, jobs: list[Job]) -> AsyncIterator[dict]:
    header = _header("chat.completion.chunk", state, "chatcmpl")
    for job in jobs:
        yield {**header, "choices": [{"index": job.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]}
    results = [new_result(state, body) for _ in jobs]
    async for job, chunk in merged(state, jobs):
        result = results[job.index]
        delta = _delta(chunk, add_chunk(result, chunk))
        lp = _chat_logprobs(state, chunk.logprobs) if body.logprobs else None
        finish = result.finish_reason if chunk.finish_reason is not None else None  # tool_calls, if any
        yield {**header, "choices": [{"index": job.index, "delta": delta, "logprobs": lp, "finish_reason": finish}],
               **_running_usage(body, jobs, results)}
    if body.stream_options and body.stream_options.include_usage:
        yield {**header, "choices": [], "usage": usage_of(jobs, results)}


def _running_usage(body: Any, jobs: list[Job], results: list[Result]) -> dict[str, Any]:
    """``stream_options.continuous_usage_stats`` (vLLM's): the usage so far, in every chunk."""
    if body.stream_options and body.stream_options.continuous_usage_stats:
        return {"usage": usage_of(jobs, results)}
    return {}


# ---- native /generate ----------------------------------------------------------------------
def _native_body(result: Result, started: float, rid: str, with_logprobs: bool, start: int = -1) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": rid, "prompt_tokens": result.prompt_tokens,
                            "completion_tokens": len(result.token_ids),
                            "finish_reason": {"type": result.finish_reason} if result.finish_reason else None,
                            "e2e_latency": time.monotonic() - started}
    if with_logprobs:
        meta["output_token_logprobs"] = [[lp.logprob, lp.token_id] for lp in result.logprobs]
        meta["output_top_logprobs"] = [[[v, t] for t, v in lp.top] for lp in result.logprobs]
    if with_logprobs and start >= 0 and result.prompt_logprobs is not None:
        given = result.prompt_logprobs[start:]
        meta["input_token_logprobs"] = [[None, None] if lp is None else [lp.logprob, lp.token_id] for lp in given]
        meta["input_top_logprobs"] = [None if lp is None else [[v, t] for t, v in lp.top] for lp in given]
    return {"text": result.text, "output_ids": result.token_ids, "meta_info": meta}


async def native_response(state: ServerState, body: GenerateRequest, job: Job) -> dict[str, Any]:
    started = time.monotonic()
    result = await collect(state.client.generate(job.prompt_ids, job.params, job.ticket, job.bootstrap))
    return _native_body(result, started, uuid.uuid4().hex, body.return_logprob, body.logprob_start_len)


async def stream_native(state: ServerState, body: GenerateRequest, job: Job) -> AsyncIterator[dict]:
    """Like SGLang: every event carries the text and token ids so far."""
    started, rid, result = time.monotonic(), uuid.uuid4().hex, Result()
    async for chunk in state.client.generate(job.prompt_ids, job.params, job.ticket, job.bootstrap):
        add_chunk(result, chunk)
        yield _native_body(result, started, rid, body.return_logprob)
