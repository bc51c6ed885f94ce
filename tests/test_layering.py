"""Layers import downward only (STYLE.md): every ``import`` of every module, lazy ones and
``TYPE_CHECKING`` ones too, checked against the layer order of the package it names."""

from __future__ import annotations

import ast
from pathlib import Path

import moeserve

PACKAGE = Path(moeserve.__file__).parent

# moeserve.<name> -> its layer; a module may import its own layer and those below. A kernel knows
# no config; the entry points (the server, the benchmarks, the planner, the flags they parse) sit
# on top, and only the server's CLI registers the others' commands.
LAYERS = [
    {"kernels"},
    {"config", "core"},
    {"cache", "distributed"},
    {"eplb"},
    {"layers"},
    {"models"},
    {"executor"},
    {"scheduler"},
    {"disagg"},
    {"llm", "__init__"},  # the offline engine (``from moeserve import LLM``)
    {"server", "bench", "planner", "flags"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
# beside the server, not above it
FORBIDDEN = {("bench", "server"), ("planner", "server"), ("flags", "server")}
# known exceptions, each with why it stays
ALLOWED = {
    # bench pd runs a monolithic server and a PD deployment as processes, with the helpers the
    # server's own tests and demo use to start them
    ("moeserve.bench.pd", "moeserve.server.procs"),
    # bench frontend measures the server's own API processes, over scripted ranks in place of the
    # engine (``serve``'s ``ranks_factory``), started and stopped as bench pd starts its servers
    ("moeserve.bench.frontend", "moeserve.server.launch"),
    ("moeserve.bench.frontend", "moeserve.server.procs"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """The moeserve modules ``module`` imports, each with its line (``from a import b`` names
    ``a.b`` when that is a module, else ``a``)."""
    out = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out += [(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base, node.lineno)
                    for alias in node.names]
    return [(name, line) for name, line in out if name == "moeserve" or name.startswith("moeserve.")]


def _top(module: str) -> str:
    """The package (or top-level module) of ``module`` under moeserve."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _upward(module: str, name: str) -> bool:
    src, dst = _top(module), _top(name)
    if src == dst or (module, name) in ALLOWED:
        return False
    return LAYER[dst] > LAYER[src] or (src, dst) in FORBIDDEN


def upward_imports() -> list[str]:
    modules = _modules()
    return [f"{path.relative_to(PACKAGE.parent)}:{line}: {module} imports {name}"
            for module, path in modules.items() for name, line in _imports(module, path, set(modules))
            if _upward(module, name)]


def test_every_package_has_a_layer():
    tops = {_top(module) for module in _modules()}
    assert tops <= set(LAYER), f"give these a layer: {sorted(tops - set(LAYER))}"


def test_no_module_imports_a_layer_above_it():
    assert upward_imports() == []


def test_imports_are_read_relative_lazy_and_by_submodule(tmp_path):
    path = tmp_path / "x.py"
    path.write_text("import os\nfrom ..server import cli\n\ndef f():\n    from moeserve import LLM, llm\n")
    found = _imports("moeserve.bench.x", path, {"moeserve.server.cli", "moeserve.llm"})
    assert sorted(found) == [("moeserve", 5), ("moeserve.llm", 5), ("moeserve.server.cli", 2)]


def test_the_rules():
    assert _upward("moeserve.bench.one_batch", "moeserve.server.cli")  # beside the server, not above it
    assert _upward("moeserve.kernels.rope", "moeserve.config")  # a kernel knows no config
    assert _upward("moeserve.layers.moe", "moeserve.executor.model_runner")
    assert not _upward("moeserve.server.cli", "moeserve.bench.rank")  # the CLI registers the benchmarks
    assert not _upward("moeserve.disagg.roles", "moeserve.scheduler.scheduler")
