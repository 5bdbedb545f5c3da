"""Request and response bodies of the OpenAI-compatible API.

Requests validate strictly (a string where a number belongs is a 400, never
coerced) and refuse unknown fields at any depth as OpenAI does (fields.py). Range
checks live in SamplingParams, which names the bad field. Fields of OpenAI's API that
change nothing here are declared and ignored; those that would change the answer are
in the bodies' `unsupported` tables (docs/api-fields.md lists both).
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from prefixserve.entrypoints.server.fields import Shape, Unsupported
from prefixserve.entrypoints.server.prompt_cache_fields import BREAKPOINT_KEYS, PromptCacheRequest
from prefixserve.entrypoints.server.protocol import DiagnoseFields, StrictModel
from prefixserve.entrypoints.server.usage import TokenUsage
from prefixserve.sampling_params import SamplingParams


RESPONSE_FORMAT_KEYS: Shape = {"type": None, "json_schema": {"name": None, "description": None, "schema": None,
                                                            "strict": None}}


class StreamOptions(StrictModel):
    include_usage: bool = False
    # ignored: padding that hides chunk sizes on the wire; nothing a client reads
    include_obfuscation: Optional[bool] = None


class _GenerationRequest(DiagnoseFields, PromptCacheRequest):
    """Fields both endpoints share: sampling, streaming, the caching fields (prompt_cache_fields.py)
    and the prefixserve extensions."""
    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: Optional[dict[str, float]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # ignored: an end-user id for OpenAI's abuse monitoring
    user: Optional[str] = None
    # Higher is more important: scheduled first, preempted and evicted last.
    priority: int = 0

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int]) -> SamplingParams:
        """Raises ValueError naming the bad field."""
        def given(value: Any, default: Any) -> Any:
            return default if value is None else value
        return SamplingParams(
            n=self.n,
            temperature=given(self.temperature, 1.0),
            top_p=given(self.top_p, 1.0),
            top_k=given(self.top_k, 0),
            min_p=given(self.min_p, 0.0),
            repetition_penalty=given(self.repetition_penalty, 1.0),
            presence_penalty=given(self.presence_penalty, 0.0),
            frequency_penalty=given(self.frequency_penalty, 0.0),
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=given(self.stop, []),
            stop_token_ids=given(self.stop_token_ids, []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_GenerationRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = None
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None
    best_of: Optional[int] = None
    # as on chat completions (one parser: tools.py response_format_of)
    response_format: Optional[dict[str, Any]] = None
    # The caching fields mean what they mean on chat completions, but a text prompt has no marks:
    # explicit mode writes nothing and retention has nothing to pin.
    field_keys: ClassVar[dict[str, Shape]] = {"response_format": RESPONSE_FORMAT_KEYS}


FUNCTION_KEYS: Shape = {"name": None, "arguments": None}
TOOL_CALL_KEYS: Shape = {"id": None, "type": None, "function": FUNCTION_KEYS}


class ContentPart(StrictModel):
    # Other part kinds (input_audio, file) parse here and are refused with a clear message; image_url
    # takes prefixserve's min_pixels / max_pixels beside OpenAI's url and detail (media.pixel_bounds).
    model_config = ConfigDict(strict=True, extra="allow")
    known_extra: ClassVar[frozenset[str]] = frozenset({
        "image_url", "input_audio", "file", "refusal",
        # OpenAI's token-exact breakpoint (prompt_cache_fields.py), read when the conversation is built
        "prompt_cache_breakpoint"})
    field_keys: ClassVar[dict[str, Shape]] = {
        "prompt_cache_breakpoint": BREAKPOINT_KEYS,
        "image_url": {"url": None, "detail": None, "min_pixels": None, "max_pixels": None},
        "input_audio": {"data": None, "format": None},
        "file": {"file_data": None, "file_id": None, "filename": None}}
    type: str
    text: Optional[str] = None
    # Anthropic-style prompt-caching breakpoint (prefixserve extension), checked when rendering.
    cache_control: Optional[dict[str, Any]] = None


class ChatMessage(StrictModel):
    # Templates may read fields we do not know (tool_calls, reasoning_content, ...): keep them.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    known_extra: ClassVar[frozenset[str]] = frozenset({
        "tool_calls", "tool_call_id", "function_call", "refusal", "audio",
        "reasoning_content", "reasoning"})  # the last two: what vLLM's clients send back
    field_keys: ClassVar[dict[str, Shape]] = {"tool_calls": TOOL_CALL_KEYS, "function_call": FUNCTION_KEYS,
                                              "audio": {"id": None}}
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[ContentPart], None] = None
    name: Optional[str] = None
    # A breakpoint at the end of this message's content (for string content).
    cache_control: Optional[dict[str, Any]] = None


def _text_only(modalities: Any) -> bool:
    return modalities is None or modalities == ["text"]


class ChatCompletionRequest(_GenerationRequest):
    unsupported: ClassVar[dict[str, Unsupported]] = {
        "audio": Unsupported("answers are text only"),
        "modalities": Unsupported('answers are text only (modalities ["text"] is accepted)', _text_only),
        "prediction": Unsupported("predicted outputs are not implemented"),
        "web_search_options": Unsupported("this server does not search the web"),
        "functions": Unsupported("use tools"),
        "function_call": Unsupported("use tool_choice"),
    }
    field_keys: ClassVar[dict[str, Shape]] = {
        "tools": {"type": None, "cache_control": None,
                  "function": {"name": None, "description": None, "parameters": None, "strict": None}},
        "tool_choice": {"type": None, "function": {"name": None}},
        "response_format": RESPONSE_FORMAT_KEYS,
    }
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: Optional[bool] = None
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema"}}
    response_format: Optional[dict[str, Any]] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # A template of the client's own: refused unless the server trusts clients with templates.
    chat_template: Optional[str] = None
    # Id or name of a cached content (POST /v1/cached_contents) the prompt starts with.
    cached_content: Optional[str] = None
    # Accepted and ignored: what OpenAI stores, bills, monitors or routes by, and hints a model
    # without those controls cannot follow (docs/api-fields.md).
    store: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    safety_identifier: Optional[str] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None


class TokenizeRequest(StrictModel):
    """POST /tokenize, vLLM's shape: a `prompt` (text) or chat `messages` (with their tools),
    tokenized as /v1/completions or /v1/chat/completions would."""
    unsupported: ClassVar[dict[str, Unsupported]] = {
        "continue_final_message": Unsupported("the final message is always closed", lambda v: v in (None, False)),
        "mm_processor_kwargs": Unsupported("prompts are text only"),
    }
    field_keys: ClassVar[dict[str, Shape]] = {"tools": ChatCompletionRequest.field_keys["tools"]}
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(default=None, min_length=1)
    tools: Optional[list[dict[str, Any]]] = None
    add_generation_prompt: bool = True
    # None: True for a prompt (as /v1/completions), False for messages (the template writes them)
    add_special_tokens: Optional[bool] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False
    cache_salt: Optional[str] = None


class DetokenizeRequest(StrictModel):
    """POST /detokenize, vLLM's shape."""
    model: Optional[str] = None
    tokens: list[int]


# ------------------------------------------------------------------ responses
class PromptTokensDetails(BaseModel):
    # Prompt tokens read from the prefix cache.
    cached_tokens: int
    # Prompt tokens this request computed and pinned at its marks (usage.py says exactly which).
    cache_write_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # Always present, 0 included: how many prompt tokens came from the prefix cache.
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, usage: TokenUsage) -> Usage:
        """OpenAI's usage object over every prompt of one HTTP request."""
        details = PromptTokensDetails(cached_tokens=usage.read, cache_write_tokens=usage.written)
        return cls(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                   total_tokens=usage.prompt_tokens + usage.completion_tokens,
                   prompt_tokens_details=details)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    # [{"id", "type": "function", "function": {"name", "arguments"}}] when the model called tools
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: Optional[str] = None


class DeltaMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prefixserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
