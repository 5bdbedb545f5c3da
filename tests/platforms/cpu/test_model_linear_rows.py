"""Projections handed to oneDNN come in a bounded set of row counts (`linear.onednn_rows`).

oneDNN keeps a JIT-compiled primitive (0.5-0.7 MB) per distinct shape for the life of the
process; fed every step's raw token count, a server grew by ~0.9 GB per 1,000 distinct prompt
lengths. These tests check the padding's arithmetic, that padded results equal unpadded ones,
and that an engine serving many prompt lengths hands oneDNN only a few row counts.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import prefixserve.platforms.cpu.linear as linear_mod
import prefixserve.platforms.cpu.platform as decoder_mod
from prefixserve.engine.config import EngineConfig
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.platforms.cpu.linear import (EXACT_ROWS, PRIMITIVE_CACHE_CAPACITY, ROW_STEP_MIN, STEPS_PER_OCTAVE,
                                      linear, onednn_rows)
from prefixserve.platforms.cpu.native.small_m_gemm import MAX_ROWS
from prefixserve.sampling_params import SamplingParams


def test_rows_are_padded_to_few_sizes() -> None:
    sizes = [onednn_rows(m, 64, 256) for m in range(1, 4097)]
    assert sizes[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))
    assert all(r >= m for m, r in enumerate(sizes, 1))
    assert sizes == sorted(sizes)
    assert all(onednn_rows(r, 64, 256) == r for r in sizes), "a padded size must map to itself"
    # past the first octaves of steps of ROW_STEP_MIN, at most 1/STEPS_PER_OCTAVE more rows
    assert all((r - m) * STEPS_PER_OCTAVE <= m for m, r in enumerate(sizes, 1) if m > ROW_STEP_MIN * STEPS_PER_OCTAVE)
    # logarithmic: EXACT_ROWS exact sizes, then at most STEPS_PER_OCTAVE per octave
    octaves = (4096 // EXACT_ROWS).bit_length() - 1
    assert len(set(sizes)) <= EXACT_ROWS + STEPS_PER_OCTAVE * octaves
    assert len(set(sizes[EXACT_ROWS:2048])) == 38


def test_large_products_keep_their_rows() -> None:
    """Padding would cost every layer more than the one primitive a step builds for them."""
    assert onednn_rows(300, 1024, 4096) == 300
    assert all(onednn_rows(m, 64, 256) > m for m in (33, 300, 1000, 2047))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(33, 64), (100, 136), (517, 64), (3, 41, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_padded_rows_give_the_unpadded_result(dtype: torch.dtype, shape: tuple[int, ...], with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen).to(dtype)
    w = torch.randn(72, shape[-1], generator=gen).to(dtype)
    b = torch.randn(72, generator=gen).to(dtype) if with_bias else None
    got = linear(x, w, b)
    assert got.shape == (*shape[:-1], 72) and got.dtype == dtype and got.is_contiguous()
    tol = {"rtol": 0, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got.double(), F.linear(x.double(), w.double(), None if b is None else b.double()),
                               **tol)


@pytest.mark.skipif(not linear_mod.ONEDNN_LINEAR, reason="torch has no oneDNN linear here")
def test_an_engine_serving_200_prompt_lengths_gives_onednn_few_shapes(monkeypatch) -> None:
    shapes: set[tuple[int, ...]] = set()
    onednn = linear_mod._onednn_linear

    def recording(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shapes.add((*x.shape, weight.shape[0]))
        return onednn(x, weight, bias)

    monkeypatch.setattr(linear_mod, "_onednn_linear", recording)
    # row-major weights, as where the CPU has no AVX-512 (with it a float32 model's are packed and
    # oneDNN never runs)
    monkeypatch.setattr(decoder_mod, "packing_applies", lambda weight: False)
    # float32: the dtype that reaches _onednn_linear (auto may pick bfloat16, which F.linear serves)
    engine = LLMEngine(EngineConfig(model="random:qwen3-tiny", dtype="float32", enable_prefix_caching=False))
    rng = random.Random(0)
    lengths = list(range(40, 240))
    rng.shuffle(lengths)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for i, length in enumerate(lengths):
        engine.add_request(str(i), [rng.randrange(10, 1000) for _ in range(length)], params)
        while engine.has_unfinished_requests():
            engine.step()
    # one prefill step per prompt, its 40-239 tokens padded to 48, 64, ..., 240: 13 row counts
    # for each of the 4 projection shapes, where unpadded they were 200 (fewer where the few-row
    # kernel's limit, 32 or 64 rows by instruction set, takes the smallest)
    rows = {shape[0] for shape in shapes}
    assert rows == {r for r in range(48, 241, 16) if r > MAX_ROWS}
    assert len(shapes) == len(rows) * 4


def test_both_primitive_caches_are_bounded_before_onednn_is_first_used() -> None:
    """The capacities are read once, at oneDNN's first use, so they are set when linear.py is
    imported. A child process shows oneDNN's cache evicting a shape (built again: "cache_miss")
    once PRIMITIVE_CACHE_CAPACITY others were built; ideep's cache is seen only through memory
    (either cache alone at 1024 left +260-300 MB for 800 shapes here), so its setting is read back."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    env["ONEDNN_VERBOSE"] = "2"
    script = textwrap.dedent(f"""
        import os
        import torch
        import prefixserve.platforms.cpu.linear as linear_mod
        print("capacities", os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"], os.environ["LRU_CACHE_CAPACITY"])
        w = torch.ones(8, 8)
        def build(m):
            linear_mod._onednn_linear(torch.ones(m, 8), w, None)
        for m in range(1000, 1000 + {PRIMITIVE_CACHE_CAPACITY} + 1):
            build(m)
        print("---- again", flush=True)
        build(1000 + {PRIMITIVE_CACHE_CAPACITY})   # the latest: still cached
        print("---- first", flush=True)
        build(1000)                                # the first: evicted
    """)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    settings, again, first = out.stdout.split("---- ")
    assert f"capacities {PRIMITIVE_CACHE_CAPACITY} {PRIMITIVE_CACHE_CAPACITY}\n" in settings
    assert "cache_miss" not in again
    assert "create:cache_miss" in first and "mb1000ic8oc8" in first
