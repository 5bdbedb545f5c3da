"""Paged attention in PyTorch ops and a platform's kernels (and a reference for faster backends).

Writes go through one indexed copy per pool (in the pool's layout: kv_layout.write_kv), or the
platform's writer where it takes the pool. Reads: every chunk of more than one query token in the step
(fresh prompts and chunks continuing a cached context) is answered by one call of the platform's prefill
kernel, which reads K/V straight from the pool (the CPU's: `platforms/cpu/native/paged_prefill_attention.c`);
without it, each chunk gathers its sequence's blocks and runs one SDPA call. Every decode token of the
step (query length 1) is answered together, reading each run of blocks shared
by several sequences once (see cascade.py) and the rest through the platform's
decode kernel, which carries on from the run's state, or one padded gather. The decode plan is built once per step
(`build_metadata`) and travels in this backend's own metadata type. How the kernels are driven is the
platform's (paged_kernels.py); this module names none.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from prefixserve.model.attention.backend import AttentionBackend
from prefixserve.model.attention.cascade import DecodePlan, plan_decode
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.attention.paged_kernels import PagedDecodeKernel, PagedKernel, PagedKernels
from prefixserve.model.attention.registry import register_backend
from prefixserve.model.kv_layout import ROWS, gather_rows, pool_geometry, write_kv
from prefixserve.model.platform import platform_for


class GatherBuffer:
    """A reused destination for K/V read through block tables (and the prefill kernel's scratch).

    A fresh tensor of tens of MB per layer costs more in page faults than the copy
    itself (gathering 71 MB: 46 ms into a new tensor, 7 ms into a reused one), so
    the buffer is kept. It grows by half again when outgrown, so contexts that
    lengthen a block per step do not reallocate every step.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def flat(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """At least `numel` elements of scratch, 1-D, valid until the next call."""
        buf = self._buffer
        if buf is None or buf.dtype != dtype or buf.device != device:
            buf = None
        if buf is None or buf.numel() < numel:
            size = max(numel, 3 * buf.numel() // 2 if buf is not None else 0)
            buf = self._buffer = torch.empty(size, dtype=dtype, device=device)
        return buf

    def __call__(self, kv_cache: torch.Tensor, blocks: torch.Tensor,
                 layout: str = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `blocks` (a pool in `layout`), each [len(blocks) * block_size, KVH, D] token rows, valid
        until the next call."""
        _, block_size, kv_heads, head_dim = pool_geometry(kv_cache, layout)
        block_shape = (block_size, kv_heads, head_dim)
        per_pool = blocks.numel() * block_size * kv_heads * head_dim
        buf = self.flat(2 * per_pool, kv_cache.dtype, kv_cache.device)
        keys = buf[:per_pool].view(blocks.numel(), *block_shape)
        values = buf[per_pool: 2 * per_pool].view(blocks.numel(), *block_shape)
        gather_rows(kv_cache, layout, blocks, keys, values)
        return keys.flatten(0, 1), values.flatten(0, 1)


@dataclass
class TorchPagedMetadata:
    """The torch backend's per-step metadata: the generic fields, the step's decode plan and, with the
    platform's decode kernel, its tables (PagedKernels.decode_tables)."""
    common: AttentionMetadata
    decode: DecodePlan | None
    native: Any = None


# Plain torch ops run wherever torch does ("meta": models built for their shapes only); a platform's
# kernels serve its device and step aside elsewhere. A faster backend for a device registers
# a higher rank.
@register_backend("torch", devices=("cpu", "cuda", "mps", "xpu", "meta"),
                  dtypes=(torch.float32, torch.bfloat16, torch.float16), rank=0)
class TorchPagedAttention(AttentionBackend):
    def __init__(self, use_native: bool = True, device: torch.device | str = "cpu") -> None:
        """use_native: prefill chunks and decode read K/V straight from the pool through the kernels of
        `device`'s platform, where it has them."""
        self._gather = GatherBuffer()
        self._kernels: PagedKernels | None = platform_for(device).paged_attention_kernels()
        loaded: tuple[PagedDecodeKernel | None, PagedKernel | None, Any] = (
            self._kernels.load() if use_native and self._kernels is not None else (None, None, None))
        self._decode_kernel, self._prefill_kernel, self._writer = loaded

    @property
    def decode_kernel(self) -> PagedDecodeKernel | None:
        """The platform's decode kernel this backend runs where a step's metadata holds its tables."""
        return self._decode_kernel

    def reads_layout(self, layout: str, dtype: torch.dtype) -> bool:
        """Whether both kernels read a pool of `dtype` laid out in `layout` (rows: always, or no kernels)."""
        return layout == ROWS or (self._kernels is not None
                                  and self._kernels.reads(self._decode_kernel, self._prefill_kernel, layout, dtype))

    def build_metadata(self, common: AttentionMetadata) -> TorchPagedMetadata:
        # the decode kernel carries a run's state into a sequence's own blocks at a softmax tile's edge
        kernel, kernels = self._decode_kernel, self._kernels
        plan = plan_decode(common, kernel.tile_keys if kernel is not None else 1)
        if plan is None or kernel is None or kernels is None:
            return TorchPagedMetadata(common, plan)
        return TorchPagedMetadata(common, plan, kernels.decode_tables(kernel, plan))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                step: TorchPagedMetadata, scale: float) -> torch.Tensor:
        meta = step.common
        layout = meta.kv_layout
        kernels = self._kernels
        if (self._writer is None or kernels is None
                or not kernels.write(self._writer, kv_cache, layout, meta.slot_mapping, k, v)):
            write_kv(kv_cache, layout, meta.slot_mapping, k, v)

        out = q.new_empty(q.shape)
        if meta.max_query_len > 1:
            kernel = self._prefill_kernel
            # every chunk of the step in one call, K/V read from the pool (its own already written there)
            if not (kernel is not None and kernels is not None and self.reads_layout(layout, kv_cache.dtype)
                    and kernels.prefill(kernel, q, kv_cache, meta, scale, out,
                                        lambda n: self._gather.flat(n, torch.float32, q.device))):
                self._prefill(q, k, v, kv_cache, meta, scale, out)
        plan = step.decode
        if plan is not None:
            kernel = self._decode_kernel
            if kernel is not None and (step.native is None or not kernel.supports(q, kv_cache)
                                       or not self.reads_layout(layout, kv_cache.dtype)):
                kernel = None
            rows = q if plan.all_rows else q.index_select(0, plan.rows)
            result = self._decode(rows, kv_cache, layout, plan, scale, kernel, step.native)
            if plan.all_rows:
                out.copy_(result)
            else:
                out.index_copy_(0, plan.rows, result.to(out.dtype))
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, layout: str, plan: DecodePlan, scale: float,
                kernel: PagedDecodeKernel | None, tables: Any) -> torch.Tensor:
        """Single-token queries q [N, H, D] over their contexts, each shared run read once.

        The G query heads of a KV head are laid out as G query rows of that head, so
        grouped-query attention needs no K/V expansion.
        """
        n, num_heads, head_dim = q.shape
        num_kv_heads = pool_geometry(kv_cache, layout)[2]
        group = num_heads // num_kv_heads
        # float32 until the result is rounded once: in bfloat16 a second rounding flips greedy tokens
        queries = q.view(n, num_kv_heads, group, head_dim).float()
        if kernel is not None and self._kernels is not None:
            out = self._kernels.decode(kernel, queries, kv_cache, layout, plan, tables, scale)
        else:
            out = _decode_gathered(queries, kv_cache, layout, plan, scale, self._gather)
        return out.reshape(n, num_heads, head_dim)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                 meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        """The chunks of more than one query token, one SDPA call each, into their rows of out."""
        start = 0
        for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu.tolist(), meta.seq_lens_cpu.tolist())):
            if q_len > 1:
                rows = slice(start, start + q_len)
                if q_len == seq_len:
                    # Nothing cached before this chunk: its own k/v are the whole context.
                    out[rows] = _attend(q[rows], k[rows], v[rows], None, scale)
                else:
                    used = -(-seq_len // meta.block_size)
                    keys, values = self._gather(kv_cache, meta.block_tables[s, :used], meta.kv_layout)
                    keys, values = keys[:seq_len], values[:seq_len]
                    visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
                    visible = visible.tril(diagonal=seq_len - q_len)
                    out[rows] = _attend(q[rows], keys, values, visible, scale)
            start += q_len


def _stacked(queries: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Every member's queries as rows of one task per KV head: [1, KVH, m * G, D]."""
    _, num_kv_heads, group, head_dim = queries.shape
    return queries.index_select(0, members).transpose(0, 1).reshape(1, num_kv_heads, len(members) * group, head_dim)


def _unstacked(x: torch.Tensor, m: int) -> torch.Tensor:
    """[1, KVH, m * G, ...] back to [m, KVH, G, ...]."""
    return x.view(x.shape[1], m, -1, *x.shape[3:]).transpose(0, 1)


def _decode_gathered(queries: torch.Tensor, kv_cache: torch.Tensor, layout: str, plan: DecodePlan, scale: float,
                     gather: GatherBuffer) -> torch.Tensor:
    """Without the platform's decode kernel: the suffixes through one padded gather, each shared run through one
    gather, merged exactly through their log-sum-exps (the cascade / split-K trick of FlashInfer and
    flash-decoding; equal to one pass up to float32 rounding, not bit for bit)."""
    n, num_kv_heads, group, head_dim = queries.shape
    keys, values = gather(kv_cache, plan.suffix_tables.view(-1), layout)
    keys = keys.view(n, -1, num_kv_heads, head_dim).transpose(1, 2).float()
    values = values.view(n, -1, num_kv_heads, head_dim).transpose(1, 2).float()
    bias = None
    if plan.suffix_padded:
        bias = torch.zeros(plan.suffix_padding.shape, dtype=torch.float32, device=queries.device)
        bias.masked_fill_(plan.suffix_padding, float("-inf"))
    out, lse = attention_with_lse(queries, keys, values, bias, scale)  # [N, KVH, G, D], [N, KVH, G]
    for run in plan.shared:
        members = run.members
        m = len(members)
        run_keys, run_values = gather(kv_cache, run.blocks, layout)
        run_keys, run_values = run_keys.transpose(0, 1)[None].float(), run_values.transpose(0, 1)[None].float()
        run_out, run_lse = attention_with_lse(_stacked(queries, members), run_keys, run_values, None, scale)
        run_out, run_lse = _unstacked(run_out, m), _unstacked(run_lse, m)
        own_out, own_lse = out.index_select(0, members), lse.index_select(0, members)
        both = torch.logaddexp(own_lse, run_lse)
        merged = (own_out * (own_lse - both).exp().unsqueeze(-1) + run_out * (run_lse - both).exp().unsqueeze(-1))
        out.index_copy_(0, members, merged)
    return out


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention q [B, H, Lq, D] over k/v [B, H, Lk, D] (any strides) plus an additive bias,
    returning (out [B, H, Lq, D], float32 log-sum-exp of the scaled scores [B, H, Lq])."""
    if q.device.type == "cpu":
        # the CPU flash kernel behind F.scaled_dot_product_attention, which also returns the LSE
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias, scale=scale)
        return out, lse
    return reference_attention_with_lse(q, k, v, bias, scale)


def reference_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_lse in plain matmuls, for devices without the CPU kernel."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if bias is not None:
        scores = scores + bias
    lse = scores.logsumexp(-1)
    return torch.matmul((scores - lse.unsqueeze(-1)).exp().to(v.dtype), v), lse


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """One sequence: q [Lq, H, D] over k/v [Lk, KVH, D]; causal when visible is None (Lq == Lk).
    In float32 whatever the pool's dtype, like the decode path, so a token's output does not depend
    on whether it ran alone (decode) or in a chunk; the caller rounds it once."""
    result = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).float(), k.transpose(0, 1).unsqueeze(0).float(),
        v.transpose(0, 1).unsqueeze(0).float(), attn_mask=visible, is_causal=visible is None, scale=scale,
        enable_gqa=True)
    return result[0].transpose(0, 1)
