"""Online expert rebalancing changes where experts live, never what the model computes: greedy
tokens equal the single-process engine's when rebalances happen mid-run, chunk by chunk, in
every dispatch mode (real rank processes over gloo)."""

from __future__ import annotations

import pytest
import torch

from moeserve import LLM, SamplingParams
from moeserve.core import BootstrapInfo
from moeserve.eplb.placement import ExpertPlacement
from tests.disagg.pd_utils import bootstrap_server, pd_scheduler
from tests.distributed.layouts import ENGINE, requests

DP4 = {"tp_size": 4, "dp_size": 4, "enable_dp_attention": True, "moe_a2a_backend": "torch",
       "ep_num_redundant_experts": 4}
# a rebalance every 4 passes, one layer per pause: several rebalances, each in 2 chunks, while requests run
EPLB = {"enable_eplb": True, "eplb_rebalance_num_iterations": 4, "eplb_rebalance_layers_per_chunk": 1}


def _trivial(num_layers: int = 3) -> list[list[int]]:
    return ExpertPlacement.trivial(num_layers, 8, 4, 4).phy2log.tolist()


@pytest.mark.parametrize("mode, algorithm", [("low_latency", "static"), ("normal", "static"),
                                             ("auto", "dynamic")])
def test_greedy_tokens_survive_rebalances_mid_run(layout_model, layout_reference, mode, algorithm):
    prompts, params = requests()
    with LLM(layout_model, **ENGINE, **DP4, **EPLB, deepep_mode=mode, ep_dispatch_algorithm=algorithm) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == layout_reference
        stats = llm.expert_stats()
    assert stats["rebalances"] >= 2 and len(stats["pauses_s"]) == 2  # two MoE layers, one per pause
    assert stats["phy2log"] != _trivial()  # experts did move between ranks
    assert stats["phy2log"][0] == _trivial()[0]  # the dense layer's row is left alone


@pytest.mark.parametrize("source", ["host", "mmap"])
def test_a_rebalance_asked_for_moves_experts_and_outputs_stay(layout_model, source):
    """Asked through the control path (as ``POST /rebalance_experts``), on one rank with FP8
    weights: the scales move with the weights, read from a host copy or the mapped checkpoint."""
    prompts, params = requests()
    settings = {"ep_num_redundant_experts": 3, "enable_eplb": True, "eplb_rebalance_num_iterations": 10_000,
                "quantization": "fp8", "eplb_weights_source": source}
    with LLM(layout_model, **ENGINE, quantization="fp8") as plain:
        want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    with LLM(layout_model, **ENGINE, **settings) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        before = llm.expert_stats()["phy2log"]
        result = llm.rebalance_experts()
        assert result["phy2log"] != before and result["rebalances"] == 1
        assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        runner = llm.runner
        for layer in (1, 2):  # each slot now holds its new logical expert's weights and scales
            stacks = runner.model.model.layers[layer].mlp.experts.stacks()
            assert stacks["w13"].dtype == torch.float8_e4m3fn and "w13_scale_inv" in stacks
            for slot, logical in enumerate(result["phy2log"][layer]):
                source = runner.eplb.fetch(layer, logical)
                for name, stack in stacks.items():
                    assert torch.equal(_bits(stack[slot]), _bits(source[name])), (layer, slot, name)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def test_fake_dispatch_serves_valid_tokens_and_balances_the_load(layout_model):
    prompts, params = requests()
    settings = {**DP4, "deepep_mode": "low_latency", "ep_dispatch_algorithm": "fake",
                "expert_distribution_recorder_mode": "stat"}
    with LLM(layout_model, **ENGINE, **settings) as llm:
        llm.start_expert_distribution_record()
        outs = llm.generate(prompts, [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * len(prompts),
                            use_tqdm=False)
        dumped = llm.dump_expert_distribution_record()
    assert all(len(o.token_ids) == 40 and all(0 <= t < 320 for t in o.token_ids) for o in outs)
    assert dumped["balancedness"] > 0.8  # uniform random routing: near 1
    with LLM(layout_model, **ENGINE, **{**settings, "ep_dispatch_algorithm": "static"}) as llm:
        llm.start_expert_distribution_record()
        llm.generate(prompts, [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)] * len(prompts),
                     use_tqdm=False)
        routed = llm.dump_expert_distribution_record()
    assert dumped["balancedness"] > routed["balancedness"]  # the real router is skewed


def test_prefill_and_decode_servers_keep_their_own_recorders_and_placements(layout_model, layout_reference, tmp_path):
    eplb = {"ep_num_redundant_experts": 3, "enable_eplb": True, "eplb_rebalance_num_iterations": 10_000}
    secret = str(tmp_path / "secret")
    with bootstrap_server(secret) as (port, _):
        prefill, decode = (pd_scheduler(layout_model, mode, "fake", port, secret, **eplb)
                           for mode in ("prefill", "decode"))
        try:
            assert _pd_round(prefill, decode, port, first_room=0) == layout_reference
            before = [s.runner.eplb.current.phy2log.clone() for s in (prefill, decode)]
            decode.runner.eplb.request_rebalance()  # the decode server rebalances from its own load only
            while decode.runner.eplb.busy:
                decode.runner.forward(None)
            assert torch.equal(prefill.runner.eplb.current.phy2log, before[0])
            assert not torch.equal(decode.runner.eplb.current.phy2log, before[1])
            prefill_load, decode_load = (s.runner.eplb.recorder.totals()[0] for s in (prefill, decode))
            assert not torch.equal(prefill_load, decode_load)  # prompts there, generated tokens here
            assert _pd_round(prefill, decode, port, first_room=100) == layout_reference
        finally:
            prefill.role.close()
            decode.role.close()


def _pd_round(prefill, decode, port: int, first_room: int) -> list[list[int]]:
    prompts, params = requests()
    reqs = []
    for i, (ids, p) in enumerate(zip(prompts, params)):
        info = BootstrapInfo("127.0.0.1", port, room=first_room + i)
        prefill.add_request(f"p{first_room + i}", ids, p, info)
        reqs.append(decode.add_request(f"d{first_room + i}", ids, p, info))
    while not all(r.finished for r in reqs) or prefill.num_requests:
        prefill.step()
        decode.step()
    return [r.output_ids for r in reqs]
