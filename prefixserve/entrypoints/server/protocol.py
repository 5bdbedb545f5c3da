"""What every request body of the server shares, whichever API it speaks: strict validation and
the prefixserve diagnosis fields. The dialects' bodies (openai/protocol.py, anthropic/protocol.py)
build on these, so neither dialect borrows the other's."""
from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, PrivateAttr


class StrictModel(BaseModel):
    """Types are checked without coercion. Unknown fields are refused before a model sees the
    body (fields.py); the ones an operator lets through are dropped here, and their paths kept
    so that the server logs them."""
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    _unknown_fields: tuple[str, ...] = PrivateAttr(default=())


class PrefixserveOptions(StrictModel):
    """The request's `prefixserve` extension object; unknown keys are refused (typos would
    otherwise silently turn diagnosis off)."""
    model_config = ConfigDict(strict=True, extra="forbid")
    diagnose: bool = False
    diagnose_against: Optional[str] = None


class DiagnoseFields(StrictModel):
    """Live cache-miss diagnosis (prefixserve extension, on every generation endpoint): asked by
    `diagnose: true` or `prefixserve: {"diagnose": true}`; `diagnose_against` (top-level or in
    `prefixserve`) names the earlier response id to compare with and implies `diagnose`."""
    diagnose: bool = False
    diagnose_against: Optional[str] = None
    prefixserve: Optional[PrefixserveOptions] = None
