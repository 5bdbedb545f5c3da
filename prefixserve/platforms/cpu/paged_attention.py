"""The CPU platform's paged-attention kernels as the torch backend drives them (model/attention/paged_kernels.py).

Prefill chunks and decode tokens read K/V straight from the pool through the native kernels
(`native/paged_prefill_attention.c`, `native/paged_decode_attention.c`), in rows or, where their tiles read
them, in panels (panels.py); a pool of panels is written by the pointwise kernels' `write_panels` (torch's
indexed copy through their strides: 8x the time).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from prefixserve.model.attention.cascade import DecodePlan
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.attention.paged_kernels import PagedKernels
from prefixserve.model.kv_layout import ROWS
from prefixserve.platforms.cpu.native import fused_pointwise, isa, paged_decode_attention, paged_prefill_attention
from prefixserve.platforms.cpu.native.fused_pointwise import FusedPointwise
from prefixserve.platforms.cpu.native.paged_decode_attention import DecodeState, KernelTables, PagedDecodeAttention
from prefixserve.platforms.cpu.native.paged_prefill_attention import PagedPrefillAttention
from prefixserve.platforms.cpu.panels import PANELS


@dataclass(frozen=True)
class NativeDecodeTables:
    """A decode plan's tables as the native kernel takes them, checked once per step for every layer."""
    suffix: KernelTables
    runs: tuple[KernelTables, ...]   # one per shared run, with its members


class CpuPagedKernels(PagedKernels):
    def load(self) -> tuple[PagedDecodeAttention | None, PagedPrefillAttention | None, FusedPointwise | None]:
        return (paged_decode_attention.default_kernel(), paged_prefill_attention.default_kernel(),
                fused_pointwise.default_kernel())

    def reads(self, decode: PagedDecodeAttention | None, prefill: PagedPrefillAttention | None, layout: str,
              dtype: torch.dtype) -> bool:
        """Rows always; panels where both kernels run tiles that read a pool of panels of `dtype`."""
        if layout == ROWS:
            return True
        return (layout == PANELS and decode is not None and prefill is not None
                and isa.reads_panels(decode.body, dtype) and isa.reads_panels(prefill.body, dtype))

    def write(self, writer: FusedPointwise, kv_cache: torch.Tensor, layout: str, slots: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> bool:
        if layout != PANELS or not kv_cache.is_cpu:
            return False
        writer.write_panels(kv_cache, slots, k, v)
        return True

    def prefill(self, kernel: PagedPrefillAttention, q: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor,
                scratch: Callable[[int], torch.Tensor]) -> bool:
        if not kernel.supports(q, kv_cache):
            return False
        kernel.for_layout(meta.kv_layout)(q, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale,
                                          out=out, min_query_len=2, scratch=scratch)
        return True

    def decode_tables(self, kernel: PagedDecodeAttention, plan: DecodePlan) -> NativeDecodeTables | None:
        if not plan.suffix_lens.is_cpu:
            return None
        return NativeDecodeTables(kernel.tables(plan.suffix_tables, plan.suffix_lens),
                                  tuple(kernel.tables(run.blocks[None], run.tokens, run.members)
                                        for run in plan.shared))

    def decode(self, kernel: PagedDecodeAttention, queries: torch.Tensor, kv_cache: torch.Tensor, layout: str,
               plan: DecodePlan, tables: NativeDecodeTables, scale: float) -> torch.Tensor:
        """Each shared run once for all its members (their queries stacked as the rows of one task per KV
        head, read and written in place by the kernel), then every sequence's own blocks carrying on from
        where its run left the online softmax. The kernel treats every row alike whatever the rows beside
        it, so each sequence gets the bits one pass over its whole context gives: caching on (a run) and
        off (no run) agree exactly."""
        kernel = kernel.for_layout(layout)
        state = None
        if plan.shared:
            # rows in no run carry on from an empty softmax; runs write every row of their members
            state = DecodeState.fresh(queries.shape, filled=not plan.runs_cover_all)
            for run_tables in tables.runs:
                kernel.run_partial(queries, kv_cache, run_tables, scale, state)
        out, _ = kernel.run(queries, kv_cache, tables.suffix, scale, carry=state)
        return out
