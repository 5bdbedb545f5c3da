"""What every HTTP request passes before any endpoint sees it: the body-size bound, the API key,
and the client's X-Request-Id echoed back.

A plain ASGI middleware, so that a request without a valid key, or with a body beyond the
bound, is answered before its body is parsed at all: an attacker's megabytes cost the server
a read, not a JSON parse and a validation holding the GIL the engine needs.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable, Optional

from prefixserve.entrypoints.server.auth import ANONYMOUS, KeyTable, Principal, key_of
from prefixserve.entrypoints.server.errors import ANTHROPIC_PATH_PREFIX, APIError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Routes that act on the whole server rather than on the caller's own requests.
ADMIN_PATHS = ("/reset_prefix_cache", "/metrics")
OPEN_PATHS = ("/health", "/openapi.json", "/docs", "/redoc")
MAX_REQUEST_ID = 128


class Gate:
    def __init__(self, app: Callable, *, keys: Optional[KeyTable], max_body_bytes: int) -> None:
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        anthropic = path.startswith(ANTHROPIC_PATH_PREFIX)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        send = _echo_request_id(send, headers.get("x-request-id"))

        principal = self._principal(path, headers)
        if isinstance(principal, APIError):
            await principal.response(anthropic)(scope, receive, send)
            return
        scope.setdefault("state", {})["principal"] = principal

        declared = headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await self._too_large(anthropic)(scope, receive, send)
            return
        body, rest = await _read_body(receive, self.max_body_bytes)
        if body is None:
            await self._too_large(anthropic)(scope, receive, send)
            return
        await self.app(scope, _replay(body, rest, receive), send)

    def _principal(self, path: str, headers: dict[str, str]) -> Principal | APIError:
        if self.keys is None or path in OPEN_PATHS:
            return ANONYMOUS
        principal = self.keys.lookup(key_of(headers.get("authorization"), headers.get("x-api-key")))
        if principal is None:
            return APIError(401, "missing or invalid API key: send Authorization: Bearer <key> (or x-api-key)",
                            type="invalid_request_error", code="invalid_api_key",
                            headers={"WWW-Authenticate": "Bearer"})
        if path in ADMIN_PATHS and not principal.admin:
            return APIError(403, f"{path} acts on the whole server and needs an admin key",
                            type="permission_error", code="admin_key_required")
        return principal

    def _too_large(self, anthropic: bool):
        return APIError(413, f"the request body is larger than {self.max_body_bytes} bytes",
                        type="invalid_request_error", code="request_too_large").response(anthropic)


async def _read_body(receive: Receive, limit: int) -> tuple[Optional[bytes], Optional[Message]]:
    """The whole body (None beyond `limit`), and a message that came after it, if any."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), message
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None, None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), None


def _replay(body: bytes, rest: Optional[Message], receive: Receive) -> Receive:
    """The body as one message, then whatever the real channel says (a disconnect, for streams)."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]
    if rest is not None:
        pending.append(rest)

    async def receive_next() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()
    return receive_next


def _echo_request_id(send: Send, request_id: Optional[str]) -> Send:
    if not request_id or len(request_id) > MAX_REQUEST_ID or not (request_id.isascii() and request_id.isprintable()):
        return send

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []),
                                              (b"x-request-id", request_id.encode("latin-1"))]}
        await send(message)
    return send_with_id
