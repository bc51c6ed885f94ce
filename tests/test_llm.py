"""The offline façade on a tiny checkpoint with a tokenizer: text in, text out."""

from __future__ import annotations

import os

import pytest

from moeserve import LLM, SamplingParams
from moeserve.models.tiny import make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "v3"), preset="v3", seed=0,
                           initializer_range=0.1)
    return LLM(path, dtype="float32", page_size=4, max_total_tokens=1024)


def test_text_prompts_and_token_id_prompts_agree(llm):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ids = llm.tokenizer.encode("The quick brown fox")
    by_text, by_ids = llm.generate(["The quick brown fox", ids], params, use_tqdm=False)
    assert by_text.prompt_token_ids == ids
    assert by_text.token_ids == by_ids.token_ids
    assert by_text.text == llm.tokenizer.decode(by_text.token_ids)


def test_stop_string_cuts_the_text(llm):
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    full = llm.generate(["abc"], params, use_tqdm=False)[0]
    stop = full.text[5:7]
    assert stop, "need some text to cut at"
    cut = llm.generate(["abc"], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:full.text.find(stop)]
    assert full.token_ids[:len(cut.token_ids)] == cut.token_ids


def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "What is 1+1?"}]
    out = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    ids = llm.tokenizer.apply_chat_template(messages)
    assert out.prompt_token_ids == ids and len(out.token_ids) == 6


def test_eos_ends_generation_unless_ignored(llm):
    assert llm.tokenizer.eos_token_id in llm.scheduler.eos_token_ids
    prompt = llm.tokenizer.encode("hello")
    free = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    eos_like = free.token_ids[2]
    saved = llm.scheduler.eos_token_ids
    llm.scheduler.eos_token_ids = frozenset({eos_like})  # pretend the model's eos is that token
    try:
        stopped = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)[0]
        ignored = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
                               use_tqdm=False)[0]
    finally:
        llm.scheduler.eos_token_ids = saved
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[:free.token_ids.index(eos_like) + 1]
    assert stopped.text == llm.tokenizer.decode(stopped.token_ids[:-1])
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_unknown_setting_is_refused(tmp_path):
    path = make_tiny_model(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="page_sise"):
        LLM(path, page_sise=4)


def test_sharded_checkpoint_gives_the_same_tokens(tmp_path):
    single = make_tiny_model(str(tmp_path / "single"), preset="v2-lite", seed=5, initializer_range=0.1)
    sharded = make_tiny_model(str(tmp_path / "sharded"), preset="v2-lite", seed=5, initializer_range=0.1,
                              shard_size_mb=0.05)
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = [LLM(p, dtype="float32", max_total_tokens=256).generate(["shards"], params, use_tqdm=False)[0]
            for p in (single, sharded)]
    assert outs[0].token_ids == outs[1].token_ids
