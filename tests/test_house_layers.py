"""The house: prefixserve's rooms import one another only downwards (shared/DESIGN.md).

A room is a subpackage of prefixserve/ or one of its top-level modules. Every module is parsed
(no import runs), every import in it, at module level or inside a function, relative ones
resolved, is an arrow from its room to the room it names. The checks: no circle between rooms
(a circle means no room in it can be understood or tested without the others), none of the
arrows that run back up, and kv and scheduler stay on ints and lists: no torch, nothing
outside the standard library but the hash (and redis-py in kv/stores).
"""
from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

from import_graph import ROOT, imported_names, module_name

# room -> rooms it must never import.
UPWARD = {
    "replicas": {"entrypoints", "benchmarks"},
    "engine": {"entrypoints", "replicas", "benchmarks", "diagnose"},
    "model": {"engine", "worker", "scheduler", "entrypoints", "platforms"},
    "worker": {"engine", "scheduler", "entrypoints", "platforms"},
    "platforms": {"engine", "worker", "scheduler", "entrypoints", "replicas", "benchmarks"},
}
# room -> the only rooms it may import (besides itself).
ONLY = {
    "kv": {"errors"},
    "scheduler": {"kv", "errors", "sampling_params"},
}
# room -> third-party packages it may import (besides the standard library); file -> more.
THIRD_PARTY = {"kv": {"xxhash"}, "scheduler": set()}
THIRD_PARTY_IN = {"kv/stores/redis_store.py": {"redis"}}


def room_of(module: str) -> str | None:
    """prefixserve.kv.manager -> kv; prefixserve.errors -> errors; outside the package -> None."""
    parts = module.split(".")
    if parts[0] != "prefixserve" or len(parts) < 2:
        return None
    return parts[1]


def rooms(root: Path) -> set[str]:
    return {p.name for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()} | {
        p.stem for p in root.glob("*.py") if p.name != "__init__.py"}


def arrows(root: Path = ROOT) -> dict[tuple[str, str], list[str]]:
    """(from room, to room) -> where: 'kv/manager.py:12 imports prefixserve.errors'."""
    known = rooms(root)
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for path in sorted(root.rglob("*.py")):
        here = room_of(module_name(path))
        if here is None:
            continue
        for line, name in imported_names(path):
            there = room_of(name)
            if there is not None and there != here and there in known:
                found[here, there].append(f"{path.relative_to(root)}:{line} imports {name}")
    return found


def circles(found: dict[tuple[str, str], list[str]]) -> list[list[str]]:
    """The room graph's strongly connected components of more than one room."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in found:
        graph[a].add(b)

    def reach(start: str) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reached = {room: reach(room) for room in list(graph)}
    components = {frozenset(r for r in reached[room] if room in reached.get(r, ())) for room in reached}
    return sorted(sorted(c) for c in components if len(c) > 1)


def upward(found: dict[tuple[str, str], list[str]]) -> list[str]:
    bad = []
    for (a, b), where in sorted(found.items()):
        if b in UPWARD.get(a, ()) or (a in ONLY and b not in ONLY[a]):
            bad += [f"{a} -> {b}: {w}" for w in where]
    return bad


def third_party(root: Path = ROOT) -> list[str]:
    bad = []
    for room, allowed in THIRD_PARTY.items():
        for path in sorted((root / room).rglob("*.py")):
            rel = str(path.relative_to(root))
            ok = allowed | THIRD_PARTY_IN.get(rel, set())
            for line, name in imported_names(path):
                top = name.split(".")[0]
                if top and top != "prefixserve" and top not in sys.stdlib_module_names and top not in ok:
                    bad.append(f"{rel}:{line} imports {name}")
    return bad


def test_no_circle_between_rooms() -> None:
    found = arrows()
    inside = [w for (a, b), where in found.items() for w in where
              if any({a, b} <= set(c) for c in circles(found))]
    assert circles(found) == [], inside


def test_no_arrow_runs_back_up() -> None:
    assert upward(arrows()) == []


def test_kv_and_scheduler_import_no_torch_nor_other_third_party() -> None:
    assert third_party() == []


def test_the_check_catches_each_kind_of_leak() -> None:
    """The checks themselves: each kind of arrow that runs back up, a circle, and torch in kv,
    written as a probe module into the room, is caught; the probe is removed afterwards."""
    probes = {
        # replicas -> entrypoints, which imports replicas: both a circle and an upward arrow
        ("replicas", "plain"): "import prefixserve.entrypoints.serve\n",
        ("engine", "relative"): "from ..diagnose import lint\n",
        ("engine", "alias"): "from prefixserve import benchmarks\n",
        ("model", "nested"): "def f():\n    from prefixserve.engine.config import EngineConfig\n",
        ("worker", "from"): "from prefixserve.scheduler import Scheduler\n",
        ("kv", "sideways"): "from prefixserve.tokenizer import Tokenizer\n",
        ("scheduler", "up"): "from prefixserve.worker import runner\n",
    }
    for (room, kind), source in probes.items():
        path = ROOT / room / f"_leak_probe_{kind}.py"
        path.write_text(source)
        try:
            assert any(path.name in line for line in upward(arrows())), (room, kind)
        finally:
            path.unlink()

    # tokenizer -> entrypoints closes a circle (entrypoints imports tokenizer); no rule names it.
    path = ROOT / "tokenizer" / "_leak_probe_circle.py"
    path.write_text("def f():\n    import prefixserve.entrypoints.cli\n")
    try:
        assert any({"entrypoints", "tokenizer"} <= set(c) for c in circles(arrows()))
        assert all("_leak_probe" not in line for line in upward(arrows()))
    finally:
        path.unlink()

    for room, source in (("kv", "import torch\n"), ("scheduler", "def f():\n    import numpy as np\n")):
        path = ROOT / room / "_leak_probe_torch.py"
        path.write_text(source)
        try:
            assert any(path.name in line for line in third_party()), room
        finally:
            path.unlink()

    assert circles(arrows()) == [] and upward(arrows()) == [] and third_party() == []


def test_rooms_are_subpackages_and_top_level_modules() -> None:
    assert (room_of("prefixserve.kv.manager"), room_of("prefixserve.errors"), room_of("prefixserve")) == \
        ("kv", "errors", None)
    assert {"kv", "scheduler", "engine", "entrypoints", "errors", "sampling_params"} <= rooms(ROOT)
