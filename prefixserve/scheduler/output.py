"""The plan one scheduling step hands to the worker.

The worker keeps every running request's block table between steps (one row
per request), so a plan carries only what changed since the previous plan:

- `SchedulerOutput.dropped_ids`: requests whose rows the worker forgets first,
  before anything else of this plan: finished, aborted or preempted since the
  previous plan. Their blocks went back to the KV manager.
- `ScheduledSequence.full_block_table`: the request's whole table, when the
  worker holds no row for it (newly admitted, resumed after preemption, a
  fork's first step) or when copy-on-write replaced one of its blocks; the
  worker (re)writes the row from it.
- `ScheduledSequence.new_block_ids`: otherwise, the blocks appended to the
  table this step (usually none, one when a decode crosses into a new block).

Applied in that order, the worker's row equals the KV manager's table for every
scheduled request, and an idle worker holds no row.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ScheduledSequence:
    request_id: str
    # Tokens fed this step: all_token_ids[start_pos : start_pos + len(token_ids)].
    token_ids: list[int]
    start_pos: int
    # True when this chunk reaches the end of the known tokens, so its last
    # row's logits are sampled; a partial prefill chunk samples nothing.
    sample: bool
    # How many samples to draw from the last row (n > 1 forks after the prompt).
    num_samples: int = 1
    # The whole block table, when the worker must (re)write its row; None otherwise.
    full_block_table: Optional[list[int]] = None
    # Blocks appended to the table this step (empty when full_block_table is set).
    new_block_ids: list[int] = field(default_factory=list)
    # The request's images (Request.multimodal), None for a text-only request.
    multimodal: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass
class SchedulerOutput:
    sequences: list[ScheduledSequence] = field(default_factory=list)
    # Copy-on-write block copies (src, dst) to perform before the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    # Requests whose block tables the worker drops before applying this plan.
    dropped_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences
