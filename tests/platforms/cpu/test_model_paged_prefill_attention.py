"""The paged prefill-attention kernel against float64 softmax attention with a causal mask built from positions,
in each body this CPU runs (AVX2 everywhere, AVX-512 where torch reports it, giving the same bits, and bfloat16
dot products for a bfloat16 pool's keys where the CPU has avx512_bf16)."""
from __future__ import annotations

import shutil

import pytest
import torch

from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.attention.torch_paged import TorchPagedAttention
from prefixserve.model.kv_layout import ROWS
from prefixserve.platforms.cpu.native import paged_prefill_attention
from native_kernel_build import build_fresh
from prefixserve.platforms.cpu.native.isa import AVX2, AVX512_BF16, ISAS, best_isa
from prefixserve.platforms.cpu.native.paged_prefill_attention import PagedPrefillAttention, _agrees_with_torch, load


BODIES = ISAS[: ISAS.index(best_isa()) + 1]


@pytest.fixture(scope="module", params=BODIES)
def kernel(request, tmp_path_factory) -> PagedPrefillAttention:
    return build_fresh(load, tmp_path_factory).with_body(request.param)


def reference(q, pool, starts, lens, tables, scale):
    """Each sequence's queries, at the last positions of its context, over the keys at or before them."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    heads, kv_heads = q.shape[1], pool.shape[3]
    for b in range(len(lens)):
        first, end, length = int(starts[b]), int(starts[b + 1]), int(lens[b])
        n = end - first
        if n == 0:
            continue
        # query head j reads KV head j // group
        keys = pool[0][tables[b]].flatten(0, 1)[:length].double().repeat_interleave(heads // kv_heads, dim=1)
        values = pool[1][tables[b]].flatten(0, 1)[:length].double().repeat_interleave(heads // kv_heads, dim=1)
        positions = torch.arange(length - n, length)
        hidden = torch.arange(length)[None, :] > positions[:, None]                       # [n, length]
        scores = torch.einsum("qhd,khd->hqk", q[first:end].double(), keys) * scale
        weights = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out[first:end] = torch.einsum("hqk,khd->qhd", weights, values)
    return out


def assert_within_bf16_rounding(got: torch.Tensor, case: "Case") -> None:
    """A bfloat16 result against the float64 reference on the same (bfloat16) values: one rounding of the
    output (2^-9 of it), float32 sums far below it; 2^-8 of the output and of sum_j p_j |v_j| (where the
    output cancels to near 0) leaves room for both."""
    magnitudes = case.pool.clone()
    magnitudes[1] = magnitudes[1].abs()
    terms = reference(case.q.float(), magnitudes.float(), case.starts, case.lens, case.tables, case.scale)
    expected = case.expected()
    served = torch.zeros(got.shape[0], dtype=torch.bool)
    served[: int(case.starts[-1])] = True
    err = (got.double() - expected).abs()[served]
    assert (err <= 2 ** -8 * (expected.abs() + terms)[served] + 1e-6).all(), float(err.max())


class Case:
    """Sequences with the given (query length, cached length) in one pool of randomly placed blocks."""

    def __init__(self, seed: int, chunks: list[tuple[int, int]], block_size: int, head_dim: int, group: int,
                 kv_heads: int = 2, spare_rows: int = 3) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.lens = torch.tensor([n + cached for n, cached in chunks])
        width = max(-(-int(length) // block_size) for length in self.lens) + 1   # a padding column
        num_blocks = width * len(chunks) + 5
        self.pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen) * 2
        self.tables = torch.randperm(num_blocks, generator=gen)[: width * len(chunks)].view(len(chunks), width)
        self.starts = torch.tensor([0] + [n for n, _ in chunks]).cumsum(0)
        # rows of other sequences (decodes, say) after the chunks: not the kernel's to write
        self.q = torch.randn(int(self.starts[-1]) + spare_rows, kv_heads * group, head_dim, generator=gen)
        self.scale = head_dim ** -0.5

    def run(self, kernel: PagedPrefillAttention, **kwargs) -> torch.Tensor:
        return kernel(self.q, self.pool, self.starts, self.lens, self.tables, self.scale, **kwargs)

    def expected(self) -> torch.Tensor:
        return reference(self.q.float(), self.pool.float(), self.starts, self.lens, self.tables, self.scale)


# fresh prompts (nothing cached) and chunks continuing a cached prefix, lengths cutting through blocks and tiles
CHUNKS = [(2, 0), (5, 7), (17, 0), (64, 30), (130, 0), (130, 41), (3, 100)]


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_matches_reference(kernel: PagedPrefillAttention, block_size: int, head_dim: int, group: int) -> None:
    case = Case(block_size * 1000 + head_dim * 10 + group, CHUNKS, block_size, head_dim, group)
    out = case.run(kernel)
    torch.testing.assert_close(out.double(), case.expected(), rtol=0, atol=2e-5)


@pytest.mark.parametrize("head_dim", [24, 136])
def test_head_dims_not_a_multiple_of_16(kernel: PagedPrefillAttention, head_dim: int) -> None:
    case = Case(head_dim, [(9, 0), (70, 21)], block_size=4, head_dim=head_dim, group=2)
    torch.testing.assert_close(case.run(kernel).double(), case.expected(), rtol=0, atol=2e-5)


def test_long_chunk_over_a_long_cached_context(kernel: PagedPrefillAttention) -> None:
    """Several key tiles before the diagonal, several query blocks per head, the model's shape."""
    case = Case(7, [(300, 700)], block_size=16, head_dim=128, group=2, kv_heads=4)
    torch.testing.assert_close(case.run(kernel).double(), case.expected(), rtol=0, atol=2e-5)


