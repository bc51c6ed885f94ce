"""The tokenizer wrapper against transformers' own tokenizer, on the tiny byte-level BPE."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from moeserve.models.tiny import ASSISTANT, BOS, USER, write_tiny_tokenizer
from moeserve.models.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["héllo → 世界", "the end", "emoji 🙂 and 中文 mixed with ascii", "ä¸ edge: 世世世"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tok"))
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir: str) -> Tokenizer:
    tokenizer = load_tokenizer(tok_dir)
    assert tokenizer is not None
    return tokenizer


def test_no_tokenizer_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert load_tokenizer(str(tmp_path)) is None


def test_matches_transformers(tok: Tokenizer, tok_dir: str) -> None:
    ref = transformers.AutoTokenizer.from_pretrained(tok_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text) and ids[0] == ref.bos_token_id
        assert tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False) == BOS + text
    assert tok.eos_token_id == ref.eos_token_id
    assert tok.vocab_size == len(ref) > ref.vocab_size  # User/Assistant are added tokens


def test_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": "héllo"}]
    ids = tok.apply_chat_template(messages)
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=False) == f"{BOS}sys{USER}héllo{ASSISTANT}"
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert tok.decode(no_prompt, skip_special_tokens=False) == f"{BOS}sys{USER}héllo"


def test_missing_chat_template(tmp_path: Path) -> None:
    write_tiny_tokenizer(str(tmp_path))
    config_path = os.path.join(tmp_path, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    del config["chat_template"]
    with open(config_path, "w") as f:
        json.dump(config, f)
    tok = load_tokenizer(str(tmp_path))
    assert tok is not None
    with pytest.raises(ValueError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_incremental_detokenize_equals_full_decode(tok: Tokenizer, text: str, chunk: int) -> None:
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi 世界"}])
    output = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.step(output[i:i + chunk]) for i in range(0, len(output), chunk)]
    assert "".join(deltas) + detok.flush() == tok.decode(output) == text
    assert detok.output_text == text
    # Nothing was held back to the end, and no delta carried half a character.
    assert all("\ufffd" not in d for d in deltas)


def test_incremental_holds_back_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode("世", add_special_tokens=False)
    assert len(ids) > 1  # one character, several tokens
    detok = IncrementalDetokenizer(tok)
    assert [detok.step([i]) for i in ids] == [""] * (len(ids) - 1) + ["世"]


def test_flush_emits_an_unfinished_character(tok: Tokenizer) -> None:
    ids = tok.encode("a世", add_special_tokens=False)[:-1]  # cut inside 世
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.step([i]) for i in ids)
    assert text == "a"
    assert text + detok.flush() == tok.decode(ids)
    assert tok.decode(ids).endswith("\ufffd")


def test_special_tokens_kept_when_asked(tok: Tokenizer) -> None:
    output = tok.encode("hi", add_special_tokens=False) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    text = "".join(detok.step([i]) for i in output) + detok.flush()
    assert text == tok.decode(output, skip_special_tokens=False) == "hi<｜end▁of▁sentence｜>"


def test_decode_through_the_rust_tokenizer_matches_transformers():
    """``Tokenizer.decode`` skips transformers' Python wrapper (the stream's per-token cost) only
    where the text is the same: random ids, special tokens skipped and kept."""
    import random

    from moeserve.models.tiny_chat import embedded_model_path
    from moeserve.models.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(embedded_model_path())
    assert tokenizer._fast_decode is not None
    rng, vocab = random.Random(0), len(tokenizer.hf)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert tokenizer.decode(ids, skip) == tokenizer.hf.decode(ids, skip_special_tokens=skip)
