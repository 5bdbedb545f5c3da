"""What dtype="auto" means on the CPU platform: bfloat16 where the CPU multiplies it faster, float32 elsewhere.

With AMX, oneDNN runs bfloat16 matmuls about 6x faster than float32 (1.2-2.1 vs 0.26-0.34
TFLOP/s on an Intel Xeon of this project) and decode reads half the bytes. On an AMD CPU
avx512_bf16 is the vector units' own bfloat16 dot product (Zen 4 EPYCs ran bfloat16 matmuls
2.3-2.8x faster than float32, a Zen 5 EPYC 2.0x): bfloat16, untimed. On an Intel CPU without AMX
it says little: a Xeon VM whose hypervisor withholds AMX ran them at 0.55x (149 vs 253 GFLOP/s,
2026-12-01). So there, auto times one matmul in both dtypes at start (a few tens of ms,
alternating the dtypes) and takes bfloat16 only when it is clearly faster: a timing a busy
moment can tip, so a restarted server may choose otherwise, which the AMD rule rules out there.
Without either feature every bfloat16 product is widened to float32 on the fly: float32. Off the
CPU, auto keeps the checkpoint's own dtype (model/platform.py).

The features and the timing are read once a process (`detected_support`): a timing, however careful, can
land on either side of the line on a busy machine, and two engines of one process must not answer in two
dtypes (a test's float32 oracle beside its bfloat16 server, on a 2-vCPU Zen 5 EPYC in a full test run).
Engines in several processes take a dtype resolved once for all of them (engine/dtype_resolution.py).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Optional

import torch

from prefixserve.model.platform import AUTO, DtypeChoice, Platform
from prefixserve.platforms.cpu.linear import linear
from prefixserve.platforms.cpu.native.isa import cpu_probe, cpu_vendor
from prefixserve.platforms.cpu.packed_weight import PackedWeight
from prefixserve.platforms.cpu.packed_weight import applies as packing_applies

# bfloat16 also costs accuracy: take it only for a clear gain
MIN_BF16_SPEEDUP = 1.25
AMD = "AuthenticAMD"


@dataclass(frozen=True)
class CpuBf16Support:
    """The CPU features that make bfloat16 fast, as torch (and so oneDNN) sees them."""
    amx_bf16: bool
    avx512_bf16: bool
    # float32 over bfloat16 matmul time, measured only with avx512_bf16, no AMX and not AMD
    bf16_speedup: Optional[float] = None
    vendor: Optional[str] = None

    @classmethod
    def detect(cls) -> "CpuBf16Support":
        amx, avx512_bf16 = cpu_probe("_is_amx_tile_supported"), cpu_probe("_is_avx512_bf16_supported")
        vendor = cpu_vendor()
        speedup = measure_bf16_speedup() if avx512_bf16 and not amx and vendor != AMD else None
        return cls(amx_bf16=amx, avx512_bf16=avx512_bf16, bf16_speedup=speedup, vendor=vendor)


def choose_dtype(requested: str, device: torch.device,
                 support: Optional[CpuBf16Support] = None) -> DtypeChoice:
    """Resolves the engine's dtype setting; an explicit dtype always wins."""
    if requested != AUTO or device.type != "cpu":
        return Platform().choose_dtype(requested, device)
    support = support or detected_support()
    if support.amx_bf16:
        return DtypeChoice(requested, "bfloat16", "auto: the CPU has AMX (bfloat16 tiles)")
    if support.avx512_bf16 and support.vendor == AMD:
        return DtypeChoice(requested, "bfloat16", "auto: an AMD CPU with avx512_bf16 (bfloat16 dot products in its "
                                                  "vector units)")
    if support.avx512_bf16:
        speedup = support.bf16_speedup
        if speedup is None:
            raise ValueError("CpuBf16Support with avx512_bf16, no AMX and not AMD needs bf16_speedup")
        if speedup >= MIN_BF16_SPEEDUP:
            return DtypeChoice(requested, "bfloat16",
                               f"auto: the CPU has avx512_bf16 and multiplies bfloat16 {speedup:.2f}x faster")
        return DtypeChoice(requested, "float32", f"auto: the CPU has avx512_bf16 but no AMX, and multiplies "
                                                 f"bfloat16 only {speedup:.2f}x as fast as float32")
    return DtypeChoice(requested, "float32", "auto: the CPU has neither AMX nor avx512_bf16")


@functools.cache
def detected_support() -> CpuBf16Support:
    """This process's `CpuBf16Support.detect()`, measured on first use: what every later dtype="auto" reads."""
    return CpuBf16Support.detect()


def measure_bf16_speedup(rounds: int = 9) -> float:
    """float32 time over bfloat16 time of a 256 x 1024 x 1024 matmul (a prefill chunk's shape), each
    through the kernel the model's projections would use (`linear`, on a packed weight where the
    model packs them): the fastest of `rounds` products in each dtype, the dtypes alternating, after a warm-up that
    builds oneDNN's primitives. Timing each dtype in a burst of its own let one busy moment on a
    shared machine slow one dtype only (a 0.6x machine once read 3.7x, and two engines in one
    process chose different dtypes); alternating, each dtype's fastest round comes from the
    quiet moments both had."""
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 1024, generator=generator), torch.randn(1024, 1024, generator=generator)
    b16 = b.bfloat16()
    operands = tuple((x, PackedWeight(w) if packing_applies(w) else w) for x, w in ((a, b), (a.bfloat16(), b16)))
    best = [float("inf"), float("inf")]
    for x, y in operands:
        linear(x, y)
    for _ in range(rounds):
        for i, (x, y) in enumerate(operands):
            start = time.perf_counter()
            linear(x, y)
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0] / best[1]
