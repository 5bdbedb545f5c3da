"""The native argmax behind greedy sampling against torch.argmax, the oracle it must match exactly:
the first index of the maximum, of the first NaN where a row holds one, and 0 for a row of -inf; on
one row split among threads and on many rows, for widths that leave ragged vector tails."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from native_kernel_build import build_fresh
from prefixserve.platforms.cpu.native.row_argmax import RowArgmax, load
from prefixserve.worker.sampler import Sampler, SamplingRow
from prefixserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> RowArgmax:
    return build_fresh(load, tmp_path_factory)


@pytest.mark.parametrize("rows", [1, 2, 3, 16])
@pytest.mark.parametrize("width", [1, 7, 8, 9, 1001, 151936])
def test_matches_torch_on_random_rows(kernel: RowArgmax, rows: int, width: int) -> None:
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(rows * width))
    assert torch.equal(kernel(x), torch.argmax(x, dim=-1))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_ties_nans_and_empty_rows_as_torch_has_them(kernel: RowArgmax, threads: int) -> None:
    """Ties in different chunks of a row split among threads, a NaN after the maximum, a NaN in a later
    chunk than an earlier, larger value, a row of -inf, a row of one value repeated."""
    x = torch.randn(6, 1000, generator=torch.Generator().manual_seed(threads))
    x[0, 3] = x[0, 998] = 40.0
    x[1, 10], x[1, 700] = 1e30, float("nan")
    x[2, 900], x[2, 5] = float("nan"), float("nan")
    x[3] = float("-inf")
    x[4] = 2.5
    x[5, 499], x[5, 500] = 9.0, 9.0
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for r in range(6):
            assert torch.equal(kernel(x[r:r + 1]), torch.argmax(x[r:r + 1], dim=-1)), r
        assert torch.equal(kernel(x), torch.argmax(x, dim=-1))
    finally:
        torch.set_num_threads(before)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.sampled_from([-1.0, 0.0, 0.5, 3.0, float("inf"), float("-inf"), float("nan")]),
                         min_size=1, max_size=40), min_size=1, max_size=4).filter(
    lambda rows: len({len(r) for r in rows}) == 1))
def test_matches_torch_on_few_distinct_values(kernel: RowArgmax, rows: list[list[float]]) -> None:
    x = torch.tensor(rows, dtype=torch.float32)
    assert torch.equal(kernel(x), torch.argmax(x, dim=-1))


def test_takes_only_float32_cpu_rows(kernel: RowArgmax) -> None:
    assert kernel(torch.zeros(0, 5)).shape == (0,)
    for bad in (torch.zeros(2, 5, dtype=torch.bfloat16), torch.zeros(5), torch.zeros(2, 0)):
        with pytest.raises(ValueError, match="row_argmax"):
            kernel(bad)


def test_greedy_sampling_picks_torchs_argmax() -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 5000, generator=gen)
    logits[2, 17] = logits[2, 4000] = 30.0
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], []) for _ in range(4)]
    assert Sampler()(logits.clone(), rows).token_ids == torch.argmax(logits, dim=-1).tolist()
