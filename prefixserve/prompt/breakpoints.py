"""cache_control breakpoints: where each marked part or tool ends in the rendered prompt (see
render.py for the method and the tools -> system -> messages rule)."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Any, Callable, Optional, Protocol

from prefixserve.errors import CacheControlError
from prefixserve.prompt.common_prefix import common_prefix_len
from prefixserve.prompt.conversation import Conversation

_PRIVATE_USE = range(0xE000, 0xF900)


@dataclass(frozen=True)
class Breakpoint:
    where: str
    ttl: str
    char_offset: int  # end of the covered prefix in the rendered text
    num_tokens: int   # prompt tokens in that prefix
    exact: bool = False  # kept to the token (prompt_cache_breakpoint), not to full blocks


class _Renders(Protocol):
    def render_text(self, conversation: Conversation, *,
                    suffixes: Optional[dict[tuple[int, int], str]] = None,
                    tools: Optional[list[dict[str, Any]]] = None) -> str: ...


def locate_breakpoints(renderer: _Renders, conversation: Conversation, text: str,
                       tokens_by: Callable[[int], int]) -> list[Breakpoint]:
    """The breakpoint of every mark of `conversation` (rendered as `text`), in marks() order."""
    marks = conversation.marks()
    if not marks:
        return []
    ends = {**_tool_ends(renderer, conversation, text), **_part_ends(renderer, conversation, text)}
    is_tool = {t.where for t in conversation.tools}
    tools_end = 0
    if conversation.tools and any(where not in is_tool for where, _ in marks):
        last = conversation.tools[-1]
        tools_end = ends[last.where] if last.where in ends else \
            _tool_end(renderer, conversation, len(conversation.tools) - 1, text)
    breakpoints = []
    for where, control in marks:
        offset = ends[where] if where in is_tool else max(ends[where], tools_end)
        breakpoints.append(Breakpoint(where, control.ttl, offset, tokens_by(offset), control.exact))
    return breakpoints


def _part_ends(renderer: _Renders, conversation: Conversation, text: str) -> dict[str, int]:
    """Each marked part ends where a sentinel appended to its text lands."""
    marked = [(i, j, p.where) for i, turn in enumerate(conversation.turns)
              for j, p in enumerate(turn.parts or ()) if p.cache_control is not None]
    if not marked:
        return {}
    sentinels = _unused_chars(text, len(marked))
    suffixes = {(i, j): s for (i, j, _), s in zip(marked, sentinels)}
    with_sentinels = renderer.render_text(conversation, suffixes=suffixes)
    positions = {}
    for (_, _, where), s in zip(marked, sentinels):
        count = with_sentinels.count(s)
        if count != 1:
            raise CacheControlError(
                f"the chat template renders {where} {count} times, so its cache_control "
                f"breakpoint has no single place in the prompt", param=f"{where}.cache_control")
        positions[where] = with_sentinels.index(s)
    order = sorted(positions.values())
    clean = with_sentinels
    for s in sentinels:
        clean = clean.replace(s, "")
    if clean != text:
        raise CacheControlError(
            "the chat template changes the text of a part marked with cache_control (it trims "
            "or rewrites it), so the breakpoint cannot be placed; move the mark to another part",
            param=f"{marked[0][2]}.cache_control")
    # Each sentinel shifts every later one by a character.
    return {where: pos - order.index(pos) for where, pos in positions.items()}


def _tool_ends(renderer: _Renders, conversation: Conversation, text: str) -> dict[str, int]:
    return {t.where: _tool_end(renderer, conversation, i, text)
            for i, t in enumerate(conversation.tools) if t.cache_control is not None}


def _tool_end(renderer: _Renders, conversation: Conversation, i: int, text: str) -> int:
    """Tools render as JSON with no room for a sentinel: tool i ends where the rendering stops
    depending on the tools after it (later tools dropped; a probe tool put right after it)."""
    kept = [t.spec for t in conversation.tools[:i + 1]]
    mark = _unused_chars(text, 1)[0]
    probe = {"type": "function", "function": {"name": mark, "description": mark,
                                              "parameters": {}}}
    probed = renderer.render_text(conversation, tools=kept + [probe])
    if mark not in probed:
        return 0  # the template does not render tools: nothing of them is in the prompt
    end = common_prefix_len(text, probed)
    if i + 1 < len(conversation.tools):
        end = min(end, common_prefix_len(text, renderer.render_text(conversation, tools=kept)))
    return end


def _unused_chars(text: str, n: int) -> list[str]:
    used = set(text)
    found = list(islice((chr(c) for c in _PRIVATE_USE if chr(c) not in used), n))
    if len(found) < n:
        raise CacheControlError("the prompt uses every private-use character; cache_control "
                                "breakpoints cannot be located in it")
    return found
