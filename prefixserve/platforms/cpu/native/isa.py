"""The instruction sets the native kernels have bodies for, and the widest one this CPU runs."""
from __future__ import annotations

import torch

# best last: AVX2 + FMA (8 lanes), AVX-512 (16 lanes), AVX-512 with bfloat16 dot products (vdpbf16ps)
AVX2, AVX512, AVX512_BF16 = "avx2", "avx512", "avx512_bf16"
ISAS = (AVX2, AVX512, AVX512_BF16)
# the `body` argument of the attention kernels (attention_tiles.h)
BODY_CODES = {AVX2: 0, AVX512: 1, AVX512_BF16: 2}


def cpu_probe(name: str) -> bool:
    """One of torch's private CPU feature probes (`_is_avx512_bf16_supported`, `_is_amx_tile_supported`):
    torch asks the CPU and, for AMX, the OS (which must grant the tile state), so a feature listed in
    /proc/cpuinfo but withheld by a hypervisor counts as absent, as it is for oneDNN. A torch without
    the probe cannot use the feature either."""
    probe = getattr(torch.cpu, name, None)
    return bool(probe()) if probe is not None else False


def cpu_fields() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ("vendor_id", "model name", "cpu family", ...); empty
    where the system has no such file (not Linux)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, sep, value = line.partition(":")
                if not sep:
                    if fields:
                        break      # the first processor's block is enough
                    continue
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_vendor() -> str | None:
    """The CPU's vendor ("AuthenticAMD", "GenuineIntel"); None where /proc/cpuinfo does not say."""
    return cpu_fields().get("vendor_id")


def reads_panels(body: str, dtype: torch.dtype) -> bool:
    """Whether the attention kernels' tiles in `body` read a pool of panels of `dtype` (panels.py): a
    bfloat16 pool's in word pairs (the avx512_bf16 body), a float32 pool's in the AVX-512 tiles."""
    if dtype == torch.bfloat16:
        return body == AVX512_BF16
    return dtype == torch.float32 and body in (AVX512, AVX512_BF16)


def best_isa() -> str:
    """The widest body this CPU and OS run, as torch sees them."""
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return AVX2
    return AVX512_BF16 if cpu_probe("_is_avx512_bf16_supported") else AVX512
