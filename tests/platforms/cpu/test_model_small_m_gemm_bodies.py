"""Every body of the few-row GEMM this CPU runs (AVX2 everywhere; AVX-512 where torch reports it)
against float64 products, over the shapes that exercise
the register tiles' edges: row counts around the 6-row groups, weight rows around the 4-row
tiles, k with and without a masked tail. The engine relies on one more property: a row's bits
do not depend on the rows computed beside it (a request decoded alone or in a batch, cached or
not, gets the same logits), checked bit for bit for every row count the kernel takes.
"""
from __future__ import annotations

import pytest
import torch

from native_kernel_build import build_fresh
from prefixserve.platforms.cpu.native.small_m_gemm import (AVX2, AVX512, MAX_ROWS, MAX_ROWS_BY_ISA, SmallMGemm,
                                                            best_isa, load, runnable_isas)

ISAS = runnable_isas()


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> SmallMGemm:
    return build_fresh(load, tmp_path_factory)


def test_the_widest_runnable_body_is_the_default(kernel: SmallMGemm) -> None:
    assert kernel.isa == best_isa() and ISAS[-1] == (AVX2 if best_isa() == AVX2 else AVX512)
    assert MAX_ROWS == MAX_ROWS_BY_ISA[best_isa()]
    with pytest.raises(ValueError, match="unknown instruction set"):
        kernel.with_isa("sse2")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 13, 16, MAX_ROWS])
@pytest.mark.parametrize("n, k", [(1, 8), (5, 136), (13, 1024), (97, 520)])
def test_float32_body_matches_float64(kernel: SmallMGemm, isa: str, m: int, n: int, k: int) -> None:
    body = kernel.with_isa(isa)
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    x, w, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    for bias in (None, b):
        got = body(x, w, bias)
        exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
        terms = x.double().abs() @ w.double().abs().T
        assert got.dtype == torch.float32 and got.shape == (m, n)
        # float32 accumulation: at most ~k roundings of 2^-24 of the terms' magnitude
        assert ((got.double() - exact).abs() <= k * 2.0 ** -24 * terms + 1e-6).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 4, 6, 11, 16, MAX_ROWS])
@pytest.mark.parametrize("n, k", [(3, 8), (13, 136), (96, 3072)])
def test_bfloat16_body_is_the_exact_product_rounded_once(kernel: SmallMGemm, isa: str, m: int, n: int, k: int) -> None:
    body = kernel.with_isa(isa)
    gen = torch.Generator().manual_seed(m * 131 + n + k)
    x, w = torch.randn(m, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    got = body(x, w, b)
    exact = x.double() @ w.double().T + b.double()
    terms = x.double().abs() @ w.double().abs().T
    assert got.dtype == torch.bfloat16
    # float32 accumulation of exact products, then one rounding to bfloat16 (half an ulp: 2^-8 relative)
    assert ((got.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + k * 2.0 ** -24 * terms + 1e-30).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(kernel: SmallMGemm, isa: str, dtype: torch.dtype) -> None:
    body = kernel.with_isa(isa)
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(MAX_ROWS, 136, generator=gen).to(dtype)
    w, b = torch.randn(13, 136, generator=gen).to(dtype), torch.randn(13, generator=gen).to(dtype)
    alone = torch.cat([body(rows[r:r + 1], w, b) for r in range(MAX_ROWS)])
    for m in range(2, MAX_ROWS + 1):
        # the same rows in every position of a batch of m: row r of a batch starting at `start`
        start = (m * 5) % (MAX_ROWS - m + 1)
        assert torch.equal(body(rows[start:start + m].contiguous(), w, b), alone[start:start + m]), m


@pytest.mark.parametrize("isa", ISAS)
def test_threads_split_the_weight_rows_without_overlap(kernel: SmallMGemm, isa: str) -> None:
    """Every output written once whatever the thread count: a missed or doubled tile shows."""
    body = kernel.with_isa(isa)
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 64, generator=gen), torch.randn(4 * 11 + 3, 64, generator=gen)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(body(x, w))
        torch.testing.assert_close(results[0].double(), x.double() @ w.double().T, rtol=0, atol=1e-4)
        assert all(torch.equal(r, results[0]) for r in results[1:])
    finally:
        torch.set_num_threads(before)
