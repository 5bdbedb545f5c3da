"""The response store as a request reads it (a previous_response_id, GET, DELETE, the input
items): off the event loop, since a file or Redis store does I/O, and with an unreachable store
answered as what it is, a 503 with Retry-After that a client may retry, not the 500 of a bug.

The client is told only that the store is unavailable (the store's URL can hold a password);
the cause goes to the log, once per failed request, as a warning (an outage is the operator's
to fix, not an error in this server), and each is counted in
prefixserve:response_store_errors_total. An exception the backend does not name as an outage
(a corrupt record, a bug) stays a 500."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable, TypeVar

from fastapi import Request

from prefixserve.entrypoints.server.errors import APIError
from prefixserve.entrypoints.server.metrics import StoreOperation
from prefixserve.entrypoints.server.response_store import ResponseStoreUnavailable
from prefixserve.entrypoints.server.state import get_state

logger = logging.getLogger(__name__)
T = TypeVar("T")


async def from_store(request: Request, operation: StoreOperation, call: Callable[..., T], *args: object) -> T:
    """call(*args), a method of the server's response store, in a worker thread."""
    state = get_state(request)
    try:
        return await asyncio.to_thread(call, *args)
    except ResponseStoreUnavailable as exc:
        logger.warning("%s %s answered 503: the response store is unavailable (%s)", request.method,
                       request.url.path, exc)
        state.metrics.response_store_failed(operation)
        raise APIError(503, "the response store is unavailable; retry later", type="server_error",
                       code="response_store_unavailable",
                       headers={"Retry-After": str(state.config.retry_after_s)}) from None
