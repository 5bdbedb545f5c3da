"""The paged decode-attention kernel against plain float64 softmax attention over gathered K/V, in
each body this CPU runs (AVX2 everywhere, AVX-512 and its bfloat16 pairs where torch reports them),
and the two properties exact prefix caching rests on: a softmax carried on from a shared run's state
gives the bits of one pass over the whole context, and a row's bits do not depend on the rows beside
it; and that a bfloat16 model's queries and output, taken and written in bfloat16, keep the bits of
float32 ones. (That a token gets the prefill kernel's bits: test_model_attention_kernels_agree.py.)"""
from __future__ import annotations

import pytest
import torch

from native_kernel_build import build_fresh
from prefixserve.model.kv_layout import ROWS, to_layout
from prefixserve.platforms.cpu.native.isa import AVX512_BF16, ISAS, best_isa
from prefixserve.platforms.cpu.native.paged_decode_attention import DecodeState, PagedDecodeAttention, load
from prefixserve.platforms.cpu.panels import PANELS

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


# every kind of float32 an output can hold: the largest values, signed zeros, values that round up
# across a power of two, subnormals, infinities (a V row holding one), NaNs (from inf - inf)
EXTREMES = [3.3895313892515355e38, -3.38e38, 0.0, -0.0, 1.99609375, 1e-39, float("inf"), float("-inf"),
            float("nan")]


@pytest.fixture(scope="module")
def words_kernel(tmp_path_factory) -> PagedDecodeAttention:
    """The tiles that read a bfloat16 pool's keys as word pairs, where the CPU runs them."""
    if AVX512_BF16 not in BODIES:
        pytest.skip("needs a CPU with avx512_bf16")
    return build_fresh(load, tmp_path_factory).with_body(AVX512_BF16)


@pytest.mark.parametrize("layout", [ROWS, PANELS])
@pytest.mark.parametrize("group", [2, 3, 8])
def test_bfloat16_queries_and_output_give_the_bits_of_float32_ones_rounded(
        words_kernel: PagedDecodeAttention, layout: str, group: int) -> None:
    """Tiles that read a bfloat16 pool's keys as word pairs take a bfloat16 model's queries as they are and
    write a finished output in bfloat16: what a decode step did by widening the queries to float32 first
    and rounding the float32 output after, in torch. The oracle: the same calls on the widened queries,
    and torch's rounding of their output, bit for bit (a NaN as a NaN), over a shared run and each
    sequence's own blocks, with outputs of every magnitude."""
    kernel = words_kernel.for_layout(layout)
    gen = torch.Generator().manual_seed(group)
    block_size, kv_heads, head_dim, num_blocks, sequences = 16, 2, 128, 30, 5
    run_blocks = kernel.tile_keys // block_size
    rows = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    rows[1] *= torch.exp2(torch.randint(-40, 40, rows[1].shape, generator=gen).float())
    rows[1, -1, :, 0, :len(EXTREMES)] = torch.tensor(EXTREMES)       # the last block: sequence 4's own
    pool = to_layout(rows.bfloat16(), layout)
    order = torch.randperm(num_blocks - 1, generator=gen)
    run, own = order[:run_blocks], torch.cat([order[run_blocks:run_blocks + 8], torch.tensor([num_blocks - 1] * 2)])
    own = own.view(sequences, 2)
    lens = torch.randint(1, 2 * block_size + 1, (sequences,), generator=gen)
    q = torch.randn(sequences, kv_heads, group, head_dim, generator=gen).bfloat16()
    members = kernel.tables(run[None], torch.tensor([run_blocks * block_size]), torch.tensor([4, 0, 2, 1]))
    states = []
    for queries in (q, q.float()):
        state = DecodeState.fresh(q.shape)
        kernel.run_partial(queries, pool, members, 0.1, state)
        states.append(state)
    assert all(torch.equal(a, b) for a, b in zip(states[0].__dict__.values(), states[1].__dict__.values()))

    out = torch.empty(q.shape, dtype=torch.bfloat16)
    got, got_lse = kernel(q[:4], pool, own[:4], lens[:4], 0.1, carry=DecodeState(
        *(t[:4].contiguous() for t in states[0].__dict__.values())), out=out[:4])
    want, want_lse = kernel(q[:4].float(), pool, own[:4], lens[:4], 0.1, carry=DecodeState(
        *(t[:4].contiguous() for t in states[1].__dict__.values())))
    alone, alone_lse = kernel(q[4:], pool, own[4:], lens[4:], 0.1, out=out[4:])
    want_alone, want_alone_lse = kernel(q[4:].float(), pool, own[4:], lens[4:], 0.1)
    want = torch.cat([want, want_alone]).bfloat16()
    assert got.data_ptr() == out.data_ptr() and alone.data_ptr() == out[4:].data_ptr()
    nan = want.isnan()
    assert nan.any() and want.isinf().any() and torch.equal(out.isnan(), nan)
    assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))
    assert torch.equal(got_lse, want_lse) and torch.equal(alone_lse, want_alone_lse)


def test_bfloat16_queries_and_output_need_tiles_that_read_word_pairs(kernel: PagedDecodeAttention) -> None:
    pool, tables, lens = torch.zeros(2, 4, 16, 1, 32), torch.tensor([[0, 1]]), torch.tensor([20])
    q = torch.zeros(1, 1, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 queries"):
        kernel(q, pool, tables, lens, 1.0)                     # a float32 pool: no word pairs to read
    out = torch.empty(q.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out must be"):
        kernel(q.float(), pool, tables, lens, 1.0, out=out)
    if kernel.reads_query_words(pool.bfloat16(), 32):
        with pytest.raises(ValueError, match="out must be"):
            kernel(q, pool.bfloat16(), tables, lens, 1.0, out=out.float())
    else:
        with pytest.raises(ValueError, match="float32 queries"):
            kernel(q, pool.bfloat16(), tables, lens, 1.0)
