"""Prompts shared by the server and diagnose: conversations with cache_control marks, one
renderer that locates every part and mark in tokens, and the longest common prefix.

Below the entry points and diagnose; imports nothing of prefixserve but `errors` (the
tokenizer it renders with is passed in).
"""
from prefixserve.prompt.breakpoints import Breakpoint
from prefixserve.prompt.common_prefix import common_prefix_len
from prefixserve.prompt.conversation import (MAX_BREAKPOINTS, TTL_SECONDS, CacheControl,
                                             Conversation, Part, Tool, Turn, parse_cache_control)
from prefixserve.prompt.render import PromptRenderer, RenderedPrompt
from prefixserve.prompt.span import (GENERATION_PROMPT, HISTORY, NEW_TURN, PROMPT, SYSTEM, TOOLS,
                                     Span)

__all__ = ["Breakpoint", "CacheControl", "Conversation", "GENERATION_PROMPT", "HISTORY",
           "MAX_BREAKPOINTS", "NEW_TURN", "PROMPT", "Part", "PromptRenderer", "RenderedPrompt",
           "SYSTEM", "Span", "TOOLS", "TTL_SECONDS", "Tool", "Turn", "common_prefix_len",
           "parse_cache_control"]
