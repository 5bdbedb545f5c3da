"""The plan one scheduling step hands to the worker."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScheduledSequence:
    request_id: str
    # Tokens fed this step: all_token_ids[start_pos : start_pos + len(token_ids)].
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    # True when this chunk reaches the end of the known tokens, so its last
    # row's logits are sampled; a partial prefill chunk samples nothing.
    sample: bool
    # How many samples to draw from the last row (n > 1 forks after the prompt).
    num_samples: int = 1

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

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences
