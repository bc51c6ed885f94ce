"""Reasoning separated from the answer (``--reasoning-parser``), as the text streams in.

DeepSeek-R1's template ends the generation prompt with ``<think>\\n``, so a completion starts inside
its reasoning and closes it with ``</think>``; what follows is the answer. Everything before the end
tag is ``reasoning_content`` (a leading ``<think>`` the model writes itself is dropped), everything
after it ``content``; a completion that never closes its reasoning is all reasoning (SGLang's
``deepseek-r1`` parser does the same).
"""

from __future__ import annotations

from dataclasses import dataclass

# parser name -> (start tag, end tag)
PARSERS = {"deepseek-r1": ("<think>", "</think>")}


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Feed text pieces in order; each ``feed`` returns what can be said of them so far. A piece that
    ends with the beginning of a tag is held back until the next piece (or ``finish``) settles it."""

    def __init__(self, name: str) -> None:
        if name not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {sorted(PARSERS)}, got {name!r}")
        self.start, self.end = PARSERS[name]
        self.in_reasoning = True
        self.at_start = True  # nothing said yet: a leading start tag is the model's own and dropped
        self._held = ""

    def feed(self, text: str) -> Split:
        text, self._held = self._held + text, ""
        out = Split()
        if self.at_start and self.in_reasoning:
            stripped = text.lstrip()
            if self.start.startswith(stripped):  # perhaps the start tag, not all here yet
                self._held = text
                return out
            if stripped.startswith(self.start):
                text = stripped[len(self.start):]
            self.at_start = False
        if not self.in_reasoning:
            out.content = text
            return out
        cut = text.find(self.end)
        if cut >= 0:
            self.in_reasoning = False
            out.reasoning, out.content = text[:cut], text[cut + len(self.end):]
            return out
        keep = _partial_tag(text, self.end)
        out.reasoning, self._held = text[:len(text) - keep], text[len(text) - keep:]
        return out

    def finish(self) -> Split:
        """What was held back, once nothing follows."""
        held, self._held = self._held, ""
        if self.at_start and self.start.startswith(held.lstrip()):
            held = ""
        return Split(reasoning=held) if self.in_reasoning else Split(content=held)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that begins ``tag`` (0 when none does)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
