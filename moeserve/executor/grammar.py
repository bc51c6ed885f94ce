"""Constrained decoding: a request's output held to a JSON schema, a regular expression or an EBNF
grammar, through a maintained grammar library (xgrammar by default, llguidance as the other
choice: ``--grammar-backend``).

A request asks by one of ``SamplingParams``' grammar fields (``json_schema``, ``regex``, ``ebnf``;
the OpenAI ``response_format`` and SGLang's ``/generate`` fields map to them). On arrival the rank
compiles the grammar against the tokenizer's vocabulary (compiled grammars are cached by text)
and gives the request a ``Constraint``: the grammar's matcher and how many of the request's
output tokens it has taken. Each step, before the sampler draws, every constrained row's matcher
writes the bitmask of the tokens it allows; the mask is applied on the logits' device. The bitmask
is filled on the host after the forward pass has been queued and before anything waits on it,
so on a GPU it is computed while the forward pass runs. After the draw the matcher takes the
token; a grammar that is complete allows only the stop tokens, and a matcher that has taken one
ends the request (``FinishReason.STOP``).

The API process checks a grammar before it answers (``check_grammar``: a schema, regex or EBNF
that does not parse is a 400 naming its field); it needs no tokenizer for that.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable
from typing import Any

import torch

from moeserve.config import GRAMMAR_BACKENDS

logger = logging.getLogger(__name__)

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")
_COMPILED_CACHE = 256  # compiled grammars kept per rank


def grammar_of(params: Any) -> tuple[str, str] | None:
    """``(field, text)`` of the grammar a request asks for, or None."""
    for name in GRAMMAR_FIELDS:
        value = getattr(params, name, None)
        if value is not None:
            return name, value
    return None


def check_grammar(params: Any, backend: str = "xgrammar") -> None:
    """Raise ValueError naming the field when the request's grammar does not parse (or asks for
    more than one grammar)."""
    given = [name for name in GRAMMAR_FIELDS if getattr(params, name, None) is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of {', '.join(GRAMMAR_FIELDS)}; got {', '.join(given)}")
    if not given:
        return
    name = given[0]
    text = getattr(params, name)
    if name == "json_schema":
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from exc
    try:
        _parse(backend, name, text)
    except Exception as exc:  # the libraries raise RuntimeError (xgrammar) or ValueError
        raise ValueError(f"{name} could not be compiled: {_said(exc)}") from exc


def _said(exc: Exception) -> str:
    """A library's error on one line (xgrammar's carry a C++ source position first)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.split(" is false: ", 1)[-1])
    return text[:300]


@functools.lru_cache(maxsize=_COMPILED_CACHE)
def _parse(backend: str, name: str, text: str) -> Any:
    """The grammar as the backend's object, parsed without a vocabulary (cached)."""
    if backend == "xgrammar":
        import xgrammar as xgr

        if name == "json_schema":
            return xgr.Grammar.from_json_schema(text, any_whitespace=False)
        if name == "regex":
            return xgr.Grammar.from_regex(text)
        return xgr.Grammar.from_ebnf(text)
    import llguidance

    grammar = _llguidance_grammar(name, text)
    verdict = llguidance.LLMatcher.validate_grammar(grammar)
    message = verdict[1] if isinstance(verdict, tuple) and not verdict[0] else verdict
    if isinstance(message, str) and message:
        raise ValueError(message)
    return grammar


def _llguidance_grammar(name: str, text: str) -> str:
    """llguidance's grammar text; JSON as xgrammar writes it here (``", "`` and ``": "``, no other
    whitespace), so a free model cannot spend its tokens on blank space."""
    import llguidance

    if name == "json_schema":
        return llguidance.JsonCompiler(separators=(", ", ": "), whitespace_flexible=False).compile(text)
    return llguidance.grammar_from({"regex": "regex", "ebnf": "gbnf"}[name], text)


