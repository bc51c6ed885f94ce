"""The embedded default model's task, and the shipped checkpoint answering it in transformers."""

from __future__ import annotations

import json
import os
import random
from collections import defaultdict

import pytest
import torch

import moeserve
from moeserve.models.tiny_chat import (
    embedded_model_path,
    held_out_prompts,
    is_correct,
    is_held_out,
    make_example,
    solve,
)


def test_training_stream_never_yields_held_out_prompts() -> None:
    rng = random.Random(0)
    train = {make_example(rng)[0] for _ in range(20_000)}
    held_out = held_out_prompts(500, seed=0)
    assert not any(is_held_out(p) for p in train)
    assert all(is_held_out(p) for p, _ in held_out)
    assert train.isdisjoint(p for p, _ in held_out)


def test_held_out_prompts_are_distinct_repeatable_and_mixed() -> None:
    pairs = held_out_prompts(200, seed=0)
    assert pairs == held_out_prompts(200, seed=0) != held_out_prompts(200, seed=1)
    assert len({p for p, _ in pairs}) == 200
    additions = sum(p.startswith("What is") for p, _ in pairs)
    assert 60 < additions < 140  # both skills are evaluated
    assert all(solve(p) == a for p, a in pairs)


def test_examples_cover_the_task_ranges() -> None:
    rng = random.Random(1)
    examples = [make_example(rng) for _ in range(5_000)]
    sums = [int(a) for p, a in examples if p.startswith("What is")]
    words = [a for p, a in examples if p.startswith("Reverse:")]
    assert max(sums) >= 1000 and min(sums) < 100  # 1 to 4 answer digits
    assert {len(w) for w in words} == set(range(3, 9))
    assert all(solve(p) == a for p, a in examples)


@pytest.mark.parametrize(("prompt", "completion", "expected"), [
    ("What is 123+456?", "579", True),
    ("What is 999+999?", " 1998\n", True),
    ("What is 0+7?", "7", True),
    ("What is 123+456?", "578", False),
    ("What is 123+456?", "5790", False),
    ("Reverse: hello", "olleh", True),
    ("Reverse: hello", "  olleh ", True),
    ("Reverse: hello", "hello", False),
    ("Reverse: hello", "o l l e h", False),
])
def test_is_correct(prompt: str, completion: str, expected: bool) -> None:
    assert is_correct(prompt, completion) is expected


def test_is_correct_rejects_other_prompts() -> None:
    with pytest.raises(ValueError):
        is_correct("Tell me a story", "no")


def test_shipped_folder_is_complete() -> None:
    path = embedded_model_path()
    assert path == os.path.join(os.path.dirname(moeserve.__file__), "assets", "tiny-chat")
    names = set(os.listdir(path))
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    size = sum(os.path.getsize(os.path.join(path, n)) for n in names)
    assert size < 8 * 2**20


def _greedy_answers(model, tokenizer, prompts: list[str], max_new_tokens: int = 12) -> dict[str, tuple[str, bool]]:
    """prompt -> (decoded completion, whether eos ended it); batched by prompt length so no padding."""
    by_length: dict[int, list[tuple[str, list[int]]]] = defaultdict(list)
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        by_length[len(ids)].append((prompt, ids))
    answers = {}
    for group in by_length.values():
        input_ids = torch.tensor([ids for _, ids in group])
        with torch.no_grad():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=tokenizer.eos_token_id)
        for (prompt, _), new in zip(group, out[:, input_ids.shape[1]:].tolist()):
            answers[prompt] = (tokenizer.decode(new, skip_special_tokens=True), tokenizer.eos_token_id in new)
    return answers


def test_shipped_model_answers_held_out_prompts() -> None:
    transformers = pytest.importorskip("transformers")
    path = embedded_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    # the MTP module (layer num_hidden_layers, as released): transformers' model has no place for it
    assert info["unexpected_keys"] and all(k.startswith("model.layers.4.") for k in info["unexpected_keys"]), info
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "deepseek_v3" and config["vocab_size"] >= len(tokenizer)
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_token_id, tokenizer.eos_token_id)

    # Another held-out draw than the one the training script reports on, so no run was tuned to it.
    pairs = held_out_prompts(100, seed=1)
    answers = _greedy_answers(model.eval(), tokenizer, [p for p, _ in pairs])
    right = [p for p, _ in pairs if answers[p][1] and is_correct(p, answers[p][0])]
    wrong = {p: answers[p] for p, _ in pairs if p not in right}
    assert len(right) >= 95, wrong
