"""Every error a client sees, decided in one place.

The engine and the server raise the classes of `prefixserve.errors`; this module maps each
class to an HTTP status and to OpenAI's body {"error": {"message", "type", "param", "code"}}
everywhere except the Anthropic Messages endpoint, which answers Anthropic's
{"type": "error", "error": {"type", "message"}}. `APIError` is the HTTP layer's own error for
what only HTTP knows (an unknown model name, a malformed body). A client mistake is always a
4xx naming the field; an error of no known class is a 500 whose body names no internals.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixserve.errors import (CachedContentLimitError, CapacityError, ConflictError, DuplicateRequestError,
                                EngineDeadError, EngineError, InvalidRequestError, NotFoundError, PinLimitError,
                                PrefixServeError, QueueFullError, RequestAbortedError)

logger = logging.getLogger(__name__)

# Pydantic names union members and wrappers in error locations; they are not request fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "tuple"}
ANTHROPIC_PATH_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 409: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
# (class, HTTP status, OpenAI error type), most specific first: the first match wins.
_STATUS: tuple[tuple[type[PrefixServeError], int, str], ...] = (
    (QueueFullError, 429, "rate_limit_exceeded"),
    (PinLimitError, 409, "invalid_request_error"),
    (CachedContentLimitError, 409, "invalid_request_error"),
    (CapacityError, 503, "server_error"),
    (DuplicateRequestError, 409, "invalid_request_error"),
    (InvalidRequestError, 400, "invalid_request_error"),
    (NotFoundError, 404, "not_found_error"),
    (ConflictError, 409, "invalid_request_error"),
    (RequestAbortedError, 499, "request_aborted"),
    (EngineDeadError, 503, "server_error"),
    (EngineError, 500, "server_error"),
    (PrefixServeError, 500, "server_error"),
)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def __reduce__(self):
        # raised in the render process too, and pickled back with its status and field
        return (_api_error_of, (self.status, self.message, dict(self.__dict__)))

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as a server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"

    def anthropic_sse(self) -> str:
        return f"event: error\ndata: {json.dumps(self.anthropic_body())}\n\n"


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def api_error(exc: BaseException, *, param: Optional[str] = None, retry_after_s: int = 1,
              renames: Optional[dict[str, str]] = None) -> APIError:
    """The HTTP error for anything the engine or the server raised.

    param: the request field to blame when the error names none (e.g. "messages" for a
    prompt the engine refused). renames: engine field names this endpoint spells differently
    (chat's top_logprobs is the engine's logprobs)."""
    if isinstance(exc, APIError):
        return exc
    for cls, status, kind in _STATUS:
        if isinstance(exc, cls):
            # the caller's field fills in only for a mistake in the request, not for a feature
            # this server lacks (pins by id under --replicas)
            field = exc.param or (param if isinstance(exc, InvalidRequestError)
                                  and exc.code != "not_supported" else None)
            message = exc.message
            if renames and field in renames:
                if message.startswith(f"{field} must"):  # a field check: the client's spelling
                    message = renames[field] + message[len(field):]
                field = renames[field]
            headers = {"Retry-After": str(retry_after_s)} if status in (429, 503) else None
            if status >= 500:
                logger.error("%s: %s", type(exc).__name__, message)
            return APIError(status, message, type=kind, param=field if status < 500 else None,
                            code=exc.code, headers=headers)
    logger.error("unexpected error", exc_info=exc)
    return APIError(500, "internal error; the server log has the details", type="server_error")


def _param_of(loc: tuple) -> Optional[str]:
    parts: list[str] = []
    for item in loc:
        if item == "body" and not parts:
            continue
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and item.isidentifier() and item not in _TYPE_TAGS:
            parts.append(("." if parts else "") + item)
    return "".join(parts) or None


def _api_error_of(status: int, message: str, fields: dict[str, Any]) -> APIError:
    error = APIError(status, message)
    error.__dict__.update(fields)
    return error


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    for err in errors:
        if err.get("type") == "json_invalid":
            detail = err.get("ctx", {}).get("error", err.get("msg", ""))
            return bad_request(f"malformed JSON body: {detail}", code="invalid_json")
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if loc == ("body",):
        if first.get("type") == "missing":
            return bad_request("the request needs a JSON body", code="invalid_json")
        return bad_request("the request body must be a JSON object", code="invalid_json")
    param = _param_of(loc)
    # Union members each report; the member errors share the field, so list each field once.
    seen: dict[Optional[str], str] = {}
    for err in errors:
        p = _param_of(tuple(err.get("loc", ())))
        seen.setdefault(p, f"{p or 'body'}: {err.get('msg', 'invalid')}")
    code = "missing_required_parameter" if first.get("type") == "missing" else "invalid_type"
    return bad_request("invalid request: " + "; ".join(list(seen.values())[:4]), param=param, code=code)


def _anthropic(request: Request) -> bool:
    return request.url.path.startswith(ANTHROPIC_PATH_PREFIX)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(_anthropic(request))

    @app.exception_handler(PrefixServeError)
    async def _prefixserve(request: Request, exc: PrefixServeError) -> JSONResponse:
        retry = request.app.state.server.config.retry_after_s
        return api_error(exc, retry_after_s=retry).response(_anthropic(request))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response(_anthropic(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type=kind,
                        headers=getattr(exc, "headers", None)).response(_anthropic(request))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s", request.url.path, exc_info=exc)
        return api_error(exc).response(_anthropic(request))
