"""Launching the paged-attention kernels (attention_kernels.py) for one step.

A step's plan is built once on the host (`plan_step`) and read by every layer: the prefill tiles of
every chunk of more than one query token, and the decode plan of the torch backend (model/attention/
cascade.py: shared runs and each sequence's suffix) with its split sizes. Decode writes partial results,
one column per split of a sequence's suffix and of its shared run, and one combine launch merges them
through their LSEs, so a shared prefix read once by many sequences costs one more column, not a pass.

Tile sizes are fixed per device and head dim (the interpreter cannot autotune); the CPU's are small so
small test shapes cross several tiles and splits.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from prefixserve.model.attention.cascade import DecodePlan, plan_decode
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.kv_layout import ROWS
from prefixserve.platforms.cuda import attention_kernels as K
from prefixserve.platforms.cuda.triton_runtime import compiled, dot_precision, next_power_of_2

# how many programs a decode launch aims for per streaming multiprocessor (flash-decoding's split count)
PROGRAMS_PER_SM = 2
MAX_SPLITS = 64


@dataclass(frozen=True)
class Tiles:
    block_m: int      # query rows of a prefill or shared-run program
    block_n: int      # keys loaded per inner step
    num_warps: int


def tiles_for(device: torch.device, head_dim: int, dtype: torch.dtype) -> Tiles:
    if device.type != "cuda":
        return Tiles(16, 16, 1)
    wide = next_power_of_2(head_dim) > 128 or dtype == torch.float32
    return Tiles(64 if wide else 128, 32 if wide else 64, 4 if wide else 8)


@lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def splits_for(longest: int, programs: int, device: torch.device, block_n: int) -> int:
    """How many splits a launch of `programs` programs a split cuts each context into to fill the device
    (never more than the longest context has key tiles). The CPU interpreter runs programs one after
    another: one split."""
    if device.type != "cuda":
        return 1
    wanted = -(-PROGRAMS_PER_SM * _sm_count(device.index or 0) // max(programs, 1))
    return max(1, min(MAX_SPLITS, wanted, -(-longest // block_n)))


@dataclass
class PrefillTiles:
    tile_chunk: torch.Tensor    # [tiles] int64: index of the chunk each program serves
    tile_start: torch.Tensor    # [tiles] int64: its first query row within the chunk
    q_start: torch.Tensor       # [chunks] int64: the chunk's first row of the flat batch
    q_len: torch.Tensor         # [chunks] int64
    seq_len: torch.Tensor       # [chunks] int64: context after the step
    tables: torch.Tensor        # [chunks, W] int64
    num_tiles: int


@dataclass
class SharedRunSplits:
    members: torch.Tensor
    blocks: torch.Tensor
    tokens: int
    split_tokens: int
    num_splits: int
    first_part: int            # its partial results' first column


@dataclass
class DecodeSplits:
    plan: DecodePlan
    num_splits: int            # of each suffix
    runs: tuple[SharedRunSplits, ...]
    num_parts: int


@dataclass
class TritonStep:
    """What every layer's launches of one step read: the prefill tiles and the decode splits."""
    prefill: PrefillTiles | None
    decode: DecodeSplits | None


