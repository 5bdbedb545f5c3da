"""Paged attention in plain PyTorch ops, for CPU (and as a reference for faster backends).

Writes go through one index_copy_ per pool. Reads: a prefill chunk gathers its
sequence's blocks and runs one SDPA call; every decode token of the step
(query length 1) is answered by a single padded SDPA call with a key mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from prefixserve.model.attention.backend import AttentionBackend
from prefixserve.model.attention.metadata import AttentionMetadata


class TorchPagedAttention(AttentionBackend):
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        k_pool = kv_cache[0].view(-1, num_kv_heads, head_dim)
        v_pool = kv_cache[1].view(-1, num_kv_heads, head_dim)
        k_pool.index_copy_(0, meta.slot_mapping, k)
        v_pool.index_copy_(0, meta.slot_mapping, v)

        out = q.new_empty(q.shape)
        decode_seqs: list[int] = []
        decode_rows: list[int] = []
        start = 0
        for s, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if q_len == 1:
                decode_seqs.append(s)
                decode_rows.append(start)
            elif q_len > 1:
                rows = slice(start, start + q_len)
                if q_len == seq_len:
                    # Nothing cached before this chunk: its own k/v are the whole context.
                    out[rows] = _attend(q[rows], k[rows], v[rows], None, scale)
                else:
                    keys, values = _gather(kv_cache, meta.block_tables[s], seq_len, meta.block_size)
                    visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device)
                    visible = visible.tril(diagonal=seq_len - q_len)
                    out[rows] = _attend(q[rows], keys, values, visible, scale)
            start += q_len
        if decode_seqs:
            self._decode(q, kv_cache, meta, decode_seqs, decode_rows, scale, out)
        return out

    @staticmethod
    def _decode(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                seqs: list[int], rows: list[int], scale: float, out: torch.Tensor) -> None:
        """All single-token queries at once, each seeing its sequence's first seq_len slots."""
        seq_lens = [meta.seq_lens_cpu[s] for s in seqs]
        longest = max(seq_lens)
        num_blocks = -(-longest // meta.block_size)
        device = q.device
        if len(seqs) == meta.num_seqs:
            tables = meta.block_tables[:, :num_blocks]
            queries = q
        else:
            seq_index = torch.tensor(seqs, dtype=torch.long, device=device)
            tables = meta.block_tables.index_select(0, seq_index)[:, :num_blocks]
            queries = q.index_select(0, torch.tensor(rows, dtype=torch.long, device=device))
        batch, (num_kv_heads, head_dim) = len(seqs), kv_cache.shape[-2:]
        # index_select on the flattened table: an order of magnitude faster than advanced
        # indexing with a 2-D index. [batch * blocks, BS, KVH, D] -> [batch, KVH, slots, D]
        flat_tables = tables.reshape(-1)
        keys = kv_cache[0].index_select(0, flat_tables).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = kv_cache[1].index_select(0, flat_tables).view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
        if batch == 1:
            keys, values, mask = keys[:, :, :longest], values[:, :, :longest], None
        else:
            lengths = torch.tensor(seq_lens, dtype=torch.long, device=device)
            slots = torch.arange(keys.shape[2], device=device)
            mask = (slots[None, :] < lengths[:, None])[:, None, None, :]
        result = F.scaled_dot_product_attention(
            queries.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        result = result.squeeze(2)
        if len(seqs) == meta.num_seqs:
            out.copy_(result)
        else:
            out.index_copy_(0, torch.tensor(rows, dtype=torch.long, device=device), result)


def _gather(kv_cache: torch.Tensor, table: torch.Tensor, seq_len: int,
            block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first seq_len K and V rows [seq_len, KVH, D] of one sequence, read through its blocks."""
    blocks = table[: -(-seq_len // block_size)]
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    keys = kv_cache[0].index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
    values = kv_cache[1].index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:seq_len]
    return keys, values


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """One sequence: q [Lq, H, D] over k/v [Lk, KVH, D]; causal when visible is None (Lq == Lk)."""
    result = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        attn_mask=visible, is_causal=visible is None, scale=scale, enable_gqa=True)
    return result[0].transpose(0, 1)