@pytest.mark.parametrize("head_dim", [24, 64, 136])
def test_a_bfloat16_pool_is_within_bfloat16_roundings_of_the_reference(kernel: PagedPrefillAttention,
                                                                       head_dim: int) -> None:
    """A bfloat16 pool and queries give the float64 reference within a bfloat16 rounding. The float32
    bodies give the float32 kernel's result on the same values, rounded once (bit for bit: widening is
    exact); the dot-product body sums the same exact products of Q and K in pairs, so it is held to the
    reference."""
    case = Case(21, CHUNKS, block_size=16, head_dim=head_dim, group=2)
    case.pool, case.q = case.pool.bfloat16().float(), case.q.bfloat16().float()
    wide = case.run(kernel)
    half = kernel(case.q.bfloat16(), case.pool.bfloat16(), case.starts, case.lens, case.tables, case.scale)
    assert half.dtype == torch.bfloat16
    assert_within_bf16_rounding(half, case)
    if kernel.body != AVX512_BF16:
        assert torch.equal(half, wide.bfloat16())
        torch.testing.assert_close(half.double(), case.expected(), rtol=2 ** -8, atol=2e-5)


@pytest.mark.parametrize("head_dim", [8, 24, 48, 128, 136])
def test_every_body_gives_the_avx2_bits(kernel: PagedPrefillAttention, head_dim: int) -> None:
    """The AVX-512 tiles run the AVX2 tiles' multiply-adds lane for lane over wider registers, so a
    server's outputs do not depend on which of those bodies its CPU runs (head dims cover every slab
    remainder). The dot-product body gives those bits on a float32 pool; on a bfloat16 pool it is held to
    the reference within bfloat16 roundings, as the AVX2 body is."""
    case = Case(head_dim + 5, CHUNKS, block_size=16, head_dim=head_dim, group=2)
    assert torch.equal(case.run(kernel), case.run(kernel.with_body(AVX2)))
    case.pool = case.pool.bfloat16()
    case.q = case.q.bfloat16()
    if kernel.body == AVX512_BF16:
        assert_within_bf16_rounding(case.run(kernel), case)
        assert_within_bf16_rounding(case.run(kernel.with_body(AVX2)), case)
    else:
        assert torch.equal(case.run(kernel), case.run(kernel.with_body(AVX2)))


