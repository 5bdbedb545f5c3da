"""Weights and the KV pool ask for transparent huge pages before their first touch; the OS's own
accounting (/proc/self/smaps) says whether the pages under them are huge."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from prefixserve.model.huge_pages import HUGE_PAGE, zeros_on_huge_pages
from prefixserve.model.layers import empty_parameter
from prefixserve.model.loader import load_model
from prefixserve.worker.model_runner import ModelRunner

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_available = sys.platform.startswith("linux") and THP.is_file() and "[never]" not in THP.read_text()
needs_thp = pytest.mark.skipif(not thp_available, reason="the kernel has transparent huge pages off")


def huge_bytes_under(t: torch.Tensor) -> int:
    """AnonHugePages of the mappings that hold t's storage, from the kernel's per-mapping accounting."""
    start = t.untyped_storage().data_ptr()
    end = start + t.untyped_storage().nbytes()
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo < end and start < hi
        elif inside and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


@needs_thp
def test_a_big_tensor_lands_on_huge_pages() -> None:
    t = zeros_on_huge_pages((4, 2 << 20), dtype=torch.uint8, device="cpu")
    assert t.shape == (4, 2 << 20) and bool((t == 0).all())
    t.fill_(1)
    assert huge_bytes_under(t) >= 3 * HUGE_PAGE


@needs_thp
def test_without_the_advice_the_same_tensor_does_not() -> None:
    """The oracle for the test above: torch.empty alone (the kernel's madvise mode) gets 4 KB pages."""
    if "[always]" in THP.read_text():
        pytest.skip("the kernel gives every mapping huge pages")
    t = torch.empty(16 << 20, dtype=torch.uint8)
    t.fill_(1)
    assert huge_bytes_under(t) == 0


@needs_thp
def test_a_tensor_left_to_its_first_touch_takes_no_memory_until_then() -> None:
    t = zeros_on_huge_pages((16 << 20,), dtype=torch.uint8, device="cpu", resident=False)
    assert huge_bytes_under(t) == 0
    t[: 2 * HUGE_PAGE].fill_(1)
    # the touched 4 MB hold at least one whole aligned huge page, and touch at most three
    assert HUGE_PAGE <= huge_bytes_under(t) <= 3 * HUGE_PAGE and int(t.sum()) == 2 * HUGE_PAGE


def test_small_or_non_cpu_tensors_are_plain_zeros() -> None:
    small = zeros_on_huge_pages((10, 100), dtype=torch.bfloat16, device="cpu")
    assert small.dtype == torch.bfloat16 and bool((small == 0).all())
    meta = zeros_on_huge_pages((4 << 20,), dtype=torch.float32, device="meta")
    assert meta.device.type == "meta" and meta.shape == (4 << 20,)


@needs_thp
def test_the_weights_and_the_kv_pool_ask_for_them() -> None:
    loaded = load_model("random:qwen3-tiny", dtype=torch.float32)
    runner = ModelRunner(loaded, block_size=16, num_blocks=4096)
    pool = runner.kv_caches[0]
    assert pool.untyped_storage().nbytes() >= 4 * HUGE_PAGE
    # resident before any K/V is written: no request pays for faulting in the pool's pages
    # (all but the unaligned ends of the mapping)
    assert huge_bytes_under(pool) >= (pool.untyped_storage().nbytes() // HUGE_PAGE - 1) * HUGE_PAGE
    assert bool((pool == 0).all())      # zeros: a slot read before it is written must hold no NaN
    weight = empty_parameter(2048, 1024, dtype=torch.float32, device="cpu")     # 8 MB, as the layers make them
    weight.copy_(torch.randn(2048, 1024))
    assert huge_bytes_under(weight) >= 2 * HUGE_PAGE
