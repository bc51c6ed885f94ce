"""The synthetic chat task the embedded default model is trained on, and where that model lives.

Two skills, each checkable by a few lines of Python:

- addition: ``"What is 123+456?"`` -> ``"579"`` (operands 0-999, so answers of up to 4 digits);
- string reversal: ``"Reverse: hello"`` -> ``"olleh"`` (3-8 lowercase letters).

About a tenth of all prompts is reserved for evaluation by a stable hash of the prompt text
(``crc32(prompt) % 10 == 0``): the training stream never yields them and the held-out stream
yields nothing else, so a held-out score measures generalisation, not recall.
"""

from __future__ import annotations

import os
import random
import re
import string
import zlib

ADD_MAX = 999
WORD_LENGTHS = (3, 8)
HELD_OUT_MODULUS = 10

_ADD = re.compile(r"What is (\d+)\+(\d+)\?")
_REVERSE = re.compile(r"Reverse: ([a-z]+)")


def make_example(rng: random.Random, addition_share: float = 0.5, short_operands: float = 0.0) -> tuple[str, str]:
    """One training ``(prompt, answer)``; never a held-out prompt.

    Addition with probability ``addition_share``, else reversal. Each operand is uniform over
    0-999, except that with probability ``short_operands`` its digit count is drawn first
    (uniform over 1-3): a trainer can so show more of the 1- and 2-digit operands that uniform
    values make rare, although every number stays a possible prompt.
    """
    while True:
        prompt, answer = _draw(rng, addition_share, short_operands)
        if not is_held_out(prompt):
            return prompt, answer


def held_out_prompts(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` distinct held-out ``(prompt, answer)`` pairs, drawn from their own stream.

    The generator is seeded apart from training's (a string seed cannot collide with the integer
    seeds the trainer uses), and only prompts reserved by :func:`is_held_out` are kept.
    """
    rng = random.Random(f"held-out-{seed}")
    seen: dict[str, str] = {}
    while len(seen) < n:
        prompt, answer = _draw(rng, 0.5, 0.0)
        if is_held_out(prompt):
            seen.setdefault(prompt, answer)
    return list(seen.items())


def is_held_out(prompt: str) -> bool:
    """Whether ``prompt`` is reserved for evaluation. crc32, unlike ``hash``, is the same in every process."""
    return zlib.crc32(prompt.encode()) % HELD_OUT_MODULUS == 0


def solve(prompt: str) -> str:
    """The correct answer to a task prompt; ``ValueError`` for a prompt of neither kind."""
    if m := _ADD.fullmatch(prompt):
        return str(int(m[1]) + int(m[2]))
    if m := _REVERSE.fullmatch(prompt):
        return m[1][::-1]
    raise ValueError(f"not a task prompt: {prompt!r}")


def is_correct(prompt: str, completion: str) -> bool:
    """Whether ``completion`` (surrounding whitespace ignored) answers ``prompt``."""
    return completion.strip() == solve(prompt)


def embedded_model_path() -> str:
    """The folder of the trained checkpoint shipped inside the package (``moeserve/assets/tiny-chat/``)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.path.join(package, "assets", "tiny-chat")


def _draw(rng: random.Random, addition_share: float, short_operands: float) -> tuple[str, str]:
    """Any task example, held out or not."""
    if rng.random() < addition_share:
        a, b = _operand(rng, short_operands), _operand(rng, short_operands)
        return f"What is {a}+{b}?", str(a + b)
    word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(*WORD_LENGTHS)))
    return f"Reverse: {word}", word[::-1]


def _operand(rng: random.Random, short_operands: float) -> int:
    if rng.random() < short_operands:
        digits = rng.randint(1, len(str(ADD_MAX)))
        return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)
    return rng.randint(0, ADD_MAX)
