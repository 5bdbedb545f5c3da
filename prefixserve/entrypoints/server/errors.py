"""Errors: OpenAI's shape {"error": {"message", "type", "param", "code"}} everywhere except the
Anthropic Messages endpoint, which answers Anthropic's {"type": "error", "error": {"type", "message"}}."""
from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixserve.engine.async_llm import EngineDeadError, EngineStepError, RequestAbortedError
from prefixserve.entrypoints.server.cache_control import CacheControlError
from prefixserve.sampling_params import SamplingParams
from prefixserve.scheduler import QueueFull, RequestRejected

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}
# Pydantic names union members and wrappers in error locations; they are not request fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "tuple"}
ANTHROPIC_PATH_PREFIX = "/v1/messages"
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 409: "invalid_request_error",
                    413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


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


def sampling_error(exc: ValueError, renames: Optional[dict[str, str]] = None) -> APIError:
    """SamplingParams names the bad field first in its message; report it as the param."""
    message = str(exc)
    first = message.split(" ", 1)[0].strip("(:,")
    param = first if first in _SAMPLING_FIELDS else None
    if param is not None and renames and param in renames:
        # The request spells this field differently (chat's top_logprobs is our logprobs).
        message = renames[param] + message[len(first):]
        param = renames[param]
    return bad_request(message, param=param, code="invalid_value")


def engine_error(exc: BaseException, *, param: Optional[str], retry_after_s: int) -> APIError:
    """Maps what AsyncLLM raises to the HTTP error a client should see."""
    if isinstance(exc, QueueFull):
        return APIError(429, str(exc), type="rate_limit_exceeded", code="queue_full",
                        headers={"Retry-After": str(retry_after_s)})
    if isinstance(exc, RequestRejected):
        return bad_request(str(exc), param=param)
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead")
    if isinstance(exc, RequestAbortedError):
        return APIError(499, str(exc), type="request_aborted")
    if isinstance(exc, EngineStepError):
        return APIError(500, str(exc), type="server_error", code="engine_error")
    logger.error("unexpected engine error", exc_info=exc)
    return APIError(500, f"internal error: {exc!r}", type="server_error")


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

    @app.exception_handler(CacheControlError)
    async def _cache_control(request: Request, exc: CacheControlError) -> JSONResponse:
        return bad_request(str(exc), param=exc.param,
                           code="invalid_cache_control").response(_anthropic(request))

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
        return APIError(500, f"internal error: {exc!r}",
                        type="server_error").response(_anthropic(request))
