"""Transparent huge pages for the big, long-lived CPU tensors: weights and the KV pool.

Decode streams every weight once a step and reads K/V rows scattered over a pool of GiBs. With 4 KB
pages that is a TLB miss every few rows; where the kernel leaves transparent huge pages to the
program (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise, the usual default), memory gets
2 MB pages only when asked before it is first touched. On a Zen 5 EPYC (2 threads) a 311 MB bfloat16
LM head is read by the few-row GEMM at 44.5-46.0 GB/s on 4 KB pages and 46.0-49.1 GB/s on 2 MB
pages, against 49.6 GB/s for torch's sum over 1 GiB; batch-1 decode of random:qwen3-0.6b in bfloat16
took 25.5-26.1 instead of 26.7-27.6 ms a token.

Such tensors get a mapping of their own: memory from torch's allocator may be a reused, already
touched part of the heap, which the advice no longer changes.
"""
from __future__ import annotations

import math
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)


def zeros_on_huge_pages(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device | str,
                        resident: bool = True) -> torch.Tensor:
    """torch.zeros(shape), in an anonymous mapping of its own advised to use huge pages where it is a
    CPU tensor of at least one huge page on Linux.

    resident: every page is faulted in now. The kernel hands out zeroed pages as they are first
    touched; left to that, each request writing K/V to blocks never used before pays for zeroing
    2 MB pages (the pool writes of 32 new tokens after a cached 1024 took 15 instead of 1.6 ms on a
    Zen 4 EPYC), and a pool that a busy server grows into could meet an out-of-memory kill
    mid-request instead of a failure at start. Weights, overwritten by loading right after, skip it."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if (torch.device(device).type != "cpu" or nbytes < HUGE_PAGE or _ADVICE is None
            or not sys.platform.startswith("linux")):
        return torch.zeros(shape, dtype=dtype, device=device)
    # private: a shared anonymous mapping is shmem, which has huge pages of its own setting (mostly off)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(_ADVICE)
    except OSError:
        pass  # a kernel without transparent huge pages: 4 KB pages, only slower
    # the tensor keeps the mapping alive; it is unmapped when the last view of the storage goes
    tensor = torch.frombuffer(region, dtype=dtype).view(shape)
    if resident:
        tensor.zero_()
    return tensor
