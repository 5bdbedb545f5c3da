"""The paged decode-attention kernel against plain float64 softmax attention over gathered K/V, in
each body this CPU runs (AVX2 everywhere, AVX-512 and its bfloat16 pairs where torch reports them),
and the two properties exact prefix caching rests on: a softmax carried on from a shared run's state
gives the bits of one pass over the whole context, and a row's bits do not depend on the rows beside
it. (That a token gets the prefill kernel's bits: test_model_attention_kernels_agree.py.)"""
from __future__ import annotations

import pytest
import torch

from native_kernel_build import build_fresh
from prefixserve.model.native.isa import AVX512_BF16, ISAS, best_isa
from prefixserve.model.native.paged_decode_attention import DecodeState, PagedDecodeAttention, load

BODIES = ISAS[: ISAS.index(best_isa()) + 1]


@pytest.fixture(scope="module", params=BODIES)
def kernel(request, tmp_path_factory) -> PagedDecodeAttention:
    return build_fresh(load, tmp_path_factory).with_body(request.param)


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
    """The reference reads the same (bfloat16) values in float64. A float32 body attends a bfloat16 pool
    in float32, so the tolerance is float32's either way; the bfloat16 body rounds each probability to
    bfloat16 for its P V products, so its outputs are held to a rounding of sum_j p_j |v_j| (the
    log-sum-exps, from float32 probabilities, to float32's)."""
    gen = torch.Generator().manual_seed(block_size * 1000 + rows * 10 + head_dim)
    kv_heads, num_blocks, batch, width = 3, 23, 4, 6
    pool = (torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen) * 2).to(dtype)
    # a bfloat16 model's queries hold bfloat16 values (the pair body multiplies them as such)
    q = torch.randn(batch, kv_heads, rows, head_dim, generator=gen).to(dtype).float()
    # distinct random blocks per sequence, lengths cutting into the middle of a block
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)])
    lens = torch.randint(1, width * block_size + 1, (batch,), generator=gen)
    out, lse = kernel(q, pool, tables, lens, head_dim ** -0.5)
    want_out, want_lse = reference(q, pool, tables, lens, head_dim ** -0.5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=2e-5)
    if kernel.body == AVX512_BF16 and dtype == torch.bfloat16 and head_dim % 16 == 0:
        magnitudes = pool.clone()
        magnitudes[1] = magnitudes[1].abs()
        terms, _ = reference(q, magnitudes, tables, lens, head_dim ** -0.5)
        err = (out.double() - want_out).abs()
        assert (err <= 2 ** -8 * terms + 2e-5).all(), float((err - 2 ** -8 * terms).max())
    else:
        torch.testing.assert_close(out.double(), want_out, rtol=0, atol=2e-5)


def test_rejects_lengths_past_the_table(kernel: PagedDecodeAttention) -> None:
    pool = torch.zeros(2, 4, 4, 1, 8)
    with pytest.raises(ValueError, match="past its block table"):
        kernel(torch.zeros(1, 1, 1, 8), pool, torch.tensor([[0, 1]]), torch.tensor([9]), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 144])
