"""Compiling this platform's kernels for a device: Triton's JIT on CUDA, its interpreter on the CPU.

The kernels are written as plain functions (no `@triton.jit` at import) and compiled on first use; the
device functions they call are `@triton.jit` when their module is imported, after `prepare`. Which
of the two a process runs is Triton's choice at its import: `triton.language`'s own functions (tl.sum,
tl.zeros, ...) are compiled or interpreted from TRITON_INTERPRET as it is then. So the first kernel for
CPU tensors turns the interpreter on before Triton is imported (a process that already compiles for a GPU
is told why it cannot), and kernels for CUDA tensors refuse a process that interprets. The interpreter
cannot run `@triton.autotune`, so no kernel here autotunes: block sizes are fixed per head dim.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from functools import lru_cache
from typing import Any, Callable

import torch

INTERPRET = "TRITON_INTERPRET"


class TritonUnavailable(RuntimeError):
    """Triton is not installed, or runs in the other mode in this process."""


def triton_missing() -> str | None:
    """Why Triton cannot be used in this process, or None (without importing it)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed; pip install 'prefixserve[cuda]'"
    return None


def require_triton() -> None:
    why = triton_missing()
    if why is not None:
        raise TritonUnavailable(why)


def interpreting() -> bool:
    """Whether this process's Triton interprets kernels (decided when triton.language is imported)."""
    if "triton.language" not in sys.modules:
        return os.environ.get(INTERPRET, "0").lower() in ("1", "true", "on", "yes")
    import triton
    return bool(triton.knobs.runtime.interpret)


def prepare(device_type: str) -> None:
    """Makes this process's Triton able to run kernels on `device_type` tensors, or says why it cannot. Call
    before importing a kernel module (they import triton.language)."""
    require_triton()
    if device_type == "cpu":
        if "triton.language" not in sys.modules:
            os.environ[INTERPRET] = "1"
        elif not interpreting():
            raise TritonUnavailable(
                "Triton kernels run on CPU tensors only under Triton's interpreter, which this process did not "
                f"choose: Triton was imported without {INTERPRET}=1 (set it before anything imports triton)")
    elif device_type == "cuda":
        if interpreting():
            raise TritonUnavailable(f"this process runs Triton's interpreter ({INTERPRET}=1): CUDA kernels "
                                    "would run on the host; unset it")
    else:
        raise ValueError(f"Triton kernels run on cuda and cpu tensors, not {device_type!r}")


@lru_cache(maxsize=None)
def compiled(fn: Callable[..., Any], device_type: str) -> Any:
    """`fn` as a launchable Triton kernel (`kernel[grid](...)`) for tensors on `device_type`."""
    prepare(device_type)
    import triton
    return triton.jit(fn)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: float32 operands multiply in full precision (TF32 would move greedy
    tokens against the float32 reference); bfloat16 and float16 ones ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
