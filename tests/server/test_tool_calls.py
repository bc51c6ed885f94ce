"""Tool calls in DeepSeek's formats: the same content and calls however the text is cut into
pieces, and the grammars of ``tool_choice`` required / named accept exactly valid calls."""

from __future__ import annotations

import itertools
import json

import pytest

from moeserve.server.tool_calls import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, ToolCallParser, call_grammar

V3_CALL = CALL_BEGIN + "function" + SEP + "{name}\n```json\n{args}\n```" + CALL_END
V31_CALL = CALL_BEGIN + "{name}" + SEP + "{args}" + CALL_END
DSML = ('<｜DSML｜function_calls>\n<｜DSML｜invoke name="{name}">\n<｜DSML｜parameter name="city" string="true">'
        'Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
        '</｜DSML｜invoke>\n</｜DSML｜function_calls>')
CALLS = [("get_weather", '{"city": "Paris", "days": 3}'), ("add", '{"a": 1, "b": 2}')]


def _v3(calls, call=V3_CALL):
    return CALLS_BEGIN + "".join(call.format(name=n, args=a) for n, a in calls) + CALLS_END


CASES = [  # parser, text -> content, [(name, arguments)]
    ("deepseekv3", "Let me check. " + _v3(CALLS), "Let me check. ", CALLS),
    ("deepseekv3", _v3(CALLS[:1]), "", CALLS[:1]),
    ("deepseekv3", "no call here, not even <｜tool", "no call here, not even <｜tool", []),
    ("deepseekv31", "ok" + _v3(CALLS, V31_CALL), "ok", CALLS),
    ("deepseekv32", "Sure." + DSML.format(name="get_weather"), "Sure.", [("get_weather", '{"city": "Paris", "days": 3}')]),
]


def _run(parser: str, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    p = ToolCallParser(parser)
    content, calls = "", {}
    for piece in [*pieces, None]:
        out = p.feed(piece) if piece is not None else p.finish()
        content += out.content
        for d in out.calls:
            if d.id is not None:
                assert d.index not in calls and d.id.startswith("call_")
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    assert [[c["function"]["name"], c["function"]["arguments"]] for c in p.calls] == list(calls.values())
    return content, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_every_way_of_cutting_the_text_gives_the_same_calls(parser, text, content, calls):
    assert _run(parser, [text]) == (content, calls)
    assert _run(parser, list(text)) == (content, calls)  # a character at a time
    step = max(1, len(text) // 12)
    for a, b in itertools.combinations(range(1, len(text), step), 2):
        assert _run(parser, [text[:a], text[a:b], text[b:]]) == (content, calls), (a, b)


def test_arguments_stream_before_the_call_ends():
    p = ToolCallParser("deepseekv3")
    out = p.feed(CALLS_BEGIN + V3_CALL.format(name="f", args='{"x": 1').split(CALL_END)[0].rsplit("\n```", 1)[0])
    assert [(d.name, d.arguments) for d in out.calls] == [("f", ""), (None, '{"x": 1')]


def test_an_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="tool_call_parser"):
        ToolCallParser("gpt")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
             "required": ["city", "days"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]


@pytest.mark.parametrize("parser, call", [("deepseekv3", V3_CALL), ("deepseekv31", V31_CALL)])
def test_the_required_and_named_grammars_accept_exactly_valid_calls(parser, call):
    xgr_testing = pytest.importorskip("xgrammar.testing")
    from xgrammar import Grammar

    required = Grammar.from_ebnf(call_grammar(parser, TOOLS, several=True))
    one = Grammar.from_ebnf(call_grammar(parser, TOOLS))
    named = Grammar.from_ebnf(call_grammar(parser, TOOLS, only="add"))
    accepts = xgr_testing._is_grammar_accept_string
    compact = [(n, json.dumps(json.loads(a))) for n, a in CALLS]
    assert accepts(required, _v3(compact, call)) and accepts(required, _v3(compact[1:], call))
    assert accepts(one, _v3(compact[:1], call)) and not accepts(one, _v3(compact, call))
    assert accepts(named, _v3(compact[1:], call)) and not accepts(named, _v3(compact[:1], call))
    assert not accepts(required, _v3([("add", '{"a": 1}')], call))  # b is required
    assert not accepts(required, _v3([("sub", '{"a": 1, "b": 2}')], call))  # no such tool
    assert not accepts(required, "plain text")
    with pytest.raises(ValueError, match="sub"):
        call_grammar(parser, TOOLS, only="sub")
