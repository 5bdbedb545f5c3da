"""What the KV manager knows about one request."""
from __future__ import annotations

from typing import Optional

from prefixserve.kv.hashing import BlockHash


class RequestBlocks:
    """A request's block table and the hash chain of its full blocks.

    hashes[i] is the content hash of full block i. canon[i] is the physical block that stands
    for block i in the hash index (the request's own block, a hit block, or an equal block that
    another request registered first), with canon_gen[i] its generation at that time; a later
    block is registered as the child of canon[i] only while that generation still matches.
    canon[i] is NO_PARENT when the chain was cut at or before block i.

    pending holds the token-exact breakpoints (t, tokens of t's block before t) whose partial
    block is still to be cached (partial_blocks.py); allocated_end is where the last successful
    allocation ended; write_limit, when set, keeps full blocks past that many tokens out of the
    index (explicit cache writes).
    """

    __slots__ = ("table", "hashes", "canon", "canon_gen", "extras_first", "extras_rest",
                 "priority", "pending", "allocated_end", "write_limit", "special")

    def __init__(self, table: list[int], extras_first: bytes, extras_rest: bytes,
                 priority: int, special: Optional[dict[int, bytes]] = None) -> None:
        self.table = table
        self.hashes: list[BlockHash] = []
        self.canon: list[int] = []
        self.canon_gen: list[int] = []
        self.extras_first = extras_first
        self.extras_rest = extras_rest
        self.priority = priority
        self.pending: list[tuple[int, bytes]] = []
        self.allocated_end = 0
        self.write_limit: Optional[int] = None
        # encoded keys of the blocks an image overlaps (kv/hashing.py special_block_extras)
        self.special = special or {}

    def fork(self) -> RequestBlocks:
        child = RequestBlocks(list(self.table), self.extras_first, self.extras_rest,
                              self.priority, self.special)
        child.hashes = list(self.hashes)
        child.canon = list(self.canon)
        child.canon_gen = list(self.canon_gen)
        child.pending = list(self.pending)
        child.allocated_end = self.allocated_end
        child.write_limit = self.write_limit
        return child
