"""Expert workloads: synthetic Zipf routing, mixes, server dumps and the recorded directory."""

from __future__ import annotations

import json

import pytest
import torch

from moeserve.eplb.files import save_distribution
from moeserve.eplb.workload import (
    PHASES,
    Routing,
    SourceOptions,
    load_recording,
    load_source,
    mix_routing,
    prompt_ids,
    read_prompts,
    routing_from_per_token,
    sample_distinct,
    save_recording,
    zipf_weights,
)

SMALL = SourceOptions(num_experts=16, top_k=4, num_layers=3, num_groups=4, num_tokens=4000, seed=3)


def test_zipf_is_deterministic_given_the_seed():
    a, b = load_source("zipf:1.0", SMALL), load_source("zipf:1.0", SMALL)
    assert torch.equal(a.topk_ids, b.topk_ids)
    assert torch.equal(a.topk_ids, load_source("zipf:1.0:3", SMALL).topk_ids)  # the seed given inline
    assert not torch.equal(a.topk_ids, load_source("zipf:1.0:4", SMALL).topk_ids)
    assert a.topk_ids.shape == (3, 4000, 4) and a.topk_ids.dtype == torch.int16
    assert (a.num_groups, a.phase.unique().tolist()) == (4, [PHASES.index("drawn")])


def test_zipf_routes_k_distinct_experts_per_token():
    ids = load_source("zipf:1.5", SMALL).topk_ids.long()
    assert ((ids >= 0) & (ids < 16)).all()
    assert (ids.sort(-1).values.diff(dim=-1) != 0).all()


def test_zipf_counts_follow_the_permutation():
    counts = load_source("zipf:1.2", SMALL).counts()  # [L, E]
    weight = zipf_weights(1.2, 3, 16, torch.Generator().manual_seed(3))  # the same draws of the permutation
    for layer in range(3):
        hottest = weight[layer].argsort(descending=True)[:3]  # ranks 1-3: far apart at S = 1.2
        assert counts[layer].argsort(descending=True)[:3].tolist() == hottest.tolist()
    assert (counts.sum(1) == 4000 * 4).all()


def test_sampling_without_replacement_matches_torch_multinomial():
    """Marginals per slot against torch's own successive sampling, on a skewed load."""
    weight = torch.tensor([[40.0, 20, 10, 5, 3, 1, 1, 0]])
    n, k = 40_000, 3
    ours = sample_distinct(weight / weight.sum(), n, k, torch.Generator().manual_seed(0))[0]  # [T, k]
    ref = torch.multinomial(weight.expand(n, -1), k, replacement=False, generator=torch.Generator().manual_seed(1))
    for slot in range(k):
        got = torch.bincount(ours[:, slot], minlength=8) / n
        want = torch.bincount(ref[:, slot], minlength=8) / n
        assert torch.allclose(got, want, atol=0.012), (slot, got, want)
    assert (ours != 7).all()  # no weight, never drawn


def test_too_few_experts_with_load_for_k():
    with pytest.raises(ValueError, match="top_k"):
        sample_distinct(torch.tensor([[1.0, 1.0, 0.0, 0.0]]), 10, 3, torch.Generator())


def test_mix_at_the_ends_is_either_source():
    a, b = load_source("zipf:1.0:1", SMALL), load_source("zipf:1.0:2", SMALL)
    assert torch.equal(load_source("mix:zipf:1.0:1,zipf:1.0:2,0", SMALL).topk_ids, a.topk_ids)
    assert torch.equal(load_source("mix:zipf:1.0:1,zipf:1.0:2,1", SMALL).topk_ids, b.topk_ids)
    half = mix_routing(a, b, 0.5, seed=SMALL.seed)
    assert torch.equal(half.topk_ids, load_source("mix:zipf:1.0:1,zipf:1.0:2,0.5", SMALL).topk_ids)
    from_b = (half.topk_ids == b.topk_ids).all(-1).all(0) & ~(half.topk_ids == a.topk_ids).all(-1).all(0)
    assert 0.45 < from_b.float().mean() < 0.55
    longer = mix_routing(a, b, 0.0, num_tokens=6000)  # longer than either source: it wraps around
    assert longer.num_tokens == 6000 and torch.equal(longer.topk_ids[:, 4000:], a.topk_ids[:, :2000])


def test_mix_specs_nest_in_brackets():
    options = SourceOptions(num_experts=8, top_k=2, num_layers=2, num_groups=2, num_tokens=500)
    b = load_source("zipf:1.0:2", options)
    nested = load_source("mix:[mix:zipf:1.0:1,zipf:1.0:2,1],zipf:0,0", options)
    assert torch.equal(nested.topk_ids, b.topk_ids)


@pytest.mark.parametrize("spec", ["zipf:", "zipf:-1", "zipf:a", "mix:zipf:1,0.5", "mix:zipf:1,zipf:1,2", "nowhere"])
def test_bad_sources(spec):
    with pytest.raises(ValueError, match="zipf|mix|not a recorded"):
        load_source(spec, SMALL)


