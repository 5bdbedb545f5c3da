"""The test tree's own rule: no test module imports another. What several test modules share lives
in a support module beside conftest.py (live_server.py, tool_fixtures.py, waiting.py, ...) or in
a conftest.py; a test module imported by another runs its tests' module-level code twice, ties
one file's fixtures to another's, and only imports at all when pytest happened to collect the
other module's folder first."""
from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, at module level or inside a function;
    `from m import n` gives m and m.n (n may be a module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def imports_of_test_modules(path: Path) -> list[str]:
    """'file:line imports module' for each import in `path` of a module named test_*."""
    hits: list[tuple[int, str]] = []
    for line, name in imported_names(path):
        # `from test_b import x` names test_b once, not once more for each of its names
        if any(part.startswith("test_") for part in name.split(".")) and (line, name.rpartition(".")[0]) not in hits:
            hits.append((line, name))
    return [f"{path.name}:{line} imports {name}" for line, name in hits]


def test_no_test_module_imports_another() -> None:
    found = [f"{path.parent.relative_to(TESTS)}/{hit}" for path in sorted(TESTS.rglob("*.py"))
             for hit in imports_of_test_modules(path)]
    assert not found, "move what they share into a support module or conftest.py:\n" + "\n".join(found)


def test_the_check_sees_every_form_of_import(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import test_a\nfrom test_b import x\nfrom tests.kv.test_c import y\n"
                      "def f():\n    from test_d import z\nimport live_server\nfrom testing import t\n"
                      "from tests.kv import test_e\n")
    assert [hit.split(" imports ")[1] for hit in imports_of_test_modules(sample)] == [
        "test_a", "test_b", "tests.kv.test_c", "tests.kv.test_e", "test_d"]
