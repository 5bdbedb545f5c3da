"""The packed GEMM's tile body (AMX, native/packed_gemm.c), checked where no CPU here has AMX: the same C
file built with its tile instructions emulated in C, so everything the body itself decides (which tile
reads which bytes of x and of the panels, the strides, the row groups and the last group's fewer rows, the
k steps, the four column groups, the sums' round trip through memory, bias, rounding, the widened store,
the last panel's columns, the threads' panels) is held to an independent product of the instruction's
definition, bit for bit. What the emulation cannot show is the hardware's own rounding inside the
instruction; on a CPU with AMX the default kernel takes the tile body and tests/platforms/cpu/test_model_packed_gemm.py
holds it to float64 products and to batch invariance there.
"""
from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys

import pytest
import torch

from native_kernel_build import build_fresh
from prefixserve.platforms.cpu.native import build, packed_gemm
from prefixserve.platforms.cpu.native.isa import cpu_probe

def require_bfloat16_body() -> None:
    """Both builds run bfloat16 on avx512_bf16 code (the vector body, and the tile body's finish)."""
    if torch.bfloat16 not in packed_gemm.runnable_dtypes():
        pytest.skip("needs a CPU with avx512_bf16 (the vector body and the tile body's finish)")


@pytest.fixture(scope="module")
def emulated(tmp_path_factory) -> packed_gemm.PackedGemm:
    require_bfloat16_body()
    return build_fresh(lambda cc, out: packed_gemm.load(cc, out, emulate_tiles=True), tmp_path_factory)


@pytest.fixture(scope="module")
def native(tmp_path_factory) -> packed_gemm.PackedGemm:
    require_bfloat16_body()
    return build_fresh(packed_gemm.load, tmp_path_factory)


def packed(w: torch.Tensor) -> torch.Tensor:
    """W's panels, the last panel's unused columns NaN (they must reach no result)."""
    n, k = w.shape
    return packed_gemm.pack(w, torch.full(packed_gemm.panel_shape(n, k, w.dtype), float("nan"), dtype=w.dtype))


def tile_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tile_k: int) -> torch.Tensor:
    """x @ w.T (+ bias) in float32 as TDPBF16PS defines it, one output at a time in effect: per step of tile_k
    elements of k, the even and the odd elements' products summed in two chains (a product of two bfloat16
    values is exact in float32, so each addition is a fused multiply-add), their sum added to the output."""
    xf, wf = x.float(), w.float()
    acc = torch.zeros(x.shape[0], w.shape[0])
    for start in range(0, x.shape[1], tile_k):
        even, odd = torch.zeros_like(acc), torch.zeros_like(acc)
        for p in range(start, start + tile_k, 2):
            even = even + xf[:, p, None] * wf[None, :, p]
            odd = odd + xf[:, p + 1, None] * wf[None, :, p + 1]
        acc = acc + (even + odd)
    return acc if bias is None else acc + bias.float()


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16(),
            torch.randn(n, generator=gen).bfloat16())


def test_the_emulated_build_takes_the_tiles_and_the_default_one_exactly_where_the_cpu_grants_amx(emulated, native):
    assert emulated.tiles and emulated.tile_k == 32
    # torch asks the CPU for AMX tiles and Linux for the permission, as the library does when it loads
    assert native.tiles == cpu_probe("_is_amx_tile_supported")


def test_the_emulated_build_is_cached_apart_from_the_plain_one(tmp_path) -> None:
    """The macros are part of the cache key: an emulated library is never loaded as the process's kernel."""
    require_bfloat16_body()
    cc = build.compiler()
    emulated = packed_gemm.load(cc, tmp_path, emulate_tiles=True)
    plain = packed_gemm.load(cc, tmp_path)
    assert emulated.tiles and plain.tiles == cpu_probe("_is_amx_tile_supported")
    assert len(list(tmp_path.glob("packed_gemm-*.so"))) == 2
    assert build.cache_key("packed_gemm", cc) != build.cache_key("packed_gemm", cc, (packed_gemm.EMULATE_TILES,))


# loads the emulated and the plain build in a fresh process (the library reads the environment when it loads)
LOAD_AND_MULTIPLY = """
import json, sys, torch
from prefixserve.platforms.cpu.native import build, packed_gemm
operands = torch.load(sys.argv[1])
n = operands["panels"].shape[0] * packed_gemm.PANEL
results = {}
for emulate in (True, False):
    kernel = packed_gemm.load(build.compiler(), sys.argv[2], emulate_tiles=emulate)
    results[str(emulate)] = {"tiles": kernel.tiles, "y": kernel(operands["x"], operands["panels"], n).float().tolist()}
print(json.dumps(results))
"""


