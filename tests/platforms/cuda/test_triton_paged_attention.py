"""The Triton paged-attention kernels in float32 (on the CPU under Triton's interpreter without a GPU), against the
torch backend's gathers and SDPA (model/attention/torch_paged.py with no platform kernels) as the oracle.

Steps are drawn at random: pools with shuffled physical blocks, ragged chunk lengths over cached contexts
of any length (inside a block, on its edge, several blocks), single-token decodes mixed with chunks in one
step, GQA groups of 1, 2 and 4, head dims that are and are not a power of two, and decode sequences that
share leading blocks (the cascade) with splits of the context forced small so every sequence crosses
several. Each case checks every output row, and that the step's K/V landed in their slots.
"""
from __future__ import annotations

import random

import pytest
import torch

from kernel_device import KERNEL_DEVICE
from prefixserve.model.attention.cascade import plan_decode
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.attention.torch_paged import TorchPagedAttention
from prefixserve.platforms.cuda.attention import TritonPagedAttention

TOLERANCE = 2e-5


def random_step(rng: random.Random, *, num_blocks: int, block_size: int, chunks: list[tuple[int, int]],
                shared: int = 0):
    """(query_lens, seq_lens, block tables) for sequences given as (cached tokens, new tokens); the first
    `shared` blocks of every sequence's table are one common run when shared > 0."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    common = [free.pop() for _ in range(shared)]
    query_lens, seq_lens, tables = [], [], []
    for cached, new in chunks:
        total = cached + new
        blocks = -(-total // block_size)
        own = [free.pop() for _ in range(blocks - min(shared, blocks))]
        tables.append(common[:blocks] + own)
        query_lens.append(new)
        seq_lens.append(total)
    return query_lens, seq_lens, tables


def run_both(query_lens, seq_lens, tables, *, block_size, num_blocks, heads, kv_heads, head_dim, seed,
             num_splits=None):
    torch.manual_seed(seed)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, KERNEL_DEVICE)
    tokens = sum(query_lens)
    pool, q, k, v = (torch.randn(*shape, device=KERNEL_DEVICE) for shape in (
        (2, num_blocks, block_size, kv_heads, head_dim), (tokens, heads, head_dim), (tokens, kv_heads, head_dim),
        (tokens, kv_heads, head_dim)))
    scale = head_dim ** -0.5
    reference = TorchPagedAttention(use_native=False, device=KERNEL_DEVICE)
    expected_pool = pool.clone()
    expected = reference.forward(q, k, v, expected_pool, reference.build_metadata(meta), scale)
    backend = TritonPagedAttention(device=KERNEL_DEVICE, num_splits=num_splits)
    got = backend.forward(q, k, v, pool, backend.build_metadata(meta), scale)
    assert torch.equal(pool, expected_pool)
    return got, expected


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 16), (4, 2, 16), (8, 2, 32), (4, 2, 24)])
def test_ragged_prefill_over_cached_contexts(heads, kv_heads, head_dim):
    rng = random.Random(heads * 100 + head_dim)
    # fresh prompt, chunk over a cached context inside a block / on a block edge / over several blocks,
    # a chunk longer than one query tile, and a decode token in the same step
    chunks = [(0, 21), (5, 3), (8, 9), (37, 40), (13, 1), (0, 2)]
    step = random_step(rng, num_blocks=40, block_size=8, chunks=chunks)
    got, expected = run_both(*step, block_size=8, num_blocks=40, heads=heads, kv_heads=kv_heads,
                             head_dim=head_dim, seed=1)
    assert (got - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("num_splits", [3, 8, None])
def test_decode_split_over_long_contexts(num_splits):
    rng = random.Random(num_splits or 0)
    chunks = [(rng.randrange(0, 150), 1) for _ in range(5)] + [(0, 1)]
    step = random_step(rng, num_blocks=120, block_size=8, chunks=chunks)
    got, expected = run_both(*step, block_size=8, num_blocks=120, heads=8, kv_heads=2, head_dim=16, seed=2,
                             num_splits=num_splits)
    assert (got - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("block_size,shared", [(8, 6), (16, 2)])
def test_cascade_shares_a_prefix_and_merges_each_suffix(block_size, shared):
    rng = random.Random(block_size)
    prefix = shared * block_size
    # six decodes over one cached prefix (suffixes of different lengths, one ending on a block edge),
    # one unrelated decode and one chunk in the same step
    chunks = [(prefix + rng.randrange(1, 3 * block_size), 1) for _ in range(5)] + [(prefix + block_size - 1, 1)]
    query_lens, seq_lens, tables = random_step(rng, num_blocks=80, block_size=block_size, chunks=chunks,
                                               shared=shared)
    free = sorted(set(range(80)) - {b for t in tables for b in t})
    query_lens += [1, 5]
    seq_lens += [30, 12]
    tables += [free[:4], free[4:6]]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    plan = plan_decode(meta)
    assert plan is not None and len(plan.shared) == 1 and len(plan.shared[0].members) == 6
    got, expected = run_both(query_lens, seq_lens, tables, block_size=block_size, num_blocks=80, heads=4,
                             kv_heads=2, head_dim=16, seed=3, num_splits=3)
    assert (got - expected).abs().max().item() < TOLERANCE
