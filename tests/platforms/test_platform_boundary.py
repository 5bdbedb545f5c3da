"""The platform boundary: one kind of device's kernels stay in its platform package.

Every module of the package is parsed, and every import in it, at module level or inside a function,
relative ones resolved, is checked: nothing outside prefixserve/platforms/cpu imports the CPU platform
(its native kernels included), except the benchmarks, which sit above every part and time the kernels
themselves; and model/ and worker/ import no platform at all (they ask model/platform.py's registry,
which loads the platforms package by name).
"""
from __future__ import annotations

from pathlib import Path

import pytest

from import_graph import ROOT, imported_names, names_any

CPU_PLATFORM = ROOT / "platforms" / "cpu"
# parts that may import a platform's modules: the platform itself, and the benchmarks above everything
MAY_IMPORT_CPU = (CPU_PLATFORM, ROOT / "benchmarks")
NO_PLATFORM = (ROOT / "model", ROOT / "worker")
MODULES = sorted(ROOT.rglob("*.py"))


def _inside(path: Path, folders: tuple[Path, ...]) -> bool:
    return any(path.is_relative_to(folder) for folder in folders)


def violations(path: Path) -> list[str]:
    forbidden: tuple[str, ...] = ()
    if _inside(path, NO_PLATFORM):
        forbidden = ("prefixserve.platforms",)
    elif not _inside(path, MAY_IMPORT_CPU):
        forbidden = ("prefixserve.platforms.cpu",)
    return [f"{path.relative_to(ROOT)}:{line} imports {name}" for line, name in imported_names(path)
            if names_any(name, forbidden)]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_platform_modules_stay_behind_the_registry(path: Path) -> None:
    assert violations(path) == []


def test_the_check_catches_each_kind_of_leak() -> None:
    """The walker itself: every way of importing a platform from where it may not be is caught."""
    samples = {
        ROOT / "engine": {
            "plain": "import prefixserve.platforms.cpu.native.build\n",
            "from": "from prefixserve.platforms.cpu.dtype_choice import choose_dtype\n",
            "alias": "from prefixserve.platforms import cpu\n",
            "nested": "def f():\n    from prefixserve.platforms.cpu.native import report\n",
            "relative": "from ..platforms.cpu import packed_weight\n",
        },
        ROOT / "model": {
            "any_platform": "import prefixserve.platforms\n",
            "alias": "from prefixserve import platforms\n",
            "nested": "def f():\n    import prefixserve.platforms.cuda\n",
            "relative": "from ..platforms import cpu\n",
        },
        ROOT / "worker": {
            "from": "from prefixserve.platforms.cpu.decode_program import DecodeProgram\n",
            "relative": "from ..platforms.cpu.native import row_argmax\n",
        },
    }
    for folder, sources in samples.items():
        for name, source in sources.items():
            path = folder / f"_leak_probe_{name}.py"
            path.write_text(source)
            try:
                assert violations(path), f"{folder.name}: {name}"
            finally:
                path.unlink()
    allowed = {
        ROOT / "model": "from prefixserve.model.platform import platform_for\n",
        ROOT / "benchmarks": "from prefixserve.platforms.cpu.native.isa import cpu_probe\n",
        CPU_PLATFORM: "from prefixserve.platforms.cpu.native import build\nfrom ..cpu import panels\n",
    }
    for folder, source in allowed.items():
        path = folder / "_leak_probe_clean.py"
        path.write_text(source)
        try:
            assert violations(path) == [], folder.name
        finally:
            path.unlink()
