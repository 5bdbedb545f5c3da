"""The packed GEMM and the packed weights it reads (native/packed_gemm.c, platforms/cpu/packed_weight.py), in
each dtype it has a body for that this CPU runs (float32 with AVX-512, bfloat16 with avx512_bf16; on a CPU
with AMX, bfloat16 of a k that is a multiple of 32 runs the tile body, whose tiling is also checked on
emulated tiles in test_model_packed_gemm_tiles.py).

Against float64 products of the same operands, over shapes that cut the 6-row groups and the
64-column panels at every edge; bit for bit, a row's result whatever the rows beside it and the thread
count (what exact prefix caching rests on); and packing as a change of layout only: the values come
back out exactly, the embedding lookup reads the packed LM head, and a packed model holds no second
copy of any weight.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from native_kernel_build import build_fresh
from prefixserve.model.hf_weights import hf_weight_targets
from prefixserve.platforms.cpu.linear import linear
from prefixserve.model.loader import load_model
from prefixserve.platforms.cpu.native import build, packed_gemm
from prefixserve.platforms.cpu.native.isa import AVX2, AVX512, best_isa
from prefixserve.model.prepared_weight import embedding
from prefixserve.platforms.cpu.packed_weight import PackedWeight
from prefixserve.model.random_models import random_model

PANEL = packed_gemm.PANEL
RUNNABLE = packed_gemm.runnable_dtypes()
# every dtype the kernel has a body for, each test of one skipped where this CPU cannot run that body
DTYPES = [pytest.param(dtype, marks=pytest.mark.skipif(dtype not in RUNNABLE, reason=f"no {dtype} body on this CPU "
                                                       "(float32 needs AVX-512, bfloat16 avx512_bf16)"))
          for dtype in (torch.float32, torch.bfloat16)]
# the store's rounding, relative: one rounding to bfloat16 (half an ulp), none in float32
STORE_ROUNDING = {torch.bfloat16: 2.0 ** -8, torch.float32: 0.0}


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> packed_gemm.PackedGemm:
    if best_isa() == AVX2:
        pytest.skip("needs a CPU with AVX-512")
    return build_fresh(packed_gemm.load, tmp_path_factory)


def packed(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    return packed_gemm.pack(w, torch.full(packed_gemm.panel_shape(n, k, w.dtype), float("nan"), dtype=w.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 8, 13, 16, 64, 130])
@pytest.mark.parametrize("n, k", [(1, 2), (13, 24), (64, 1024), (70, 136), (200, 3072), (3, 7)])
def test_the_product_of_the_exact_operands_rounded_once(kernel, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    k += k % packed_gemm.STEP[dtype]       # an odd length (float32's edge) is a whole number of bfloat16 pairs
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    x, w = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    for bias in (None, b):
        got = kernel(x, packed(w), n, bias)
        exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
        terms = x.double().abs() @ w.double().abs().T
        assert got.dtype == dtype and got.shape == (m, n)
        # float32 sums (~k roundings of 2^-24 of the terms), then the store's rounding; the NaNs in the
        # last panel's unused columns reach nothing
        bound = STORE_ROUNDING[dtype] * exact.abs() + (k + 1) * 2.0 ** -24 * (terms + exact.abs()) + 1e-30
        assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_bits_do_not_depend_on_the_batch_on_the_models_shapes(dtype: torch.dtype) -> None:
    """A prompt's rows are computed in chunks of other sizes with caching on than off, so a row must
    get the same bits in a batch of any size and at any place in it, from decode to prefill sizes, on
    the 0.6B model's projection shapes (through `linear`, as the model calls it)."""
    gen = torch.Generator().manual_seed(11)
    for k, n in [(1024, 4096), (3072, 1024)]:
        w = PackedWeight((torch.randn(n, k, generator=gen) * 0.05).to(dtype))
        rows = torch.randn(700, k, generator=gen).to(dtype)
        alone = torch.cat([linear(rows[r:r + 1], w) for r in (0, 5, 6, 7, 699)])
        whole = linear(rows, w)
        assert torch.equal(whole[[0, 5, 6, 7, 699]], alone), (k, n)
        # 7 to 24 rows take k in chunks in row groups of even size (8: 4 + 4, 13: 4 + 4 + 5), up to 18 smaller
        # chunks; 6 and fewer take whole panels in one group, 25 and more in groups of 6: every row against
        # the 700's
        for m in (2, 6, 7, 8, 13, 16, 18, 19, 24, 25, 47, 64, 65, 130):
            assert torch.equal(linear(rows[:m], w), whole[:m]), (k, n, m)
        shifted = linear(rows[3:133].contiguous(), w)     # every row in another place of its row group
        assert torch.equal(shifted[2:5], alone[1:4])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n", [(1, 1), (7, 70), (16, 200), (30, 13)])
