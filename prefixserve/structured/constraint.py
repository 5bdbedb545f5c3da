"""One sample's grammar state: an llguidance matcher kept in step with the sample's output tokens.

The matcher is brought up to date from the output token list each time a mask is asked for,
instead of being told about each token as it is sampled: a step that is rolled back, a preempted
request recomputed, or a row replaced by a stand-in then never leaves it out of step."""
from __future__ import annotations

from typing import Sequence

import llguidance
import torch

from prefixserve.errors import InvalidRequestError


class Constraint:
    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.consumed = 0  # output tokens the matcher has seen

    def fork(self) -> Constraint:
        twin = Constraint(self.matcher.deep_copy(), self.vocab_size)
        twin.consumed = self.consumed
        return twin

    def sync(self, output_token_ids: Sequence[int]) -> None:
        n = len(output_token_ids)
        if n < self.consumed:
            if not self.matcher.rollback(self.consumed - n):
                raise RuntimeError(f"grammar could not roll back: {self.matcher.get_error()}")
            self.consumed = n
        if n > self.consumed:
            if not self.matcher.consume_tokens(list(output_token_ids[self.consumed:])):
                raise InvalidRequestError(f"the output left the grammar: {self.matcher.get_error()[:200]}")
            self.consumed = n

    def fill(self, output_token_ids: Sequence[int], bitmask: torch.Tensor) -> None:
        """Writes the allowed next tokens (one bit per token id) into `bitmask`, an int32 row."""
        self.sync(output_token_ids)
        self.matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
        if self.matcher.is_error():
            raise InvalidRequestError(f"the grammar failed: {self.matcher.get_error()[:200]}")
