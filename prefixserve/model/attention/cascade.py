"""Planning decode attention so a prefix shared by many sequences is read once, not once per sequence.

Sixteen questions about one cached document decode together: their block
tables start with the same blocks. Reading each sequence's whole context would
copy the document's K/V sixteen times per layer per step; instead each group
of sequences with a common leading run of blocks attends to that run in one
call (their queries stacked), and to its own remaining blocks (the "suffix")
in a second one. The native kernel carries the run's unfinished softmax into
the suffix (the same bits as one pass, see torch_paged.py); without it the two
finished halves are merged through their log-sum-exps (the cascade / split-K
trick of FlashInfer and flash-decoding).

The plan depends only on the step's host arrays, so the torch backend builds it
once per step (array operations over the block tables, a Python loop only over
groups of sequences that share a first block) and every layer reads it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from prefixserve.model.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class SharedRun:
    """Decode sequences (indices into the plan's rows) whose contexts start with the same blocks."""
    members: torch.Tensor  # [n] int64
    blocks: torch.Tensor   # [P] int64: physical ids of the shared leading blocks
    tokens: torch.Tensor   # [1] int64: P * block_size, the run's length as the kernel takes it


@dataclass
class DecodePlan:
    """Every single-token query of a step, in the order of `rows`."""
    rows: torch.Tensor            # [N] int64: rows of the flat batch holding decode tokens
    all_rows: bool                # rows is 0..num_tokens-1: no gather or scatter needed
    suffix_tables: torch.Tensor   # [N, S_blocks] int64: blocks after each sequence's shared run, 0-padded
    suffix_padded: bool           # some suffix is shorter than S_blocks * block_size
    suffix_lens: torch.Tensor     # [N] int64: tokens in each sequence's suffix
    shared: tuple[SharedRun, ...]
    block_size: int
    runs_cover_all: bool = False  # every decode sequence is a member of some shared run

    @cached_property
    def suffix_padding(self) -> torch.Tensor:
        """[N, 1, 1, S_blocks * block_size] bool: True where a suffix slot is past the sequence's end.
        Only the gather path masks with it; the native kernel takes the lengths."""
        slots = torch.arange(self.suffix_tables.shape[1] * self.block_size, device=self.suffix_lens.device)
        return (slots[None, :] >= self.suffix_lens[:, None])[:, None, None, :]


def plan_decode(meta: AttentionMetadata, run_tokens_multiple: int = 1) -> DecodePlan | None:
    """The step's decode plan; every shared run a whole number of `run_tokens_multiple` tokens (the
    native kernel's softmax tile: a run ending inside a tile would change the bits it carries on)."""
    starts = meta.query_start_loc_cpu
    decoding = np.flatnonzero(starts[1:] - starts[:-1] == 1)
    if not len(decoding):
        return None
    bs = meta.block_size
    if len(decoding) == meta.num_seqs:
        tables, lens = meta.block_tables_cpu, meta.seq_lens_cpu   # the common decode step: no copy
    else:
        tables, lens = meta.block_tables_cpu[decoding], meta.seq_lens_cpu[decoding]
    shared_blocks = np.zeros(len(decoding), dtype=np.int64)
    unit = math.lcm(bs, run_tokens_multiple) // bs
    runs = [] if len(decoding) < 2 else _shared_runs(tables, lens, bs, unit, shared_blocks)

    used = -(-lens // bs)
    width = int((used - shared_blocks).max())
    columns = shared_blocks[:, None] + np.arange(width)
    inside = columns < used[:, None]
    np.minimum(columns, tables.shape[1] - 1, out=columns)
    suffix_tables = np.where(inside, np.take_along_axis(tables, columns, axis=1), 0)
    suffix_lens = lens - shared_blocks * bs
    device = meta.seq_lens.device
    return DecodePlan(
        rows=_tensor(starts[decoding], device),
        all_rows=len(decoding) == meta.num_tokens,
        suffix_tables=_tensor(suffix_tables, device),
        suffix_padded=bool((suffix_lens != width * bs).any()),
        suffix_lens=_tensor(suffix_lens, device),
        shared=tuple(SharedRun(members=_tensor(m, device), blocks=_tensor(b, device),
                               tokens=_tensor(np.array([len(b) * bs]), device)) for m, b in runs),
        block_size=bs,
        runs_cover_all=sum(len(m) for m, _ in runs) == len(decoding),
    )


def _shared_runs(tables: np.ndarray, lens: np.ndarray, block_size: int, unit: int,
                 shared_blocks: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """(members, blocks) of each group of decode sequences whose tables start with the same blocks, a
    whole number of `unit` blocks each; records each member's run length in shared_blocks."""
    first = tables[:, 0]
    order = np.argsort(first, kind="stable")   # stable: members stay in row order
    ordered = first[order]
    bounds = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    group_starts = np.concatenate(([0], bounds))
    group_ends = np.concatenate((bounds, [len(first)]))
    runs = []
    for begin, end in zip(group_starts.tolist(), group_ends.tolist()):
        if end - begin < 2:
            continue
        members = order[begin:end]
        # A run must stop before each member's last token: the slot just written is
        # read through the member's own suffix, so no suffix is ever empty.
        limit = int(((lens[members] - 1) // block_size).min())
        if limit == 0:
            continue
        leading = tables[members, :limit]
        agree = (leading == leading[0]).all(axis=0)
        length = limit if agree.all() else int(agree.argmin())
        length -= length % unit
        if length:
            runs.append((members, leading[0, :length].copy()))
            shared_blocks[members] = length
    return runs


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device, non_blocking=True)
