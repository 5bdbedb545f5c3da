"""Owns the model and its KV pool; runs one forward pass per scheduling step.

The runner knows nothing of requests or caching policy: it receives a plan of
sequences (which tokens, at which positions, what changed in their block
tables), keeps every running request's block table between steps, flattens the
plan into tensors, copies blocks for copy-on-write, runs the model once over
every sequence together and samples the rows that asked for it.

`prepare_inputs` is the host half of a step (block tables, input arrays, the
attention backend's per-step plan) and `execute` the whole step, so the host
cost can be measured alone (`benchmarks/host_step.py`).
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import numpy as np
import torch

from prefixserve.model.attention.metadata import AttentionMetadata, token_layout
from prefixserve.model.huge_pages import zeros_on_huge_pages
from prefixserve.model.kv_layout import kv_cache_bytes_per_block, kv_cache_shape
from prefixserve.model.loader import LoadedModel
from prefixserve.model.platform import platform_for
from prefixserve.worker.batched_sampler import BatchedSampler
from prefixserve.worker.block_tables import BlockTables
from prefixserve.worker.encoder_cache import DEFAULT_ENCODER_CACHE_BYTES, EncoderCache
from prefixserve.worker.multimodal_step import multimodal_inputs
from prefixserve.worker.device_block_tables import DeviceBlockTables
from prefixserve.worker.sampler import SampleResult, Sampler, SamplingRow


class PlannedSequence(Protocol):
    request_id: str
    token_ids: list[int]
    start_pos: int
    sample: bool
    num_samples: int
    full_block_table: Optional[list[int]]
    new_block_ids: list[int]
    multimodal: Any  # a vision-language prompt's images (multimodal/inputs.py), or None


class PlannedStep(Protocol):
    """A step's plan as the scheduler writes it (scheduler/output.py documents the fields)."""
    sequences: Sequence[PlannedSequence]
    block_copies: Sequence[tuple[int, int]]
    dropped_ids: Sequence[str]


@dataclass
class StepInputs:
    input_ids: torch.Tensor      # [T] int64
    positions: torch.Tensor      # [T] int64
    attn_metadata: Any           # what the attention backend built for this step
    logit_rows: torch.Tensor     # [R] int64: the flat-batch row behind each sample drawn
    num_logit_rows: int
    # a vision-language model's: embeddings with image rows filled (None: look input_ids up), M-RoPE [3, T]
    inputs_embeds: Optional[torch.Tensor] = None
    rope_positions: Optional[torch.Tensor] = None


def num_blocks_for_memory(loaded: LoadedModel, block_size: int, kv_cache_memory: int) -> int:
    dtype = next(loaded.model.parameters()).dtype
    per_block = kv_cache_bytes_per_block(loaded.config, block_size, dtype)
    return kv_cache_memory // per_block


