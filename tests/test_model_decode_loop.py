"""The decode loop's two conversions (model/native/decode_loop.c) against torch's, their oracle: the
step's queries widened to float32 and the attention output narrowed to bfloat16 must be the bits the
torch copies they replace gave, or the decode program would leave the module path's bits. The loop's
kernel calls are held to the module path by tests/test_model_decode_program.py."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from native_kernel_build import build_fresh
from prefixserve.model.native.decode_loop import DecodeLoop, load


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> DecodeLoop:
    return build_fresh(load, tmp_path_factory)


# every kind of float32: halfway cases for bfloat16 (ties to even both ways), the largest values, the
# smallest normal and subnormals, infinities, signed zeros
SPECIAL = [1.00390625, 1.01171875, -1.00390625, 3.3895313892515355e38, -3.39e38, 1.1754944e-38, 1e-40, -1e-45,
           float("inf"), float("-inf"), 0.0, -0.0, 65504.0, 2.0 ** -133]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=False), min_size=1, max_size=70))
def test_narrowing_rounds_as_torch(kernel, values: list[float]) -> None:
    x = torch.tensor(values + SPECIAL, dtype=torch.float32)
    got = kernel.narrow(x)
    assert torch.equal(got.view(torch.int16), x.bfloat16().view(torch.int16))


def test_narrowing_a_nan_gives_a_nan_and_widening_is_exact(kernel) -> None:
    x = torch.randn(4099, generator=torch.Generator().manual_seed(3)) * 1e3
    x[[0, 17, 4098]] = float("nan")
    narrowed = kernel.narrow(x)
    assert narrowed[[0, 17, 4098]].isnan().all() and not narrowed[1:17].isnan().any()
    half = torch.cat([x.bfloat16(), torch.tensor(SPECIAL).bfloat16()])
    assert torch.equal(kernel.widen(half).view(torch.int32), half.float().view(torch.int32))
