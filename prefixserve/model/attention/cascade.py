"""Planning decode attention so a prefix shared by many sequences is read once, not once per sequence.

Sixteen questions about one cached document decode together: their block
tables start with the same blocks. Reading each sequence's whole context would
copy the document's K/V sixteen times per layer per step; instead each group
of sequences with a common leading run of blocks attends to that run in one
batched matmul (their queries stacked), and to its own remaining blocks (the
"suffix") in a second, padded one. The two partial softmaxes are merged
exactly through their log-sum-exps (the cascade / split-K trick of FlashInfer
and flash-decoding).

The plan depends only on host lists, so it is built once per step and read by
every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SharedRun:
    """Decode sequences (indices into the plan's rows) whose contexts start with the same blocks."""
    members: torch.Tensor  # [n] int64
    blocks: torch.Tensor   # [P] int64: physical ids of the shared leading blocks


@dataclass(frozen=True)
class DecodePlan:
    """Every single-token query of a step, in the order of `rows`."""
    rows: torch.Tensor            # [N] int64: rows of the flat batch holding decode tokens
    all_rows: bool                # rows is 0..num_tokens-1: no gather or scatter needed
    suffix_tables: torch.Tensor   # [N, S_blocks] int64: blocks after each sequence's shared run, 0-padded
    suffix_padding: torch.Tensor  # [N, 1, 1, S_blocks * block_size] bool: True where a slot is past the end
    suffix_padded: bool           # any True in suffix_padding
    suffix_lens: torch.Tensor     # [N] int64: tokens in each sequence's suffix
    shared: tuple[SharedRun, ...]


def plan_decode(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                block_size: int, device: torch.device | str) -> DecodePlan | None:
    seqs = [s for s, q in enumerate(query_lens) if q == 1]
    if not seqs:
        return None
    rows: list[int] = []
    start = 0
    for s, q in enumerate(query_lens):
        if q == 1:
            rows.append(start)
        start += q

    shared_blocks = [0] * len(seqs)
    runs: list[tuple[list[int], list[int]]] = []
    by_first_block: dict[int, list[int]] = {}
    for i, s in enumerate(seqs):
        by_first_block.setdefault(block_tables[s][0], []).append(i)
    for members in by_first_block.values():
        if len(members) < 2:
            continue
        # A run must stop before each member's last token: the slot just written is
        # read through the member's own suffix, so no suffix is ever empty.
        limit = min((seq_lens[seqs[i]] - 1) // block_size for i in members)
        first = block_tables[seqs[members[0]]]
        length = 0
        while length < limit and all(block_tables[seqs[i]][length] == first[length] for i in members):
            length += 1
        if length:
            runs.append((members, first[:length]))
            for i in members:
                shared_blocks[i] = length

    suffixes = []
    for i, s in enumerate(seqs):
        used = -(-seq_lens[s] // block_size)
        suffixes.append(block_tables[s][shared_blocks[i]:used])
    width = max(len(t) for t in suffixes)
    as_long = dict(dtype=torch.long, device=device)
    suffix_lens = torch.tensor([seq_lens[s] - shared_blocks[i] * block_size for i, s in enumerate(seqs)],
                               **as_long)
    slots = torch.arange(width * block_size, device=device)
    padded = any(seq_lens[s] - shared_blocks[i] * block_size != width * block_size for i, s in enumerate(seqs))
    return DecodePlan(
        rows=torch.tensor(rows, **as_long),
        all_rows=len(rows) == start,
        suffix_tables=torch.tensor([t + [0] * (width - len(t)) for t in suffixes], **as_long),
        suffix_padding=(slots[None, :] >= suffix_lens[:, None])[:, None, None, :],
        suffix_padded=padded,
        suffix_lens=suffix_lens,
        shared=tuple(SharedRun(members=torch.tensor(m, **as_long), blocks=torch.tensor(b, **as_long))
                     for m, b in runs),
    )