def test_widened_results_are_the_results_as_float32(kernel, m: int, n: int, dtype: torch.dtype) -> None:
    """`widened` (the logits' path) stores what `.float()` of the dtype's result holds, bit for bit: the
    same rounding, halfway sums, infinities from sums past the largest value and NaN included, on rows
    of 16 or fewer (chunks, requests into L2) and more (four groups), with and without a bias."""
    gen = torch.Generator().manual_seed(m * 131 + n)
    k = 96
    x, w = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    x[0, :2] = torch.tensor([3e38, 3e38]).to(dtype)        # row 0: sums that overflow to +-inf
    w[:, :2] = 1.0
    if m > 1:
        x[1, 0] = float("nan")                               # row 1: NaN in every column
    bias = torch.randn(n, generator=gen)
    for b in (None, bias):
        plain = kernel.product(x, packed(w), n, b)
        widened = kernel.product(x, packed(w), n, b, widened=True)
        assert widened.dtype == torch.float32 and widened.shape == (m, n)
        assert torch.equal(widened.view(torch.int32), plain.float().view(torch.int32))
    assert plain.float().isinf().any() and (m == 1 or plain.float()[1].isnan().all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_packed_heads_logits_are_its_results_widened(dtype: torch.dtype) -> None:
    """compute_logits of a packed model takes the widened store: the same bits as the head's results in
    the model's dtype, then `.float()` (what the logits were before it)."""
    model = load_model("random:qwen3-tiny", dtype=str(dtype).removeprefix("torch."), seed=5).model
    h = torch.randn(16, model.config.hidden_size).to(dtype)
    assert torch.equal(model.compute_logits(h), linear(h, model.lm_head).float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_threads_split_the_panels_without_overlap(kernel, dtype: torch.dtype) -> None:
    """Every output written once whatever the thread count: a missed or doubled panel shows."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(9, 64, generator=gen).to(dtype), torch.randn(PANEL * 5 + 3, 64, generator=gen).to(dtype)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 7):
            torch.set_num_threads(threads)
            results.append(kernel(x, packed(w), w.shape[0]))
        torch.testing.assert_close(results[0].double(), x.double() @ w.double().T, rtol=1e-2, atol=1e-2)
        assert all(torch.equal(r, results[0]) for r in results[1:])
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_operands_that_do_not_fit_are_refused(kernel, dtype: torch.dtype) -> None:
    w = torch.randn(70, 24).to(dtype)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(ValueError, match="does not fit"):
        kernel(torch.randn(3, 26).to(dtype), packed(w), 70)
    with pytest.raises(ValueError, match="does not fit"):
        kernel(torch.randn(3, 24).to(other), packed(w), 70)       # x in the other dtype
    with pytest.raises(ValueError, match="does not fit"):
        kernel(torch.randn(3, 24).to(dtype), packed(w), 200)      # more columns than the panels hold
    with pytest.raises(ValueError, match="bias"):
        kernel(torch.randn(3, 24).to(dtype), packed(w), 70, torch.zeros(69))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 64, 70, 200])
def test_packing_changes_the_layout_only(n: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(n, 24, generator=gen).to(dtype)
    p = PackedWeight(w)
    assert p.shape == (n, 24) and p.dtype == dtype and torch.equal(p.unpacked(), w)
    ids = torch.tensor([[0, n - 1], [n // 2, 0]])
    assert torch.equal(embedding(ids, p), F.embedding(ids, w))
    bad = [w.double(), w[0]] + ([w[:, :23].contiguous()] if dtype == torch.bfloat16 else [])
    for weight in bad:
        with pytest.raises(ValueError, match="cannot pack"):
            PackedWeight(weight)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_model_is_packed_once_with_its_tied_head_shared(dtype: torch.dtype) -> None:
    """load_model packs every projection and the head; the embedding reads the packed head, the bytes
    held are the row-major model's (no copy kept), and the weights read back out are the same values."""
    loaded = load_model("random:qwen3-tiny", dtype=str(dtype).removeprefix("torch."), seed=3)
    plain = random_model("qwen3-tiny", dtype=dtype, device="cpu", seed=3)
    model = loaded.model
    assert model.embed_tokens is model.lm_head and isinstance(model.lm_head, PackedWeight)
    for layer in model.layers:
        for weight in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                       layer.mlp.down_proj):
            assert isinstance(weight, PackedWeight)
    nbytes = lambda m: sum(t.numel() * t.element_size() for t in m.parameters())
    assert nbytes(model) == nbytes(plain)         # every shape of qwen3-tiny is a multiple of the panel
    ours, theirs = hf_weight_targets(model), hf_weight_targets(plain)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # the same model through the row-major path: equal up to the kernels' float32 rounding order
    ids = torch.arange(5, 40)
    assert torch.equal(embedding(ids, model.embed_tokens), F.embedding(ids, plain.embed_tokens))
    h = torch.randn(9, model.config.hidden_size).to(dtype)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(model.compute_logits(h), plain.compute_logits(h), rtol=tolerance, atol=tolerance)
    assert not model.pack_weights() and model.lm_head is model.embed_tokens   # packed already: nothing to do


@pytest.mark.skipif(torch.bfloat16 not in RUNNABLE, reason="needs a CPU with avx512_bf16")
def test_a_projection_the_kernel_cannot_take_stays_row_major() -> None:
    """An odd row length (here the down projection's, from an odd intermediate size) is served by the
    row-major path; the rest of the model is still packed."""
    plain = random_model("qwen3-tiny", dtype=torch.bfloat16, device="cpu", seed=4)
    mlp = plain.layers[0].mlp
    odd = torch.nn.Parameter(torch.randn(mlp.down_proj.shape[0], 127).bfloat16(), requires_grad=False)
    del mlp.down_proj
    mlp.down_proj = odd
    assert plain.pack_weights()
    assert mlp.down_proj is odd and isinstance(mlp.gate_up_proj, PackedWeight)
    assert isinstance(plain.layers[1].mlp.down_proj, PackedWeight)


@pytest.mark.parametrize("isa, packs", [(AVX512, (torch.float32,)), (AVX2, ())])
def test_a_cpu_without_a_dtypes_body_keeps_that_dtypes_weights_row_major(monkeypatch, isa: str, packs) -> None:
    """Without avx512_bf16 only float32 weights are packed; without AVX-512 none, and the kernel is
    reported missing for that reason."""
    if best_isa() == AVX2 and isa == AVX512:
        pytest.skip("the float32 body needs a CPU with AVX-512")
    monkeypatch.setattr(build, "best_isa", lambda: isa)
    monkeypatch.setattr(packed_gemm, "best_isa", lambda: isa)
    packed_gemm.default_kernel.cache_clear()
    try:
        kernel = packed_gemm.default_kernel()
        if packs:
            assert kernel is not None and kernel.dtypes == packs
        else:
            assert kernel is None and build.kernel_status("packed_gemm").reason == build.NO_AVX512
        for dtype in ("float32", "bfloat16"):
            head = load_model("random:qwen3-tiny", dtype=dtype).model.lm_head
            assert isinstance(head, PackedWeight) == (getattr(torch, dtype) in packs), dtype
    finally:
        packed_gemm.default_kernel.cache_clear()
