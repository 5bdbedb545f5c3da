"""One renderer for the server and diagnose: a Conversation -> the prompt's text and token ids,
the span of every part of it, and the breakpoint of every cache_control mark.

Everything is located by one rule: an element ends where the rendering stops depending on what
follows it, i.e. at the longest common prefix of the real rendering and a rendering that changes
what follows the element. What follows depends on the element:

- A message (its span): the later messages and the generation prompt. The rendering of the turns
  up to it, without the generation prompt, agrees with the real one up to the end of its content
  and of the template text that closes it (`<|im_end|>\\n`). A template that refuses such a
  partial conversation merges that message into the next one's span.
- A marked text part (its breakpoint): more text of the same message, as another part (block) may
  follow it there, so the mark ends where the part's text ends. A sentinel, an unused
  private-use code point, is appended to each marked part and lands exactly there. Deleting the
  sentinels must give the real rendering back; a template that drops, repeats or rewrites a
  marked part is reported (CacheControlError), never guessed around.
- A tool (its breakpoint): the later tools. Two renderings keep tools[:i+1] and change what
  follows (later tools dropped; a probe tool put right after tool i), so tool i ends after its
  JSON plus the separator every continuation shares (the newline before the next tool or
  </tools>).
- The tools together (their span): what the rendering without tools lacks, cut out of whichever
  message span the template puts them in.

So a breakpoint on the last part of message i ends inside the span of message i, exactly the
message's closing text before the span's end.

Order tools -> system -> messages (Anthropic's): a mark covers every element before it in that
order, so a system or message mark reaches at least to the end of the last tool even when the
template renders the tools after the system text.

Characters -> tokens, for spans and breakpoints alike: the tokens ending at or before a
character position, from the tokenizer's character offsets. A token straddling the position
belongs to what follows: it changes when what follows changes.

tests/prompt/test_cache_control_locate.py and tests/prompt/test_prompt_render.py check all this against brute
force.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import Any, Callable, Optional, Sequence

from prefixserve.prompt.breakpoints import Breakpoint, locate_breakpoints
from prefixserve.prompt.conversation import Conversation
from prefixserve.prompt.message_spans import PartialRenders, locate_spans
from prefixserve.prompt.span import Span


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]
    breakpoints: list[Breakpoint]
    _locate_spans: Callable[[], list[Span]] = field(repr=False, compare=False)

    @cached_property
    def spans(self) -> list[Span]:
        """Contiguous spans covering every token. Located on first use: that takes a rendering
        per message, and the server needs spans only for requests that ask for a diagnosis."""
        return self._locate_spans()


class PromptRenderer:
    """Renders Conversations through a tokenizer's chat template (a prefixserve Tokenizer)."""

    def __init__(self, tokenizer, *, add_generation_prompt: bool = True,
                 template_kwargs: Optional[dict[str, Any]] = None) -> None:
        self.tokenizer = tokenizer
        self.add_generation_prompt = add_generation_prompt
        self.template_kwargs = dict(template_kwargs or {})
        self._partials = PartialRenders(lambda messages, tools: self._apply(messages, tools, False))

    def render_text(self, conversation: Conversation, *,
                    suffixes: Optional[dict[tuple[int, int], str]] = None,
                    tools: Optional[list[dict[str, Any]]] = None,
                    generation: Optional[bool] = None) -> str:
        """The text of `conversation`; suffixes[(turn, part)] is appended to that part's text,
        tools replaces the conversation's tool specs, generation the renderer's
        add_generation_prompt. Raises the template's complaint (a ValueError) for a
        conversation it cannot render."""
        suffixes = suffixes or {}
        messages = [turn.template_message({p: s for (t, p), s in suffixes.items() if t == i})
                    for i, turn in enumerate(conversation.turns)]
        return self._apply(messages, [t.spec for t in conversation.tools] if tools is None else tools,
                           generation)

    def render(self, conversation: Conversation) -> RenderedPrompt:
        conversation.check_marks()
        messages = [turn.template_message() for turn in conversation.turns]
        tools = [t.spec for t in conversation.tools]
        text = self._apply(messages, tools, None)
        encoding = self.tokenizer.encoding(text, add_special_tokens=False)
        tokens_by = _token_counter(encoding.offsets)
        breakpoints = locate_breakpoints(self, conversation, text, tokens_by)
        # The spans read these template messages, not the conversation: a caller may change
        # the conversation before it asks for them.
        return RenderedPrompt(text, list(encoding.ids), breakpoints,
                              lambda: self._spans(messages, tools, text, tokens_by))

    def _apply(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
               generation: Optional[bool]) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False,
            add_generation_prompt=self.add_generation_prompt if generation is None else generation,
            **self.template_kwargs)

    def _spans(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], text: str,
               tokens_by: Callable[[int], int]) -> list[Span]:
        without_tools = None
        if tools:
            try:
                without_tools = self._apply(messages, [], None)
            except Exception:  # a template may need tools; then they stay inside their message
                pass
        return locate_spans([m.get("role") for m in messages], text,
                            self._partials.of(messages, tools), without_tools, tokens_by)


def _token_counter(offsets: Sequence[tuple[int, int]]) -> Callable[[int], int]:
    """offset -> how many leading tokens end at or before character `offset`."""
    ends = [end for _, end in offsets]
    if ends != sorted(ends):
        # A running maximum sorts them for bisect and still stops the count at the first token
        # ending after `offset`.
        ends = list(accumulate(ends, max))
    return lambda offset: bisect_right(ends, offset)
