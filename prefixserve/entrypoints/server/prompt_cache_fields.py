"""OpenAI's prompt-caching request fields, mapped onto prefixserve's cache machinery: one place
for every endpoint that takes them (chat completions, completions and the Responses API, whose
bodies all build on PromptCacheRequest). docs/openai-caching-params.md is the user's side of
this table.

prompt_cache_key        -> the replicas router's first routing key, namespaced by the request's
                           cache namespace (its tenant, and its cache_salt): never shared across
                           tenants, and never a cache key itself (it isolates nothing)
prompt_cache_breakpoint -> a token-exact breakpoint on its content part: a pin of the prompt up
  {"mode": "explicit",     to the part's end, its partial last block kept (kv/partial_blocks.py),
   "ttl"?: "30m"|"12h"}    for the mark's ttl (else the request's), counted with cache_control
                           marks against the cap of 4
prompt_cache_options    -> mode "implicit" (default): the automatic prefix cache as always;
  {"mode"?, "ttl"?}        "explicit": only the marked prefixes enter the cache (the engine's
                           cache_write_limit is the furthest mark; no mark, nothing); ttl "30m"
                           is the default ttl of the marks
prompt_cache_retention  -> "in_memory": the default; "24h": every OpenAI mark is pinned for 24
                           hours (times --cache-ttl-scale), within the pin caps
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

from prefixserve.entrypoints.server.fields import Shape
from prefixserve.entrypoints.server.protocol import StrictModel
from prefixserve.errors import CacheControlError, InvalidRequestError
from prefixserve.prompt import Breakpoint, CacheControl

MODES = ("implicit", "explicit")
OPTION_TTLS = ("30m",)
BREAKPOINT_TTLS = ("30m", "12h")
RETENTIONS = ("in_memory", "24h")
OPTIONS_KEYS: Shape = {"mode": None, "ttl": None}
BREAKPOINT_KEYS: Shape = {"mode": None, "ttl": None}
MAX_KEY_CHARS = 1024


@dataclass(frozen=True)
class PromptCacheFields:
    """A request's caching fields, checked."""
    key: Optional[str] = None
    mode: str = "implicit"
    ttl: str = "30m"
    retention: str = "in_memory"

    @property
    def explicit(self) -> bool:
        return self.mode == "explicit"

    def mark(self, raw: Any, where: str) -> Optional[CacheControl]:
        """The token-exact mark a content part's prompt_cache_breakpoint asks for (None: none)."""
        if raw is None:
            return None
        param = f"{where}.prompt_cache_breakpoint"
        if not isinstance(raw, dict):
            raise CacheControlError(f'{param} must be an object like {{"mode": "explicit"}}, '
                                    f"got {raw!r}", param=param)
        if raw.get("mode") != "explicit":
            raise CacheControlError(f'{param}.mode must be "explicit", got {raw.get("mode")!r}',
                                    param=f"{param}.mode")
        ttl = raw.get("ttl", self.ttl)
        if ttl not in BREAKPOINT_TTLS:
            raise CacheControlError(f"{param}.ttl must be one of {list(BREAKPOINT_TTLS)}, got {ttl!r}",
                                    param=f"{param}.ttl")
        return CacheControl("24h" if self.retention == "24h" else ttl, exact=True)

    def write_limit(self, breakpoints: Sequence[Breakpoint]) -> Optional[int]:
        """The engine's cache_write_limit: in explicit mode the furthest mark (0 without one:
        nothing is written), else None (the automatic cache)."""
        if not self.explicit:
            return None
        return max((b.num_tokens for b in breakpoints), default=0)

    def routing_key(self, namespace: Optional[str]) -> Optional[str]:
        """The router's key: prompt_cache_key inside the request's cache namespace, so two
        tenants sending the same key are two keys."""
        if self.key is None:
            return None
        scope = namespace if namespace is not None else ""
        return f"{len(scope)}:{scope}|{self.key}"


def prompt_cache_fields(key: Any = None, options: Any = None, retention: Any = None
                        ) -> PromptCacheFields:
    """Checks the request-level fields; a bad value is a 400 naming its field."""
    if key is not None and (not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS):
        raise InvalidRequestError(f"prompt_cache_key must be a string of 1-{MAX_KEY_CHARS} "
                                  f"characters, got {key!r}", param="prompt_cache_key")
    mode, ttl = "implicit", "30m"
    if options is not None:
        if not isinstance(options, dict):
            raise InvalidRequestError(f"prompt_cache_options must be an object, got {options!r}",
                                      param="prompt_cache_options")
        mode = options.get("mode", mode)
        if mode not in MODES:
            raise InvalidRequestError(f"prompt_cache_options.mode must be one of {list(MODES)}, "
                                      f"got {mode!r}", param="prompt_cache_options.mode")
        ttl = options.get("ttl", ttl)
        if ttl not in OPTION_TTLS:
            raise InvalidRequestError(f"prompt_cache_options.ttl must be one of {list(OPTION_TTLS)}, "
                                      f"got {ttl!r}", param="prompt_cache_options.ttl")
    if retention is None:
        retention = "in_memory"
    if retention not in RETENTIONS:
        raise InvalidRequestError(f"prompt_cache_retention must be one of {list(RETENTIONS)}, "
                                  f"got {retention!r}", param="prompt_cache_retention")
    return PromptCacheFields(key, mode, ttl, retention)


class PromptCacheRequest(StrictModel):
    """The caching fields of a chat-completions, completions or Responses body, declared here
    once so that the three APIs take the same ones: OpenAI's (checked by request_cache_fields) and
    prefixserve's cache_salt."""
    field_keys: ClassVar[dict[str, Shape]] = {"prompt_cache_options": OPTIONS_KEYS}
    prompt_cache_key: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None
    prompt_cache_retention: Optional[str] = None
    # Requests with different salts never share cached blocks (tenant isolation).
    cache_salt: Optional[str] = None


def request_cache_fields(body: PromptCacheRequest) -> PromptCacheFields:
    """A request body's prompt_cache_key, prompt_cache_options and prompt_cache_retention, checked."""
    return prompt_cache_fields(body.prompt_cache_key, body.prompt_cache_options, body.prompt_cache_retention)
