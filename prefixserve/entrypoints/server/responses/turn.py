"""One response being made: its response object when it opens and when it finishes, and what a
finished one stores (response_store.py): the response, the conversation's full item list, and
the exact token ids of its turn (the prompt and what the model generated), which a later
previous_response_id puts back into the turn memory."""
from __future__ import annotations

from typing import Any, Optional

from prefixserve.engine.outputs import RequestOutput
from prefixserve.entrypoints.server.pipeline import Call
from prefixserve.entrypoints.server.prompting.turn_memory import turn_of
from prefixserve.entrypoints.server.responses.objects import response_id, response_object
from prefixserve.entrypoints.server.responses.protocol import ResponsesRequest
from prefixserve.entrypoints.server.state import ServerState
from prefixserve.entrypoints.server.usage import TokenUsage


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

    def finish(self, output: RequestOutput, items: list[dict[str, Any]]) -> dict[str, Any]:
        """The finished response; stored (with the exact tokens of its turn) unless store is false."""
        completion = output.outputs[0]
        status = "incomplete" if completion.finish_reason == "length" else "completed"
        response = response_object(self.id, self.body, self.state.model_name, self.created, status=status,
                                   output=items, usage=TokenUsage.of([output]))
        if self.body.store:
            prompt = self.call.prompt
            turn = turn_of(prompt.rendered.text, prompt.token_ids, completion, self.state.async_llm.tokenizer)
            self.state.responses.put(self.tenant, {
                "id": self.id, "response": response, "history": self.history + self.items + items,
                "turn": {"text": turn[0], "ids": turn[1]} if turn is not None else None})
        return response
