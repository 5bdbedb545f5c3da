"""One generation request, whichever API it speaks: auth -> parse -> render -> submit -> stream or
collect -> usage, written once for /v1/chat/completions, /v1/completions and /v1/messages.

A dialect (openai/chat.py, openai/completions.py, anthropic/messages.py) translates its body
into a GenerationRequest and the pipeline's results (outputs, diagnoses, the `prefixserve`
extension, usage: usage.py) into its wire format. The stages run in one order on every endpoint,
so a body with several mistakes is refused for the same one wherever it is sent. The body is
parsed before the pipeline starts (prompting/bodies.py, a FastAPI dependency); the stream loop is
streaming.py's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Union

from fastapi import Request

from prefixserve.engine.outputs import RequestOutput
from prefixserve.entrypoints.server.diagnosis import LiveDiagnosis, diagnose_ask, with_diagnosis
from prefixserve.entrypoints.server.auth import ANONYMOUS, Principal
from prefixserve.entrypoints.server.errors import APIError, api_error
from prefixserve.entrypoints.server.generation import Generation, submit
from prefixserve.entrypoints.server.media import LoadedImage, fetch_images, pixel_bounds
from prefixserve.entrypoints.server.prompt_cache_fields import PromptCacheFields
from prefixserve.entrypoints.server.prompting.bodies import ConversationSource
from prefixserve.entrypoints.server.prompting.pins import unix_time, warning_headers
from prefixserve.entrypoints.server.protocol import DiagnoseFields
from prefixserve.entrypoints.server.request_log import LoggedRequest, logged_images
from prefixserve.entrypoints.server.rendering import PreparedPrompt, encode_prompts, prepare_prompt
from prefixserve.entrypoints.server.state import ServerState, get_state, new_id, principal
from prefixserve.entrypoints.server.streaming import EventStream, Framing, relay
from prefixserve.entrypoints.server.tools import ChatTools
from prefixserve.errors import InvalidRequestError
from prefixserve.multimodal.prompt import PreparedImages
from prefixserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation rendered through the chat template (chat completions, Messages)."""
    source: ConversationSource
    cached_content: Optional[str]
    add_generation_prompt: bool = True
    template_kwargs: Optional[dict[str, Any]] = None


@dataclass(frozen=True)
class TextPrompts:
    """Prompts given as text or token ids, tokenized without a template (/v1/completions)."""
    prompt: Union[str, list]


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class GenerationRequest:
    """What a dialect read from its body, in the pipeline's terms. The callables run at their
    stage: `check` (the dialect's own refusals) right after auth, `tools` (tokenizer -> the
    request's tools) before rendering, `sampling` (tools -> SamplingParams) after it."""
    id_prefix: str                      # of the response id: "chatcmpl", "cmpl", "msg"
    param: str                          # the body field holding the prompt, named when it is refused
    model: Optional[str]
    cache_salt: Optional[str]
    priority: int
    diagnose: DiagnoseFields
    prompt: Union[ChatPrompt, TextPrompts]
    sampling: Callable[[Optional[ChatTools]], SamplingParams]
    renames: Optional[dict[str, str]] = None   # engine field names the body spells differently
    check: Callable[[], None] = _nothing
    tools: Optional[Callable[[Any], ChatTools]] = None
    cache: PromptCacheFields = PromptCacheFields()   # OpenAI's caching fields (prompt_cache_*)


@dataclass(frozen=True)
class Finished:
    """Every prompt's final output, and its diagnosis where one was asked for."""
    outputs: list[RequestOutput]
    diagnoses: list[Optional[dict[str, Any]]]


