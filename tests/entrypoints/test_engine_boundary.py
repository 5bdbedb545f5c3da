"""The engine boundary: entry points reach the engine only through its public API.

Every module under prefixserve/entrypoints/ (and the benchmarks that drive engines) is
parsed, and every import in it, at module level or inside a function, is checked: none may
name the layers below the engine. Nor may an entry point reach through the engine front to
the engine object itself (`async_llm.engine`, `run_in_engine`), which would let it touch the
KV manager or the scheduler without importing them.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from import_graph import ROOT, imported_names, names_any

FORBIDDEN = ("prefixserve.kv", "prefixserve.scheduler", "prefixserve.worker", "prefixserve.model")
MODULES = sorted((ROOT / "entrypoints").rglob("*.py")) + [ROOT / "benchmarks" / "engines" / "prefixserve_engine.py"]
# The replicas drive engines too (the router and its index may use kv's hasher and events).
MODULES += [ROOT / "replicas" / f"{name}.py" for name in ("deployment", "front", "service", "metrics")]
MODULES += [ROOT / "benchmarks" / "replica_tenants.py"]


def violations(path: Path) -> list[str]:
    bad = [f"{path.name}:{line} imports {name}" for line, name in imported_names(path)
           if names_any(name, FORBIDDEN)]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        own = isinstance(node.value, ast.Name) and node.value.id == "self"  # a class's own field
        if node.attr in ("run_in_engine", "kv", "scheduler", "runner") or (node.attr == "engine" and not own):
            bad.append(f"{path.name}:{node.lineno} reaches through .{node.attr}")
    return bad


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_entry_point_uses_only_the_engine_api(path: Path) -> None:
    assert violations(path) == []


def test_the_check_catches_each_kind_of_leak(tmp_path: Path) -> None:
    """The walker itself: every way of importing a forbidden layer is caught."""
    package = ROOT / "entrypoints" / "server"
    samples = {
        "plain": "import prefixserve.kv.manager\n",
        "from": "from prefixserve.scheduler import Scheduler\n",
        "alias": "from prefixserve import worker\n",
        "nested": "def f():\n    from prefixserve.model.loader import load_model\n",
        "relative": "from ...model import loader\n",
        "reach": "def f(a):\n    return a.engine.kv\n",
    }
    for name, source in samples.items():
        path = package / f"_leak_probe_{name}.py"
        path.write_text(source)
        try:
            assert violations(path), name
        finally:
            path.unlink()
    clean = package / "_leak_probe_clean.py"
    clean.write_text("from prefixserve.engine import AsyncLLM\nfrom prefixserve.errors import NotFoundError\n")
    try:
        assert violations(clean) == []
    finally:
        clean.unlink()
