"""Owns the model and its KV pool; runs one forward pass per scheduling step.

The runner knows nothing of requests or caching policy: it receives a plan of
sequences (which tokens, at which positions, through which block table),
flattens it into tensors, copies blocks for copy-on-write, runs the model once
over every sequence together and samples the rows that asked for it.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.kv_layout import kv_cache_bytes_per_block, kv_cache_shape
from prefixserve.model.loader import LoadedModel
from prefixserve.worker.sampler import SampleResult, Sampler, SamplingRow


class PlannedSequence(Protocol):
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    sample: bool
    num_samples: int


def num_blocks_for_memory(loaded: LoadedModel, block_size: int, kv_cache_memory: int) -> int:
    dtype = next(loaded.model.parameters()).dtype
    per_block = kv_cache_bytes_per_block(loaded.config, block_size, dtype)
    return kv_cache_memory // per_block


class ModelRunner:
    def __init__(self, loaded: LoadedModel, *, block_size: int, num_blocks: int,
                 vocab_limit: int | None = None, seed: int = 0) -> None:
        self.model = loaded.model
        self.config = loaded.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = next(self.model.parameters()).dtype
        self.device = next(self.model.parameters()).device
        shape = kv_cache_shape(self.config, num_blocks, block_size)
        # zeros, not empty: a slot read before it is written must never hold NaNs
        # that a masked-out attention weight of 0 would still turn into NaN.
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.config.num_hidden_layers)]
        self.sampler = Sampler(vocab_limit)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv_caches)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    @torch.inference_mode()
    def execute(self, sequences: Sequence[PlannedSequence], rows: Sequence[SamplingRow],
                block_copies: Sequence[tuple[int, int]] = ()) -> SampleResult:
        """One forward over every planned sequence; samples one row per entry of ``rows``.

        ``rows`` lists, in plan order, one SamplingRow per sample drawn: a sequence with
        ``sample`` set contributes ``num_samples`` rows, the others none.
        """
        self.copy_blocks(block_copies)
        if not sequences:
            return SampleResult(token_ids=[])
        input_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        for seq in sequences:
            n = len(seq.token_ids)
            input_ids.extend(seq.token_ids)
            positions.extend(range(seq.start_pos, seq.start_pos + n))
            if seq.sample:
                logit_rows.extend([len(input_ids) - 1] * seq.num_samples)
        if len(logit_rows) != len(rows):
            raise ValueError(f"plan samples {len(logit_rows)} rows but {len(rows)} were described")
        meta = AttentionMetadata.build(
            query_lens=[len(s.token_ids) for s in sequences],
            seq_lens=[s.start_pos + len(s.token_ids) for s in sequences],
            block_tables=[list(s.block_table) for s in sequences],
            block_size=self.block_size,
            device=self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, self.kv_caches, meta)
        if not logit_rows:
            return SampleResult(token_ids=[])
        picked = hidden.index_select(0, torch.tensor(logit_rows, dtype=torch.long, device=self.device))
        logits = self.model.compute_logits(picked)
        return self.sampler(logits, rows, default_generator=self.generator)
