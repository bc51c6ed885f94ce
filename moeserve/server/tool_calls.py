"""Tool calls in DeepSeek's output formats (``--tool-call-parser``), parsed as the text streams in,
and the grammars that make ``tool_choice`` ``required`` or a named function a valid call.

``deepseekv3`` (V3, R1)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

``deepseekv31`` (V3.1): ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGUMENTS<｜tool▁call▁end｜>`` inside the
same outer tags. ``deepseekv32`` (V3.2, DSML): ``<｜DSML｜function_calls>`` holding
``<｜DSML｜invoke name="NAME">`` with one ``<｜DSML｜parameter name="P" string="true|false">VALUE
</｜DSML｜parameter>`` per argument (``string="false"``: the value is JSON), then
``</｜DSML｜invoke>`` and ``</｜DSML｜function_calls>``.

``ToolCallParser.feed`` takes text as it arrives and returns the content and the tool-call deltas
it settles: a call's id and name once the name is whole, then its arguments as they arrive (V3.2:
each call whole, once its invoke closes). Text that may be the start of a tag is held back until
it is settled, so the deltas do not depend on how the text was cut.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("deepseekv3", "deepseekv31", "deepseekv32")

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
V3_ARGS_BEGIN, V3_ARGS_END = "\n```json\n", "\n```"
DSML_BEGIN, DSML_END = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"
DSML_INVOKE_END = "</｜DSML｜invoke>"
_DSML_INVOKE = re.compile(r'<｜DSML｜invoke name="([^"]*)">(.*?)</｜DSML｜invoke>', re.DOTALL)
_DSML_PARAM = re.compile(r'<｜DSML｜parameter name="([^"]*)"(?: string="(true|false)")?>(.*?)</｜DSML｜parameter>', re.DOTALL)


@dataclass
class ToolCallDelta:
    """A piece of call ``index``: its ``id`` and ``name`` come once, first; ``arguments`` grow."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def as_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index, "function": {"arguments": self.arguments}}
        if self.id is not None:
            out.update(id=self.id, type="function")
            out["function"]["name"] = self.name
        return out