class Constraint:
    """One request's matcher and how many of its output tokens it has taken."""

    def __init__(self, matcher: Any, backend: str) -> None:
        self.matcher, self.backend = matcher, backend
        self.taken = 0
        self.refused: int | None = None  # a token the grammar did not allow (a bug, or a hostile peer)

    def catch_up(self, output_ids: list[int]) -> None:
        """Take the output tokens not taken yet (after a draw, or a first token sampled by a
        prefill server)."""
        for token in output_ids[self.taken:]:
            if self.terminated:
                break
            if not (self.matcher.accept_token(token) if self.backend == "xgrammar"
                    else self.matcher.consume_token(token)):
                self.refused = token
                break
            self.taken += 1
        self.taken = len(output_ids)

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated() if self.backend == "xgrammar" else self.matcher.is_stopped())


class GrammarBackend:
    """Compiles grammars against one tokenizer and vocabulary; one per rank."""

    def __init__(self, backend: str, hf_tokenizer: Any, vocab_size: int, stop_ids: Iterable[int]) -> None:
        if backend not in GRAMMAR_BACKENDS:
            raise ValueError(f"grammar_backend must be one of {GRAMMAR_BACKENDS}, got {backend!r}")
        self.name, self.vocab_size = backend, vocab_size
        self._hf, self._stop_ids = hf_tokenizer, sorted(set(stop_ids))
        self._compile = functools.lru_cache(maxsize=_COMPILED_CACHE)(self._compile_uncached)

    @functools.cached_property
    def _library(self) -> Any:
        """The compiler (xgrammar) or tokenizer (llguidance), built at the first grammar."""
        if self.name == "xgrammar":
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._hf, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._stop_ids or None)
            return xgr.GrammarCompiler(info, cache_enabled=True)
        import llguidance.hf

        return llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self._stop_ids[0]
                                            if self._stop_ids else None)

    def _compile_uncached(self, name: str, text: str) -> Any:
        if self.name == "xgrammar":
            if name == "json_schema":
                return self._library.compile_json_schema(text, any_whitespace=False)
            if name == "regex":
                return self._library.compile_regex(text)
            return self._library.compile_grammar(text)
        return _llguidance_grammar(name, text)

    def constraint(self, params: Any) -> Constraint | None:
        """A new matcher for the request's grammar (None: it has none); raises ValueError naming
        the field when the grammar does not compile."""
        grammar = grammar_of(params)
        if grammar is None:
            return None
        try:
            compiled = self._compile(*grammar)
        except Exception as exc:
            raise ValueError(f"{grammar[0]} could not be compiled: {_said(exc)}") from exc
        if self.name == "xgrammar":
            import xgrammar as xgr

            return Constraint(xgr.GrammarMatcher(compiled), self.name)
        import llguidance

        return Constraint(llguidance.LLMatcher(self._library, compiled), self.name)


@functools.cache
def _xgrammar_batch() -> Any:
    """xgrammar's filler of many matchers' bitmasks at once, on its own threads."""
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher(max_threads="auto")


def apply_grammars(logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
    """``logits [B, V]`` float32 with every token a row's grammar forbids at -inf (in place; the
    rows without a grammar, or whose grammar is done, untouched)."""
    rows = [i for i, c in enumerate(constraints) if c is not None and not c.terminated]
    if not rows:
        return logits
    width = logits.shape[1]
    for backend in {constraints[i].backend for i in rows}:
        if backend == "xgrammar":
            import xgrammar as xgr

            mine = [i for i in rows if constraints[i].backend == backend]
            bitmask = xgr.allocate_token_bitmask(len(constraints), width)
            _xgrammar_batch().batch_fill_next_token_bitmask([constraints[i].matcher for i in mine], bitmask,
                                                            indices=mine)
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=mine)
        else:
            import llguidance.torch as llg_torch

            bitmask = llg_torch.allocate_token_bitmask(len(constraints), width)
            bitmask.fill_(-1)  # rows without a grammar allow everything
            for i in rows:
                if constraints[i].backend == backend:
                    llg_torch.fill_next_token_bitmask(constraints[i].matcher, bitmask, i)
            llg_torch.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
    return logits
