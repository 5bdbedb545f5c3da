"""The paged decode-attention kernel against plain float64 softmax attention over gathered K/V."""
from __future__ import annotations

import pytest
import torch

from native_kernel_build import build_fresh
from prefixserve.model.native.paged_decode_attention import PagedDecodeAttention, load


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> PagedDecodeAttention:
    return build_fresh(load, tmp_path_factory)


def reference(q, pool, tables, lens, scale):
    outs, lses = [], []
    for b in range(q.shape[0]):
        keys = pool[0][tables[b]].flatten(0, 1)[: lens[b]].double().transpose(0, 1)   # [KVH, L, D]
        values = pool[1][tables[b]].flatten(0, 1)[: lens[b]].double().transpose(0, 1)
        scores = q[b].double() @ keys.transpose(-1, -2) * scale                        # [KVH, R, L]
        lse = scores.logsumexp(-1)
        outs.append((scores - lse[..., None]).exp() @ values)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("rows", [1, 2, 7, 32])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
def test_matches_reference(kernel: PagedDecodeAttention, block_size: int, rows: int, head_dim: int,
                           dtype: torch.dtype) -> None:
    """A bfloat16 pool is attended in float32: the reference reads the same (bfloat16) values in
    float64, so the tolerance is float32's either way."""
    gen = torch.Generator().manual_seed(block_size * 1000 + rows * 10 + head_dim)
    kv_heads, num_blocks, batch, width = 3, 23, 4, 6
    pool = (torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen) * 2).to(dtype)
    q = torch.randn(batch, kv_heads, rows, head_dim, generator=gen)
    # distinct random blocks per sequence, lengths cutting into the middle of a block
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)])
    lens = torch.randint(1, width * block_size + 1, (batch,), generator=gen)
    out, lse = kernel(q, pool, tables, lens, head_dim ** -0.5)
    want_out, want_lse = reference(q, pool, tables, lens, head_dim ** -0.5)
    torch.testing.assert_close(out.double(), want_out, rtol=0, atol=2e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-5)


def test_rejects_lengths_past_the_table(kernel: PagedDecodeAttention) -> None:
    pool = torch.zeros(2, 4, 4, 1, 8)
    with pytest.raises(ValueError, match="past its block table"):
        kernel(torch.zeros(1, 1, 1, 8), pool, torch.tensor([[0, 1]]), torch.tensor([9]), 1.0)
