"""prefixserve.prompt sits below the server and diagnose: of prefixserve it may import only the
error hierarchy and the tokenizer."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PROMPT = Path(__file__).resolve().parents[2] / "prefixserve" / "prompt"
ALLOWED = ("prefixserve.prompt", "prefixserve.errors", "prefixserve.tokenizer")


@pytest.mark.parametrize("path", sorted(PROMPT.glob("*.py")), ids=lambda p: p.name)
def test_prompt_imports_only_what_lies_below_it(path: Path) -> None:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}:{node.lineno}: relative import"
            names = [node.module or ""]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name == "prefixserve" or name.startswith("prefixserve."):
                assert name.startswith(ALLOWED), f"{path.name}:{node.lineno} imports {name}"
