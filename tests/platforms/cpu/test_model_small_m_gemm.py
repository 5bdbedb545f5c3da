"""The small-m projection kernel against float64 matmuls, its dispatch from `linear`, and its fallbacks.

The kernel must be built wherever a project machine can build it (x86 with AVX2 and a C
compiler): these tests fail, not skip, if it silently is not, because every decode step
depends on it for speed.
"""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from prefixserve.platforms.cpu.linear import linear
from native_kernel_build import build_fresh, needs_kernel
from prefixserve.platforms.cpu.native.build import build, compiler, cpu_supported
from prefixserve.platforms.cpu.native.small_m_gemm import MAX_ROWS, SmallMGemm, default_kernel, load


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    return out if b is None else out + b.double()


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> SmallMGemm:
    return build_fresh(load, tmp_path_factory)


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 7, 12, MAX_ROWS])
@pytest.mark.parametrize("n", [1, 5, 6, 13, 97])
@pytest.mark.parametrize("k", [8, 136, 1024])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(kernel: SmallMGemm, m: int, n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if with_bias else None
    got = kernel(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    # float32 accumulation over k terms of unit variance
    torch.testing.assert_close(got.double(), reference(x, w, b), rtol=0, atol=2e-6 * k ** 0.5 * 4)


@needs_kernel
def test_threads_split_the_rows_without_overlap(kernel: SmallMGemm) -> None:
    """Every output written exactly once whatever the thread count: a missed or doubled tile shows."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 64, generator=gen), torch.randn(6 * 7 + 4, 64, generator=gen)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            torch.testing.assert_close(kernel(x, w).double(), reference(x, w, None), rtol=0, atol=1e-4)
    finally:
        torch.set_num_threads(before)


@needs_kernel
def test_linear_uses_the_kernel_for_few_rows_only(monkeypatch) -> None:
    calls = []
    real = default_kernel()
    assert real is not None, "the kernel must build on a machine that can build it"
    monkeypatch.setattr("prefixserve.platforms.cpu.linear.default_kernel",
                        lambda: (lambda *a: calls.append(a[0].shape[0]) or real(*a)))
    w = torch.randn(40, 64)
    for rows in (1, MAX_ROWS, MAX_ROWS + 1):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(linear(x, w).double(), reference(x, w, None), rtol=0, atol=1e-4)
    assert calls == [1, MAX_ROWS]


@pytest.mark.parametrize("case", ["k not a multiple of 8", "non-contiguous", "float64", "needs grad", "3-d"])
def test_unsupported_operands_fall_back_to_torch(case: str) -> None:
    x, w = torch.randn(3, 64), torch.randn(10, 64)
    if case == "k not a multiple of 8":
        x, w = torch.randn(3, 60), torch.randn(10, 60)
    elif case == "non-contiguous":
        x = torch.randn(64, 3).T
    elif case == "float64":
        x, w = x.double(), w.double()
    elif case == "needs grad":
        x.requires_grad_(True)
    elif case == "3-d":
        x = torch.randn(2, 3, 64)
    assert case == "needs grad" or not SmallMGemm.supports(x, w, None)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
    if case == "needs grad":
        linear(x, w).sum().backward()
        assert x.grad is not None


def test_a_broken_compiler_means_no_kernel_not_an_error(tmp_path) -> None:
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` executable to stand in for a broken compiler")
    if not cpu_supported():
        assert load(false, tmp_path) is None  # not even tried
        return
    assert load(false, tmp_path) is None
    assert load(None, tmp_path) is None


@needs_kernel
def test_build_is_cached_per_source_and_compiler(tmp_path) -> None:
    cc = compiler()
    first = build("small_m_gemm", cc, tmp_path)
    stamp = first.stat().st_mtime_ns
    assert build("small_m_gemm", cc, tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left behind


def test_turned_off_by_environment(monkeypatch) -> None:
    monkeypatch.setenv("PREFIXSERVE_NATIVE_KERNELS", "0")
    default_kernel.cache_clear()
    try:
        assert default_kernel() is None
    finally:
        default_kernel.cache_clear()


@needs_kernel
def test_unwritable_cache_folder_builds_in_a_temp_folder(tmp_path, monkeypatch) -> None:
    """A cache folder that cannot be used (here a file in its place: what fails even for root) still
    gets the kernel, built and loaded in a private temp folder that is removed once loaded."""
    locked, temp = tmp_path / "locked", tmp_path / "tmp"
    locked.write_text("not a folder")
    temp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(temp))
    assert load(compiler(), locked) is not None
    assert list(temp.iterdir()) == []
