"""What the KV manager hands the stores: the blocks of a prompt past the pool's hit."""
from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.kv.stores.record import BlockMeta


@dataclass
class StoreLookup:
    """The pool's hit for a prompt (block ids and generations, as a lookup walks them) and
    the blocks after it, each with what a stored record of it must match."""
    prefix_ids: list[int]
    prefix_gens: list[int]
    candidates: list[BlockMeta] = field(default_factory=list)