def test_prefixserve_amx_0_keeps_bfloat16_on_the_vector_body(emulated, tmp_path) -> None:
    """Loaded with PREFIXSERVE_AMX=0, the emulated build and the plain one (on an AMX CPU too) report no tiles
    and give the same bits: the vector body's."""
    x, w, _ = operands(64, 512, 1024, seed=9)
    panels = packed(w)
    torch.save({"x": x, "panels": panels}, tmp_path / "operands.pt")
    run = subprocess.run([sys.executable, "-c", LOAD_AND_MULTIPLY, str(tmp_path / "operands.pt"),
                          str(tmp_path / "kernels")], env={**os.environ, packed_gemm.AMX_ENV: "0"},
                         capture_output=True, text=True, check=True)
    results = json.loads(run.stdout)
    assert not results["True"]["tiles"] and not results["False"]["tiles"]
    vector = torch.tensor(results["False"]["y"])
    assert torch.equal(torch.tensor(results["True"]["y"]), vector)
    # the tiles' sums round differently from the vector body's somewhere here, so the equality says which ran
    assert not torch.equal(emulated(x, panels, 512).float(), vector)


@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 40])
@pytest.mark.parametrize("n, k", [(1, 32), (64, 64), (70, 1024), (200, 96)])
def test_the_tile_body_gives_the_bits_of_the_instructions_product(emulated, m: int, n: int, k: int) -> None:
    x, w, b = operands(m, n, k, seed=m * 7919 + n * 31 + k)
    panels = packed(w)
    for bias in (None, b):
        want = tile_product(x, w, bias, emulated.tile_k)
        got = emulated(x, panels, n, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert torch.equal(got, want.bfloat16()), (m, n, k, bias is None)
        # the LM head's store: the same rounding, widened to float32
        widened = emulated.product(x, panels, n, None if bias is None else bias.float(), widened=True)
        assert widened.dtype == torch.float32 and torch.equal(widened, want.bfloat16().float())


def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads(emulated) -> None:
    """Row groups of 16, the last one shorter: a row alone, at any place in a batch, on one thread or two."""
    x, w, b = operands(53, 130, 128, seed=5)
    panels = packed(w)
    whole = emulated(x, panels, 130, b)
    for r in (0, 15, 16, 31, 47, 48, 52):
        assert torch.equal(emulated(x[r:r + 1], panels, 130, b), whole[r:r + 1]), r
    assert torch.equal(emulated(x[16:41], panels, 130, b), whole[16:41])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = emulated(x, panels, 130, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, whole)


@pytest.mark.parametrize("m", [17, 33])
def test_the_last_groups_fewer_rows_read_nothing_past_the_last_row(emulated, m: int) -> None:
    """x ends where an unreadable page begins: a last group read as 16 rows would fault."""
    k, page = 64, mmap.PAGESIZE
    data = -(-m * k * 2 // page) * page
    region = mmap.mmap(-1, data + page)
    start = ctypes.addressof(ctypes.c_char.from_buffer(region))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(start + data, page, 0) == 0, ctypes.get_errno()      # 0: PROT_NONE
    try:
        x = torch.frombuffer(region, dtype=torch.bfloat16, count=m * k, offset=data - m * k * 2).view(m, k)
        src, w, b = operands(m, 70, k, seed=m)
        x.copy_(src)
        assert torch.equal(emulated(x, packed(w), 70, b), tile_product(src, w, b, emulated.tile_k).bfloat16())
    finally:
        libc.mprotect(start + data, page, mmap.PROT_READ | mmap.PROT_WRITE)


@pytest.mark.parametrize("k", [2, 24, 136, 1000])
def test_a_k_that_is_no_whole_number_of_tile_steps_takes_the_vector_body(emulated, native, k: int) -> None:
    """Per weight, by its k alone (never by the rows), so a row's bits stay independent of the batch."""
    x, w, b = operands(19, 70, k, seed=k)
    panels = packed(w)
    assert torch.equal(emulated(x, panels, 70, b), native(x, panels, 70, b))


def test_the_tile_body_agrees_with_float64_on_the_models_shapes(emulated) -> None:
    """The 0.6B model's k (1024 and 3072) over decode and prefill row counts: float32 sums of exact products
    (~k roundings of 2^-24 of the terms' magnitude), then one rounding to bfloat16."""
    gen = torch.Generator().manual_seed(3)
    for m, k in ((16, 1024), (33, 3072)):
        x = torch.randn(m, k, generator=gen).bfloat16()
        w = (torch.randn(96, k, generator=gen) * 0.05).bfloat16()
        got = emulated(x, packed(w), 96).double()
        exact = x.double() @ w.double().T
        terms = x.double().abs() @ w.double().abs().T
        bound = 2.0 ** -8 * exact.abs() + (k + 1) * 2.0 ** -24 * (terms + exact.abs()) + 1e-30
        assert ((got - exact).abs() <= bound).all()
