"""Constrained decoding on the offline engine, with each grammar library: outputs match their
grammar whatever the draw, and requests without one in the same batch are untouched."""

from __future__ import annotations

import json
import re

import pytest

from moeserve import LLM, SamplingParams
from moeserve.config import GRAMMAR_BACKENDS
from moeserve.models.tiny import make_tiny_model

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                           "year": {"type": "integer", "minimum": 1000, "maximum": 2999},
                                           "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"},
                                                    "maxItems": 2}},
          "required": ["city", "year", "tags"], "additionalProperties": False}
REGEX = r"(yes|no), because [a-z]{1,8}\."
EBNF = 'root ::= "total: " digit digit? " items"\ndigit ::= [0-9]'
PLAIN = ["What is the capital of France?", "Count to five."]


def _valid_json(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"city", "year", "tags"} and value["city"] in ("Paris", "Rome", "Oslo")
            and 1000 <= value["year"] <= 2999 and all(re.fullmatch("[a-z]{1,5}", t) for t in value["tags"]))


CHECKS = {"json_schema": (json.dumps(SCHEMA), _valid_json),
          "regex": (REGEX, lambda t: re.fullmatch(REGEX, t) is not None),
          "ebnf": (EBNF, lambda t: re.fullmatch(r"total: [0-9]{1,2} items", t) is not None)}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("grammar") / "v3"), preset="v3", seed=4, initializer_range=0.1)


@pytest.fixture(scope="module", params=GRAMMAR_BACKENDS)
def llm(request, model_path):
    with LLM(model_path, grammar_backend=request.param) as engine:
        yield engine


def test_outputs_match_their_grammar_and_plain_requests_are_untouched(llm):
    plain = SamplingParams(max_tokens=12, temperature=0)
    alone = [o.token_ids for o in llm.generate(PLAIN, plain, use_tqdm=False)]
    prompts, params = list(PLAIN), [plain] * len(PLAIN)
    for field, (text, _) in CHECKS.items():
        for seed in range(2):
            prompts.append(f"Answer {seed}:")
            params.append(SamplingParams(max_tokens=60, temperature=1.0, seed=seed, **{field: text}))
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in out[:len(PLAIN)]] == alone
    for o, p in zip(out[len(PLAIN):], params[len(PLAIN):]):
        field = next(f for f in CHECKS if getattr(p, f) is not None)
        assert o.finish_reason == "stop" and CHECKS[field][1](o.text), (field, o.text)


def test_a_grammar_that_does_not_compile_is_refused_by_name(llm):
    for field, text in [("regex", "(unclosed"), ("json_schema", '{"type": "no-such-type"}'), ("ebnf", 'root ::= "a" (')]:
        with pytest.raises(ValueError, match=field):
            llm.generate(["x"], SamplingParams(max_tokens=4, **{field: text}), use_tqdm=False)
    assert llm.generate(["x"], SamplingParams(max_tokens=2, regex="[ab]+"), use_tqdm=False)[0].text
