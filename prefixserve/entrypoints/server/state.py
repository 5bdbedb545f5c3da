"""What every endpoint of one app reads: the engine front, settings, metrics and the miss
explainer."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

from fastapi import Request

from prefixserve.diagnose.live import MissExplainer
from prefixserve.engine.async_llm import AsyncLLM
from prefixserve.entrypoints.server.cached_content_registry import CachedContentRegistry
from prefixserve.entrypoints.server.config import ServerConfig
from prefixserve.entrypoints.server.errors import APIError, bad_request
from prefixserve.entrypoints.server.metrics import ServerMetrics


@dataclass
class ServerState:
    async_llm: AsyncLLM
    config: ServerConfig
    model_name: str
    metrics: ServerMetrics
    # Live cache-miss diagnosis: the last requests, keyed by the response ids clients saw.
    explainer: MissExplainer
    created: int = field(default_factory=lambda: int(time.time()))
    cached_contents: CachedContentRegistry = field(default_factory=CachedContentRegistry)

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", type="invalid_request_error",
                           param="model", code="model_not_found")

    def check_cache_salt(self, cache_salt: Optional[str]) -> None:
        if cache_salt is not None and not cache_salt:
            raise bad_request("cache_salt must be a non-empty string", param="cache_salt")


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def token_text(tokenizer, token_id: int) -> str:
    """The text of one token as it reads on its own (special tokens included)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
