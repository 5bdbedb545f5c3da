"""The grammar masks of a step's constrained rows, computed on a worker thread while the forward
runs.

A row's mask depends only on its output tokens so far, all known when the step is planned, so
its matcher can catch up (Constraint.sync) and fill its bitmask, and the bitmask become the
row of 0 / -inf the sampler adds, before the logits exist; llguidance releases the GIL while it
computes. The sampler waits for them only when it applies them. The runner uses the worker only
on an accelerator: on CPU the hand-off cost more than the work (docs/structured-output.md).

Only the worker touches a step's matchers between `start` and the end of the wait, and the
runner waits before the step returns, even when the forward fails: the engine's own uses of a
matcher (forking it for n > 1, a re-sync after a rollback or a preemption in a later step)
never overlap it. Each sample owns its matcher, so no two rows of a step share one.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from prefixserve.structured.constraint import Constraint
from prefixserve.structured.mask import bitmask_words, mask_bias


@dataclass(frozen=True)
class MaskJob:
    """One constrained row: its index among the step's sampling rows, its matcher, its output."""
    row: int
    constraint: Constraint
    output_token_ids: Sequence[int]


@dataclass
class StepMasks:
    rows: list[int] = field(default_factory=list)  # rows whose mask was computed, in order
    bias: Optional[torch.Tensor] = None            # [len(rows), words * 32]: 0 / -inf per token
    # Rows whose matcher failed (an output that left its grammar): they alone fail.
    errors: dict[int, BaseException] = field(default_factory=dict)


class MaskWorker:
    """Owned by one sampler; its one thread starts with the first constrained step."""

    def __init__(self) -> None:
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._bitmasks = torch.empty((0, 0), dtype=torch.int32)  # reused: one step at a time

    def start(self, jobs: Sequence[MaskJob]) -> concurrent.futures.Future[StepMasks]:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefixserve-masks")
        return self._pool.submit(self.compute, jobs)

    def compute(self, jobs: Sequence[MaskJob]) -> StepMasks:
        """The masks of `jobs`, on the calling thread (the worker's, or the sampler's when it was
        given no started masks)."""
        out = StepMasks()
        if not jobs:
            return out
        words = bitmask_words(jobs[0].constraint.vocab_size)
        if self._bitmasks.shape[0] < len(jobs) or self._bitmasks.shape[1] != words:
            self._bitmasks = torch.empty((len(jobs), words), dtype=torch.int32)
        for job in jobs:
            try:
                job.constraint.fill(job.output_token_ids, self._bitmasks[len(out.rows)])
                out.rows.append(job.row)
            except Exception as exc:
                out.errors[job.row] = exc
        if out.rows:
            out.bias = mask_bias(self._bitmasks[:len(out.rows)])
        return out
