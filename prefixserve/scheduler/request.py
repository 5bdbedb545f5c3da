"""A request as the scheduler sees it: token ids, progress and state, no tensors."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from prefixserve.sampling_params import SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    """The id of sample `index` (>= 1) of an n > 1 request, forked from sample 0 after the prompt."""
    return f"{parent_id}#{index}"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int  # resolved: never None, bounded by max_model_len
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: Optional[str] = None
    priority: int = 0
    # Who the request is for (a name from the server's keys file; None: the anonymous tenant).
    tenant: Optional[str] = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Prompt lengths whose prefix the cache keeps token-exact (explicit breakpoints): a prefill
    # chunk ends at each one not on a block boundary, so its partial block can be cached.
    cache_breakpoints: tuple[int, ...] = ()
    # Only full blocks within this many leading tokens enter the cache (None: all).
    cache_write_limit: Optional[int] = None
    # Sequence index within a group of n samples; children are forked from index 0.
    sample_index: int = 0
    # (image content hash, first placeholder token, number of tokens) of each image in the prompt:
    # extra keys of the blocks they overlap (kv/hashing.py)
    image_spans: tuple[tuple[bytes, int, int], ...] = ()
    # the prompt's images for the worker (multimodal/inputs.py), carried here unread
    multimodal: Any = None

    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V is in the pool (or will be after the step that scheduled them).
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache the first time this request was scheduled.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None

    def __post_init__(self) -> None:
        # all_token_ids grows in place so the KV manager can hash newly full blocks
        # without copying the sequence every step.
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
