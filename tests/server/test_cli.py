"""The ``moeserve`` command: make-tiny-model, then generate from it."""

from __future__ import annotations

import pytest

from moeserve.server.cli import main


@pytest.mark.parametrize("preset", ["v3", "v2-lite"])
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
