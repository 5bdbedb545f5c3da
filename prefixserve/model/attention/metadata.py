"""What one forward pass needs to know about the sequences packed into it.

The model runner builds this once per step from host arrays; the attention
backend turns it into its own per-step plan (`AttentionBackend.build_metadata`).
Token rows are packed sequence after sequence: the new tokens of sequence s are
rows ``query_start_loc[s]:query_start_loc[s + 1]`` of the flat batch, and they
are the last positions of its context.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prefixserve.model.kv_layout import ROWS, check_layout


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
    # Host copies (int64 numpy arrays), so backends can plan without reading device tensors back.
    query_start_loc_cpu: np.ndarray
    seq_lens_cpu: np.ndarray
    block_tables_cpu: np.ndarray
    max_query_len: int
    # how the pools hold K/V (kv_layout.py): writes and reads follow it
    kv_layout: str = ROWS

    def __post_init__(self) -> None:
        check_layout(self.kv_layout)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc_cpu[-1])

    @property
    def query_lens_cpu(self) -> np.ndarray:
        return np.diff(self.query_start_loc_cpu)

    @classmethod
    def from_host(cls, query_start_loc: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
                  block_size: int, device: torch.device | str = "cpu",
                  layout: tuple[np.ndarray, np.ndarray] | None = None,
                  kv_layout: str = ROWS, device_block_tables: torch.Tensor | None = None) -> "AttentionMetadata":
        """From int64 host arrays: query_start_loc [S + 1], seq_lens [S], block_tables [S, W] (0-padded).

        `layout` is token_layout(query_start_loc, seq_lens) when the caller computed it already.
        The arrays are handed to the tensors without a copy where the device is the CPU.
        `device_block_tables`: block_tables already on the device (the worker's delta-updated copy).
        """
        seq_of_token, positions = layout if layout is not None else token_layout(query_start_loc, seq_lens)
        slots = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        num_seqs = len(seq_lens)
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
        return cls(
            slot_mapping=_to_device(slots, device),
            query_start_loc=_to_device(query_start_loc, device),
            seq_lens=_to_device(seq_lens, device),
            block_tables=device_block_tables if device_block_tables is not None else _to_device(block_tables, device),
            block_size=block_size,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            block_tables_cpu=block_tables,
            max_query_len=max_query_len,
            kv_layout=kv_layout,
        )

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """Builds the metadata from per-sequence host lists (tests, micro-benchmarks), checking them."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables differ in length")
        for q, n, table in zip(query_lens, seq_lens, block_tables):
            if q < 0 or q > n:
                raise ValueError(f"query length {q} outside [0, {n}]")
            if len(table) * block_size < n:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {n} tokens")
        width = max((len(t) for t in block_tables), default=0)
        padded = np.zeros((len(block_tables), width), dtype=np.int64)
        for row, table in zip(padded, block_tables):
            row[:len(table)] = table
        starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=starts[1:])
        return cls.from_host(starts, np.array(seq_lens, dtype=np.int64).reshape(-1), padded, block_size, device)


def token_layout(query_start_loc: np.ndarray, seq_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sequence index, position) of every token row of the flat batch, as int64 arrays."""
    num_seqs = len(seq_lens)
    num_tokens = int(query_start_loc[-1])
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if num_tokens == num_seqs and (query_lens == 1).all():
        # the common decode step: one query token per sequence
        return np.arange(num_seqs, dtype=np.int64), seq_lens - 1
    seq_of_token = np.repeat(np.arange(num_seqs, dtype=np.int64), query_lens)
    first_position = seq_lens - query_lens - query_start_loc[:-1]
    return seq_of_token, np.arange(num_tokens, dtype=np.int64) + first_position[seq_of_token]


def _to_device(array: np.ndarray, device: torch.device | str) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)
