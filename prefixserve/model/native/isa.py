"""The instruction sets the native kernels have bodies for, and the widest one this CPU runs."""
from __future__ import annotations

import torch

# best last: AVX2 + FMA (8 lanes), AVX-512 (16 lanes), AVX-512 with bfloat16 dot products (vdpbf16ps)
AVX2, AVX512, AVX512_BF16 = "avx2", "avx512", "avx512_bf16"
ISAS = (AVX2, AVX512, AVX512_BF16)


def best_isa() -> str:
    """The widest body this CPU and OS run, as torch sees them (a hypervisor that withholds a feature
    withholds it from torch too)."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return AVX2
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return AVX512_BF16 if bf16 is not None and bf16() else AVX512
