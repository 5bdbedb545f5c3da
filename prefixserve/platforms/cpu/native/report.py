"""Which native kernels this process uses and, for each one it does not, why: for start-up logs,
the engine's stats() and /health.

Kernels load lazily, on their first use; `load_all()` loads them all at once (at engine
start-up, so the first request does not pay for the builds and the report is complete from
the start) and returns the report.
"""
from __future__ import annotations

from typing import Callable

from prefixserve.platforms.cpu.native import (build, decode_loop, fused_pointwise, packed_gemm, paged_decode_attention,
                                      paged_prefill_attention, row_argmax, small_m_gemm)

_DEFAULT_KERNELS: dict[str, Callable[[], object]] = {
    "small_m_gemm": small_m_gemm.default_kernel,
    "packed_gemm": packed_gemm.default_kernel,
    "paged_decode_attention": paged_decode_attention.default_kernel,
    "paged_prefill_attention": paged_prefill_attention.default_kernel,
    "fused_pointwise": fused_pointwise.default_kernel,
    "row_argmax": row_argmax.default_kernel,
    "decode_loop": decode_loop.default_kernel,
}


def kernel_report() -> dict[str, dict[str, object]]:
    """{kernel name: KernelStatus.as_dict()}, JSON-ready; loads nothing (a kernel not yet used: "not_loaded").

    Each entry: active (bool), reason (None when active, else one of build.REASONS), detail
    (str), library (the file loaded, or None), note (why the cache folder was passed over, or None).
    """
    report = {}
    for name in _DEFAULT_KERNELS:
        status = build.kernel_status(name) or build.KernelStatus(
            name, False, build.NOT_LOADED, "not used yet: kernels load on first use (or at start-up via load_all())")
        report[name] = status.as_dict()
    return report


def load_all() -> dict[str, dict[str, object]]:
    """Build and load every kernel now (each at most once per process) and return `kernel_report()`.

    Never raises for a kernel's sake: one that cannot be used is reported and its callers take torch.
    """
    for default_kernel in _DEFAULT_KERNELS.values():
        default_kernel()
    return kernel_report()
