"""cache_control breakpoints: where each marked element ends in the rendered prompt, in tokens.

Clients mark content parts, system blocks and tools with Anthropic's
`cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`. The engine caches token
prefixes, so every mark has to become a number of leading tokens of the rendered prompt.

How a mark is located:

1. Text (system blocks, message content parts): the conversation is rendered a second time
   with a sentinel, an unused private-use code point, appended to each marked part's text.
   Deleting the sentinels from that rendering must give the real rendering back exactly; then
   each sentinel's position is exactly where its part ends. A template that drops, repeats or
   rewrites a marked part is reported as an error, never guessed around.
2. Tools are rendered as JSON, with no place for a sentinel after a tool. Tool i ends where
   the rendering stops depending on what follows it: the longest common prefix of the real
   rendering and two renderings that keep tools[:i+1] and change what follows (the later tools
   dropped; a probe tool put right after tool i). That prefix ends after tool i plus whatever
   separator every continuation shares (the newline before the next tool or before </tools>).
3. Order tools -> system -> messages (Anthropic's): a mark covers every element before it in
   that order, so a system or message mark reaches at least to the end of the last tool even
   when the template renders the tools after the system text.
4. Characters -> tokens: the tokenizer's character offsets of the rendered text; the prefix of
   a mark is the tokens ending at or before its offset (a token straddling it belongs to what
   follows, as it would change if what follows changed).

tests/test_cache_control_locate.py checks this against brute force: a part's end is where the
rendering first changes when the part's last character changes, and the token count is the
longest run of leading tokens whose decoded text is a prefix of the text before the mark.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}
MAX_BREAKPOINTS = 4
_CONTROL_KEYS = {"type", "ttl"}
_PRIVATE_USE = range(0xE000, 0xF900)


class CacheControlError(ValueError):
    """A request's cache_control cannot be honoured; `param` names the offending field."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class CacheControl:
    ttl: str = "5m"

    def __post_init__(self) -> None:
        if self.ttl not in TTL_SECONDS:
            raise ValueError(f"ttl must be one of {sorted(TTL_SECONDS)}, got {self.ttl!r}")


def parse_cache_control(raw: Any, where: str) -> Optional[CacheControl]:
    """The cache_control object of the element at `where` (None when absent)."""
    if raw is None:
        return None
    param = f"{where}.cache_control"
    if not isinstance(raw, dict):
        raise CacheControlError(f"{param} must be an object like {{\"type\": \"ephemeral\"}}, "
                                f"got {raw!r}", param)
    unknown = sorted(set(raw) - _CONTROL_KEYS)
    if unknown:
        raise CacheControlError(f"{param} has unknown fields {unknown}", param)
    if raw.get("type") != "ephemeral":
        raise CacheControlError(f"{param}.type must be \"ephemeral\", got {raw.get('type')!r}", param)
    ttl = raw.get("ttl", "5m")
    if ttl not in TTL_SECONDS:
        raise CacheControlError(f"{param}.ttl must be \"5m\" or \"1h\", got {ttl!r}", param)
    return CacheControl(ttl)


@dataclass
class Part:
    """One text part of a message (or one system block)."""
    text: str
    cache_control: Optional[CacheControl] = None
    where: str = ""


@dataclass
class Turn:
    """One message: its template fields (role, name, tool_calls, ...) and its text parts."""
    fields: dict[str, Any]
    parts: Optional[list[Part]]  # None: the message has no content

    def template_message(self, suffixes: Optional[dict[int, str]] = None) -> dict[str, Any]:
        """The message as the chat template reads it: text parts joined by newlines."""
        message = dict(self.fields)
        if self.parts is not None:
            suffixes = suffixes or {}
            message["content"] = "\n".join(p.text + suffixes.get(i, "")
                                           for i, p in enumerate(self.parts))
        return message


@dataclass
class Tool:
    spec: dict[str, Any]  # what the template renders (no cache_control in it)
    cache_control: Optional[CacheControl] = None
    where: str = ""


@dataclass
class Conversation:
    turns: list[Turn]
    tools: list[Tool] = field(default_factory=list)

    def marks(self) -> list[tuple[str, CacheControl]]:
        """(where, control) of every mark, in the order tools -> system -> messages."""
        found = [(t.where, t.cache_control) for t in self.tools if t.cache_control is not None]
        for turn in self.turns:
            found += [(p.where, p.cache_control) for p in turn.parts or ()
                      if p.cache_control is not None]
        return found

    def check_marks(self) -> None:
        marks = self.marks()
        if len(marks) > MAX_BREAKPOINTS:
            wheres = ", ".join(w for w, _ in marks)
            raise CacheControlError(
                f"a request may set at most {MAX_BREAKPOINTS} cache_control breakpoints; this one "
                f"sets {len(marks)} ({wheres})", marks[MAX_BREAKPOINTS][0] + ".cache_control")

    def unmarked(self) -> Conversation:
        return Conversation(
            [Turn(t.fields, None if t.parts is None else [replace(p, cache_control=None)
                                                          for p in t.parts]) for t in self.turns],
            [replace(t, cache_control=None) for t in self.tools])

    def then(self, other: Conversation) -> Conversation:
        """This conversation followed by other's turns (other's tools must be empty)."""
        return Conversation(self.turns + other.turns, self.tools)


