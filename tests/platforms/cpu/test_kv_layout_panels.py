"""A pool of panels (platforms/cpu/panels.py) against the pool of rows it lays out: the word layout written out by
hand, the torch writes and gathers, and the native kernels' bits. Reading K/V where they lie in panels
instead of transposing rows must change no bit of any output: the rows kernels are the oracle here (they
are held to float64 references in test_model_paged_decode_attention.py and
test_model_paged_prefill_attention.py), and prefill and decode must keep agreeing with each other."""
from __future__ import annotations

import pytest
import torch

from native_kernel_build import build_fresh
from prefixserve.model.kv_layout import ROWS, gather_rows, kv_cache_shape, pool_geometry, to_layout, write_kv
from prefixserve.platforms.cpu.native import paged_decode_attention, paged_prefill_attention
from prefixserve.platforms.cpu.native.isa import AVX2, AVX512, best_isa, reads_panels
from prefixserve.platforms.cpu.native.paged_decode_attention import DecodeState, PagedDecodeAttention
from prefixserve.platforms.cpu.panels import PANELS


def _read_here(dtype: torch.dtype):
    return pytest.param(dtype, id=str(dtype).removeprefix("torch."), marks=pytest.mark.skipif(
        not reads_panels(best_isa(), dtype), reason=f"this CPU runs no tiles that read {dtype} panels (bfloat16: "
        "avx512_bf16, float32: AVX-512)"))


# the pools of panels this CPU's kernels read (a pool of either dtype is laid out and gathered anywhere)
READ_HERE = [_read_here(torch.bfloat16), _read_here(torch.float32)]
DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])


