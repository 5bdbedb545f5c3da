"""Every error prefixserve raises on purpose, in one hierarchy.

A caller (the HTTP layer, a script) tells a client mistake from a capacity limit from an
engine failure by class, never by parsing a message. Each error may name the request field it
is about (`param`) and carry a stable machine-readable `code`. The HTTP status and the
OpenAI / Anthropic error bodies are decided in one place, the server's error mapping; this
module stays a leaf (standard library only) so that `kv` and `scheduler` can raise these
without importing anything heavy.

    PrefixServeError
    ├── InvalidRequestError (also a ValueError)   the request itself is wrong: fix it, don't retry
    │   ├── DuplicateRequestError                 a request id already in use
    │   ├── PromptTooLongError                    prompt + max_tokens beyond the model or the pool
    │   ├── CacheControlError                     a cache_control mark that cannot be honoured
    │   └── ChatTemplateError                     the chat template cannot render these messages
    ├── NotFoundError (also a LookupError)        a named thing (cached content, pin, request) is not there
    ├── ConflictError                             the request clashes with what exists (a name taken)
    ├── CapacityError                             the server is full now: retry later or ask for less
    │   ├── QueueFullError                        the waiting queue is at its bound
    │   └── PinLimitError                         pinning would pass the pinned-block cap
    ├── RequestAbortedError                       the request was aborted (client gone, explicit abort)
    ├── LoadError (also a ValueError)             the model or tokenizer cannot be loaded (at start)
    └── EngineError                               the engine failed, not the request
        ├── EngineDeadError                       the engine loop has stopped
        └── EngineStepError                       a step failed on this request, which alone was ended
"""
from __future__ import annotations

from typing import Optional


class PrefixServeError(Exception):
    """Base of every error prefixserve raises on purpose."""

    default_code: Optional[str] = None

    def __init__(self, message: str, *, param: Optional[str] = None,
                 code: Optional[str] = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def __reduce__(self):
        # Errors cross process boundaries (the server's render process): keep field and code.
        return _rebuild, (type(self), self.message, self.param, self.code)


def _rebuild(cls: type[PrefixServeError], message: str, param: Optional[str],
             code: Optional[str]) -> PrefixServeError:
    return cls(message, param=param, code=code)


class InvalidRequestError(PrefixServeError, ValueError):
    """The request is malformed or asks for something impossible; nothing was queued."""

    default_code = "invalid_value"


class DuplicateRequestError(InvalidRequestError):
    default_code = "duplicate_request_id"


class PromptTooLongError(InvalidRequestError):
    default_code = "context_length_exceeded"


class CacheControlError(InvalidRequestError):
    default_code = "invalid_cache_control"


class ChatTemplateError(InvalidRequestError):
    default_code = "chat_template_error"


class NotFoundError(PrefixServeError, LookupError):
    default_code = "not_found"


class ConflictError(PrefixServeError):
    default_code = "conflict"


class CapacityError(PrefixServeError):
    """Not now: the server lacks room for this request at the moment."""

    default_code = "capacity"


class QueueFullError(CapacityError):
    default_code = "queue_full"


class PinLimitError(CapacityError):
    default_code = "pin_limit"


class CachedContentLimitError(CapacityError):
    default_code = "cached_content_limit"


class RequestAbortedError(PrefixServeError):
    default_code = "request_aborted"


class LoadError(PrefixServeError, ValueError):
    """A model or tokenizer folder cannot be used; the message names the file and the problem."""

    default_code = "load_error"


class EngineError(PrefixServeError):
    """The engine failed; the request may be fine."""

    default_code = "engine_error"


class EngineDeadError(EngineError):
    default_code = "engine_dead"


class EngineStepError(EngineError):
    default_code = "engine_error"