@dataclass(frozen=True)
class Breakpoint:
    where: str
    ttl: str
    char_offset: int  # end of the covered prefix in the rendered text
    num_tokens: int   # prompt tokens in that prefix


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]
    breakpoints: list[Breakpoint]


class PromptRenderer:
    """Renders a Conversation through a tokenizer's chat template and locates its marks."""

    def __init__(self, tokenizer, *, add_generation_prompt: bool = True,
                 template_kwargs: Optional[dict[str, Any]] = None) -> None:
        self.tokenizer = tokenizer
        self.add_generation_prompt = add_generation_prompt
        self.template_kwargs = dict(template_kwargs or {})

    def render_text(self, conversation: Conversation,
                    suffixes: Optional[dict[tuple[int, int], str]] = None,
                    tools: Optional[list[dict[str, Any]]] = None) -> str:
        """Raises ValueError (the template's complaint) for a conversation it cannot render."""
        suffixes = suffixes or {}
        messages = [turn.template_message({p: s for (t, p), s in suffixes.items() if t == i})
                    for i, turn in enumerate(conversation.turns)]
        if tools is None:
            tools = [t.spec for t in conversation.tools]
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, add_generation_prompt=self.add_generation_prompt,
            tokenize=False, **self.template_kwargs)

    def render(self, conversation: Conversation) -> RenderedPrompt:
        conversation.check_marks()
        text = self.render_text(conversation)
        encoding = self.tokenizer.backend.encode(text, add_special_tokens=False)
        token_ends = [end for _, end in encoding.offsets]
        ends = {**self._tool_ends(conversation, text), **self._part_ends(conversation, text)}
        is_tool = {t.where for t in conversation.tools}
        marks = conversation.marks()
        tools_end = 0
        if conversation.tools and any(where not in is_tool for where, _ in marks):
            last = conversation.tools[-1]
            tools_end = ends[last.where] if last.where in ends else \
                self._tool_end(conversation, len(conversation.tools) - 1, text)
        breakpoints = []
        for where, control in marks:
            offset = ends[where] if where in is_tool else max(ends[where], tools_end)
            breakpoints.append(Breakpoint(where, control.ttl, offset,
                                          tokens_ending_by(token_ends, offset)))
        return RenderedPrompt(text, list(encoding.ids), breakpoints)

    # ------------------------------------------------------------- text parts
    def _part_ends(self, conversation: Conversation, text: str) -> dict[str, int]:
        marked = [(i, j, p.where) for i, turn in enumerate(conversation.turns)
                  for j, p in enumerate(turn.parts or ()) if p.cache_control is not None]
        if not marked:
            return {}
        sentinels = _unused_chars(text, len(marked))
        suffixes = {(i, j): s for (i, j, _), s in zip(marked, sentinels)}
        with_sentinels = self.render_text(conversation, suffixes)
        positions = {}
        for (i, j, where), s in zip(marked, sentinels):
            count = with_sentinels.count(s)
            if count != 1:
                raise CacheControlError(
                    f"the chat template renders {where} {count} times, so its cache_control "
                    f"breakpoint has no single place in the prompt", f"{where}.cache_control")
            positions[where] = with_sentinels.index(s)
        order = sorted(positions.values())
        clean = with_sentinels
        for s in sentinels:
            clean = clean.replace(s, "")
        if clean != text:
            raise CacheControlError(
                "the chat template changes the text of a part marked with cache_control (it trims "
                "or rewrites it), so the breakpoint cannot be placed; move the mark to another part",
                f"{marked[0][2]}.cache_control")
        # Each sentinel shifts every later one by a character.
        return {where: pos - order.index(pos) for where, pos in positions.items()}

    # ------------------------------------------------------------------ tools
    def _tool_ends(self, conversation: Conversation, text: str) -> dict[str, int]:
        return {t.where: self._tool_end(conversation, i, text)
                for i, t in enumerate(conversation.tools) if t.cache_control is not None}

    def _tool_end(self, conversation: Conversation, i: int, text: str) -> int:
        kept = [t.spec for t in conversation.tools[:i + 1]]
        mark = _unused_chars(text, 1)[0]
        probe = {"type": "function", "function": {"name": mark, "description": mark,
                                                  "parameters": {}}}
        probed = self.render_text(conversation, tools=kept + [probe])
        if mark not in probed:
            return 0  # the template does not render tools: nothing of them is in the prompt
        end = common_prefix_length(text, probed)
        if i + 1 < len(conversation.tools):
            end = min(end, common_prefix_length(text, self.render_text(conversation, tools=kept)))
        return end


def _unused_chars(text: str, n: int) -> list[str]:
    used = set(text)
    found = [chr(c) for c in _PRIVATE_USE if chr(c) not in used][:n]
    if len(found) < n:
        raise CacheControlError("the prompt uses every private-use character; cache_control "
                                "breakpoints cannot be located in it")
    return found


def common_prefix_length(a: str, b: str) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:  # binary search on prefix equality: long prompts, cheap slicing compares
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def tokens_ending_by(token_ends: list[int], offset: int) -> int:
    """How many leading tokens end at or before character `offset`."""
    count = 0
    for end in token_ends:
        if end > offset:
            break
        count += 1
    return count