def _sharing_case(seed: int, block_size: int):
    """Sequences whose tables begin with runs of the same blocks, as prefix caching makes them: (query
    length, total length, how many leading blocks each shares with sequence 0, a single token that
    the kernel serves only with min_query_len 1)."""
    gen = torch.Generator().manual_seed(seed)
    specs = [(1, 300, 0), (40, 310, 19), (33, 290, 17), (5, 140, 8), (1, 200, 12), (70, 330, 3), (12, 90, 20),
             (9, 400, 13)]
    width = max(-(-total // block_size) for _, total, _ in specs)
    num_blocks = width * len(specs) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(specs), width, dtype=torch.long)
    base = order[:width]
    rest = iter(order[width:])
    for b, (_, total, shared) in enumerate(specs):
        used = -(-total // block_size)
        tables[b] = torch.tensor([base[j] if (b == 0 or j < min(shared, used)) else next(rest) for j in range(width)])
    q_lens = [n for n, _, _ in specs]
    case = Case(seed, [(1, 0)], block_size, head_dim=64, group=2)
    case.pool = torch.randn(2, num_blocks, block_size, 2, 64, generator=gen)
    case.tables = tables
    case.lens = torch.tensor([total for _, total, _ in specs])
    case.starts = torch.tensor([0] + q_lens).cumsum(0)
    case.q = torch.randn(int(case.starts[-1]), 4, 64, generator=gen)
    return case


def _unshared(case):
    """The same sequences with every block copied to a block of its own: the same keys, nothing shared."""
    flat = case.tables.flatten()
    copy = Case.__new__(Case)
    copy.pool = case.pool[:, flat].clone()
    copy.tables = torch.arange(flat.numel()).view(case.tables.shape)
    copy.lens, copy.starts, copy.q, copy.scale = case.lens, case.starts, case.q, case.scale
    return copy


@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keys_shared_by_several_sequences_are_read_from_one_packing(kernel: PagedPrefillAttention, block_size: int,
                                                                     dtype: torch.dtype) -> None:
    """Sequences starting on the same blocks (shared runs of every length, cut inside and at softmax
    tiles, a single-token sequence on them that the kernel does not serve) read those keys from one
    packing: the same bits as when every sequence owns copies of its blocks, and the reference."""
    case = _sharing_case(block_size, block_size)
    case.pool, case.q = case.pool.to(dtype), case.q.to(dtype)
    alone = _unshared(case)
    for min_query_len in (2, 1):
        shared = case.run(kernel, min_query_len=min_query_len)
        assert torch.equal(shared, alone.run(kernel, min_query_len=min_query_len))
    # with min_query_len 1 every row was served
    if dtype == torch.bfloat16:
        assert_within_bf16_rounding(shared, case)
    else:
        torch.testing.assert_close(shared.double(), case.expected(), rtol=0, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cached,new", [(1024, 32), (1000, 17), (130, 5)])
def test_a_short_chunk_over_a_long_context_gets_the_bits_of_keys_packed_up_front(kernel: PagedPrefillAttention,
                                                                                 dtype: torch.dtype, cached: int,
                                                                                 new: int) -> None:
    """A short chunk alone over its context (one work item per KV head, nothing shared: its item packs
    each tile where it uses it) gives the bits it gets when a second sequence starts on the same blocks
    (the keys packed once, up front, for both), and the reference. The model's shape: 8 KV heads of
    128, two query heads each."""
    gen = torch.Generator().manual_seed(cached + new)
    block_size, kv_heads, head_dim, group = 16, 8, 128, 2
    length = cached + new
    used = -(-length // block_size)
    pool = (torch.randn(2, 2 * used + 3, block_size, kv_heads, head_dim, generator=gen) * 2).to(dtype)
    order = torch.randperm(2 * used + 3, generator=gen)
    alone = Case.__new__(Case)
    alone.pool, alone.scale = pool, head_dim ** -0.5
    alone.tables = order[:used].view(1, used)
    alone.lens, alone.starts = torch.tensor([length]), torch.tensor([0, new])
    alone.q = torch.randn(new, kv_heads * group, head_dim, generator=gen).to(dtype)
    # beside it, a sequence of 40 queries on the same leading blocks, then blocks of its own
    paired = Case.__new__(Case)
    paired.pool, paired.scale = pool, alone.scale
    other = torch.cat([alone.tables[0, : used - 1], order[used: used + 2]])
    paired.tables = torch.stack([alone.tables[0], other[:used]])
    paired.lens = torch.tensor([length, length])
    paired.starts = torch.tensor([0, new, new + 40])
    paired.q = torch.cat([alone.q, torch.randn(40, kv_heads * group, head_dim, generator=gen).to(dtype)])
    threads = torch.get_num_threads()
    try:
        # on 2 threads the lone chunk's 8 items (one per KV head) give each thread the 4 it wants
        torch.set_num_threads(2)
        got = alone.run(kernel)
        assert torch.equal(got, paired.run(kernel)[:new])
    finally:
        torch.set_num_threads(threads)
    if dtype == torch.bfloat16:
        assert_within_bf16_rounding(got, alone)
    else:
        torch.testing.assert_close(got.double(), alone.expected(), rtol=0, atol=2e-5)


def test_thread_counts_give_identical_results(kernel: PagedPrefillAttention) -> None:
    """Work items are split differently for different thread counts; every row must come out the same."""
    case = Case(8, CHUNKS, block_size=5, head_dim=64, group=2)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(case.run(kernel))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(results[0].double(), case.expected(), rtol=0, atol=2e-5)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_serves_only_chunks_of_min_query_len(kernel: PagedPrefillAttention) -> None:
    """Single-token and empty sequences are left to decode: their rows of `out` stay as they were."""
    case = Case(9, [(1, 9), (6, 4), (0, 5), (1, 0), (12, 0)], block_size=4, head_dim=16, group=2)
    out = torch.full(case.q.shape, 7.0)
    assert case.run(kernel, out=out, min_query_len=2) is out
    want = case.expected().float()
    served = torch.zeros(case.q.shape[0], dtype=torch.bool)
    served[1:7] = served[8:20] = True
    torch.testing.assert_close(out[served], want[served], rtol=0, atol=2e-5)
    assert bool((out[~served] == 7.0).all())
    # with every sequence served, the single tokens match too
    torch.testing.assert_close(case.run(kernel).double(), case.expected(), rtol=0, atol=2e-5)


def test_a_bfloat16_out_keeps_the_rows_it_does_not_serve(kernel: PagedPrefillAttention) -> None:
    """With a bfloat16 pool the kernel stores its rows straight into the caller's bfloat16 `out`: the
    rows it serves get the bits a fresh output gets, every other row keeps what it held."""
    case = Case(9, [(1, 9), (6, 4), (0, 5), (1, 0), (12, 0)], block_size=4, head_dim=32, group=2)
    case.pool, case.q = case.pool.bfloat16(), case.q.bfloat16()
    every = case.run(kernel)
    assert_within_bf16_rounding(every, case)
    out = torch.full(case.q.shape, 7.0, dtype=torch.bfloat16)
    assert case.run(kernel, out=out, min_query_len=2) is out
    served = torch.zeros(case.q.shape[0], dtype=torch.bool)
    served[1:7] = served[8:20] = True
    assert torch.equal(out[served], every[served])
    assert bool((out[~served] == 7.0).all())


def test_strided_queries_and_reused_scratch(kernel: PagedPrefillAttention) -> None:
    """q as a column view of a fused projection; one scratch buffer serves calls of different sizes."""
    case = Case(10, [(20, 13), (33, 0)], block_size=16, head_dim=32, group=4)
    case.q = _fused_view(case.q)
    assert not case.q.is_contiguous()
    buffer = torch.full((100_000,), float("nan"))
    asked = []

    def scratch(n: int) -> torch.Tensor:
        asked.append(n)
        return buffer

    torch.testing.assert_close(case.run(kernel, scratch=scratch).double(), case.expected(), rtol=0, atol=2e-5)
    small = Case(11, [(5, 2)], block_size=16, head_dim=32, group=4)
    torch.testing.assert_close(small.run(kernel, scratch=scratch).double(), small.expected(), rtol=0, atol=2e-5)
    # per sequence and KV head, K and V of its keys rounded up to 16
    assert asked == [2 * 2 * (48 + 48) * 32, 2 * 2 * 16 * 32]


def _fused_view(q: torch.Tensor) -> torch.Tensor:
    """q's values as the first columns of a wider projection's rows: rows q.shape[1:].numel() + 40 apart."""
    width = q[0].numel()
    fused = torch.randn(q.shape[0], width + 40).to(q.dtype)
    fused[:, :width] = q.flatten(1)
    return fused[:, :width].view(q.shape)


def test_strided_bfloat16_queries_are_read_in_place(kernel: PagedPrefillAttention) -> None:
    """bfloat16 queries are read from their rows as they lie (no widened copy): a column view of a fused
    projection gives the contiguous queries' bits."""
    case = Case(12, [(20, 13), (33, 0)], block_size=16, head_dim=32, group=4)
    case.pool, case.q = case.pool.bfloat16(), case.q.bfloat16()
    want = case.run(kernel)
    case.q = _fused_view(case.q)
    assert not case.q.is_contiguous() and case.q.stride(0) == case.q[0].numel() + 40
    assert torch.equal(case.run(kernel), want)


def test_rejects_inconsistent_inputs(kernel: PagedPrefillAttention) -> None:
    pool = torch.zeros(2, 4, 4, 1, 8)
    q = torch.zeros(6, 2, 8)
    with pytest.raises(ValueError, match="past its block table"):
        kernel(q, pool, torch.tensor([0, 6]), torch.tensor([9]), torch.tensor([[0, 1]]), 1.0)
    with pytest.raises(ValueError, match="more queries than positions"):
        kernel(q, pool, torch.tensor([0, 6]), torch.tensor([5]), torch.tensor([[0, 1]]), 1.0)
    with pytest.raises(ValueError, match="within the rows of q"):
        kernel(q, pool, torch.tensor([0, 7]), torch.tensor([7]), torch.tensor([[0, 1]]), 1.0)
    with pytest.raises(ValueError, match="scratch"):
        kernel(q, pool, torch.tensor([0, 6]), torch.tensor([6]), torch.tensor([[0, 1]]), 1.0,
               scratch=lambda n: torch.empty(n - 1))
    with pytest.raises(ValueError, match="within the rows of q"):
        kernel(q, pool, torch.tensor([3, 2]), torch.tensor([7]), torch.tensor([[0, 1]]), 1.0)
    with pytest.raises(ValueError, match="shapes do not match"):
        kernel(torch.zeros(6, 2, 16), pool, torch.tensor([0, 6]), torch.tensor([6]), torch.tensor([[0, 1]]), 1.0)


def test_backend_answers_every_chunk_with_one_kernel_call(kernel: PagedPrefillAttention, monkeypatch) -> None:
    """Two chunks and a decode in one step: one call serves both chunks, the decode rows are left to decode."""
    calls = []

    class Counting:
        supports = staticmethod(PagedPrefillAttention.supports)

        def __call__(self, *args, **kwargs):
            calls.append(kwargs.get("min_query_len"))
            return kernel(*args, **kwargs)

        def for_layout(self, layout):
            assert layout == ROWS
            return self

    backend = TorchPagedAttention(use_native=True)
    monkeypatch.setattr(backend, "_prefill_kernel", Counting())
    case = Case(12, [(9, 0), (1, 6), (11, 5)], block_size=4, head_dim=16, group=2, spare_rows=0)
    k_pool, v_pool = case.pool[0].flatten(0, 1), case.pool[1].flatten(0, 1)
    meta = AttentionMetadata.build([9, 1, 11], case.lens.tolist(), case.tables.tolist(), 4)
    # the step's new K/V are the ones already at their slots, so writing them changes nothing
    out = backend.forward(case.q, k_pool[meta.slot_mapping], v_pool[meta.slot_mapping], case.pool,
                          backend.build_metadata(meta), case.scale)
    assert calls == [2]
    torch.testing.assert_close(out.double(), case.expected(), rtol=0, atol=2e-5)


def test_backend_falls_back_to_sdpa_where_the_kernel_does_not_apply() -> None:
    """A head size the kernel cannot take (not a multiple of 8) goes through the torch path."""
    backend = TorchPagedAttention(use_native=True)
    case = Case(13, [(7, 0), (5, 3)], block_size=4, head_dim=12, group=2, spare_rows=0)
    if backend._prefill_kernel is not None:
        assert not backend._prefill_kernel.supports(case.q, case.pool)
    k_pool, v_pool = case.pool[0].flatten(0, 1), case.pool[1].flatten(0, 1)
    meta = AttentionMetadata.build([7, 5], case.lens.tolist(), case.tables.tolist(), 4)
    out = backend.forward(case.q, k_pool[meta.slot_mapping], v_pool[meta.slot_mapping], case.pool,
                          backend.build_metadata(meta), case.scale)
    torch.testing.assert_close(out.double(), case.expected(), rtol=0, atol=2e-5)


def test_probe_rejects_a_wrong_kernel(kernel: PagedPrefillAttention) -> None:
    class OffByOne:
        def __call__(self, *args, **kwargs):
            return kernel(*args, **kwargs) + 1e-3

    assert _agrees_with_torch(kernel)
    assert not _agrees_with_torch(OffByOne())


def test_a_broken_compiler_means_no_kernel_not_an_error(tmp_path) -> None:
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` executable to stand in for a broken compiler")
    assert load(false, tmp_path) is None
    assert load(None, tmp_path) is None


def test_turned_off_by_environment(monkeypatch) -> None:
    monkeypatch.setenv("PREFIXSERVE_NATIVE_KERNELS", "0")
    paged_prefill_attention.default_kernel.cache_clear()
    try:
        assert paged_prefill_attention.default_kernel() is None
        assert TorchPagedAttention(use_native=True)._prefill_kernel is None
    finally:
        paged_prefill_attention.default_kernel.cache_clear()
