"""Running Triton kernels on the CPU through Triton's interpreter, for the kernel tests.

``TRITON_INTERPRET`` must be set before Triton compiles anything, so each test module runs all
its interpreter checks in one subprocess (``interpreted``) and reads back one JSON line. Keep
inputs float16 / float32 / float8 there: the interpreter's bf16 loads are unreliable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def interpreted(entry: str) -> dict[str, object]:
    """Run ``entry`` (``"module:function"``, a function that calls ``report``) in a subprocess
    with the interpreter on; return what it reported. Skips where Triton is not installed."""
    pytest.importorskip("triton")
    module, function = entry.split(":")
    code = f"from {module} import {function}; {function}()"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    assert proc.returncode == 0 and lines, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len(MARK):])


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
