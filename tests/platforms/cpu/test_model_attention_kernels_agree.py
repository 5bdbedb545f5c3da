"""A token's attention output has the same bits whether the decode kernel computes it (alone, with
other sequences, or stacked over a shared run and carried on into its own blocks) or the prefill
kernel computes it as a row of a chunk, in every body this CPU runs, float32 and bfloat16 pools.

Prefix caching is exact only with this: with caching on, a prompt whose uncached remainder is one
token runs that token through decode where caching off ran it in a prefill chunk; a later turn
reuses K/V its earlier decode steps wrote where caching off recomputes them in a prefill; a
preempted sequence recomputes its decoded tokens in a prefill. The oracle here is the other kernel,
which test_model_paged_prefill_attention.py holds to float64 attention."""
from __future__ import annotations

import pytest
import torch

from native_kernel_build import build_fresh
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.attention.torch_paged import TorchPagedAttention
from prefixserve.platforms.cpu.native import paged_decode_attention, paged_prefill_attention
from prefixserve.platforms.cpu.native.isa import ISAS, best_isa

BODIES = ISAS[: ISAS.index(best_isa()) + 1]


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    return (build_fresh(paged_prefill_attention.load, tmp_path_factory),
            build_fresh(paged_decode_attention.load, tmp_path_factory))


@pytest.fixture(params=BODIES)
def kernels(request, libraries):
    prefill, decode = libraries
    return prefill.with_body(request.param), decode.with_body(request.param)


def make_case(seed: int, dtype: torch.dtype, block_size: int, head_dim: int, group: int, length: int):
    gen = torch.Generator().manual_seed(seed)
    kv_heads = 2
    blocks = -(-length // block_size)
    num_blocks = blocks + 5
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table = torch.randperm(num_blocks, generator=gen)[:blocks][None]
    # the model's queries are in its dtype
    q = torch.randn(length, kv_heads * group, head_dim, generator=gen).to(dtype)
    return pool, table, q


def decode_rows(decode, q_rows: torch.Tensor, pool, table, positions: list[int], scale: float) -> torch.Tensor:
    """The queries at `positions` as decode tokens of as many sequences sharing one table, in one call."""
    n, heads, head_dim = q_rows.shape
    kv_heads = pool.shape[3]
    queries = q_rows.float().view(n, kv_heads, heads // kv_heads, head_dim)
    tables = table.expand(n, -1).contiguous()
    out, _ = decode(queries, pool, tables, torch.tensor([p + 1 for p in positions]), scale)
    return out.reshape(n, heads, head_dim).to(pool.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 128, 2), (16, 64, 1), (5, 32, 3), (128, 136, 2)])
def test_a_token_decoded_gets_the_bits_of_its_prefill_row(kernels, dtype, block_size, head_dim, group):
    prefill, decode = kernels
    length = 300
    pool, table, q = make_case(block_size + head_dim, dtype, block_size, head_dim, group, length)
    scale = head_dim ** -0.5
    chunk = prefill(q, pool, torch.tensor([0, length]), torch.tensor([length]), table, scale)
    # tile edges (64 keys), block edges, the first and the last position
    positions = [0, 1, 4, 5, 15, 16, 62, 63, 64, 65, 127, 128, 129, 191, 200, 255, 256, length - 1]
    decoded = decode_rows(decode, q[positions], pool, table, positions, scale)
    for i, p in enumerate(positions):
        assert torch.equal(decoded[i], chunk[p]), f"position {p}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_over_a_cached_context_agrees_too(kernels, dtype):
    """The same token as the last row of a short chunk continuing a cached context (what caching on
    runs) and alone (a one-token remainder)."""
    prefill, decode = kernels
    length, head_dim = 200, 128
    pool, table, q = make_case(7, dtype, 16, head_dim, 2, length)
    scale = 0.1
    for chunk_len in (2, 3, 17):
        rows = q[length - chunk_len:]
        chunk = prefill(rows, pool, torch.tensor([0, chunk_len]), torch.tensor([length]), table, scale)
        decoded = decode_rows(decode, q[length - 1:], pool, table, [length - 1], scale)
        assert torch.equal(decoded[0], chunk[-1]), chunk_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("run_blocks", [5, 8, 9])
def test_a_decode_step_over_a_shared_run_gets_the_prefill_bits(kernels, dtype, run_blocks):
    """The torch backend's decode step: sequences sharing their first blocks are stacked over the run
    (cut to whole softmax tiles), then carry on over their own blocks. Each must get what the prefill
    kernel gives the same token in a chunk, whether the shared blocks end on a tile's edge (8 blocks of
    16: 128 keys) or not (5, 9)."""
    prefill, decode = kernels
    backend = TorchPagedAttention(use_native=True)
    backend._prefill_kernel, backend._decode_kernel = prefill, decode
    gen = torch.Generator().manual_seed(run_blocks)
    block_size, kv_heads, group, head_dim, num_blocks = 16, 2, 2, 64, 60
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    run, rest = order[:run_blocks].tolist(), order[run_blocks:].tolist()
    own_lens = [1, 16, 17, 40, 64]
    tables = [run + rest[i * 4:i * 4 + 4] for i in range(len(own_lens))]
    lens = [n + run_blocks * block_size for n in own_lens]
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size)
    # the step's K/V are the ones already at their slots: writing them changes nothing
    k_pool, v_pool = pool[0].flatten(0, 1), pool[1].flatten(0, 1)
    step = backend.build_metadata(meta)
    assert step.decode.shared, "the members share a run"
    out = backend.forward(q, k_pool[meta.slot_mapping], v_pool[meta.slot_mapping], pool, step, 0.125)
    for i, length in enumerate(lens):
        # the token as the last row of a two-token chunk (the row before it: any query)
        rows = torch.cat([torch.randn(1, kv_heads * group, head_dim, generator=gen).to(dtype), q[i:i + 1]])
        chunk = prefill(rows, pool, torch.tensor([0, 2]), torch.tensor([length]), torch.tensor([tables[i]]), 0.125)
        assert torch.equal(out[i], chunk[-1]), i
