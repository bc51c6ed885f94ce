"""Tokenizer access for the engine: a thin wrapper over a Hugging Face fast tokenizer.

transformers is imported inside ``load_tokenizer`` only, so engines that run on token ids
(benchmarks, tests with ``skip_tokenizer``) never pay for it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# the class names transformers saves for a tokenizer that tokenizer.json defines whole
PLAIN_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")

# Tokens of prompt kept as left context when detokenizing the first output tokens: enough for
# tokenizers whose decode of a lone token differs from its decode in context (SentencePiece's
# leading space), the same number vLLM and SGLang use.
INITIAL_CONTEXT_TOKENS = 5


def load_tokenizer(path: str) -> Tokenizer | None:
    """The tokenizer saved in the folder ``path``, or None when it has no tokenizer files.

    A plain fast tokenizer (``tokenizer.json`` alone defines it) is built by its own class:
    ``AutoTokenizer`` imports the code of every model family (torch.compile's included), seconds
    in each process that loads a tokenizer -- the API process and every rank."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    if _tokenizer_class(path) in PLAIN_FAST_TOKENIZERS:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return Tokenizer(TokenizersBackend.from_pretrained(path))
    from transformers import AutoTokenizer

    return Tokenizer(AutoTokenizer.from_pretrained(path))


def _tokenizer_class(path: str) -> str | None:
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


class Tokenizer:
    """Text <-> token ids, plus the chat template, over a ``transformers`` tokenizer."""

    def __init__(self, hf_tokenizer: Any) -> None:
        self.hf = hf_tokenizer
        # no token covers more characters of text than its vocabulary string has (byte-level
        # vocabularies spell a byte as one character), so len(text) / this <= the token count
        self.max_token_chars = max((len(t) for t in hf_tokenizer.get_vocab()), default=1)
        # the Rust tokenizer straight: transformers' decode adds tens of microseconds of Python
        # per call (argument conversion, cleanup checks), and a stream decodes twice per token;
        # only where transformers would not change its text (no clean-up of spaces)
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._fast_decode = None if getattr(hf_tokenizer, "clean_up_tokenization_spaces", False) else (
            backend.decode if backend is not None else None)

    def min_tokens(self, text: str) -> int:
        """A lower bound of ``len(encode(text))`` that costs no tokenization."""
        return -(-len(text) // self.max_token_chars)

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added special tokens included (``len(tokenizer)``)."""
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Render ``messages`` with the folder's chat template and tokenize the result."""
        # The template writes bos itself; letting encode add another would double it.
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> str:
        """``messages`` as the text of the folder's chat template (encode it without special tokens);
        ``tools`` and ``template_kwargs`` (a request's ``chat_template_kwargs``) go to the template."""
        if not self.hf.chat_template:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json has no 'chat_template')")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           tools=tools or None, **template_kwargs)


class IncrementalDetokenizer:
    """Turns output token ids, arriving a few at a time, into text deltas.

    Byte-level tokenizers split one UTF-8 character over several tokens, and decoding a prefix
    that ends inside a character yields U+FFFD. So each step decodes a window twice, from
    ``prefix_offset``: up to ``read_offset`` (text already emitted) and up to the end; the
    difference is emitted only when the longer text does not end in U+FFFD, otherwise it is held
    back until more tokens arrive (vLLM's and SGLang's scheme). The concatenated deltas plus
    ``flush()`` equal ``decode(output_ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-INITIAL_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.output_text = ""

    def step(self, new_ids: Sequence[int]) -> str:
        """Append ``new_ids``; return the text they complete ("" while a character is unfinished)."""
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.ids))
        if new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.output_text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back, U+FFFD included; call when the request finishes."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        delta = self._decode(self.prefix_offset, len(self.ids))[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.output_text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)
