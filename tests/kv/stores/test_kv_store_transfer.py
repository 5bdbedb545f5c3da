"""Blocks copied out of a pool and loaded into other blocks of another pool are the same
K/V, for every layer, in float32 and bfloat16, whether read straight into the pool's memory or
through a host buffer (the path of a pool off the CPU); no other block is touched."""
from __future__ import annotations

import pytest
import torch

from prefixserve.worker.kv_transfer import LoadTargets, read_blocks


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_round_trip_between_pools(dtype, direct):
    gen = torch.Generator().manual_seed(0)
    src = [torch.randn(2, 12, 4, 2, 8, generator=gen).to(dtype) for _ in range(3)]
    dst = [torch.zeros_like(c) for c in src]
    rows = read_blocks(src, [3, 7, 1])
    targets = LoadTargets(dst, [5, 0, 9, 11], direct=direct)
    for row, buffers in zip(rows, targets.buffers):
        flat = memoryview(row).cast("B")
        pos = 0
        for b in buffers:
            b[:] = flat[pos:pos + b.nbytes]
            pos += b.nbytes
        assert pos == flat.nbytes
    targets.commit(3)     # the fourth block was never loaded: it must stay as it was
    for s, d in zip(src, dst):
        for a, b in ((3, 5), (7, 0), (1, 9)):
            assert torch.equal(s[:, a], d[:, b])
        untouched = [i for i in range(12) if i not in (5, 0, 9)]
        assert d[:, untouched].abs().sum() == 0
