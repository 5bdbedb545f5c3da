"""The pipeline's render stage: from a request's conversation to prompt tokens and the pins its
cache_control asks for, or from /v1/completions' prompts to token ids.

For the chat-completions and Messages endpoints: resolves a named cached content (its
conversation goes first and its tokens must be the prompt's first tokens), renders through the
chat template, locates the breakpoints. Named cached contents render here too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from prefixserve.entrypoints.server.errors import bad_request
from prefixserve.entrypoints.server.prompting.bodies import ConversationSource
from prefixserve.entrypoints.server.prompting.pins import PinPlan
from prefixserve.entrypoints.server.prompting.render_pool import RenderedChat
from prefixserve.entrypoints.server.state import ServerState
from prefixserve.errors import PrefixServeError
from prefixserve.prompt import Conversation


@dataclass(frozen=True)
class PreparedPrompt:
    rendered: RenderedChat
    plan: PinPlan
    cache_salt: Optional[str]

    @property
    def token_ids(self) -> list[int]:
        return self.rendered.token_ids

    @property
    def tenant(self) -> Optional[str]:
        return self.plan.tenant


async def prepare_prompt(state: ServerState, source: ConversationSource, *,
                         cached_content: Optional[str], cache_salt: Optional[str],
                         tenant: Optional[str] = None, add_generation_prompt: bool = True,
                         template_kwargs: Optional[dict[str, Any]] = None,
                         with_spans: bool = False) -> PreparedPrompt:
    """cache_salt: the request's namespace; tenant: whose share of the pinned blocks its
    cache_control pins count against. with_spans: also locate every part's token span (for a
    diagnosis)."""
    content = None
    if cached_content is not None:
        # looked up in the request's own namespace: another tenant's (or salt's) content is not there
        content, _ = await state.async_llm.find_cached_content(cached_content, owner=cache_salt)
    rendered = await render_or_400(state, source, content=content.payload.conversation if content else None,
                                   add_generation_prompt=add_generation_prompt,
                                   template_kwargs=template_kwargs, with_spans=with_spans)
    if content is not None and rendered.token_ids[:len(content.token_ids)] != content.token_ids:
        raise bad_request(
            f"with these messages the rendered prompt does not start with cached content "
            f"{cached_content!r} (the chat template renders the combined conversation "
            f"differently), so its cache cannot be used", param="cached_content",
            code="cached_content_mismatch")
    # an agent loop's earlier turns keep the tokens the model generated (turn_memory.py)
    rendered = state.turns.splice(cache_salt, rendered, state.async_llm.tokenizer)
    plan = PinPlan(rendered.breakpoints, state.config.cache_ttl_scale,
                   content.id if content is not None else None, tenant)
    return PreparedPrompt(rendered, plan, cache_salt)


async def render_or_400(state: ServerState, source: ConversationSource, *, add_generation_prompt: bool,
                        template_kwargs: Optional[dict[str, Any]], with_spans: bool = False,
                        content: Optional[Conversation] = None) -> RenderedChat:
    """The conversation rendered in the render process (after a cached content's, if given);
    what the template refuses is the request's fault."""
    try:
        return await state.renderer.render(source, content=content, add_generation_prompt=add_generation_prompt,
                                           template_kwargs=template_kwargs, with_spans=with_spans)
    except PrefixServeError:
        raise
    except (ValueError, TypeError, KeyError) as exc:  # the template's complaint about these messages
        raise bad_request(f"the chat template could not render these messages: {exc}",
                          param="messages") from None


async def encode_prompts(state: ServerState, prompt: Union[str, list]) -> list[list[int]]:
    """Every accepted prompt form as a list of token-id prompts; token ids are checked by the engine."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    if not prompt or any(not p for p in prompt):
        raise bad_request("prompt is empty", param="prompt", code="empty_prompt")
    texts = [p for p in prompt if isinstance(p, str)]
    encoded = iter(await state.renderer.encode(texts, add_special_tokens=True) if texts else [])
    return [next(encoded) if isinstance(p, str) else list(p) for p in prompt]