class ModelRunner:
    def __init__(self, loaded: LoadedModel, *, block_size: int, num_blocks: int,
                 vocab_limit: int | None = None, seed: int = 0, kv_layout: str = "auto",
                 encoder_cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES,
                 max_num_seqs: int | None = None, max_model_len: int | None = None,
                 enforce_eager: bool = False) -> None:
        """max_num_seqs, max_model_len: the step limits a decode program sizes its buffers for;
        enforce_eager: no decode program (on CUDA: no graphs), every step through the modules."""
        self.model = loaded.model
        self.config = loaded.config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = next(self.model.parameters()).dtype
        # the model was loaded onto the engine's device: the pool, inputs and sampling follow it
        self.device = next(self.model.parameters()).device
        # the device's kernels, KV layouts and decode program (model/platform.py)
        self.platform = platform_for(self.device)
        # the pool's layout (model/kv_layout.py): what "auto" picks is the platform's call
        self.kv_layout = self.platform.choose_kv_layout(kv_layout, self.model, self.dtype, block_size)
        shape = kv_cache_shape(self.config, num_blocks, block_size, self.kv_layout)
        # zeros, not empty: a slot read before it is written must never hold NaNs
        # that a masked-out attention weight of 0 would still turn into NaN.
        self.kv_caches = [zeros_on_huge_pages(shape, dtype=self.dtype, device=self.device)
                          for _ in range(self.config.num_hidden_layers)]
        self.block_tables = BlockTables()
        # off the CPU the tables live on the device too, updated by the cells each step changes
        self.device_tables = None if self.device.type == "cpu" else DeviceBlockTables(self.block_tables, self.device)
        # Grammar masks are computed on a worker thread during the forward only where the forward
        # runs on an accelerator. On CPU the masks cost less than handing them to a thread (the
        # GIL and the wake-up), even with a core to spare (docs/structured-output.md).
        # On an accelerator the whole batch is sampled in a few tensor ops with one transfer back
        # (batched_sampler.py); on the CPU the per-row sampler is as fast or faster (scripts/sampler_bench.py).
        sampler_class = Sampler if self.device.type == "cpu" else BatchedSampler
        self.sampler = sampler_class(vocab_limit, device=self.device, overlap_masks=self.device.type != "cpu")
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        # Built now, not on the first request: the first request is not slowed by compiles,
        # and which kernels are active (and why not) is known from the start.
        self.kernels = self.platform.load_kernels()
        # decode-only steps as one fixed sequence of kernel calls, where the platform, model and kernels allow
        # a vision-language model: its image embeddings by content hash; its M-RoPE rotary is the
        # modules' own, which no decode program runs
        vision = getattr(self.model, "visual", None) is not None
        self.encoder_cache: Optional[EncoderCache] = EncoderCache(encoder_cache_bytes) if vision else None
        max_blocks = None if max_model_len is None else -(-max_model_len // block_size)
        self.decode_program = None if enforce_eager or vision else self.platform.decode_program(
            self.model, self.kv_caches, self.kv_layout, max_batch=max_num_seqs, max_blocks=max_blocks)

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

    def drop_requests(self, request_ids: Sequence[str]) -> None:
        """Forgets the block tables of requests that ended (the engine's call when it goes idle)."""
        for rid in request_ids:
            self.block_tables.drop(rid)

    def prepare_inputs(self, plan: PlannedStep) -> StepInputs | None:
        """Applies the plan's block table changes and builds the step's input tensors and attention
        metadata (the backend's per-step plan included); None when nothing is scheduled."""
        tables = self.block_tables
        self.drop_requests(plan.dropped_ids)
        sequences = plan.sequences
        if not sequences:
            return None
        num_seqs = len(sequences)
        rows = np.empty(num_seqs, dtype=np.int64)
        query_lens = np.empty(num_seqs, dtype=np.int64)
        start_pos = np.empty(num_seqs, dtype=np.int64)
        samples = np.zeros(num_seqs, dtype=np.int64)
        input_ids: list[int] = []
        for i, seq in enumerate(sequences):
            if seq.full_block_table is not None:
                rows[i] = tables.write(seq.request_id, seq.full_block_table)
            elif seq.new_block_ids:
                rows[i] = tables.append(seq.request_id, seq.new_block_ids)
            else:
                rows[i] = tables.row(seq.request_id)
            query_lens[i] = len(seq.token_ids)
            start_pos[i] = seq.start_pos
            if seq.sample:
                samples[i] = seq.num_samples
            input_ids += seq.token_ids

        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        seq_lens = start_pos + query_lens
        width = int(tables.lengths[rows].max())
        block_tables = tables.array[rows, :width]
        layout = token_layout(query_start_loc, seq_lens)
        device_tables = None
        if self.device_tables is not None:
            self.device_tables.sync()
            device_tables = self.device_tables.gather(rows, width)
        common = AttentionMetadata.from_host(query_start_loc, seq_lens, block_tables, self.block_size,
                                             self.device, layout, self.kv_layout, device_tables)
        logit_rows = np.repeat(query_start_loc[1:] - 1, samples)
        inputs = StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=self.device),
            positions=torch.from_numpy(layout[1]).to(self.device, non_blocking=True),
            attn_metadata=self.model.attention_backend.build_metadata(common),
            logit_rows=torch.from_numpy(logit_rows).to(self.device, non_blocking=True),
            num_logit_rows=len(logit_rows),
        )
        if self.encoder_cache is not None:
            inputs.inputs_embeds, inputs.rope_positions = multimodal_inputs(
                self.model, sequences, inputs.input_ids, inputs.positions, self.encoder_cache)
        return inputs

    @torch.inference_mode()
    def execute(self, plan: PlannedStep, rows: Sequence[SamplingRow]) -> SampleResult:
        """One forward over every planned sequence; samples one row per entry of ``rows``.

        ``rows`` lists, in plan order, one SamplingRow per sample drawn: a sequence with
        ``sample`` set contributes ``num_samples`` rows, the others none.
        """
        inputs = self.prepare_inputs(plan)
        self.copy_blocks(plan.block_copies)
        if inputs is None:
            return SampleResult(token_ids=[])
        if inputs.num_logit_rows != len(rows):
            raise ValueError(f"plan samples {inputs.num_logit_rows} rows but {len(rows)} were described")
        # On an accelerator the grammar masks are computed while the forward runs (mask_worker.py).
        masks = self.sampler.start_masks(rows)
        try:
            program = self.decode_program
            if program is not None and program.applies(inputs.attn_metadata, inputs.input_ids.numel()):
                hidden = program.run(inputs.input_ids, inputs.positions, inputs.attn_metadata)
            else:
                # a text model's forward is called as it always was; a vision-language one's with its images
                extra = ({} if inputs.rope_positions is None else
                         {"inputs_embeds": inputs.inputs_embeds, "rope_positions": inputs.rope_positions})
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, **extra)
            if not inputs.num_logit_rows:
                return SampleResult(token_ids=[])
            logits = self.model.compute_logits(hidden.index_select(0, inputs.logit_rows))
            return self.sampler(logits, rows, default_generator=self.generator, masks=masks)
        finally:
            if masks is not None:
                # Even after a failed forward: the engine may touch these matchers next.
                concurrent.futures.wait([masks])
