"""Intake: turning what a caller submits into a scheduler request, or refusing it.

Everything here runs before anything is queued, so a refused request leaves no trace in the
scheduler or the pool. The grammar compiler is the one piece any thread may use: AsyncLLM
compiles structured outputs off the engine thread while the engine steps.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Optional, Sequence, Union

from prefixserve.engine.outputs import CachePin
from prefixserve.errors import InvalidRequestError
from prefixserve.model.vision_config import VisionConfig
from prefixserve.multimodal import MultimodalPrompt
from prefixserve.multimodal.prompt import PreparedImages, expand_prompt, prepare_images
from prefixserve.sampling_params import SamplingParams
from prefixserve.scheduler import Request
from prefixserve.structured.constraint import Constraint
from prefixserve.structured.grammar import GrammarCompiler
from prefixserve.tokenizer import Tokenizer

PromptInput = Union[str, list[int], dict[str, Any]]


def needs_preparing(prompt: PromptInput) -> bool:
    """Whether the prompt has images that are not yet PreparedImages."""
    data = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
    return isinstance(data, dict) and not isinstance(data.get("image"), PreparedImages)


class Intake:
    def __init__(self, tokenizer: Tokenizer, *, vocab_size: int, max_model_len: int,
                 clock: Callable[[], float], grammar_compiler: Optional[GrammarCompiler] = None,
                 vision: Optional[VisionConfig] = None, max_images_per_prompt: Optional[int] = None) -> None:
        """vocab_size: the model's (prompt token ids must lie below it); grammar_compiler: None
        builds one from the tokenizer on the first structured request; vision: a vision-language
        model's image settings (None: prompts with images are refused)."""
        self.vision = vision
        self.max_images_per_prompt = max_images_per_prompt
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.clock = clock
        self._grammars = grammar_compiler
        self._grammars_lock = threading.Lock()  # compile_grammar runs on any thread
        # images this engine decoded and processed itself (not those handed over as PreparedImages)
        self.images_prepared = 0
        self._count_lock = threading.Lock()

    def tokenize_prompt(self, prompt: PromptInput) -> tuple[Optional[str], list[int], Optional[str]]:
        """Returns (prompt text, prompt token ids, cache salt) for any accepted prompt form."""
        salt = None
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt", "multi_modal_data"}
            if unknown:
                raise InvalidRequestError(f"unknown prompt fields: {sorted(unknown)}")
            salt = prompt.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise InvalidRequestError("cache_salt must be a non-empty string")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True), salt
        if isinstance(prompt, (list, tuple)):
            vocab = self.vocab_size
            for t in prompt:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                    raise InvalidRequestError(f"prompt token id {t!r} is not in [0, {vocab})")
            return None, list(prompt), salt
        raise InvalidRequestError(f"a prompt must be a string, token ids or a dict, got {type(prompt).__name__}")

    def images(self, prompt: PromptInput) -> Optional[Callable[[list[int]], tuple[list[int], MultimodalPrompt]]]:
        """For a prompt with multi_modal_data: its images decoded and processed now, and what expands its
        tokens with them; None for a prompt without images."""
        if not isinstance(prompt, dict) or prompt.get("multi_modal_data") is None:
            return None
        param = "multi_modal_data"
        data = prompt["multi_modal_data"]
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise InvalidRequestError("multi_modal_data must be a dict with an 'image' entry", param=param)
        images = data.get("image")
        if self.vision is None:
            raise InvalidRequestError("this model takes no images", param=param)
        vision = self.vision
        if isinstance(images, PreparedImages):
            prepared = list(images.items)
            self._check_count(len(prepared))
        else:
            images = images if isinstance(images, (list, tuple)) else [images]
            self._check_count(len(images))
            prepared = self._prepare(images, vision)
        return lambda token_ids: expand_prompt(token_ids, prepared, vision, param=f"{param}.image")

    def _prepare(self, images: Sequence[object], vision: VisionConfig) -> list:
        prepared = prepare_images(images, vision, param="multi_modal_data.image")
        with self._count_lock:   # any thread may prepare
            self.images_prepared += len(prepared)
        return prepared

    def _check_count(self, count: int) -> None:
        limit = self.max_images_per_prompt
        if limit is not None and count > limit:
            raise InvalidRequestError(f"{count} images in one prompt; at most {limit} allowed",
                                      param="multi_modal_data.image")

    def prepare_images(self, prompt: PromptInput) -> PromptInput:
        """The prompt with its images decoded, processed and hashed now (PreparedImages), so that
        adding it does none of that; thread-safe. A prompt without images comes back as it is."""
        if not needs_preparing(prompt) or self.vision is None:
            return prompt
        assert isinstance(prompt, dict)
        images = prompt["multi_modal_data"].get("image")
        images = images if isinstance(images, (list, tuple)) else [images]
        self._check_count(len(images))
        prepared = self._prepare(images, self.vision)
        return {**prompt, "multi_modal_data": {**prompt["multi_modal_data"], "image": PreparedImages(tuple(prepared))}}

    def compile_grammar(self, params: SamplingParams) -> Optional[Constraint]:
        """The grammar of params.structured compiled for add_request(grammar=...); None without
        one. Thread-safe and touches no request, so a slow grammar can compile on any thread
        while the engine steps. Raises InvalidRequestError (param response_format) if it
        cannot be compiled."""
        if params.structured is None:
            return None
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer.backend.to_str(), self.tokenizer.vocab_size,
                                                 sorted(self.tokenizer.eos_token_ids))
        return self._grammars.constraint(params.structured)

    def request(self, request_id: str, prompt: PromptInput, params: SamplingParams, *,
                cache_salt: Optional[str], priority: int, arrival_time: Optional[float],
                cache_pins: Sequence[CachePin], grammar: Optional[Constraint],
                cache_write_limit: Optional[int] = None,
                tenant: Optional[str] = None) -> tuple[Optional[str], Request, Optional[Constraint]]:
        """(prompt text, the scheduler's request, its compiled grammar) for LLMEngine.add_request;
        raises InvalidRequestError (or ValueError for a grammar without structured output)."""
        if grammar is not None and params.structured is None:
            raise ValueError("a compiled grammar was given for a request without structured output")
        # compiled before anything is queued: a grammar that cannot be compiled refuses the request
        constraint = grammar if grammar is not None else self.compile_grammar(params)
        text, token_ids, dict_salt = self.tokenize_prompt(prompt)
        salt = cache_salt if cache_salt is not None else dict_salt
        mm = self.images(prompt)
        if mm is not None:
            token_ids, multimodal = mm(token_ids)
        else:
            multimodal = None
        if params.max_tokens is not None:
            max_tokens = params.max_tokens
        else:
            max_tokens = self.max_model_len - len(token_ids)
        req = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            max_tokens=max(1, max_tokens),
            eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
            cache_salt=salt,
            priority=priority,
            tenant=tenant,
            arrival_time=arrival_time if arrival_time is not None else self.clock(),
            cache_breakpoints=tuple(sorted({p.num_tokens for p in cache_pins if p.exact})),
            cache_write_limit=cache_write_limit,
            image_spans=multimodal.image_spans if multimodal is not None else (),
            multimodal=multimodal,
        )
        for pin in cache_pins:
            if not 0 < pin.num_tokens <= len(token_ids):
                raise InvalidRequestError(
                    f"cache pin of {pin.num_tokens} tokens outside the {len(token_ids)}-token prompt",
                    param="cache_pins")
        if cache_write_limit is not None and (isinstance(cache_write_limit, bool) or
                                              not isinstance(cache_write_limit, int) or cache_write_limit < 0):
            raise InvalidRequestError(f"cache_write_limit must be an int >= 0, got {cache_write_limit!r}",
                                      param="cache_write_limit")
        return text, req, constraint
