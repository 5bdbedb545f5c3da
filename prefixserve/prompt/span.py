"""A named token range of a rendered prompt: the tools, the system prompt, one message, the
generation prompt (or a whole completion prompt)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TOOLS, SYSTEM, HISTORY, NEW_TURN, GENERATION_PROMPT, PROMPT = (
    "tools", "system", "history", "new-turn", "generation-prompt", "prompt")


@dataclass(frozen=True)
class Span:
    kind: str                              # one of the constants above
    start: int                             # token range [start, end)
    end: int
    message_index: Optional[int] = None    # index in the conversation's turns (system/history/new-turn)
    role: Optional[str] = None

    @property
    def label(self) -> str:
        if self.kind == HISTORY:
            return f"history message {self.message_index} ({self.role})"
        if self.kind == NEW_TURN:
            return f"new {self.role} turn (message {self.message_index})"
        return {SYSTEM: "system prompt", TOOLS: "tools", GENERATION_PROMPT: "generation prompt",
                PROMPT: "prompt"}[self.kind]

    def to_dict(self) -> dict:
        return {"part": self.label, "kind": self.kind, "start": self.start, "end": self.end,
                "message_index": self.message_index}
