"""OpenAI's Responses API (``/v1/responses``) over the chat path: a request becomes a chat
completion (its ``instructions``, earlier stored turns and ``input`` items become messages, its
flat function tools the chat tools, ``text.format`` the response format), runs as one, and its
result is written back as output items: a message with its text, one item per function call, the
reasoning when a reasoning parser split it off. Streamed, the same as typed events. Stored
responses (``store``, on by default) are kept, the newest ``STORED`` of them, for
``GET /v1/responses/{id}`` and ``previous_response_id``, in a ``ResponseStore`` that all API
workers of a server share.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from moeserve.server import openai_serving as oai
from moeserve.server.protocol import ChatCompletionRequest, check_fields

if TYPE_CHECKING:
    from moeserve.server.api import ServerState

STORED = 1024  # responses kept for retrieval and previous_response_id


class ResponseStore:
    """Stored responses, the newest ``limit``, as JSON in SQLite: in memory for one API process,
    or in a file (``path``) that every API worker of a server opens, so a response stored by one
    worker is found by the next request, whichever worker takes it. Each row is small and written
    once: a write or a read is well under a millisecond."""

    def __init__(self, path: str = ":memory:", limit: int = STORED) -> None:
        self.limit = limit
        self._db = sqlite3.connect(path, timeout=10, isolation_level=None, check_same_thread=False)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL" if path != ":memory:" else "PRAGMA journal_mode=MEMORY")
            self._db.execute("CREATE TABLE IF NOT EXISTS responses "
                             "(n INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE, body TEXT)")

    def get(self, response_id: str) -> dict[str, Any] | None:
        with self._lock:
            row = self._db.execute("SELECT body FROM responses WHERE id = ?", (response_id,)).fetchone()
        return None if row is None else json.loads(row[0])

    def put(self, response_id: str, value: dict[str, Any]) -> None:
        """Store ``value``; the oldest rows past ``limit`` go."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO responses (id, body) VALUES (?, ?)",
                             (response_id, json.dumps(value)))
            self._db.execute("DELETE FROM responses WHERE n <= (SELECT MAX(n) FROM responses) - ?", (self.limit,))

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _check_fields(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in ("reasoning", "background", "prompt", "conversation"):
                if data.get(name) not in (None, {}):
                    raise ValueError(f"{name} is not supported by this server (leave it out)")
        return check_fields(cls, data)

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if isinstance(part, dict))


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: messages as they are, a run of ``function_call`` items as one
    assistant turn with those calls, each ``function_call_output`` as a tool turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item["role"], "content": _text_of(item.get("content"))})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(item.get("output"))})
        elif kind == "reasoning":
            continue  # earlier reasoning is not sent back to the model (DeepSeek's rule)
        else:
            raise ValueError(f"input items of type {kind!r} are not supported")
    return messages


