"""The ``moeserve`` command: make-tiny-model, then generate from it."""

from __future__ import annotations

import argparse

import pytest

from moeserve.models.tiny import make_tiny_model
from moeserve.server.cli import main


@pytest.mark.parametrize("preset", ["v3", "v32", "v2-lite"])
def test_make_tiny_model_then_generate(tmp_path, capsys, preset):
    out = str(tmp_path / preset)
    assert main(["make-tiny-model", out, "--preset", preset, "--seed", "1"]) == 0
    assert main(["generate", "--model-path", out, "--prompt", "Hello", "--max-tokens", "8",
                 "--page-size", "4", "--max-total-tokens", "256"]) == 0
    printed = capsys.readouterr().out
    assert "prompt: 'Hello'" in printed and "tokens, finish:" in printed


def test_generate_reports_bad_input_without_a_traceback(tmp_path, capsys):
    out = str(tmp_path / "m")
    main(["make-tiny-model", out])
    assert main(["generate", "--model-path", out, "--prompt", "Hi", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "--model-path", str(tmp_path / "nowhere"), "--prompt", "Hi"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_runner_and_quantization_flags_reach_the_engine_config(tmp_path):
    from moeserve.config import build_engine_config
    from moeserve.server.cli import build_parser, engine_settings

    out = make_tiny_model(str(tmp_path / "m"))
    for command in ("generate", "serve"):
        args = build_parser().parse_args([command, "--model-path", out, "--quantization", "fp8",
                                          "--disable-cuda-graph", "--cuda-graph-max-bs", "48"])
        cfg = build_engine_config(args.model_path, **engine_settings(args))
        assert cfg.load.quantization == "fp8"
        assert cfg.runner.disable_cuda_graph and cfg.runner.cuda_graph_max_bs == 48
    args = build_parser().parse_args(["generate", "--model-path", out])
    cfg = build_engine_config(args.model_path, **engine_settings(args))
    assert cfg.load.quantization is None and not cfg.runner.disable_cuda_graph and cfg.runner.cuda_graph_max_bs == 256


def test_bench_subcommands_are_wired():
    from moeserve.server.cli import build_parser, cmd_bench_compare_hf, cmd_bench_one_batch

    one = build_parser().parse_args(["bench", "one-batch", "--preset", "dsv3", "--num-layers", "4",
                                     "--batch-size", "32", "128", "--quantization", "fp8"])
    assert one.func is cmd_bench_one_batch and one.batch_size == [32, 128] and one.quantization == "fp8"
    cmp = build_parser().parse_args(["bench", "compare-hf"])
    assert cmp.func is cmd_bench_compare_hf and (cmp.preset, cmp.num_layers) == ("dsv3", 4)


def test_page_size_defaults_by_device(tmp_path):
    """64-slot pages on CUDA (the Hopper decode kernel reads whole 64-row page blocks), 16 on the
    CPU; a given size is kept on either."""
    from moeserve.config import build_engine_config
    from moeserve.server.cli import build_parser, engine_settings

    out = make_tiny_model(str(tmp_path / "m"))
    sizes = {}
    for device, flags in [("cpu", []), ("cuda", []), ("cuda", ["--page-size", "16"]), ("cpu", ["--page-size", "8"])]:
        args = build_parser().parse_args(["serve", "--model-path", out, "--device", device, *flags])
        sizes[(device, *flags)] = build_engine_config(args.model_path, **engine_settings(args)).cache.page_size
    assert sizes == {("cpu",): 16, ("cuda",): 64, ("cuda", "--page-size", "16"): 16, ("cpu", "--page-size", "8"): 8}
    assert build_engine_config(out, device="cuda").cache.page_size == 64  # the offline LLM's path


def _commands(parser, path=()):
    """Every command's parser, by its words (``("bench", "rank")``)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, (*path, name))
    yield path, parser


# flags named as an engine flag that mean something else to their command: a benchmark of the
# communication or transfer layer alone (no engine), a sweep over EP sizes
NOT_ENGINE_FLAGS = {("bench", "dispatch"): {"device", "dtype"}, ("bench", "transfer"): {"device"},
                    ("eplb", "simulate"): {"ep_size"}, ("eplb", "drift"): {"ep_size"}}


def test_every_engine_flag_is_built_from_its_config_field():
    """No command declares an engine flag by hand: wherever one appears it has its field's type and
    choices (``none`` added where a command's default leaves the field's None)."""
    from moeserve.config import config_flags
    from moeserve.server.cli import build_parser

    fields = {name: (kind, spec) for name, kind, _, spec in config_flags()}
    checked = set()
    for path, parser in _commands(build_parser()):
        for action in parser._actions:
            if action.dest not in fields or action.dest in NOT_ENGINE_FLAGS.get(path, ()):
                continue
            kind, spec = fields[action.dest]
            assert action.option_strings == ["--" + action.dest.replace("_", "-")], (path, action.dest)
            if kind is bool:
                assert isinstance(action, argparse._StoreTrueAction), (path, action.dest)
            else:
                assert action.type is kind, (path, action.dest)
                choices = tuple(action.choices) if action.choices is not None else None
                assert choices in (spec.choices, (*(spec.choices or ()), "none")), (path, action.dest)
            checked.add(path)
    assert {("plan",), ("bench", "rank"), ("bench", "deployment"), ("eplb", "plan")} <= checked


def test_a_command_default_keeps_the_field_default_reachable():
    from moeserve.server.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["bench", "deployment"]).quantization == "fp8"  # the reference deployment's
    assert parse(["bench", "deployment", "--quantization", "none"]).quantization is None
    assert parse(["bench", "rank", "--role", "decode", "--ep-size", "8"]).quantization is None
    with pytest.raises(SystemExit):
        parse(["bench", "rank", "--role", "decode", "--ep-size", "8", "--quantization", "none"])
    plan = parse(["plan", "--preset", "dsv3", "--world", "8"])
    assert (plan.tp_size, plan.dp_size, plan.max_dispatch_tokens_per_rank) == (None, None, None)  # from --world


def test_config_flags_refuse_names_that_are_not_fields():
    from moeserve.flags import add_config_flags

    with pytest.raises(ValueError, match="ep_sizes"):
        add_config_flags(argparse.ArgumentParser(), {"ep_sizes"})


def test_an_sglang_deepseek_launch_line_parses_and_means_what_it_says(tmp_path, caplog):
    """SGLang's DeepSeek launch flags that moeserve has: EAGLE is the checkpoint's MTP module (SGLang's
    spelling for DeepSeek), --chat-template replaces the tokenizer's, and the no-ops say so in the log."""
    import logging

    from moeserve.config import ServerConfig, build_engine_config, config_flags
    from moeserve.flags import engine_settings
    from moeserve.server.cli import build_parser
    from moeserve.server.launch import server_tokenizer

    path = make_tiny_model(str(tmp_path / "m"), preset="v3", mtp=True)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    args = build_parser().parse_args([
        "serve", "--model-path", path, "--trust-remote-code", "--enable-metrics", "--tp-size", "1",
        "--chat-template", str(template), "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3", "--tool-call-parser", "deepseekv3",
        "--reasoning-parser", "deepseek-r1", "--grammar-backend", "llguidance", "--kv-cache-dtype", "auto"])
    engine = build_engine_config(path, **engine_settings(args))
    assert engine.cache.kv_cache_dtype == "auto"

    def kv(dtype: str) -> dict:
        return engine_settings(build_parser().parse_args(["serve", "--model-path", path, "--kv-cache-dtype", dtype]))

    assert build_engine_config(path, **kv("fp8_e4m3")).cache.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' is not supported.*use fp8_e4m3"):
        build_engine_config(path, **kv("fp8_e5m2"))
    with pytest.raises(ValueError, match="kv_cache_dtype 'int3' is not supported"):
        build_engine_config(path, **kv("int3"))
    assert engine.spec.enabled and engine.spec.num_drafts == 2 and engine.scheduler.grammar_backend == "llguidance"
    server = ServerConfig(**{n: getattr(args, n) for n, *_ in config_flags((ServerConfig,))})
    assert (server.tool_call_parser, server.reasoning_parser) == ("deepseekv3", "deepseek-r1")
    with caplog.at_level(logging.INFO):
        tokenizer = server_tokenizer(engine, server)
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "[user]hi"
    assert "--trust-remote-code: accepted" in caplog.text and "--enable-metrics: accepted" in caplog.text
