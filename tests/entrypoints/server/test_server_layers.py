"""The server's layers: dialects on top, shared things below them, and no arrow running back up.

Every module under prefixserve/entrypoints/server is parsed and every import in it, at module
level or inside a function, relative ones resolved (import_graph.py), is
checked. A room is a subpackage (openai/, anthropic/, responses/, prompting/) or a top-level module
(pipeline.py, state.py, ...). The dialects (openai/, anthropic/, responses/) may use any shared room but
never each other; no shared room may import a dialect (only app.py, which mounts their routes);
and no two rooms may reach each other through their imports (no circle).
"""
from __future__ import annotations

from import_graph import ROOT, imported_names

SERVER = ROOT / "entrypoints" / "server"
PACKAGE = "prefixserve.entrypoints.server"
DIALECTS = ("openai", "anthropic", "responses")
MOUNTS_ROUTES = "app"


def room_of(module: str) -> str | None:
    """The room a dotted name under the server belongs to (None: the package itself, or outside)."""
    if not module.startswith(PACKAGE + "."):
        return None
    return module[len(PACKAGE) + 1:].split(".")[0]


def arrows() -> list[tuple[str, int, str, str, str]]:
    """(file, line, imported name, from room, to room) of every import from one room to another."""
    found = []
    for path in sorted(SERVER.rglob("*.py")):
        parts = path.relative_to(SERVER).with_suffix("").parts
        source = parts[0] if parts[0] != "__init__" else None
        if source is None:
            continue
        for line, name in imported_names(path):
            target = room_of(name)
            if target is not None and target != source:
                found.append((str(path.relative_to(SERVER)), line, name, source, target))
    return found


def circles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The rooms that reach each other, each group sorted (strongly connected, more than one room)."""
    rooms = {r for edge in edges for r in edge}
    reach = {}
    for start in rooms:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            for a, b in edges:
                if a == node and b not in seen:
                    seen.add(b)
                    todo.append(b)
        reach[start] = seen
    groups = {frozenset({start} | {r for r in reach[start] if start in reach[r]}) for start in rooms}
    return sorted(sorted(g) for g in groups if len(g) > 1)


def violations() -> list[str]:
    bad = []
    for where, line, name, source, target in arrows():
        if source in DIALECTS and target in DIALECTS:
            bad.append(f"{where}:{line} imports {name}: one dialect imports another")
        elif target in DIALECTS and source != MOUNTS_ROUTES:
            bad.append(f"{where}:{line} imports {name}: a shared module imports a dialect")
    edges = {(source, target) for _, _, _, source, target in arrows()}
    bad += [f"a circle between the rooms {' '.join(group)}" for group in circles(edges)]
    return bad


def test_the_server_has_no_arrow_running_back_up():
    assert violations() == []


def test_the_check_catches_each_kind_of_leak():
    """The check itself: each kind of leak, written the ways an import can be written, is caught."""
    probes = {
        "dialect": (SERVER / "anthropic" / "_layer_probe.py",
                    "from ..openai.protocol import ChatCompletionRequest\n", "one dialect imports another"),
        "shared": (SERVER / "_layer_probe.py",
                   "def f():\n    from prefixserve.entrypoints.server.openai import chat\n",
                   "a shared module imports a dialect"),
        "alias": (SERVER / "prompting" / "_layer_probe.py",
                  "from prefixserve.entrypoints.server import anthropic\n", "a shared module imports a dialect"),
        "circle": (SERVER / "prompting" / "_layer_probe.py",
                   "from ..pipeline import start\n", "a circle between the rooms pipeline prompting"),
    }
    for name, (path, source, complaint) in probes.items():
        path.write_text(source)
        try:
            assert any(complaint in v for v in violations()), name
        finally:
            path.unlink()
    clean = SERVER / "openai" / "_layer_probe.py"
    clean.write_text("from prefixserve.entrypoints.server.pipeline import start\n"
                     "from ..streaming import sse\nfrom . import protocol\n")
    try:
        assert violations() == []
    finally:
        clean.unlink()
