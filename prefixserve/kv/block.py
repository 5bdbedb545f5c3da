"""One physical KV block's bookkeeping."""
from __future__ import annotations

from typing import Optional

from prefixserve.kv.hashing import BlockHash

NO_PARENT = -1


class Block:
    """State of one physical block.

    free-uncached: ref == 0 and hash is None; free-cached: ref == 0 and hash set (evictable);
    in use: ref >= 1 (request tables and pins). The content fields (tokens, extras, parent
    link) are set only while the block is in the hash index; they let a lookup prove a hit
    instead of trusting the hash.
    """

    __slots__ = ("block_id", "ref", "hash", "tokens", "extras", "parent", "parent_gen",
                 "parent_hash", "gen", "uses", "priority", "owner")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref = 0
        self.hash: Optional[BlockHash] = None
        self.tokens: Optional[bytes] = None      # token ids as stored by hashing.token_bytes
        self.extras: Optional[bytes] = None      # encoded extra keys
        # Physical id and generation of the block this one was registered after
        # (NO_PARENT for a chain's first block); a link is live while the parent's gen matches.
        self.parent = NO_PARENT
        self.parent_gen = 0
        self.parent_hash: Optional[BlockHash] = None
        # Bumped whenever the block leaves the hash index, so stale links never match again.
        self.gen = 0
        self.uses = 0        # times taken into use since it was last filled (LFU)
        self.priority = 0    # highest priority among the requests of its last use (priority policy)
        # The tenant charged for the block while it is in use or cached: the one whose request
        # allocated it (kv/tenant_shares.py); None when free and uncached, or anonymous.
        self.owner: Optional[str] = None