def chat_request(state: ServerState, body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion a Responses request amounts to; raises ValueError naming a bad field."""
    messages = []
    if body.previous_response_id is not None:
        stored = state.responses.get(body.previous_response_id)
        if stored is None:
            raise ValueError(f"previous_response_id {body.previous_response_id!r} is not stored here")
        messages += stored["conversation"]
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    messages += input_messages(body.input)
    fields: dict[str, Any] = {"model": body.model, "messages": messages, "temperature": body.temperature,
                              "top_p": body.top_p, "seed": body.seed, "max_tokens": body.max_output_tokens,
                              "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")
                                                             if k in t}}
                           for t in body.tools if t.get("type") == "function"]
        if len(fields["tools"]) < len(body.tools):
            raise ValueError("tools: only function tools are supported by this server")
    if isinstance(body.tool_choice, dict):
        fields["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.get("name", "")}}
    elif body.tool_choice is not None:
        fields["tool_choice"] = body.tool_choice
    fmt = (body.text or {}).get("format")
    if fmt and fmt.get("type") == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema"), "strict": fmt.get("strict")}}
    elif fmt:
        fields["response_format"] = {"type": fmt.get("type")}
    return ChatCompletionRequest.model_validate(fields)


def _shell(state: ServerState, body: ResponsesRequest, rid: str, status: str) -> dict[str, Any]:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "error": None,
            "incomplete_details": None, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": state.server.served_model_name, "output": [], "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "temperature": body.temperature,
            "top_p": body.top_p, "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}}, "store": body.store, "metadata": body.metadata or {},
            "usage": None}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _finish(state: ServerState, body: ResponsesRequest, chat: ChatCompletionRequest, response: dict[str, Any],
            result: oai.Result, jobs: list[oai.Job], items: list[dict[str, Any]]) -> dict[str, Any]:
    usage = oai.usage_of(jobs, [result])
    response.update(output=items, usage={
        "input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
        "total_tokens": usage["total_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens}})
    if result.finish_reason == "length":
        response.update(status="incomplete", incomplete_details={"reason": "max_output_tokens"})
    else:
        response["status"] = "completed"
    if body.store:
        said: dict[str, Any] = {"role": "assistant", "content": _content(result)}
        if result.tools is not None and result.tools.calls:
            said["tool_calls"] = result.tools.calls
        state.responses.put(response["id"], {"response": response, "conversation": [*chat_messages(chat), said]})
    return response


def chat_messages(chat: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [m.for_template() for m in chat.messages]


def _content(result: oai.Result) -> str:
    return result.text if result.parser is None and result.tools is None else result.content


def _items(result: oai.Result) -> list[dict[str, Any]]:
    items = []
    if result.parser is not None and result.reasoning:
        items.append({"type": "reasoning", "id": _item_id("rs"), "summary": [],
                      "content": [{"type": "reasoning_text", "text": result.reasoning}]})
    text = _content(result)
    if text or not (result.tools and result.tools.calls):
        items.append(_message(_item_id("msg"), text, "completed"))
    for call in result.tools.calls if result.tools is not None else []:
        items.append({"type": "function_call", "id": _item_id("fc"), "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


async def create(state: ServerState, body: ResponsesRequest, chat: ChatCompletionRequest,
                 jobs: list[oai.Job]) -> dict[str, Any]:
    result = (await oai.run_all(state, jobs, chat))[0]
    response = _shell(state, body, _item_id("resp"), "in_progress")
    return _finish(state, body, chat, response, result, jobs, _items(result))


async def stream(state: ServerState, body: ResponsesRequest, chat: ChatCompletionRequest,
                 jobs: list[oai.Job]) -> AsyncIterator[dict]:
    """The typed events of one response: created, then per output item its added / delta / done
    events as the text and calls arrive, then completed (or incomplete) with the whole response."""
    response = _shell(state, body, _item_id("resp"), "in_progress")
    seq = iter(range(1 << 62))
    event = lambda kind, **fields: {"type": kind, "sequence_number": next(seq), **fields}
    yield event("response.created", response=dict(response))
    yield event("response.in_progress", response=dict(response))
    result, items = oai.new_result(state, chat), []
    message: dict[str, Any] | None = None  # the open message item and its text so far
    calls: dict[int, dict[str, Any]] = {}  # call index -> its open item
    async for _, chunk in oai.merged(state, jobs):
        piece = oai.add_chunk(result, chunk)
        text = chunk.text if piece is None else piece.content
        if text:
            if message is None:
                message = _message(_item_id("msg"), "", "in_progress")
                items.append(message)
                yield event("response.output_item.added", output_index=len(items) - 1, item=dict(message))
                yield event("response.content_part.added", item_id=message["id"], output_index=len(items) - 1,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                message["text"] = ""
            message["text"] += text
            yield event("response.output_text.delta", item_id=message["id"], output_index=items.index(message),
                        content_index=0, delta=text, logprobs=[])
        for delta in piece.calls if piece is not None else []:
            if delta.id is not None:
                item = {"type": "function_call", "id": _item_id("fc"), "call_id": delta.id, "name": delta.name,
                        "arguments": "", "status": "in_progress"}
                items.append(item)
                calls[delta.index] = item
                yield event("response.output_item.added", output_index=len(items) - 1, item=dict(item))
            item = calls[delta.index]
            if delta.arguments:
                item["arguments"] += delta.arguments
                yield event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=items.index(item), delta=delta.arguments)
    for index, item in enumerate(items):
        if item is message:
            text = item.pop("text")
            yield event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                        text=text, logprobs=[])
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                        part=part)
            item.update(status="completed", content=[part])
        else:
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        name=item["name"], arguments=item["arguments"])
            item["status"] = "completed"
        yield event("response.output_item.done", output_index=index, item=item)
    if result.parser is not None and result.reasoning:
        items.insert(0, _items(result)[0])
    if not items:
        items.append(_message(_item_id("msg"), "", "completed"))
    final = _finish(state, body, chat, response, result, jobs, items)
    yield event("response.completed" if final["status"] == "completed" else "response.incomplete", response=final)


def retrieve(state: ServerState, response_id: str) -> dict[str, Any] | None:
    stored = state.responses.get(response_id)
    return None if stored is None else stored["response"]
