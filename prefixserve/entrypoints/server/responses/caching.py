"""OpenAI's caching parameters as /v1/responses reads them: prompt_cache_key, prompt_cache_retention,
prompt_cache_options and a content part's prompt_cache_breakpoint.

MERGE (issue 54, items 3-4): chat completions get the full mapping of these fields (routing by
prompt_cache_key, explicit mode, retention as a longer pin, token-exact breakpoints) in another
branch. Until the lead wires these two functions to that mapping, the request-level fields are
checked and otherwise ignored, as chat completions ignore them today, and an explicit
breakpoint on a part becomes the cache_control pin chat completions already honour.
"""
from __future__ import annotations

from typing import Any, Optional

from prefixserve.entrypoints.server.errors import bad_request
from prefixserve.prompt import CacheControl, parse_cache_control

RETENTIONS = ("in_memory", "24h")
OPTION_MODES = ("implicit", "explicit")


def check_cache_fields(body: Any) -> None:
    """The request-level caching fields, refused with a 400 naming the field when malformed."""
    if body.prompt_cache_key is not None and not 0 < len(body.prompt_cache_key) <= 1024:
        raise bad_request("prompt_cache_key must be a string of 1-1024 characters", param="prompt_cache_key")
    if body.prompt_cache_retention is not None and body.prompt_cache_retention not in RETENTIONS:
        raise bad_request(f"prompt_cache_retention must be one of {', '.join(RETENTIONS)}, got "
                          f"{body.prompt_cache_retention[:40]!r}", param="prompt_cache_retention")
    options = body.prompt_cache_options
    if options is not None and options.get("mode", "implicit") not in OPTION_MODES:
        raise bad_request(f"prompt_cache_options.mode must be one of {', '.join(OPTION_MODES)}",
                          param="prompt_cache_options.mode")


def part_breakpoint(raw: Any, where: str) -> Optional[CacheControl]:
    """A content part's prompt_cache_breakpoint ({"mode": "explicit"}) as the pin it asks for."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or raw.get("mode") != "explicit":
        raise bad_request(f'{where} must be {{"mode": "explicit"}}', param=where)
    return parse_cache_control({"type": "ephemeral"}, where)
