"""Rendering and tokenizing in a separate, low-priority process.

A huge request (a 30k-token prompt, a chat of thousands of messages) costs tens to hundreds
of milliseconds of Python to render and tokenize. Run in the server process, that work holds
the GIL, and the engine thread, which needs the GIL between every kernel of a step, stalls:
a 2-6 ms decode step took 110-300 ms, and every running stream paused with it. A thread does
not help (the GIL again), nor a normal-priority process (its time slices preempt one thread
of the engine's OpenMP team, and the whole team waits). So the work runs in a child process
at the lowest CPU priority: it gets the cores the engine leaves idle, a huge prompt waits a
little longer, and the streams do not notice (`scripts/stream_gap.py`).

The child loads its own copy of the engine's tokenizer once. What crosses the process
boundary is plain data: the conversation and options in, the text, token ids, breakpoints and
(when asked) spans out; errors keep their class, field and code. The child is also the
sandbox for templates: a rendering that runs past its time is killed with the child (a new
one starts), its address space is capped, and a prompt that cannot fit the model is refused
there, before its token ids are sent back.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import resource
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from prefixserve.errors import InvalidRequestError, PromptTooLongError
from prefixserve.prompt import Breakpoint, Conversation, PromptRenderer, Span

LOWEST_PRIORITY = 19
# No token of any tokenizer here is longer: a text longer than this many characters per token
# of the model's context cannot fit, and is refused before it is encoded.
MAX_CHARS_PER_TOKEN = 64
CHILD_ADDRESS_SPACE = 8 * 2**30
_tokenizer = None  # the child's own tokenizer, loaded by _start
_max_tokens = 0


@dataclass(frozen=True)
class RenderedChat:
    text: str
    token_ids: list[int]
    breakpoints: list[Breakpoint]
    spans: Optional[list[Span]]  # only when asked: locating them takes a rendering per message


def _start(model: str, max_tokens: int) -> None:
    global _tokenizer, _max_tokens
    try:
        os.nice(LOWEST_PRIORITY)
    except (AttributeError, OSError):  # not allowed here: run at normal priority
        pass
    try:  # a template that builds a huge string fails here, not in the machine's memory
        resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))
    except (ValueError, OSError):
        pass
    from prefixserve.tokenizer import load_tokenizer
    _tokenizer = load_tokenizer(model)
    _max_tokens = max_tokens


def _check_fits_length(chars: int, param: str) -> None:
    if chars > _max_tokens * MAX_CHARS_PER_TOKEN:
        raise PromptTooLongError(f"{param} holds {chars} characters, more than a "
                                 f"{_max_tokens}-token context can hold", param=param)


def _check_tokens(ids: list[int], param: str) -> None:
    if len(ids) >= _max_tokens:
        raise PromptTooLongError(f"{param} has {len(ids)} tokens; max_model_len is {_max_tokens} and at "
                                 "least one token must be generated", param=param)


def _render(conversation: Conversation, add_generation_prompt: bool, template_kwargs: Optional[dict[str, Any]],
            with_spans: bool) -> RenderedChat:
    renderer = PromptRenderer(_tokenizer, add_generation_prompt=add_generation_prompt,
                              template_kwargs=template_kwargs)
    try:
        # the rendered text holds every part's text: their length alone can rule a prompt out
        _check_fits_length(sum(len(p.text) for t in conversation.turns for p in t.parts or ()), "messages")
        rendered = renderer.render(conversation)
    except MemoryError:
        raise InvalidRequestError("rendering these messages needs more memory than a prompt may",
                                  param="messages") from None
    _check_tokens(rendered.token_ids, "messages")
    return RenderedChat(rendered.text, rendered.token_ids, rendered.breakpoints,
                        rendered.spans if with_spans else None)


def _encode(texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    for text in texts:
        _check_fits_length(len(text), "prompt")
    encoded = [_tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    for ids in encoded:
        _check_tokens(ids, "prompt")
    return encoded


def _ready() -> bool:
    return _tokenizer is not None


class RenderPool:
    """One child process (started on first use) that renders and tokenizes for one server."""

    def __init__(self, model: str, *, max_tokens: int, timeout_s: float, processes: int = 1) -> None:
        self.model = model
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.processes = processes
        self._pool: Optional[ProcessPoolExecutor] = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the server process runs threads (the engine, OpenMP) that a fork
            # would copy mid-flight.
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start, initargs=(self.model, self.max_tokens))
        return self._pool

    async def _call(self, fn, *args: Any) -> Any:
        future = self._executor().submit(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except asyncio.TimeoutError:
            self._kill()
            raise InvalidRequestError(f"rendering this request took longer than {self.timeout_s:g} s",
                                      param="messages", code="render_timeout") from None

    def _kill(self) -> None:
        """Ends the child mid-work (a template looping for ever); the next call starts a new one."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    def warm_up(self) -> None:
        """Starts the child now (without waiting), so the first request does not pay for it."""
        self._executor().submit(_ready)

    async def render(self, conversation: Conversation, *, add_generation_prompt: bool = True,
                     template_kwargs: Optional[dict[str, Any]] = None, with_spans: bool = False) -> RenderedChat:
        return await self._call(_render, conversation, add_generation_prompt, template_kwargs, with_spans)

    async def encode(self, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
        return await self._call(_encode, texts, add_special_tokens)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


