"""Usage accounting for both APIs, in one place: prompt, completion and cache tokens. Each
dialect only spells the numbers in its own fields (openai/protocol.py Usage, anthropic's usage).

Prompt-cache accounting: tokens read from the cache, written (pinned) to it, and uncached.

read     = the request's num_cached_tokens (prefix-cache hit).
written  = the longest prefix this request pinned at its marks (cache_control: block-aligned;
           prompt_cache_breakpoint: to the token), minus what it read (never negative): the
           pinned tokens it computed itself.
uncached = prompt - read - written.
The three add up to the prompt's tokens by construction.
"""
from __future__ import annotations

from dataclasses import dataclass

from prefixserve.engine.outputs import RequestOutput


@dataclass(frozen=True)
class TokenUsage:
    """One HTTP request's usage, over every prompt it sent."""
    prompt_tokens: int
    completion_tokens: int
    read: int
    written: int

    @property
    def uncached(self) -> int:
        return self.prompt_tokens - self.read - self.written

    @classmethod
    def of(cls, outputs: list[RequestOutput]) -> TokenUsage:
        return cls(prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
                   completion_tokens=sum(len(c.token_ids) for o in outputs for c in o.outputs),
                   read=sum(o.num_cached_tokens for o in outputs),
                   written=sum(_written(o) for o in outputs))


def _written(output: RequestOutput) -> int:
    pinned = max((p.pinned_tokens for p in output.pins if p.error is None), default=0)
    return max(0, pinned - output.num_cached_tokens)
