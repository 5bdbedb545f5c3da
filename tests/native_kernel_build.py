"""Building a native kernel afresh for its test module.

On a machine that can build the kernels (x86 with AVX2 and a C compiler, as every project
machine is) a kernel that does not build fails its tests instead of skipping them: every
step depends on the kernels for speed, and a silent fallback would hide that.
"""
from __future__ import annotations

from typing import Callable, TypeVar

import pytest

from prefixserve.platforms.cpu.native.build import buildable, compiler

K = TypeVar("K")
NEEDS = "needs an x86 CPU with AVX2 and a C compiler"
BUILDABLE = buildable()
needs_kernel = pytest.mark.skipif(not BUILDABLE, reason=NEEDS)


def build_fresh(load: Callable[..., K | None], tmp_path_factory: pytest.TempPathFactory) -> K:
    """The kernel `load` builds from source into a new folder (not the user's cache)."""
    if not BUILDABLE:
        pytest.skip(NEEDS)
    built = load(compiler(), tmp_path_factory.mktemp("kernels"))
    assert built is not None, "the kernel must build on a machine with AVX2 and a C compiler"
    return built
