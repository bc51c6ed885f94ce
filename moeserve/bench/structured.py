"""Decode steps with a share of the batch held to a JSON schema (``bench one-batch
--json-schema-share``): what constrained decoding costs the engine's step.

Every step goes through the engine's ``Sampler`` as the scheduler calls it: the forward pass is
queued, each constrained row's xgrammar matcher fills its bitmask on the host while the device
runs, the masks are applied on the device, the greedy tokens come back and each matcher takes its
row's token. A row whose JSON is complete starts another object (its matcher is reset), so the
share stays constrained for the whole pass. Rows are constrained from their first decode step
(the prefill's token is free).

The matchers run over a synthetic byte-level vocabulary of the model's size (a ``--preset`` has
random weights and no tokenizer): the 256 bytes, then pieces of words, numbers and JSON
punctuation, with and without a leading space, as a BPE vocabulary holds them. The mask's cost
depends on the vocabulary; a released tokenizer's figure may differ.
"""

from __future__ import annotations

import json
import random
import string

import torch

from moeserve.core import Req
from moeserve.executor.grammar import Constraint
from moeserve.executor.sampler import Sampler, SamplingInfo

# a list of records: long-lived (arrays and free strings), every JSON value kind inside
SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "items": {"type": "array", "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "score": {"type": "number"},
                           "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
            "required": ["name", "score", "tags", "ok"]}},
        "summary": {"type": "string"},
    },
    "required": ["items", "summary"],
})

_PUNCT = ['{"', '"}', '":', '",', '", "', '": "', "[", "]", "{", "}", ",", ":", '"', "[{", "}]", "},", "],", ".",
          "-", "true", "false", "null"]


def synthetic_vocab(size: int, seed: int = 0) -> list[bytes]:
    """``size`` distinct byte strings: the 256 bytes, then word and number pieces and JSON
    punctuation, some after a space; the last entry is the stop token."""
    rng = random.Random(seed)
    vocab, seen = [bytes([b]) for b in range(256)], set()
    seen.update(vocab)
    letters = string.ascii_letters
    while len(vocab) < size - 1:
        kind = rng.random()
        if kind < 0.7:
            piece = "".join(rng.choice(string.ascii_lowercase if i else letters) for i in range(rng.randint(2, 9)))
        elif kind < 0.85:
            piece = "".join(rng.choice(string.digits) for _ in range(rng.randint(1, 4)))
        else:
            piece = rng.choice(_PUNCT) + rng.choice(["", "", " ", "\n", rng.choice(letters)])
        token = ((" " if rng.random() < 0.5 else "") + piece).encode()
        if token not in seen:
            seen.add(token)
            vocab.append(token)
    return vocab + [b"<|end|>"]


def json_constraints(vocab_size: int, batch_size: int, share: float, seed: int = 0) -> list[Constraint | None]:
    """Matchers of ``SCHEMA`` for the first ``round(share * batch_size)`` rows, None for the rest."""
    import xgrammar as xgr

    if not 0.0 <= share <= 1.0:
        raise ValueError(f"json_schema_share must be in [0, 1], got {share}")
    n = round(share * batch_size)
    if n == 0:
        return [None] * batch_size
    info = xgr.TokenizerInfo(synthetic_vocab(vocab_size, seed), vocab_type=xgr.VocabType.RAW,
                             vocab_size=vocab_size, stop_token_ids=[vocab_size - 1])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(SCHEMA, any_whitespace=False)
    return [Constraint(xgr.GrammarMatcher(compiled), "xgrammar") for _ in range(n)] + [None] * (batch_size - n)


def sample_step(logits: torch.Tensor, reqs: list[Req], constraints: list[Constraint | None],
                sampler: Sampler) -> list[int]:
    """The greedy tokens of a decode step's ``logits`` through the sampler, each constrained row
    masked by its matcher; the matchers take their tokens (a complete one starts again)."""
    infos = [SamplingInfo(r.params, None, [], r.output_ids, constraint=c) for r, c in zip(reqs, constraints)]
    tokens = sampler.sample(logits, infos).next_ids
    for req, token, c in zip(reqs, tokens, constraints):
        if c is None:
            continue
        c.taken = max(c.taken, len(req.output_ids))  # the prefill's token: before the grammar
        c.catch_up(req.output_ids + [token])
        if c.refused is not None:
            raise RuntimeError(f"the grammar refused token {c.refused} it had allowed")
        if c.terminated:
            c.matcher.reset()
    return tokens
