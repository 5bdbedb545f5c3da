"""Decode steps replayed as CUDA graphs: one launch from the host for a whole forward.

At start the model's decode forward is captured once per batch size of a ladder (1, 2, 4, 8, 16, 24, 32,
...) up to the engine's max_num_seqs, all graphs sharing one memory pool, reading their inputs from
persistent buffers: token ids, positions, slots, context lengths and block tables. A step of n
sequences takes the smallest size >= n: its inputs are written into the buffers (device copies; the
block tables gathered from the step's device tables) and the graph replays. Rows past n repeat row 0:
the same token at the same position writes the same K/V into the same slot as row 0 and their outputs
are dropped, so padding never touches another sequence's blocks.

The graphs' attention is the Triton decode without the cascade (a graph cannot change how many shared
runs a step has): the decode kernel cuts each context into a fixed number of splits per graph, sized in
the kernel from each sequence's length, so one capture serves every length. Steps with a prefill chunk,
more sequences than the largest graph or tables wider than captured run eagerly.
`enforce_eager` (engine config, `--enforce-eager`) turns the graphs off.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from prefixserve.model.attention.cascade import DecodePlan
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.platforms.cuda.attention import StepPlan, TritonPagedAttention

LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def batch_ladder(max_batch: int) -> tuple[int, ...]:
    """The batch sizes captured: the ladder's below max_batch, then max_batch itself."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return tuple(b for b in LADDER if b < max_batch) + (max_batch,)


def bucket_for(n: int, ladder: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds n rows, or None where none does."""
    return next((b for b in ladder if b >= n), None)


def padded_index(n: int, rows: torch.Tensor) -> torch.Tensor:
    """For `rows` = arange(bucket): the source row of each padded row, 0..n-1 then 0 again."""
    return rows * (rows < n)


class DecodeGraphs:
    """applies(meta, tokens) / run(input_ids, positions, meta): the platform's decode program
    (model/platform.py) for a model whose attention is the Triton backend."""

    def __init__(self, model: Any, kv_caches: list[torch.Tensor], max_batch: int, max_blocks: int) -> None:
        backend = model.attention_backend
        if not isinstance(backend, TritonPagedAttention):
            raise ValueError("decode graphs replay the Triton attention backend's kernels")
        self.model = model
        self.kv_caches = kv_caches
        self.ladder = batch_ladder(max_batch)
        self.max_blocks = max_blocks
        device = kv_caches[0].device
        self.block_size = kv_caches[0].shape[2]
        num_kv_heads = kv_caches[0].shape[3]
        size = self.ladder[-1]
        self.rows = torch.arange(size, device=device)
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.zeros(size, dtype=torch.long, device=device)
        self.seq_lens = torch.ones(size, dtype=torch.long, device=device)
        self.tables = torch.zeros((size, max_blocks), dtype=torch.long, device=device)
        self._num_kv_heads = num_kv_heads
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self._capture_all()

    def _step(self, batch: int) -> StepPlan:
        """The fixed attention plan a graph of `batch` rows is captured with, over the buffers."""
        from prefixserve.platforms.cuda import paged_attention
        kernels = paged_attention
        tiles = kernels.tiles_for(self.rows.device, self.kv_caches[0].shape[4], self.kv_caches[0].dtype)
        splits = kernels.splits_for(self.max_blocks * self.block_size, batch * self._num_kv_heads,
                                    self.rows.device, tiles.block_n)
        common = AttentionMetadata(
            slot_mapping=self.slots[:batch], query_start_loc=torch.arange(batch + 1, device=self.rows.device),
            seq_lens=self.seq_lens[:batch], block_tables=self.tables[:batch], block_size=self.block_size,
            query_start_loc_cpu=np.arange(batch + 1, dtype=np.int64), seq_lens_cpu=np.ones(batch, dtype=np.int64),
            block_tables_cpu=np.zeros((batch, 1), dtype=np.int64), max_query_len=1)
        plan = DecodePlan(rows=self.rows[:batch], all_rows=True, suffix_tables=self.tables[:batch],
                          suffix_padded=True, suffix_lens=self.seq_lens[:batch], shared=(),
                          block_size=self.block_size)
        decode = kernels.DecodeSplits(plan, splits, (), splits)
        return StepPlan(common, kernels.TritonStep(None, decode))

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for batch in reversed(self.ladder):
            step = self._step(batch)
            args = (self.input_ids[:batch], self.positions[:batch], self.kv_caches, step)
            # outside the capture: Triton compiles its kernels and the allocator settles on a side stream
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self.model(*args)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch] = self.model(*args)
            self.graphs[batch] = graph
        # the captures wrote K/V of their dummy rows into block 0: give the pool back as it came
        for cache in self.kv_caches:
            cache.zero_()
        torch.cuda.synchronize()

    def applies(self, meta: Any, tokens: int) -> bool:
        if not isinstance(meta, StepPlan):
            return False
        common = meta.common
        return (common.max_query_len == 1 and tokens == common.num_seqs and tokens <= self.ladder[-1]
                and common.block_tables_cpu.shape[1] <= self.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepPlan) -> torch.Tensor:
        common = meta.common
        n = input_ids.shape[0]
        batch = bucket_for(n, self.ladder)
        assert batch is not None
        source = padded_index(n, self.rows[:batch])
        self.input_ids[:batch].copy_(input_ids.index_select(0, source))
        self.positions[:batch].copy_(positions.index_select(0, source))
        self.slots[:batch].copy_(common.slot_mapping.index_select(0, source))
        self.seq_lens[:batch].copy_(common.seq_lens.index_select(0, source))
        width = common.block_tables.shape[1]
        # columns past `width` may hold an earlier step's blocks: no kernel reads past a row's length
        self.tables[:batch, :width].copy_(common.block_tables.index_select(0, source))
        self.graphs[batch].replay()
        return self.outputs[batch][:n]
