"""Running Triton kernels on the CPU through Triton's interpreter, for the kernel tests.

``TRITON_INTERPRET`` must be set before Triton compiles anything, so each test module runs all
its interpreter checks in one subprocess (``interpreted``) and reads back one JSON line. Keep
inputs float16 / float32 / float8 there: the interpreter's bf16 loads are unreliable.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARK = "INTERPRETED "


def fix_interpreter_scalars() -> None:
    """Triton 3.6's interpreter turns loop bounds loaded from memory into ints with
    ``int(array)``, which numpy >= 2.4 refuses (triton issue 9171); take the element instead."""
    import numpy as np
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:
        return

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def report(results: dict[str, object]) -> None:
    """The subprocess's last word: its results as one JSON line."""
    print(MARK + json.dumps(results), flush=True)


_RUNS: dict[str, tuple[subprocess.Popen, Path]] = {}  # entry -> its subprocess and output file
TIMEOUT_S = 600


def prefetch(entry: str) -> None:
    """Start ``entry``'s interpreter subprocess now, in the background (``tests/conftest.py`` does so
    for every selected module at the session's start): it is one core's work for a minute, which
    overlaps the tests that wait on servers."""
    if entry in _RUNS or importlib.util.find_spec("triton") is None:
        return
    module, function = entry.split(":")
    out = Path(tempfile.mkstemp(prefix="interpreted-", suffix=".log")[1])
    with open(out, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", f"from {module} import {function}; {function}()"], cwd=REPO,
                                env={**os.environ, "TRITON_INTERPRET": "1"}, stdout=f, stderr=subprocess.STDOUT)
    _RUNS[entry] = (proc, out)


def interpreted(entry: str) -> dict[str, object]:
    """Run ``entry`` (``"module:function"``, a function that calls ``report``) in a subprocess
    with the interpreter on (or take the run ``prefetch`` started); return what it reported. Skips
    where Triton is not installed."""
    pytest.importorskip("triton")
    prefetch(entry)
    proc, out = _RUNS[entry]
    try:
        proc.wait(TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    text = out.read_text()
    lines = [line for line in text.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and lines, f"interpreter run failed (exit {proc.returncode}):\n{text[-6000:]}"
    return json.loads(lines[-1][len(MARK):])


def stop_prefetched() -> None:
    """End the runs nobody waited for (their tests were deselected or the session stopped early)."""
    for proc, out in _RUNS.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.unlink(missing_ok=True)
    _RUNS.clear()


def run_checks(checks: dict[str, Callable[[], None]]) -> None:
    """Run each check (seeded alike) inside the interpreter subprocess; report
    ``{name: "ok" | traceback}``."""
    import torch

    fix_interpreter_scalars()
    results = {}
    for name, check in checks.items():
        torch.manual_seed(0)
        try:
            check()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    report(results)
