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
boundary is plain data: the conversation (or a large body's raw bytes, parsed here: bodies.py)
and options in, the text, token ids, breakpoints and (when asked) spans out; errors keep their
class, field and code. The child is also the
sandbox for templates: a rendering that runs past its time is killed with the child (a new
one starts), its address space is capped, and a prompt that cannot fit the model is refused
there, before its token ids are sent back.

A vision-language model's pictures are prepared here too (media.prepare_images): decoding, the
processor's resizing, patches and content hashes held the GIL for tens of milliseconds per
megapixel in the server process. The child gets the model's image settings when it starts, as it
gets the tokenizer, and sends back what the engine takes (PreparedImages: the patches as numpy
arrays, the hashes, the token counts) and what the request log records of each picture.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import resource
import signal
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from pydantic import BaseModel

from prefixserve.entrypoints.server.prompting.bodies import (CHAT_KINDS, ChatKind, ConversationSource,
                                                             ParsedConversation, parse_body, parse_chat)
from prefixserve.entrypoints.server.validation import BodyLimits
from prefixserve.errors import InvalidRequestError, PromptTooLongError
from prefixserve.prompt import Breakpoint, Conversation, PromptRenderer, Span
from prefixserve.prompt.conversation import ImageSource

if TYPE_CHECKING:  # media imports torch: a text model's child never loads it
    from prefixserve.entrypoints.server.media import LoadedImage, MediaConfig
    from prefixserve.multimodal.prompt import PreparedImages

LOWEST_PRIORITY = 19
# No token of any tokenizer here is longer: a text longer than this many characters per token
# of the model's context cannot fit, and is refused before it is encoded.
MAX_CHARS_PER_TOKEN = 64
CHILD_ADDRESS_SPACE = 8 * 2**30
# Conversations parsed here and not yet rendered: a request that fails in between (its model
# is wrong, say) never renders, so only the newest few are kept.
MAX_PARSED = 16
_tokenizer = None  # the child's own tokenizer, loaded by _start
_max_tokens = 0
_parsed: OrderedDict[str, Conversation] = OrderedDict()
_vision = None  # the model's image settings (None: a text model), set by _start


@dataclass(frozen=True)
class RenderedChat:
    text: str
    token_ids: list[int]
    breakpoints: list[Breakpoint]
    spans: Optional[list[Span]]  # only when asked: locating them takes a rendering per message
    # the image parts' sources, in prompt order (fetched and decoded by media.py)
    images: tuple = ()


def _start(model: str, max_tokens: int, chat_kinds: dict[str, ChatKind], vision: Any = None) -> None:
    global _tokenizer, _max_tokens, _vision
    # Ctrl-C in a terminal reaches the whole process group: the server shuts the child down
    # itself, and a KeyboardInterrupt traceback from here would only be noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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
    CHAT_KINDS.update(chat_kinds)  # a spawned child has imported no dialect to register them
    _vision = vision
    if vision is not None:
        # imported now, not in a request's time; one thread: the child takes what the engine leaves
        import torch

        from prefixserve.entrypoints.server import media  # noqa: F401
        torch.set_num_threads(1)


def _check_fits_length(chars: int, param: str) -> None:
    if chars > _max_tokens * MAX_CHARS_PER_TOKEN:
        raise PromptTooLongError(f"{param} holds {chars} characters, more than a "
                                 f"{_max_tokens}-token context can hold", param=param)


def _check_tokens(ids: list[int], param: str) -> None:
    if len(ids) >= _max_tokens:
        raise PromptTooLongError(f"{param} has {len(ids)} tokens; max_model_len is {_max_tokens} and at "
                                 "least one token must be generated", param=param)


def _parse(raw: bytes, model: type[BaseModel], limits: BodyLimits) -> BaseModel:
    return parse_body(raw, model, limits)


def _parse_chat(raw: bytes, kind: str, limits: BodyLimits, key: str) -> BaseModel:
    body, conversation = parse_chat(raw, kind, limits)
    _parsed[key] = conversation
    while len(_parsed) > MAX_PARSED:
        _parsed.popitem(last=False)
    return body.model_copy(update=CHAT_KINDS[kind].conversation_fields)


def _conversation(source: ConversationSource) -> Conversation:
    if isinstance(source, Conversation):
        return source
    conversation = _parsed.pop(source.key, None)
    if conversation is None:  # a new child, or pushed out by newer ones: parse the body again
        conversation = parse_chat(source.raw, source.kind, source.limits)[1]
    return conversation


def _after_content(content: Conversation, conversation: Conversation) -> Conversation:
    if conversation.tools:
        raise InvalidRequestError("a request using cached_content takes its tools from the cached "
                                  "content; do not send tools", param="tools")
    if any(t.fields.get("role") == "system" for t in conversation.turns):
        raise InvalidRequestError("a request using cached_content takes its system prompt from the "
                                  "cached content; do not send one", param="system")
    return content.then(conversation)


def _render(source: ConversationSource, content: Optional[Conversation], add_generation_prompt: bool,
            template_kwargs: Optional[dict[str, Any]], with_spans: bool) -> RenderedChat:
    conversation = _conversation(source)
    if content is not None:
        conversation = _after_content(content, conversation)
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
    images = tuple(p.image for t in conversation.turns for p in t.parts or () if p.image is not None)
    return RenderedChat(rendered.text, rendered.token_ids, rendered.breakpoints,
                        rendered.spans if with_spans else None, images)


def _encode(texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    for text in texts:
        _check_fits_length(len(text), "prompt")
    encoded = [_tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]
    for ids in encoded:
        _check_tokens(ids, "prompt")
    return encoded


def _prepare_images(sources: tuple[ImageSource, ...], fetched: list[Optional[bytes]],
                    bounds: list[Optional[dict[str, int]]], config: MediaConfig) -> tuple:
    from prefixserve.entrypoints.server.media import prepare_images
    if _vision is None:
        raise InvalidRequestError("this model takes no images", param=sources[0].part if sources else None)
    return prepare_images(sources, fetched, bounds, config, _vision)


def _ready() -> bool:
    return _tokenizer is not None


class RenderPool:
    """One child process (started on first use) that renders and tokenizes for one server."""

    def __init__(self, model: str, *, max_tokens: int, timeout_s: float, processes: int = 1,
                 vision: Any = None) -> None:
        """vision: the model's image settings (EngineInfo.vision), for preparing its pictures."""
        self.model = model
        self.vision = vision
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.processes = processes
        self._pool: Optional[ProcessPoolExecutor] = None
        self._started: Optional[Future] = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn, not fork: the server process runs threads (the engine, OpenMP) that a fork
            # would copy mid-flight.
            self._pool = ProcessPoolExecutor(self.processes, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start,
                                             initargs=(self.model, self.max_tokens, dict(CHAT_KINDS), self.vision))
            self._started = self._pool.submit(_ready)
            # Lowered from here, not only by the child itself: its start (an interpreter, then
            # imports) runs before _start, and at normal priority it stalled the engine's
            # OpenMP team each time a killed child was replaced.
            for process in list(getattr(self._pool, "_processes", {}).values()):
                try:
                    os.setpriority(os.PRIO_PROCESS, process.pid, LOWEST_PRIORITY)
                except (AttributeError, OSError):
                    pass
        return self._pool

    async def _call(self, fn, *args: Any, timeout_s: Optional[float] = None,
                    what: str = "rendering this request") -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        pool = self._executor()
        # A child's start (imports, the tokenizer) is not the request's time: the clock starts
        # once the child is up.
        await asyncio.wrap_future(self._started)
        future = pool.submit(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except asyncio.TimeoutError:
            self._kill()
            raise InvalidRequestError(f"{what} took longer than {timeout_s:g} s",
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
        self._executor()

    async def parse(self, raw: bytes, model: type[BaseModel], limits: BodyLimits) -> BaseModel:
        return await self._call(_parse, raw, model, limits)

    async def parse_chat(self, raw: bytes, kind: str, limits: BodyLimits) -> tuple[BaseModel, ParsedConversation]:
        """The body without its conversation, which stays in the child until rendered."""
        key = uuid.uuid4().hex
        body = await self._call(_parse_chat, raw, kind, limits, key)
        return body, ParsedConversation(key, kind, raw, limits)

    async def render(self, source: ConversationSource, *, content: Optional[Conversation] = None,
                     add_generation_prompt: bool = True, template_kwargs: Optional[dict[str, Any]] = None,
                     with_spans: bool = False) -> RenderedChat:
        """`content`: a cached content's conversation, which the request's continues."""
        return await self._call(_render, source, content, add_generation_prompt, template_kwargs, with_spans)

    async def encode(self, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
        return await self._call(_encode, texts, add_special_tokens)

    async def prepare_images(self, sources: tuple[ImageSource, ...], fetched: list[Optional[bytes]],
                             bounds: list[Optional[dict[str, int]]], config: MediaConfig
                             ) -> tuple[PreparedImages, tuple[LoadedImage, ...]]:
        """A prompt's image parts (with the bytes fetched for URL parts, media.fetch_images, and each
        part's resizing bounds) decoded, processed and hashed: media.prepare_images, in the child.
        Each picture's work is bounded (the byte and pixel caps): the timeout, per picture, only
        catches a child that is stuck."""
        return await self._call(_prepare_images, sources, fetched, bounds, config,
                                timeout_s=self.timeout_s * max(1, len(sources)),
                                what="preparing this request's images")

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


