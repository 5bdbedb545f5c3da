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
(when asked) spans out; errors keep their class, field and code.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

from prefixserve.prompt import Breakpoint, Conversation, PromptRenderer, Span

LOWEST_PRIORITY = 19
_tokenizer = None  # the child's own tokenizer, loaded by _start


@dataclass(frozen=True)
class RenderedChat:
    text: str
    token_ids: list[int]
    breakpoints: list[Breakpoint]
    spans: Optional[list[Span]]  # only when asked: locating them takes a rendering per message


def _start(model: str) -> None:
    global _tokenizer
    try:
        os.nice(LOWEST_PRIORITY)
    except (AttributeError, OSError):  # not allowed here: run at normal priority
        pass
    from prefixserve.tokenizer import load_tokenizer
    _tokenizer = load_tokenizer(model)


def _render(conversation: Conversation, add_generation_prompt: bool, template_kwargs: Optional[dict[str, Any]],
            with_spans: bool) -> RenderedChat:
    rendered = PromptRenderer(_tokenizer, add_generation_prompt=add_generation_prompt,
                              template_kwargs=template_kwargs).render(conversation)
    return RenderedChat(rendered.text, rendered.token_ids, rendered.breakpoints,
                        rendered.spans if with_spans else None)


def _encode(texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    return [_tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]


def _ready() -> bool:
    return _tokenizer is not None


class RenderPool:
    """One child process (started on first use) that renders and tokenizes for one server."""

    def __init__(self, model: str, processes: int = 1) -> None:
        self.model = model
        self.processes = processes
        self._pool: Optional[ProcessPoolExecutor] = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the server process runs threads (the engine, OpenMP) that a fork
            # would copy mid-flight.
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start, initargs=(self.model,))
        return self._pool

    async def _call(self, fn, *args: Any) -> Any:
        return await asyncio.wrap_future(self._executor().submit(fn, *args))

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