def plan_prefill(meta: AttentionMetadata, block_m: int) -> PrefillTiles | None:
    starts = meta.query_start_loc_cpu
    q_lens = starts[1:] - starts[:-1]
    chunks = np.flatnonzero(q_lens > 1)
    if not len(chunks):
        return None
    tiles_per_chunk = -(-q_lens[chunks] // block_m)
    tile_chunk = np.repeat(np.arange(len(chunks), dtype=np.int64), tiles_per_chunk)
    first_tile = np.concatenate(([0], np.cumsum(tiles_per_chunk)[:-1]))
    tile_start = (np.arange(len(tile_chunk), dtype=np.int64) - first_tile[tile_chunk]) * block_m
    device = meta.seq_lens.device
    return PrefillTiles(
        tile_chunk=_tensor(tile_chunk, device), tile_start=_tensor(tile_start, device),
        q_start=_tensor(starts[chunks], device), q_len=_tensor(q_lens[chunks], device),
        seq_len=_tensor(meta.seq_lens_cpu[chunks], device),
        tables=_tensor(meta.block_tables_cpu[chunks], device), num_tiles=len(tile_chunk))


def plan_decode_splits(meta: AttentionMetadata, num_kv_heads: int, group: int, tiles: Tiles,
                       num_splits: int | None = None) -> DecodeSplits | None:
    """The step's decode plan with its splits; `num_splits` fixes how many each context is cut into (tests)."""
    plan = plan_decode(meta, 1)
    if plan is None:
        return None
    device = meta.seq_lens.device
    n = len(plan.suffix_lens)
    suffix_longest = int(plan.suffix_tables.shape[1]) * meta.block_size
    suffix_splits = num_splits or splits_for(suffix_longest, n * num_kv_heads, device, tiles.block_n)
    runs = []
    # a run's parts come after the suffix's; members of different runs never overlap, so runs share columns
    run_parts = 0
    for run in plan.shared:
        tokens = int(len(run.blocks)) * meta.block_size
        row_tiles = -(-len(run.members) * group // tiles.block_m)
        count = num_splits or splits_for(tokens, row_tiles * num_kv_heads, device, tiles.block_n)
        # whole key tiles a split; rounding up may leave fewer splits than asked
        per_split = -(-tokens // count)
        per_split = -(-per_split // tiles.block_n) * tiles.block_n
        count = -(-tokens // per_split)
        runs.append(SharedRunSplits(run.members, run.blocks, tokens, per_split, count, suffix_splits))
        run_parts = max(run_parts, count)
    return DecodeSplits(plan, suffix_splits, tuple(runs), suffix_splits + run_parts)


def plan_step(meta: AttentionMetadata, num_kv_heads: int, group: int, tiles: Tiles,
              num_splits: int | None = None) -> TritonStep:
    if meta.kv_layout != ROWS:
        raise ValueError(f"the Triton kernels read pools laid out in rows, not {meta.kv_layout!r}")
    return TritonStep(plan_prefill(meta, tiles.block_m),
                      plan_decode_splits(meta, num_kv_heads, group, tiles, num_splits))


def prefill(q: torch.Tensor, kv_cache: torch.Tensor, step: PrefillTiles, scale: float, out: torch.Tensor,
            tiles: Tiles) -> None:
    """Every chunk's query rows of q [T, H, D] into out, reading K/V (already written) from the pool."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    keys, values = kv_cache[0], kv_cache[1]
    kernel = compiled(K.prefill_kernel, q.device.type)
    kernel[(step.num_tiles, num_heads)](
        q, keys, values, out, step.tile_chunk, step.tile_start, step.q_start, step.q_len, step.seq_len,
        step.tables, scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2), step.tables.stride(0),
        BLOCK_SIZE=kv_cache.shape[2], GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        HEAD_P2=max(16, next_power_of_2(head_dim)), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        DOT_PRECISION=dot_precision(q.dtype), num_warps=tiles.num_warps)


def decode(q: torch.Tensor, kv_cache: torch.Tensor, step: DecodeSplits, scale: float, out: torch.Tensor,
           tiles: Tiles) -> None:
    """The decode rows of q [T, H, D] into their rows of out: the suffix splits, each shared run's
    splits, then one combine."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    plan = step.plan
    n = len(plan.suffix_lens)
    keys, values = kv_cache[0], kv_cache[1]
    head_p2 = max(16, next_power_of_2(head_dim))
    precision = dot_precision(q.dtype)
    device = q.device.type
    part_out = torch.empty((n, num_heads, step.num_parts, head_dim), dtype=torch.float32, device=q.device)
    if step.runs:
        # columns a sequence outside every run (or in a shorter run) leaves unwritten weigh nothing
        part_lse = torch.full((n, num_heads, step.num_parts), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        part_lse = torch.empty((n, num_heads, step.num_parts), dtype=torch.float32, device=q.device)
    common = dict(BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, HEAD_P2=head_p2,
                  BLOCK_N=tiles.block_n, DOT_PRECISION=precision, num_warps=tiles.num_warps)
    compiled(K.decode_split_kernel, device)[(n, num_kv_heads, step.num_splits)](
        q, keys, values, part_out, part_lse, plan.rows, plan.suffix_tables, plan.suffix_lens, scale, q.stride(0),
        q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2), plan.suffix_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), GROUP_P2=max(16, next_power_of_2(group)), **common)
    for run in step.runs:
        members = len(run.members)
        grid = (-(-members * group // tiles.block_m), num_kv_heads, run.num_splits)
        compiled(K.shared_run_kernel, device)[grid](
            q, keys, values, part_out, part_lse, plan.rows, run.members, run.blocks, run.tokens, members,
            scale, run.split_tokens, run.first_part, q.stride(0), q.stride(1), keys.stride(0), keys.stride(1),
            keys.stride(2), part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0),
            part_lse.stride(1), BLOCK_M=tiles.block_m, **common)
    compiled(K.combine_kernel, device)[(n, num_heads)](
        part_out, part_lse, out, plan.rows, step.num_parts, part_out.stride(0), part_out.stride(1),
        part_out.stride(2), part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, HEAD_P2=head_p2, PARTS_P2=max(2, next_power_of_2(step.num_parts)),
        num_warps=tiles.num_warps)


def _tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device, non_blocking=True)
