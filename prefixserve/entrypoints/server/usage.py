"""Usage accounting for both APIs, in one place: prompt, completion and cache tokens.

Prompt-cache accounting: tokens read from the cache, written (pinned) to it, and uncached.

read     = the request's num_cached_tokens (prefix-cache hit).
written  = the block-aligned prefix this request pinned through cache_control, minus what it
           read (never negative): the pinned tokens it computed itself.
uncached = prompt - read - written.
The three add up to the prompt's tokens by construction.
"""
from __future__ import annotations

from dataclasses import dataclass

from prefixserve.engine.outputs import RequestOutput
from prefixserve.entrypoints.server.openai.protocol import PromptTokensDetails, Usage


@dataclass(frozen=True)
class CacheUsage:
    prompt_tokens: int
    read: int
    written: int

    @property
    def uncached(self) -> int:
        return self.prompt_tokens - self.read - self.written

    @classmethod
    def of(cls, output: RequestOutput) -> CacheUsage:
        read = output.num_cached_tokens
        pinned = max((p.pinned_tokens for p in output.pins if p.error is None), default=0)
        return cls(len(output.prompt_token_ids), read, max(0, pinned - read))

    def anthropic(self, output_tokens: int) -> dict[str, int]:
        return {"input_tokens": self.uncached, "output_tokens": output_tokens,
                "cache_creation_input_tokens": self.written, "cache_read_input_tokens": self.read}


def usage_of(outputs: list[RequestOutput]) -> Usage:
    """OpenAI's usage object over every prompt of one HTTP request."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    caches = [CacheUsage.of(o) for o in outputs]
    details = PromptTokensDetails(cached_tokens=sum(c.read for c in caches),
                                  cache_write_tokens=sum(c.written for c in caches))
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=details)
