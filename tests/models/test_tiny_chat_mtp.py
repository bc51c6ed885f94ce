"""The shipped model's MTP module (``tools/train_tiny_chat.py --mtp-only``) as the draft model of
speculative decoding: greedy outputs as without speculation, and nearly every draft accepted."""

from __future__ import annotations

import functools

import pytest

from moeserve import LLM, SamplingParams
from moeserve.models.tiny_chat import embedded_model_path, held_out_prompts

# Another held-out draw than the one the training script reports on, so no run was tuned to it.
PROMPTS = [prompt for prompt, _ in held_out_prompts(100, seed=1)]


@functools.cache
def generate(steps: int) -> tuple[list[list[int]], float]:
    """Greedy output tokens of ``PROMPTS`` with ``steps`` draft tokens (0: no speculation), and
    the mean accept length."""
    spec = {"speculative_algorithm": "NEXTN", "speculative_num_steps": steps} if steps else {}
    llm = LLM(embedded_model_path(), **spec)
    ids = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
           for p in PROMPTS]
    outs = llm.generate(ids, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    return [out.token_ids for out in outs], llm.scheduler.spec.accept_length if steps else 0.0


def perfect_accept_length(outputs: list[list[int]], steps: int) -> float:
    """The mean accept length were every draft accepted: the prefill gives each request its first
    token, and each verify step up to ``steps + 1`` more (fewer when the request ends in it)."""
    emitted = sum(len(tokens) - 1 for tokens in outputs)
    return emitted / sum(-(-(len(tokens) - 1) // (steps + 1)) for tokens in outputs)


@pytest.mark.parametrize("steps", [1, 2])
def test_greedy_outputs_equal_decoding_without_speculation(steps: int) -> None:
    plain, _ = generate(0)
    tokens, accept_length = generate(steps)
    assert tokens == plain
    assert 1.0 <= accept_length <= perfect_accept_length(plain, steps) + 1e-9


def test_one_draft_is_nearly_always_accepted() -> None:
    plain, _ = generate(0)
    _, accept_length = generate(1)
    best = perfect_accept_length(plain, 1)  # about 1.8 on these short answers
    assert accept_length >= 1.7, f"mean accept length {accept_length:.3f} (every draft accepted: {best:.3f})"
