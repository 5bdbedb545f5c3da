"""What one forward pass needs to know about the sequences packed into it.

The model runner builds this once per step; every attention layer reads it.
Token rows are packed sequence after sequence: the new tokens of sequence s
are rows ``query_start_loc[s]:query_start_loc[s + 1]`` of the flat batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from prefixserve.model.attention.cascade import DecodePlan, plan_decode


@dataclass
class AttentionMetadata:
    # [num_tokens] int64: flat slot (block_id * block_size + offset) that each
    # new token's K/V is written to before attention reads the pool.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int64: prefix sums of the query lengths.
    query_start_loc: torch.Tensor
    # [num_seqs] int64: context length of each sequence after this step
    # (tokens already in the pool + the new ones).
    seq_lens: torch.Tensor
    # [num_seqs, max_blocks] int64: physical block ids, padded with 0.
    block_tables: torch.Tensor
    block_size: int
    # Host copies, so backends can plan without reading tensors back.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    block_tables_cpu: list[list[int]]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @cached_property
    def decode_plan(self) -> DecodePlan | None:
        """The step's single-token queries grouped by shared leading blocks; planned once, read by every layer."""
        return plan_decode(self.query_lens_cpu, self.seq_lens_cpu, self.block_tables_cpu, self.block_size,
                           self.slot_mapping.device)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Builds the metadata from per-sequence host lists.

        Each sequence's new tokens occupy the last ``query_len`` positions of
        its context, so their slots follow from its block table.
        """
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables differ in length")
        slots: list[int] = []
        for q, n, table in zip(query_lens, seq_lens, block_tables):
            if q < 0 or q > n:
                raise ValueError(f"query length {q} outside [0, {n}]")
            if len(table) * block_size < n:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {n} tokens")
            for pos in range(n - q, n):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        as_long = dict(dtype=torch.long, device=device)
        return cls(
            slot_mapping=torch.tensor(slots, **as_long),
            query_start_loc=torch.tensor(starts, **as_long),
            seq_lens=torch.tensor(seq_lens, **as_long),
            block_tables=torch.tensor(padded, **as_long).reshape(len(block_tables), width),
            block_size=block_size,
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
            block_tables_cpu=[list(t) for t in block_tables],
        )
