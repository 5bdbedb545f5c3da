"""GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items: a tenant's stored
responses (response_store.py). Another tenant's id, an expired or deleted one and one never
stored are all the same 404; an unreachable store is a 503 (store_reads.py)."""
from __future__ import annotations

from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse

from prefixserve.entrypoints.server.errors import APIError, bad_request
from prefixserve.entrypoints.server.responses.store_reads import from_store
from prefixserve.entrypoints.server.state import get_state, principal

MAX_LIMIT = 100


async def _record(request: Request, response_id: str) -> dict[str, Any]:
    record = await from_store(request, "read", get_state(request).responses.get, principal(request).tenant,
                              response_id)
    if record is None:
        raise APIError(404, f"no stored response {response_id[:80]!r} (unknown, expired, deleted or not "
                            f"stored)", type="not_found_error", param="response_id", code="response_not_found")
    return record


async def get_response(request: Request, response_id: str) -> JSONResponse:
    return JSONResponse((await _record(request, response_id))["response"])


async def delete_response(request: Request, response_id: str) -> JSONResponse:
    store = get_state(request).responses
    if not await from_store(request, "delete", store.delete, principal(request).tenant, response_id):
        raise APIError(404, f"no stored response {response_id[:80]!r}", type="not_found_error",
                       param="response_id", code="response_not_found")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def list_input_items(request: Request, response_id: str, limit: int = 20,
                           order: Literal["asc", "desc"] = "desc", after: str | None = None) -> JSONResponse:
    """Every item the response was generated from (the stored conversation and the request's
    input), newest first unless order=asc; `after` an item id, for the next page."""
    if not 1 <= limit <= MAX_LIMIT:
        raise bad_request(f"limit must be in [1, {MAX_LIMIT}], got {limit}", param="limit")
    record = await _record(request, response_id)
    items = record["history"][:len(record["history"]) - len(record["response"]["output"])]
    if order == "desc":
        items = items[::-1]
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise bad_request(f"after {after[:80]!r} is no input item of this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