def test_carrying_a_runs_state_gives_the_bits_of_one_pass(kernel: PagedDecodeAttention, dtype: torch.dtype,
                                                         head_dim: int) -> None:
    """Several sequences share their first blocks (a cached document): the run is attended once with
    every member's queries stacked as the rows of one task, left unfinished, and each member carries
    on over its own blocks. Each member must get exactly what one pass over its whole table gives,
    whatever the number of members stacked. The run is two softmax tiles: one pass starts a tile where
    the member's own blocks start."""
    gen = torch.Generator().manual_seed(head_dim)
    block_size, kv_heads, group, num_blocks = 16, 2, 3, 40
    run_blocks = 2 * kernel.tile_keys // block_size
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    run, rest = order[:run_blocks], order[run_blocks:]
    for members in (1, 2, 7):
        q = torch.randn(members, kv_heads, group, head_dim, generator=gen).to(dtype).float()
        own = torch.stack([rest[i * 3:i * 3 + 3] for i in range(members)])            # 3 blocks each
        own_lens = torch.randint(1, 3 * block_size + 1, (members,), generator=gen)
        whole_tables = torch.cat([run.expand(members, -1), own], 1)
        want_out, want_lse = kernel(q, pool, whole_tables, own_lens + run_blocks * block_size, 0.1)

        stacked = q.transpose(0, 1).reshape(1, kv_heads, members * group, head_dim)
        part = kernel.partial(stacked, pool, run[None], torch.tensor([run_blocks * block_size]), 0.1)
        unstack = lambda x: x.view(kv_heads, members, group, *x.shape[3:]).transpose(0, 1).contiguous()
        state = type(part)(unstack(part.acc), unstack(part.m), unstack(part.l))
        out, lse = kernel(q, pool, own, own_lens, 0.1, carry=state)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse), members


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("members", [[0, 1, 2, 3, 4], [3, 0], [4, 1, 2]])
def test_a_run_over_its_members_rows_in_place_gives_the_bits_of_the_stacked_copy(
        kernel: PagedDecodeAttention, dtype: torch.dtype, members: list[int]) -> None:
    """The backend hands a shared run its members' rows of the step's queries and state, which the kernel
    reads and writes in place: each member's rows must hold exactly what a pass over a stacked copy of
    its queries leaves, any other sequence's rows must be left as they were, and carrying on must give
    the bits of one pass over each member's whole context."""
    gen = torch.Generator().manual_seed(len(members))
    block_size, kv_heads, group, head_dim, num_blocks, sequences = 16, 2, 3, 64, 40, 5
    run_blocks = kernel.tile_keys // block_size
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    run, own = order[:run_blocks], order[run_blocks:run_blocks + 2 * sequences].view(sequences, 2)
    q = torch.randn(sequences, kv_heads, group, head_dim, generator=gen).to(dtype).float()
    picked = torch.tensor(members)

    stacked = q[picked].transpose(0, 1).reshape(1, kv_heads, len(members) * group, head_dim)
    part = kernel.partial(stacked, pool, run[None], torch.tensor([run_blocks * block_size]), 0.1)
    unstack = lambda x: x.view(kv_heads, len(members), group, *x.shape[3:]).transpose(0, 1)
    sentinel = DecodeState(torch.full(q.shape, 7.0), torch.full(q.shape[:3], 5.0), torch.full(q.shape[:3], 3.0))
    state = DecodeState(sentinel.acc.clone(), sentinel.m.clone(), sentinel.l.clone())
    tables = kernel.tables(run[None], torch.tensor([run_blocks * block_size]), picked)
    kernel.run_partial(q, pool, tables, 0.1, state)
    others = [i for i in range(sequences) if i not in members]
    for got, want, left in zip((state.acc, state.m, state.l), (part.acc, part.m, part.l), sentinel.__dict__.values()):
        assert torch.equal(got[picked], unstack(want)) and torch.equal(got[others], left[others])

    own_lens = torch.randint(1, 2 * block_size + 1, (sequences,), generator=gen)
    out, lse = kernel(q[picked], pool, own[picked], own_lens[picked], 0.1,
                      carry=DecodeState(*(t[picked].contiguous() for t in (state.acc, state.m, state.l))))
    want_out, want_lse = kernel(q[picked], pool, torch.cat([run.expand(len(members), -1), own[picked]], 1),
                                own_lens[picked] + run_blocks * block_size, 0.1)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_a_runs_members_must_be_distinct_sequences_of_the_queries(kernel: PagedDecodeAttention) -> None:
    pool = torch.zeros(2, 8, 16, 1, 16)
    run, tokens = torch.arange(kernel.tile_keys // 16)[None], torch.tensor([kernel.tile_keys])
    state = DecodeState.fresh(torch.Size((3, 1, 2, 16)))
    with pytest.raises(ValueError, match="distinct"):
        kernel.tables(run, tokens, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="distinct"):
        kernel.tables(run, tokens, torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="outside"):
        kernel.run_partial(torch.zeros(3, 1, 2, 16), pool, kernel.tables(run, tokens, torch.tensor([0, 3])), 1.0, state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(kernel: PagedDecodeAttention, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(2, 12, 16, 1, 128, generator=gen).to(dtype)
    tables, lens = torch.randperm(12, generator=gen)[None, :10], torch.tensor([150])
    q = torch.randn(1, 1, 20, 128, generator=gen).to(dtype).float()
    out, lse = kernel(q, pool, tables, lens, 0.09)
    for r in range(20):
        alone_out, alone_lse = kernel(q[:, :, r:r + 1].contiguous(), pool, tables, lens, 0.09)
        assert torch.equal(alone_out[0, 0, 0], out[0, 0, r]) and torch.equal(alone_lse[0, 0, 0], lse[0, 0, r]), r


def test_a_partial_pass_must_end_at_a_tiles_edge(kernel: PagedDecodeAttention) -> None:
    pool = torch.zeros(2, 8, 16, 1, 16)
    tables = torch.arange(8)[None]
    kernel.partial(torch.zeros(1, 1, 2, 16), pool, tables, torch.tensor([kernel.tile_keys]), 1.0)
    with pytest.raises(ValueError, match="whole tiles"):
        kernel.partial(torch.zeros(1, 1, 2, 16), pool, tables, torch.tensor([kernel.tile_keys - 16]), 1.0)


def test_carry_must_match_the_queries(kernel: PagedDecodeAttention) -> None:
    pool = torch.zeros(2, 8, 16, 1, 16)
    tables = torch.arange(8)[None]
    part = kernel.partial(torch.zeros(1, 1, 2, 16), pool, tables, torch.tensor([kernel.tile_keys]), 1.0)
    with pytest.raises(ValueError, match="carry"):
        kernel(torch.zeros(1, 1, 3, 16), pool, tables, torch.tensor([4]), 1.0, carry=part)