@dataclass
class Call:
    """One submitted generation request."""
    state: ServerState
    gen: Generation
    prompt: Optional[PreparedPrompt]    # a chat prompt's rendering, pins and tenant
    live: LiveDiagnosis
    tools: Optional[ChatTools]
    created: int
    # For the request log: when the request arrived, who sent it and its body as sent (None:
    # no log).
    arrived: float = 0.0
    tenant: Optional[str] = None
    raw_body: Optional[bytes] = None
    # Whose key sent it: its output tokens are taken from the key's rate limit when it finishes.
    sender: Principal = ANONYMOUS
    # The prompt's pictures, in the order of their parts: the log records what they were.
    images: tuple[LoadedImage, ...] = ()

    @property
    def id(self) -> str:
        return self.gen.request_ids[0]

    def finish(self, outputs: list[RequestOutput]) -> list[Optional[dict[str, Any]]]:
        """Every prompt has finished: remembers a chat turn for the next one (turn_memory.py) and
        every prompt for later diagnoses; returns their diagnoses (None where not asked)."""
        if self.prompt is not None:
            for output in outputs:
                self.state.turns.remember(self.prompt.cache_salt, self.prompt.rendered.text,
                                          self.prompt.token_ids, output, self.state.async_llm.tokenizer,
                                          self.prompt.tenant)
        self.state.rate_limits.spend(self.sender, sum(len(c.token_ids) for o in outputs for c in o.outputs))
        self.log(outputs)
        return [self.live.finish(rid, out) for rid, out in zip(self.gen.request_ids, outputs)]

    def log(self, outputs: list[RequestOutput]) -> None:
        if self.state.request_log is None or self.raw_body is None:
            return
        samples = [c for output in outputs for c in output.outputs]
        self.state.request_log.add(LoggedRequest(
            request_id=self.id, timestamp=self.arrived, tenant=self.tenant, raw_body=self.raw_body,
            chat=self.prompt is not None, choices=[(c.text, c.finish_reason) for c in samples],
            prompt_tokens=sum(len(o.prompt_token_ids) for o in outputs),
            completion_tokens=sum(len(c.token_ids) for c in samples),
            images=logged_images(self.images, outputs[0].image_spans if outputs else ())))

    def extension(self, outputs: list[RequestOutput],
                  diagnoses: list[Optional[dict[str, Any]]]) -> Optional[dict[str, Any]]:
        """The `prefixserve` object: the cache breakpoint report plus the diagnosis; for several
        prompts, a list of diagnoses, each with its request_id (the response base id + `-<i>`)."""
        if len(outputs) == 1:
            report = (self.prompt.plan.report(outputs[0], unix_time(self.state.async_llm.now))
                      if self.prompt is not None else None)
            return with_diagnosis(report, diagnoses[0])
        if self.live.ask is None:
            return None
        return {"diagnosis": [{"request_id": rid, **d} for rid, d in zip(self.gen.request_ids, diagnoses)]}

    def warning_headers(self, output: RequestOutput) -> dict[str, str]:
        """The header for pins the engine refused (each also logged)."""
        return warning_headers(self.prompt.plan.warnings(output)) if self.prompt is not None else {}

    async def collect(self, request: Request) -> Finished:
        """Waits for every prompt to finish (aborting them if the client leaves first)."""
        outputs = await self.gen.final_outputs(request)
        return Finished(outputs, self.finish(outputs))

    async def first_output(self, request: Request
                           ) -> tuple[RequestOutput, AsyncIterator[tuple[int, RequestOutput]]]:
        """For a stream whose headers depend on the first output (its pins are placed by then):
        that output, and every output from it on, to give `stream`."""
        first, rest = await self.gen.first_output(request)

        async def outputs() -> AsyncIterator[tuple[int, RequestOutput]]:
            yield 0, first
            async for item in rest:
                yield item
        return first, outputs()

    def stream(self, framing: Framing, outputs: Optional[AsyncIterator[tuple[int, RequestOutput]]] = None,
               headers: Optional[dict[str, str]] = None) -> EventStream:
        """The streamed response; the request is aborted however the response ends."""
        events = relay(outputs if outputs is not None else self.gen.outputs(), len(self.gen.request_ids),
                       self.gen.samples_per_prompt, framing,
                       lambda outs: Finished(outs, self.finish(outs)))
        return EventStream(events, on_close=self.gen.abort, headers=headers)


async def start(request: Request, ask: GenerationRequest) -> Call:
    """Auth, render and submit: the request is in the engine when this returns."""
    arrived = time.time()
    state = get_state(request)
    state.check_model(ask.model)
    salt = state.namespace(request, ask.cache_salt)
    priority = state.priority(request, ask.priority)
    ask.check()
    wanted = diagnose_ask(ask.diagnose)
    tools = ask.tools(state.async_llm.tokenizer) if ask.tools is not None else None
    prepared: Optional[PreparedPrompt] = None
    if isinstance(ask.prompt, ChatPrompt):
        prepared = await prepare_prompt(state, ask.prompt.source, cached_content=ask.prompt.cached_content,
                                        cache_salt=salt, tenant=principal(request).tenant,
                                        add_generation_prompt=ask.prompt.add_generation_prompt,
                                        template_kwargs=ask.prompt.template_kwargs,
                                        with_spans=wanted is not None)
        prompts = [prepared.token_ids]
        images: Optional[PreparedImages] = None
        loaded: tuple[LoadedImage, ...] = ()
        if prepared.rendered.images:
            if not state.async_llm.info.takes_images:
                part = prepared.rendered.images[0].part
                raise InvalidRequestError(f"{part}: this model takes no images (only text parts)", param=part,
                                          code="unsupported")
            vision = state.async_llm.info.vision
            assert vision is not None   # takes_images
            sources = prepared.rendered.images
            bounds = [pixel_bounds(source, vision.min_pixels, vision.max_pixels) for source in sources]
            fetched = await fetch_images(sources, state.config.media, ask.param)
            # decoded, resized, patched and hashed in the render process: the engine takes them as they are
            images, loaded = await state.renderer.prepare_images(sources, fetched, bounds, state.config.media)
    else:
        images, loaded = None, ()
        prompts = await encode_prompts(state, ask.prompt.prompt)
    sender = principal(request)
    try:
        state.rate_limits.admit(sender, sum(len(p) for p in prompts))
    except APIError:
        state.metrics.refused(sender.tenant)
        raise
    try:
        params = ask.sampling(tools)
    except InvalidRequestError as exc:
        raise api_error(exc, renames=ask.renames) from None
    live = LiveDiagnosis(state.explainer, wanted, salt, prepared.rendered.spans if prepared else None,
                         tenant=sender.tenant)
    gen = await submit(state.async_llm, state.config, state.metrics, new_id(ask.id_prefix), prompts, params,
                       cache_salt=salt, priority=priority, param=ask.param, renames=ask.renames,
                       cache_pins=prepared.plan.pins if prepared is not None else (),
                       cache_write_limit=ask.cache.write_limit(
                           prepared.rendered.breakpoints if prepared is not None else ()),
                       routing_key=ask.cache.routing_key(salt), images=images,
                       tenant=sender.tenant)
    # The body dependency has read it already: Starlette keeps it on the request.
    raw_body = await request.body() if state.request_log is not None else None
    return Call(state, gen, prepared, live, tools, created=int(time.time()), arrived=arrived,
                tenant=sender.tenant, raw_body=raw_body, sender=sender, images=loaded)