def test_the_words_of_a_panel_are_the_layouts_definition() -> None:
    """K word (i, j) of a panel holds dims 2i and 2i + 1 of key j; V word (p, c) column c of keys 2p, 2p + 1."""
    gen = torch.Generator().manual_seed(0)
    block_size, kv_heads, d = 32, 3, 16
    rows = torch.randn(2, 4, block_size, kv_heads, d, generator=gen).bfloat16()
    panels = to_layout(rows, PANELS)
    assert panels.shape == (2, 4, kv_heads, block_size, d)
    for blk, h, key in ((0, 0, 0), (3, 2, 17), (1, 1, 31), (2, 0, 14)):
        region_k = panels[0, blk, h].flatten().view(block_size // 16, d // 2, 16, 2)
        region_v = panels[1, blk, h].flatten().view(block_size // 2, d, 2)
        for i in range(d // 2):
            assert torch.equal(region_k[key // 16, i, key % 16], rows[0, blk, key, h, 2 * i:2 * i + 2])
        assert torch.equal(region_v[key // 2, :, key % 2], rows[1, blk, key, h])


def test_a_float32_panel_is_its_keys_transposed_and_its_values_are_rows() -> None:
    """float32: K element (e, j) of a panel is dim e of key j ([D][16], what the tiles multiply); V row j is
    key j's row."""
    gen = torch.Generator().manual_seed(1)
    block_size, kv_heads, d = 32, 3, 16
    rows = torch.randn(2, 4, block_size, kv_heads, d, generator=gen)
    panels = to_layout(rows, PANELS)
    for blk, h, key in ((0, 0, 0), (3, 2, 17), (1, 1, 31), (2, 0, 14)):
        region_k = panels[0, blk, h].flatten().view(block_size // 16, d, 16)
        region_v = panels[1, blk, h].flatten().view(block_size, d)
        assert torch.equal(region_k[key // 16, :, key % 16], rows[0, blk, key, h])
        assert torch.equal(region_v[key], rows[1, blk, key, h])


@DTYPES
@pytest.mark.parametrize("block_size", [16, 48])
def test_writes_and_gathers_agree_with_rows(block_size: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(block_size)
    kv_heads, d, blocks = 2, 32, 6
    rows = torch.zeros(2, blocks, block_size, kv_heads, d, dtype=dtype)
    panels = torch.zeros((2, blocks, kv_heads, block_size, d), dtype=dtype)
    slots = torch.randperm(blocks * block_size, generator=gen)[:50]
    k = torch.randn(50, kv_heads, d, generator=gen).to(dtype)
    v = torch.randn(50, kv_heads, d, generator=gen).to(dtype)
    write_kv(rows, ROWS, slots, k, v)
    write_kv(panels, PANELS, slots, k, v)
    assert torch.equal(panels, to_layout(rows, PANELS))
    picked = torch.tensor([5, 0, 3])
    got_k, got_v = (torch.empty(3, block_size, kv_heads, d, dtype=dtype) for _ in range(2))
    gather_rows(panels, PANELS, picked, got_k, got_v)
    assert torch.equal(got_k, rows[0, picked]) and torch.equal(got_v, rows[1, picked])


@DTYPES
@pytest.mark.parametrize("block_size", [16, 48])
def test_the_native_writers_put_each_word_where_write_kv_does(tmp_path_factory, block_size: int,
                                                               dtype: torch.dtype) -> None:
    """A prefill's `write_panels` and a decode step's `qk_norm_rope` into a pool of panels: bit for bit the
    pool torch's write_kv (the layout's definition, above) makes of the same K/V, nothing else touched."""
    from prefixserve.platforms.cpu.native import fused_pointwise
    writer = build_fresh(fused_pointwise.load, tmp_path_factory)
    gen = torch.Generator().manual_seed(block_size)
    q_heads, kv_heads, d, blocks, tokens = 4, 2, 64, 5, 37
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    start = torch.randn(2, blocks, kv_heads, block_size, d, generator=gen).to(dtype)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * d, generator=gen).to(dtype)
    k = qkv[:, q_heads * d:(q_heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (q_heads + kv_heads) * d:].view(tokens, kv_heads, d)
    want = start.clone()
    write_kv(want, PANELS, slots, k, v)
    got = start.clone()
    writer.write_panels(got, slots, k, v)          # rows of the qkv's stride, as a prefill hands them over
    assert torch.equal(got, want)
    # no norm and a rotation by 0: qk_norm_rope's k is qkv's as it is
    cos, sin = torch.ones(tokens, d // 2, dtype=dtype), torch.zeros(tokens, d // 2, dtype=dtype)
    got = start.clone()
    writer.qk_norm_rope(qkv, q_heads, kv_heads, d, None, None, 0.0, cos, sin, pools=(got[0], got[1], slots),
                        layout=PANELS)
    assert torch.equal(got, want)


def test_pools_that_cannot_hold_panels_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold panels"):
        pool_geometry(torch.zeros(2, 3, 2, 16, 64, dtype=torch.float16), PANELS)
    with pytest.raises(ValueError, match="cannot hold panels"):
        pool_geometry(torch.zeros(2, 3, 2, 8, 64, dtype=torch.bfloat16), PANELS)   # blocks of 8
    with pytest.raises(ValueError, match="cannot hold panels"):
        pool_geometry(torch.zeros(2, 3, 2, 16, 40), PANELS)            # a head dim of 40


@pytest.fixture(scope="module")
def decode(tmp_path_factory) -> PagedDecodeAttention:
    return build_fresh(paged_decode_attention.load, tmp_path_factory).with_body(best_isa())


def _poisoned(rows: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """rows laid out in panels, every slot no sequence reads NaN: a block's slots not yet written hold what
    they held before, and must not reach any output."""
    panels = to_layout(rows, PANELS)
    block_size = rows.shape[2]
    read = {t[s // block_size] * block_size + s % block_size
            for t, n in zip(tables.tolist(), lens.tolist()) for s in range(n)}
    slots = torch.tensor([s for s in range(rows.shape[1] * block_size) if s not in read])
    nan = torch.full((len(slots),) + rows.shape[3:], float("nan"), dtype=rows.dtype)
    write_kv(panels, PANELS, slots, nan, nan)
    return panels


@pytest.mark.parametrize("dtype", READ_HERE)
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 32])
def test_decode_over_panels_gives_the_bits_of_rows(decode: PagedDecodeAttention, block_size: int, rows: int,
                                                   dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(block_size + rows)
    kv_heads, d, num_blocks, batch, width = 3, 128, 40, 4, 5
    pool = torch.randn(2, num_blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    q = torch.randn(batch, kv_heads, rows, d, generator=gen).to(dtype).float()
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in range(batch)])
    lens = torch.randint(1, width * block_size + 1, (batch,), generator=gen)
    lens[0] = width * block_size                # one sequence filling its last panel exactly
    want_out, want_lse = decode(q, pool, tables, lens, d ** -0.5)
    panels = decode.for_layout(PANELS)
    out, lse = panels(q, _poisoned(pool, tables, lens), tables, lens, d ** -0.5)
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("dtype", READ_HERE)
@pytest.mark.parametrize("members", [[0, 1, 2, 3, 4], [3, 0]])
def test_a_shared_run_over_panels_carries_on_with_the_bits_of_rows(decode: PagedDecodeAttention,
                                                                    members: list[int], dtype: torch.dtype) -> None:
    """The decode program's calls: a shared run over its members' rows in place, then each sequence's own
    blocks carrying on from its state, over a pool of panels, against the same calls over rows."""
    gen = torch.Generator().manual_seed(len(members))
    block_size, kv_heads, group, d, num_blocks, sequences = 16, 2, 2, 128, 40, 5
    run_blocks = 2 * decode.tile_keys // block_size
    rows = torch.randn(2, num_blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    run, own = order[:run_blocks], order[run_blocks:run_blocks + 3 * sequences].view(sequences, 3)
    q = torch.randn(sequences, kv_heads, group, d, generator=gen).to(dtype).float()
    picked = torch.tensor(members)
    own_lens = torch.randint(1, 3 * block_size + 1, (sequences,), generator=gen)
    whole = torch.cat([run.expand(sequences, -1), own], 1)
    pools = {ROWS: rows, PANELS: _poisoned(rows, whole, own_lens + run_blocks * block_size)}
    results = {}
    for layout, pool in pools.items():
        kernel = decode.for_layout(layout)
        state = DecodeState.fresh(q.shape)
        kernel.run_partial(q, pool, kernel.tables(run[None], torch.tensor([run_blocks * block_size]), picked), 0.1,
                           state)
        results[layout] = kernel(q, pool, own, own_lens, 0.1, carry=state)
    assert all(torch.equal(a, b) for a, b in zip(results[ROWS], results[PANELS]))


def test_a_pool_of_panels_needs_tiles_that_read_its_dtype(decode: PagedDecodeAttention) -> None:
    with pytest.raises(ValueError, match="needs AVX-512 tiles"):
        decode.with_body(AVX2).for_layout(PANELS)
    # the AVX-512 tiles without avx512_bf16 read float32 panels, not bfloat16 word pairs (checked before the call)
    pool = torch.zeros(2, 4, 1, 16, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="do not read a torch.bfloat16 pool of panels"):
        decode.with_body(AVX512).for_layout(PANELS)(torch.zeros(1, 1, 1, 16), pool, torch.zeros(1, 1, dtype=torch.long),
                                                    torch.ones(1, dtype=torch.long), 1.0)


def test_kv_cache_shape_per_layout() -> None:
    from prefixserve.model.config import ModelConfig
    config = ModelConfig.from_hf_config({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
                                         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                         "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 100,
                                         "max_position_embeddings": 64, "rms_norm_eps": 1e-6})
    assert kv_cache_shape(config, 7, 16) == (2, 7, 16, 2, 16)
    assert kv_cache_shape(config, 7, 16, PANELS) == (2, 7, 2, 16, 16)


@pytest.fixture(scope="module")
def prefill(tmp_path_factory) -> paged_prefill_attention.PagedPrefillAttention:
    return build_fresh(paged_prefill_attention.load, tmp_path_factory).with_body(best_isa())


@pytest.mark.parametrize("dtype", READ_HERE)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("chunks", [
    [(300, 300)],                          # a fresh prompt: packed ahead of its items over rows
    [(40, 1100), (33, 1077)],              # new turns over cached histories: tiles streamed as used
    [(34, 1058), (34, 1058), (20, 1044)],  # questions under one cached document: keys shared by a leader
    [(5, 5), (17, 17), (64, 64), (1, 40)],  # short prompts, one decode token (not served)
])
def test_prefill_over_panels_gives_the_bits_of_rows(prefill, block_size: int, chunks: list, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(block_size + len(chunks))
    heads, kv_heads, d = 8, 2, 128
    width = max(n for _, n in chunks) // block_size + 1
    num_blocks = width * len(chunks) + 1
    rows = torch.randn(2, num_blocks, block_size, kv_heads, d, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.stack([order[i * width:(i + 1) * width] for i in range(len(chunks))])
    # chunks over the same cached context (its length the first chunk's) read the first one's blocks
    cached = chunks[0][1] - chunks[0][0]
    for i in range(1, len(chunks)):
        if chunks[i][1] - chunks[i][0] == cached:
            tables[i, :cached // block_size] = tables[0, :cached // block_size]
    lens = torch.tensor([n for _, n in chunks])
    starts = torch.tensor([0] + [q for q, _ in chunks]).cumsum(0)
    q = torch.randn(int(starts[-1]), heads, d, generator=gen).to(dtype)
    want = prefill(q, rows, starts, lens, tables, d ** -0.5, min_query_len=2)
    got = prefill.for_layout(PANELS)(q, _poisoned(rows, tables, lens), starts, lens, tables, d ** -0.5,
                                     min_query_len=2)
    assert torch.equal(got, want)


@pytest.mark.skipif(not reads_panels(best_isa(), torch.bfloat16), reason="this CPU does not run the avx512_bf16 "
                    "tiles, which read bfloat16 panels")
def test_stored_blocks_come_back_into_panels_and_never_into_rows(tiny_checkpoint, tmp_path) -> None:
    """A store keyed by layout: a fresh pool of panels loads the blocks another wrote and answers as it did;
    a pool of rows on the same store finds none of them (their bytes mean other words), computes them,
    and gives the same tokens (both layouts give the same bits)."""
    from kv_store_helpers import PARAMS, documents, full_blocks
    from prefixserve import LLM
    model, docs, url = str(tiny_checkpoint("qwen3")), documents(n=3), f"file://{tmp_path}"

    def run(**kwargs) -> list:
        llm = LLM(model, dtype="bfloat16", num_kv_blocks=64, kv_stores=[url], **kwargs)
        outs = [llm.generate({"prompt_token_ids": d}, PARAMS)[0] for d in docs]
        layout = llm.engine.runner.kv_layout
        llm.close()         # writes the pool's blocks to the store
        return layout, [(o.num_cached_tokens, o.outputs[0].token_ids) for o in outs]

    layout, first = run()
    assert layout == PANELS and [c for c, _ in first] == [0] * len(docs)
    layout, again = run()
    assert [c for c, _ in again] == [full_blocks(d) for d in docs] and again == [
        (full_blocks(d), t) for d, (_, t) in zip(docs, first)]
    layout, rows = run(kv_layout=ROWS)
    assert layout == ROWS and rows == [(0, t) for _, t in first]


def test_a_layout_the_engine_cannot_serve_is_refused(tiny_checkpoint) -> None:
    from prefixserve import LLM, EngineConfig
    with pytest.raises(ValueError, match="kv_layout must be one of"):
        EngineConfig(kv_layout="columns")
    model = str(tiny_checkpoint("qwen3"))
    for dtype in ("float32", "bfloat16"):
        with pytest.raises(ValueError, match="kv_layout='panels' needs"):
            LLM(model, dtype=dtype, kv_layout="panels", block_size=8, num_kv_blocks=8)


@pytest.mark.parametrize("dtype", READ_HERE)
def test_auto_lays_a_pool_out_in_panels_where_the_tiles_read_them(tiny_checkpoint, dtype: torch.dtype) -> None:
    from prefixserve import LLM
    model, name = str(tiny_checkpoint("qwen3")), str(dtype).removeprefix("torch.")
    assert LLM(model, dtype=name, num_kv_blocks=8).engine.info.kv_layout == PANELS
    assert LLM(model, dtype=name, block_size=8, num_kv_blocks=8).engine.info.kv_layout == ROWS


@pytest.mark.parametrize("dtype", READ_HERE)
def test_an_engine_over_panels_answers_and_caches_as_one_over_rows(tiny_checkpoint, dtype: torch.dtype) -> None:
    """Shared prefixes, chunked prefill, a pool small enough to preempt, decode steps through the decode
    program: every token and every cached K/V value the same in both layouts."""
    import random
    from prefixserve import LLM, SamplingParams
    model = str(tiny_checkpoint("qwen3"))
    rng = random.Random(5)
    doc = [rng.randrange(5, 4000) for _ in range(150)]
    prompts = [doc + [rng.randrange(5, 4000) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    prompts += [[rng.randrange(5, 4000) for _ in range(70)] for _ in range(2)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results = {}
    for layout in (ROWS, PANELS):
        llm = LLM(model, dtype=str(dtype).removeprefix("torch."), kv_layout=layout, num_kv_blocks=40,
                  max_num_batched_tokens=64)
        runner = llm.engine.runner
        assert runner.kv_layout == layout and runner.decode_program is not None
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        blocks = torch.arange(runner.num_blocks)
        pools = []
        for cache in runner.kv_caches:
            k, v = (torch.empty(runner.num_blocks, runner.block_size, runner.config.num_key_value_heads,
                                runner.config.head_dim, dtype=cache.dtype) for _ in range(2))
            gather_rows(cache, layout, blocks, k, v)
            pools.append((k, v))
        results[layout] = ([o.outputs[0].token_ids for o in outs], pools, llm.stats().preemptions)
    assert results[ROWS][0] == results[PANELS][0]
    assert results[PANELS][2] > 0
    assert all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(results[ROWS][1], results[PANELS][1])
               for a, b in ((ka, kb), (va, vb)))