def test_a_stat_dump_is_drawn_from_its_counts(tmp_path):
    count = torch.zeros(4, 8, dtype=torch.int64)
    count[1:] = torch.tensor([800, 400, 200, 200, 100, 100, 100, 100])  # layer 0 dense: no load
    path = str(tmp_path / "stat.json")
    save_distribution(path, count, num_groups=4, mode="stat", passes=10)
    with pytest.raises(ValueError, match="--top-k"):
        load_source(path, SourceOptions())
    routing = load_source(path, SourceOptions(top_k=2, num_tokens=30_000))
    assert routing.layer_ids == (1, 2, 3) and routing.num_groups == 4 and routing.top_k == 2
    assert (routing.topk_ids[:, :, 0] != routing.topk_ids[:, :, 1]).all()
    default = load_source(path, SourceOptions(top_k=2))
    assert default.num_tokens == 2000 // 2  # the tokens the dump recorded
    share = routing.counts()[0].double() / routing.counts()[0].sum()
    assert share.argmax() == 0 and share[0] < 0.4  # hot, but capped: one of two distinct experts


def _passes() -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    passes = []
    for i, (phase, tokens) in enumerate([("prefill", 7), ("decode", 2), ("decode", 2), ("prefill", 3)]):
        rows = tokens + (2 if phase == "decode" else 0)  # a graph bucket's padding rows past positions
        passes.append({"phase": phase, "positions": torch.arange(tokens) + i,
                       "topk_ids": {str(layer): torch.stack([torch.randperm(8, generator=gen)[:2]
                                                             for _ in range(rows)]) for layer in (1, 3)}})
    return passes


def test_a_per_token_dump_replays_as_recorded(tmp_path):
    passes = _passes()
    path = str(tmp_path / "dump.pt")
    save_distribution(path, torch.zeros(4, 8, dtype=torch.int64), num_groups=4, mode="per_token", per_token=passes)
    routing = load_source(path, SourceOptions())
    assert routing.layer_ids == (1, 3) and routing.num_tokens == 7 + 2 + 2 + 3
    assert torch.equal(routing.topk_ids[1, :7], passes[0]["topk_ids"]["3"])
    assert torch.equal(routing.topk_ids[0, 7:9], passes[1]["topk_ids"]["1"][:2])  # padding rows left out
    assert routing.phase.tolist() == [0] * 7 + [1] * 4 + [0] * 3
    assert routing.pass_index.tolist() == [0] * 7 + [1] * 2 + [2] * 2 + [3] * 3
    assert routing.only("decode").num_tokens == 4


def test_a_recorded_directory_round_trips(tmp_path):
    routing = routing_from_per_token(_passes(), 8, 4, {"model": "m"})
    info = save_recording(str(tmp_path / "rec"), routing, model="m", dataset="builtin:addition", num_layers=4)
    assert info["phases"] == {"prefill": {"tokens": 10, "passes": 2}, "decode": {"tokens": 4, "passes": 2}}
    meta = json.loads((tmp_path / "rec" / "meta.json").read_text())
    assert meta["layer_ids"] == [1, 3] and meta["top_k"] == 2 and meta["num_logical_experts"] == 8
    back = load_recording(str(tmp_path / "rec"))
    for name in ("topk_ids", "phase", "positions", "pass_index"):
        assert torch.equal(getattr(back, name), getattr(routing, name)), name
    assert (back.layer_ids, back.num_logical, back.num_groups) == ((1, 3), 8, 4)
    assert torch.equal(load_source(str(tmp_path / "rec")).counts(), routing.counts())
    assert load_source(str(tmp_path / "rec"), SourceOptions(num_tokens=20)).num_tokens == 20  # wrapped


def test_routing_checks_its_shapes():
    with pytest.raises(ValueError, match="phase"):
        Routing(torch.zeros(2, 5, 2, dtype=torch.int16), torch.zeros(4, dtype=torch.uint8), 8)
    with pytest.raises(ValueError, match="num_groups"):
        Routing(torch.zeros(2, 5, 2, dtype=torch.int16), torch.zeros(5, dtype=torch.uint8), 8, num_groups=3)


def test_read_prompts(tmp_path):
    text = tmp_path / "p.txt"
    text.write_text("What is 1+2?\n\nReverse: abc\n")
    assert read_prompts(str(text)) == ["What is 1+2?", "Reverse: abc"]
    jsonl = tmp_path / "p.jsonl"
    chat = [{"role": "user", "content": "hi"}]
    jsonl.write_text('"a"\n{"prompt": "b"}\n' + json.dumps({"messages": chat}) + "\n")
    assert read_prompts(str(jsonl)) == ["a", "b", chat]
    jsonl.write_text('{"other": 1}\n')
    with pytest.raises(ValueError, match="p.jsonl:1"):
        read_prompts(str(jsonl))


def test_prompt_ids_are_the_chat_turn_the_shipped_model_was_trained_on():
    from moeserve.models.tiny_chat import embedded_model_path
    from moeserve.models.tokenizer import load_tokenizer

    tok = load_tokenizer(embedded_model_path())
    user, assistant = tok.hf.convert_tokens_to_ids(["<｜User｜>", "<｜Assistant｜>"])
    body = tok.encode("What is 12+345?", add_special_tokens=False)
    assert prompt_ids(tok, "What is 12+345?") == [tok.bos_token_id, user, *body, assistant]
    assert prompt_ids(tok, [{"role": "user", "content": "What is 12+345?"}]) == prompt_ids(tok, "What is 12+345?")
    assert prompt_ids(tok, "What is 12+345?", chat=False) == tok.encode("What is 12+345?")
