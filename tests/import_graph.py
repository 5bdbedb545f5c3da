"""The imports of prefixserve's modules, read with ast (no module is imported, so a check can
parse the whole package without torch or Ray and see imports inside functions too).

Shared by the architecture tests: test_engine_boundary.py (what entry points may import),
test_platform_boundary.py (who may import a platform), test_server_layers.py (the rooms of the
server) and test_house_layers.py (which rooms of the package may import which).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "prefixserve"


def module_name(path: Path) -> str:
    """prefixserve/kv/manager.py -> prefixserve.kv.manager; a package's __init__.py -> the package."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file, at module level or inside a function,
    relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found.append((node.lineno, base))
            # `from prefixserve import kv` names the module in the alias
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def names_any(name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether the dotted module `name` is one of `prefixes` or inside one."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)
