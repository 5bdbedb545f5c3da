"""What every endpoint of one app reads: the engine front, settings, metrics, the miss
explainer and the process that renders and tokenizes off the engine's cores."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from fastapi import Request

from prefixserve.diagnose.live import MissExplainer
from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.entrypoints.server.auth import ANONYMOUS, Principal, cache_namespace
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.entrypoints.server.errors import APIError, bad_request
from prefixserve.entrypoints.server.metrics import ServerMetrics
from prefixserve.entrypoints.server.prompting.render_pool import RenderPool
from prefixserve.entrypoints.server.prompting.turn_memory import TurnMemory
from prefixserve.entrypoints.server.rate_limits import TokenRateLimiter
from prefixserve.entrypoints.server.request_log import RequestLog
from prefixserve.entrypoints.server.response_store import ResponseStore, StoreBounds


MAX_SALT_CHARS = 256


@dataclass
class ServerState:
    async_llm: AsyncLLM
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics
    # Live cache-miss diagnosis: the last requests, keyed by the response ids clients saw.
    explainer: MissExplainer
    # Chat templates and tokenization run there, so that one huge prompt delays only its own
    # request, never the chunks of every running stream.
    renderer: RenderPool
    # The tokens of recent finished turns, so the next turn's prompt reuses them.
    turns: TurnMemory = field(default_factory=TurnMemory)
    created: int = field(default_factory=lambda: int(time.time()))
    # Every finished generation request, for `prefixserve lint` (None: --request-log not given).
    request_log: Optional[RequestLog] = None
    # Per-key token-rate limits (tokens_per_minute in the keys file).
    rate_limits: TokenRateLimiter = field(default_factory=TokenRateLimiter)
    # Stored /v1/responses responses (None: the default, in this process's memory).
    responses: Optional[ResponseStore] = None

    def __post_init__(self) -> None:
        if self.responses is None:
            c = self.config
            self.responses = ResponseStore.open(c.response_store, StoreBounds(
                c.response_store_ttl_s, c.response_store_max_responses, c.response_store_max_bytes))

    def check_model(self, model: Optional[str]) -> None:
        """A request may name the served name or the model as the server was started on
        (--served-model-name NAME serves both); /v1/models lists the served name only."""
        if model is not None and model not in (self.model_name, self.async_llm.info.model):
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", type="invalid_request_error",
                           param="model", code="model_not_found")

    def priority(self, request: Request, priority: int) -> int:
        """The request's priority, if its key may ask for it (auth.py): 403 above max_priority."""
        limit = principal(request).max_priority
        if limit is not None and priority > limit:
            raise APIError(403, f"priority {priority} is above {limit}, the highest this API key may ask for",
                           type="permission_error", param="priority", code="priority_not_allowed")
        return priority

    def namespace(self, request: Request, cache_salt: Optional[str]) -> Optional[str]:
        """The cache salt the engine sees for this request: the caller's tenant namespace,
        subdivided by the salt the request sends (auth.py)."""
        if cache_salt is not None and not 0 < len(cache_salt) <= MAX_SALT_CHARS:
            raise bad_request(f"cache_salt must be a string of 1-{MAX_SALT_CHARS} characters",
                              param="cache_salt")
        return cache_namespace(principal(request), cache_salt)


def principal(request: Request) -> Principal:
    """Who sent the request (set by the gate; anonymous where no keys are configured)."""
    return getattr(request.state, "principal", ANONYMOUS)


def get_state(request: Request) -> ServerState:
    return request.app.state.server


class RandomIds:
    """128-bit random ids, as unpredictable as uuid4's, read from os.urandom `batch` at a time:
    os.urandom releases the GIL, and getting it back on the event loop waits for the engine
    thread's switch interval (up to 5 ms) while a step runs, once per request when read one id
    at a time."""

    def __init__(self, batch: int = 256) -> None:
        self._batch = batch
        self._lock = threading.Lock()
        self._hex = ""
        self._at = 0

    def next_hex(self) -> str:
        with self._lock:
            if self._at == len(self._hex):
                self._hex, self._at = os.urandom(16 * self._batch).hex(), 0
            self._at += 32
            return self._hex[self._at - 32:self._at]


_IDS = RandomIds()
# a forked child draws its own bytes, never the parent's next ids
os.register_at_fork(after_in_child=lambda: _IDS.__init__())


def new_id(prefix: str) -> str:
    return f"{prefix}-{_IDS.next_hex()}"


def token_text(tokenizer, token_id: int) -> str:
    """The text of one token as it reads on its own (special tokens included)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
