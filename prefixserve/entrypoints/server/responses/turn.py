"""One response being made: its response object when it opens and when it finishes, and what a
finished one stores (response_store.py): the response, the conversation's full item list, and
the exact token ids of its turn (the prompt and what the model generated), which a later
previous_response_id puts back into the turn memory.

The store is written off the event loop (a file or Redis store does I/O) and before the response
is answered, so a client continuing from the answer finds it stored. A write that fails loses the
client nothing but the storing: the response is answered all the same, saying `"store": false`,
and the failure is logged and counted (prefixserve:response_store_errors_total, operation "write")."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from prefixserve.engine.outputs import RequestOutput
from prefixserve.entrypoints.server.pipeline import Call
from prefixserve.entrypoints.server.prompting.turn_memory import turn_of
from prefixserve.entrypoints.server.responses.objects import response_id, response_object
from prefixserve.entrypoints.server.responses.protocol import ResponsesRequest
from prefixserve.entrypoints.server.state import ServerState
from prefixserve.entrypoints.server.usage import TokenUsage

logger = logging.getLogger(__name__)


class ResponseTurn:
    """One response being made: what it stores when it finishes."""

    def __init__(self, call: Call, body: ResponsesRequest, history: list[dict[str, Any]],
                 items: list[dict[str, Any]], tenant: Optional[str]) -> None:
        self.call, self.body, self.history, self.items, self.tenant = call, body, history, items, tenant
        self.id = response_id(call.id)
        self.created = float(call.created)

    @property
    def state(self) -> ServerState:
        return self.call.state

    def opened(self) -> dict[str, Any]:
        return response_object(self.id, self.body, self.state.model_name, self.created,
                               status="in_progress", output=[])

    async def finish(self, output: RequestOutput, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response; stored (with the exact tokens of its turn) unless store is false.
        One that could not be stored says `"store": false`."""
        completion = output.outputs[0]
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        response = response_object(self.id, self.body, self.state.model_name, self.created, status=status,
                                   output=items, usage=TokenUsage.of([output]))
        if self.body.store:
            prompt = self.call.prompt
            turn = turn_of(prompt.rendered.text, prompt.token_ids, completion, self.state.async_llm.tokenizer)
            stored = await self._store({
                "id": self.id, "response": response, "history": self.history + self.items + items,
                "turn": {"text": turn[0], "ids": turn[1]} if turn is not None else None})
            if not stored:
                response["store"] = False
        return response

    async def _store(self, record: dict[str, Any]) -> bool:
        store = self.state.responses
        try:
            return await asyncio.to_thread(store.put, self.tenant, record)
        except Exception:   # whatever the backend raises (unreachable Redis, a full disk)
            logger.warning("response %s answered but not stored: the response store failed", self.id,
                           exc_info=True)
            self.state.metrics.response_store_failed("write")
            return False