@dataclass
class Parsed:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: Parsed) -> Parsed:
        self.content += other.content
        self.calls += other.calls
        return self


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    """One choice's output: content apart from tool calls, as the text arrives."""

    def __init__(self, name: str) -> None:
        if name not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {name!r}")
        self.name = name
        self._begin, self._end = (DSML_BEGIN, DSML_END) if name == "deepseekv32" else (CALLS_BEGIN, CALLS_END)
        self._buf = ""
        self._state = "content"  # content | between | head | args | after
        self._calls = 0
        self.calls: list[dict[str, Any]] = []  # every call so far, OpenAI-shaped

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        while self._step(out):
            pass
        self._record(out.calls)
        return out

    def finish(self) -> Parsed:
        """The text held back, as it stands: content, or the rest of an unfinished call's arguments."""
        out = Parsed()
        if self._state in ("content", "after"):
            out.content, self._buf = self._buf, ""
        elif self._state == "args" and self.name != "deepseekv32":
            out.calls.append(ToolCallDelta(self._calls - 1, arguments=self._buf))
            self._buf = ""
        self._record(out.calls)
        return out

    def _record(self, deltas: list[ToolCallDelta]) -> None:
        for d in deltas:
            if d.id is not None:
                self.calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
            self.calls[d.index]["function"]["arguments"] += d.arguments

    def _step(self, out: Parsed) -> bool:
        """Settle what the buffer allows in the current state; True if the state moved on."""
        buf = self._buf
        if self._state in ("content", "after"):
            at = buf.find(self._begin) if self._state == "content" else -1
            if at < 0:
                keep = _held_back(buf, self._begin) if self._state == "content" else 0
                out.content += buf[:len(buf) - keep]
                self._buf = buf[len(buf) - keep:]
                return False
            out.content += buf[:at]
            self._buf, self._state = buf[at + len(self._begin):], "between"
            return True
        if self.name == "deepseekv32":
            return self._step_dsml(out)
        if self._state == "between":
            stripped = buf.lstrip()
            for tag, state in ((CALL_BEGIN, "head"), (self._end, "after")):
                if stripped.startswith(tag):
                    self._buf, self._state = stripped[len(tag):], state
                    return True
            if stripped and not (CALL_BEGIN.startswith(stripped) or self._end.startswith(stripped)):
                self._state = "after"  # not a call after all: the rest is content
                return True
            return False
        if self._state == "head":
            name = self._head_name(buf)
            if name is None:
                return False
            self._calls += 1
            out.calls.append(ToolCallDelta(self._calls - 1, new_call_id(), name))
            self._state = "args"
            return True
        # args
        end = V3_ARGS_END + CALL_END if self.name == "deepseekv3" else CALL_END
        at = buf.find(end)
        if at < 0:
            keep = _held_back(buf, end)
            if len(buf) > keep:
                out.calls.append(ToolCallDelta(self._calls - 1, arguments=buf[:len(buf) - keep]))
            self._buf = buf[len(buf) - keep:]
            return False
        if at:
            out.calls.append(ToolCallDelta(self._calls - 1, arguments=buf[:at]))
        self._buf, self._state = buf[at + len(end):], "between"
        return True

    def _head_name(self, buf: str) -> str | None:
        """The call's name once its head is whole (the buffer then starts at its arguments)."""
        if self.name == "deepseekv3":  # function<｜tool▁sep｜>NAME\n```json\n
            at = buf.find(V3_ARGS_BEGIN)
            if at < 0:
                return None
            head, self._buf = buf[:at], buf[at + len(V3_ARGS_BEGIN):]
            return head.split(SEP, 1)[-1].strip()
        at = buf.find(SEP)  # NAME<｜tool▁sep｜>
        if at < 0:
            return None
        self._buf = buf[at + len(SEP):]
        return buf[:at].strip()

    def _step_dsml(self, out: Parsed) -> bool:
        buf = self._buf
        stripped = buf.lstrip()
        if stripped.startswith(self._end):
            self._buf, self._state = stripped[len(self._end):], "after"
            return True
        at = buf.find(DSML_INVOKE_END)
        if at < 0:
            if stripped and not stripped.startswith("<") and not self._end.startswith(stripped[:len(self._end)]):
                self._state = "after"
                return True
            return False
        match = _DSML_INVOKE.search(buf[:at + len(DSML_INVOKE_END)])
        self._buf = buf[at + len(DSML_INVOKE_END):]
        if match is None:
            return True
        args = {}
        for key, is_string, value in _DSML_PARAM.findall(match.group(2)):
            if is_string == "false":
                try:
                    args[key] = json.loads(value)
                    continue
                except json.JSONDecodeError:
                    pass
            args[key] = value
        self._calls += 1
        out.calls.append(ToolCallDelta(self._calls - 1, new_call_id(), match.group(1), json.dumps(args)))
        return True


# ---- tool_choice required / named: a grammar of a valid call ---------------------------------
def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # an EBNF string: quotes and escapes as JSON's


def call_grammar(parser: str, tools: list[dict[str, Any]], only: str | None = None, several: bool = False) -> str:
    """An EBNF grammar (xgrammar's dialect) of one call in ``parser``'s format (one or more with
    ``several``), of the function ``only`` when given, its arguments held to the function's JSON
    schema."""
    import xgrammar as xgr

    functions = [t["function"] for t in tools if only is None or t["function"]["name"] == only]
    if not functions:
        raise ValueError(f"tool_choice names {only!r}, which is not among the tools")
    rules, alternatives = [], []
    for i, fn in enumerate(functions):
        schema = fn.get("parameters") or {"type": "object"}
        body = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
        rules.append(_prefixed(body.strip(), f"t{i}_"))
        name = fn["name"]
        if parser == "deepseekv3":
            alternatives.append(f'{_literal("function" + SEP + name + V3_ARGS_BEGIN)} t{i}_root {_literal(V3_ARGS_END)}')
        elif parser == "deepseekv31":
            alternatives.append(f"{_literal(name + SEP)} t{i}_root")
        else:
            raise ValueError(f"tool_choice required or named is not supported with --tool-call-parser {parser}")
    call = f"call ::= {_literal(CALL_BEGIN)} ({' | '.join(alternatives)}) {_literal(CALL_END)}"
    calls = "call+" if several else "call"
    return "\n".join([f"root ::= {_literal(CALLS_BEGIN)} {calls} {_literal(CALLS_END)}", call, *rules])


_EBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z_][\w]*|.', re.DOTALL)


def _prefixed(ebnf: str, prefix: str) -> str:
    """``ebnf`` with every rule renamed ``prefix + name`` (not inside strings or character classes),
    so several grammars' rules can share one grammar."""
    names = set(re.findall(r"^([A-Za-z_]\w*) ::=", ebnf, re.MULTILINE))
    return "".join(prefix + t if t in names else t for t in _EBNF_TOKEN.findall(ebnf))
