"""Per-request KV block bookkeeping with automatic prefix caching.

The manager never touches tensors: it decides which physical blocks hold which tokens, which
full blocks can be shared through the hash index, and which (src, dst) block copies the worker
must make before a forward. Every call here is on the engine's per-step path, so work is per
block (never per token) except for hashing the blocks that just became full.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional, Sequence

from prefixserve.kv.allocation import Allocation, PrefixHit
from prefixserve.kv.block import NO_PARENT
from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.config import KVCacheConfig
from prefixserve.kv.eviction import EvictionPolicy, make_policy
from prefixserve.kv.hashing import (BlockHash, BlockHasher, HashFn, ImageSpan, encode_extra_keys,
                                    request_extra_keys, special_block_extras, token_bytes)
from prefixserve.kv.integrity import check_integrity
from prefixserve.kv.partial_blocks import (PartialEntry, find_partial, is_partial,
                                           partial_entry, pending_breakpoints)
from prefixserve.kv.pins import PinInfo, PinRegistry
from prefixserve.kv.request_blocks import RequestBlocks
from prefixserve.kv.stats import KVCacheCounters, KVCacheStats
from prefixserve.kv.store_lookup import StoreLookup
from prefixserve.kv.tenant_shares import TenantShares, block_shares
from prefixserve.kv.stores.record import BlockMeta

# Lookups hash a prompt in chunks of this many blocks, so a miss early in a long prompt does
# not pay for serialising all of it.
_LOOKUP_CHUNK_BLOCKS = 64
_EXTRAS_CACHE_SIZE = 1024


class KVCacheManager:
    def __init__(self, config: KVCacheConfig, clock: Callable[[], float] = time.monotonic,
                 hash_fn: Optional[HashFn] = None,
                 max_pinned_blocks: Optional[int] = None) -> None:
        if not isinstance(config, KVCacheConfig):
            raise ValueError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        if max_pinned_blocks is not None:
            # Validated through the config so both ways of setting the cap obey one rule.
            config = dataclasses.replace(config, max_pinned_blocks=max_pinned_blocks)
        self.config = config
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks
        self.enable_prefix_caching = config.enable_prefix_caching
        self.hasher = BlockHasher(config.hash_algo, config.model_identity, hash_fn)
        self._clock = clock
        weights = config.tenant_weights
        if config.tenant_cache_shares and len(weights) > 1:
            policy: EvictionPolicy = TenantShares(config.eviction_policy,
                                                  block_shares(config.num_blocks, weights))
        else:
            policy = make_policy(config.eviction_policy)
        self._pool = BlockPool(config.num_blocks, policy)
        self._pins = PinRegistry(config.max_pinned_blocks, config.max_pinned_blocks_per_tenant)
        self._requests: dict[str, RequestBlocks] = {}
        self._counters = KVCacheCounters()
        self._extras: dict[Optional[str], tuple[bytes, bytes]] = {}
        # Blocks registered as computed since the last take_computed(), for write-through KV
        # stores; None unless they asked (enable_store_journal).
        self._computed: Optional[list[int]] = None

    # ------------------------------------------------------------------ lookup
    def find_cached_prefix(self, request_id: str, token_ids: Sequence[int], *,
                           cache_salt: Optional[str] = None, preempted: bool = False,
                           breakpoints: Sequence[int] = (),
                           image_spans: Sequence[ImageSpan] = ()) -> PrefixHit:
        """The longest cached prefix of token_ids: full blocks, then, where one of the request's
        token-exact breakpoints ends inside the next block, that breakpoint's partial block.
        image_spans key the blocks an image overlaps by the image's content (kv/hashing.py)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds blocks; look up a prefix "
                             "only for a request without blocks (new, or preempted and freed)")
        extras_first, extras_rest = self._encoded_extras(cache_salt)
        hit = PrefixHit([], 0, query_tokens=len(token_ids), preempted=preempted)
        if self.enable_prefix_caching:
            # The last token is always computed: its logits are needed.
            max_blocks = (len(token_ids) - 1) // self.block_size
            special = self._special(cache_salt, image_spans)
            self._walk(token_ids, max_blocks, extras_first, extras_rest,
                       hit.block_ids, hit.generations, special)
            hit.num_tokens = len(hit.block_ids) * self.block_size
            if breakpoints:
                extras = extras_rest if hit.block_ids else extras_first
                self._extend_to_breakpoint(hit, token_ids, breakpoints, len(token_ids) - 1,
                                           special.get(len(hit.block_ids), extras))
        return hit

    def _extend_to_breakpoint(self, hit: PrefixHit, token_ids: Sequence[int],
                              breakpoints: Sequence[int], limit: int, extras: bytes) -> None:
        """Adds to a hit of full blocks the partial block of the furthest breakpoint (at most
        `limit`) that ends inside the block after them, if it is cached."""
        start = hit.num_tokens
        for t in sorted(breakpoints, reverse=True):
            if start < t <= limit and t - start < self.block_size:
                tokens = token_bytes(token_ids[start:t])
                block_id = find_partial(self._pool, self.hasher, hit.block_ids, tokens, extras)
                if block_id is not None:
                    hit.block_ids.append(block_id)
                    hit.generations.append(self._pool.blocks[block_id].gen)
                    hit.num_tokens = t
                    return

    def _walk(self, token_ids: Sequence[int], max_blocks: int, extras_first: bytes,
              extras_rest: bytes, ids: list[int], gens: list[int],
              special: Optional[dict[int, bytes]] = None) -> None:
        """Appends to ids/gens the longest chain of cached blocks matching token_ids. A block
        counts only if its stored tokens and extra keys equal the request's and it was
        registered as the child of the block matched just before it (same id and generation):
        a hash collision can cost a miss, never a wrong hit."""
        bs = self.block_size
        blocks, index = self._pool.blocks, self._pool.index
        iter_chain = self.hasher.iter_chain
        parent_hash = self.hasher.seed
        prev, prev_gen = NO_PARENT, 0
        i = 0
        chunk = _LOOKUP_CHUNK_BLOCKS
        while i < max_blocks:
            end = min(max_blocks, i + chunk)
            tokens = token_bytes(token_ids[i * bs:end * bs])
            for tok, block_hash in iter_chain(parent_hash, tokens, bs, i, extras_first,
                                              extras_rest, special):
                block_id = index.get(block_hash)
                if block_id is None:
                    return
                block = blocks[block_id]
                extras = extras_rest if i else extras_first
                if special:
                    extras = special.get(i, extras)
                if (block.parent != prev or block.parent_gen != prev_gen or block.tokens != tok
                        or block.extras != extras):
                    return
                prev, prev_gen, parent_hash = block_id, block.gen, block_hash
                ids.append(block_id)
                gens.append(prev_gen)
                i += 1
            chunk *= 2

    # -------------------------------------------------------------- allocation
    def allocate_slots(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                       num_new_tokens: int, *, hit: Optional[PrefixHit] = None,
                       cache_salt: Optional[str] = None, priority: int = 0,
                       breakpoints: Sequence[int] = (),
                       write_limit: Optional[int] = None,
                       image_spans: Sequence[ImageSpan] = (),
                       tenant: Optional[str] = None) -> Optional[Allocation]:
        """Slots for num_new_tokens more tokens of request_id (all or nothing: None when the
        blocks cannot be had); a new request first takes its hit. Blocks it takes are charged
        to tenant (kv/tenant_shares.py). breakpoints, write_limit and image_spans count on a
        request's first allocation: the prompt lengths whose prefix is kept token-exact
        (partial_blocks.py), how many leading tokens of it may enter the cache at all (None:
        every full block), and the images whose content keys the blocks they overlap."""
        if num_computed_tokens < 0 or num_new_tokens < 0:
            raise ValueError(f"num_computed_tokens ({num_computed_tokens}) and num_new_tokens "
                             f"({num_new_tokens}) must be >= 0")
        end = num_computed_tokens + num_new_tokens
        if len(token_ids) < end:
            raise ValueError(f"token_ids has {len(token_ids)} entries but num_computed_tokens + "
                             f"num_new_tokens = {end}")
        if self._pins.may_expire:
            self.expire_pins()
        bs = self.block_size
        pool = self._pool
        blocks = pool.blocks
        req = self._requests.get(request_id)
        cow: list[int] = []
        reclaim: Sequence[int] = ()
        due: tuple[int, list[PartialEntry]] = (0, [])
        if req is None:
            hit_ids = hit.block_ids if hit is not None else []
            hit_tokens = hit.num_tokens if hit is not None else 0
            if num_computed_tokens != hit_tokens:
                raise ValueError(
                    f"request {request_id!r} has no blocks yet: num_computed_tokens "
                    f"({num_computed_tokens}) must equal the hit's {hit_tokens} tokens")
            if hit is not None and hit_ids:
                self._check_hit(request_id, hit)
                # Hit blocks leave the eviction queue, so they cannot also be evicted for us.
                reclaim = hit_ids
            table = hit_ids
            have = len(hit_ids)
        else:
            if hit is not None:
                raise ValueError(f"request {request_id!r} already holds blocks; pass a hit "
                                 "only on its first allocation")
            table = req.table
            have = len(table)
            if num_computed_tokens > have * bs:
                raise ValueError(
                    f"request {request_id!r}: num_computed_tokens ({num_computed_tokens}) is "
                    f"beyond its {have} blocks")
            if req.pending and req.pending[0][0] <= num_computed_tokens:
                due = self._due_partials(req, num_computed_tokens)
        if num_new_tokens:
            # Blocks this call writes into that another holder still reads, or that the cache
            # keeps (or is about to keep) as a breakpoint's partial block: copy first.
            caching = {entry[0] for entry in due[1]}
            last = min(have, (end - 1) // bs + 1)
            cow = [j for j in range(num_computed_tokens // bs, last)
                   if blocks[table[j]].ref > 1 or blocks[table[j]].hash is not None
                   or table[j] in caching]
        grow = max(0, -(-end // bs) - have)
        if grow + len(cow) and grow + len(cow) > pool.num_available_for(tenant, reclaim):
            return None
        # Everything that can reject bad input runs before the first change.
        if req is None:
            extras_first, extras_rest = self._encoded_extras(cache_salt)
            special = self._special(cache_salt, image_spans)
        hashed = len(req.hashes) if req is not None else num_computed_tokens // bs
        num_full = end // bs
        limit = req.write_limit if req is not None else write_limit
        if limit is not None:
            num_full = min(num_full, limit // bs)
        new_full_tokens = (token_bytes(token_ids[hashed * bs:num_full * bs])
                           if self.enable_prefix_caching and num_full > hashed else None)

        # Commit: nothing below can fail.
        if due[0]:
            self._cache_partials(req, due)
        if req is None:
            req = RequestBlocks(list(hit_ids), extras_first, extras_rest, priority, special)
            self._requests[request_id] = req
            if hit is not None:
                self._take_hit(req, hit, priority)
            if self.enable_prefix_caching:
                req.write_limit = write_limit
                if breakpoints:
                    req.pending = pending_breakpoints(token_ids, breakpoints, bs,
                                                      num_computed_tokens)
        copies = []
        # One allocation for both, so the floors it respects are the ones checked above.
        fresh = pool.allocate(len(cow) + grow, priority, tenant) if grow + len(cow) else []
        if cow:
            table = req.table
            for j, dst in zip(cow, fresh):
                src = table[j]
                table[j] = dst
                copies.append((src, dst))
            pool.release(src for src, _ in copies)
            self._counters.cow_copies += len(copies)
        new_ids = fresh[len(cow):]
        req.table.extend(new_ids)
        req.allocated_end = end
        if new_full_tokens is not None:
            self._register(req, new_full_tokens)
        return Allocation(new_ids, copies)

    def cache_reached_breakpoints(self, request_id: str) -> None:
        """Caches now the partial blocks of the request's breakpoints that its last allocation
        reached, instead of at its next allocation or its free. Only once that allocation's
        forward has run: the engine calls it before placing the request's pins, so a pin at a
        breakpoint that ends the prompt finds its partial block."""
        req = self._requests.get(request_id)
        if req is not None and req.pending and req.pending[0][0] <= req.allocated_end:
            self._cache_partials(req, self._due_partials(req, req.allocated_end))

    def _due_partials(self, req: RequestBlocks, computed: int) -> tuple[int, list[PartialEntry]]:
        """(how many of the request's pending breakpoints have their K/V written, at most
        `computed` tokens; the partial blocks to cache for them). A block holding several is
        cached for the furthest one. Changes nothing."""
        pending = req.pending
        count = 0
        while count < len(pending) and pending[count][0] <= computed:
            count += 1
        bs = self.block_size
        entries = []
        for k in range(count):
            t, tokens = pending[k]
            if k + 1 < count and pending[k + 1][0] // bs == t // bs:
                continue
            entry = partial_entry(self._pool, self.hasher, req, t, tokens, bs)
            if entry is not None:
                entries.append(entry)
        return count, entries

    def _cache_partials(self, req: Optional[RequestBlocks],
                        due: tuple[int, list[PartialEntry]]) -> None:
        count, entries = due
        for entry in entries:
            self._pool.register(*entry)
        if req is not None:
            del req.pending[:count]

    def _check_hit(self, request_id: str, hit: PrefixHit) -> None:
        blocks = self._pool.blocks
        bs = self.block_size
        full = len(hit.block_ids)
        tail = blocks[hit.block_ids[-1]].tokens if hit.block_ids else None
        if is_partial(tail, bs):
            full -= 1
        expected = full * bs + (len(tail) // 4 if tail is not None and is_partial(tail, bs) else 0)
        if hit.num_tokens != expected:
            raise ValueError(f"hit for {request_id!r}: num_tokens ({hit.num_tokens}) is not "
                             f"the {expected} tokens of its blocks of {bs}")
        gens = hit.generations
        for i, block_id in enumerate(hit.block_ids):
            block = blocks[block_id]
            if block.hash is None or (gens and gens[i] != block.gen):
                raise ValueError(
                    f"hit for {request_id!r} is stale: block {block_id} was evicted or reused "
                    "after the lookup; look up and allocate in the same step")

    def _take_hit(self, req: RequestBlocks, hit: PrefixHit, priority: int) -> None:
        blocks = self._pool.blocks
        ids = hit.block_ids
        self._pool.take(ids, priority)
        # _check_hit proved every hit block is in the index, so each has its hash; a partial
        # block at the end is no link of the request's chain (it is copied before any write).
        full = ids[:hit.num_tokens // self.block_size]
        req.hashes = [h for b in full if (h := blocks[b].hash) is not None]
        req.canon = list(full)
        req.canon_gen = [blocks[b].gen for b in full]
        counters = self._counters
        if hit.preempted:
            counters.recomputed_queries += 1
            counters.recomputed_query_tokens += hit.query_tokens
            counters.recomputed_hit_tokens += hit.num_tokens
        else:
            counters.queries += 1
            counters.query_tokens += hit.query_tokens
            counters.hit_tokens += hit.num_tokens

    def _register(self, req: RequestBlocks, tokens: bytes) -> None:
        """Hashes the request's newly full blocks (their tokens, from token_bytes, follow its
        last hashed block) and puts them in the index, so that requests scheduled later in this
        step, or later, can share them."""
        bs = self.block_size
        pool = self._pool
        blocks, index = pool.blocks, pool.index
        table, hashes, canon, canon_gen = req.table, req.hashes, req.canon, req.canon_gen
        extras_first, extras_rest, special = req.extras_first, req.extras_rest, req.special
        i = len(hashes)
        parent_hash = hashes[-1] if i else self.hasher.seed
        for tok, block_hash in self.hasher.iter_chain(parent_hash, tokens, bs, i,
                                                      extras_first, extras_rest, special):
            hashes.append(block_hash)
            extras = extras_rest if i else extras_first
            if special:
                extras = special.get(i, extras)
            link, link_gen = (canon[i - 1], canon_gen[i - 1]) if i else (NO_PARENT, 0)
            if i and (link == NO_PARENT or blocks[link].gen != link_gen):
                # The chain above this block is no longer in the index (evicted, replaced or
                # reset): a lookup could never reach this block, so it is not registered.
                self._cut(canon, canon_gen)
            else:
                existing = index.get(block_hash)
                if existing is not None and self._same_block(existing, tok, extras, link, link_gen):
                    # Computed twice (forks, concurrent chunked prefills): the first copy
                    # stays the one lookups find, and this request's chain continues from it.
                    canon.append(existing)
                    canon_gen.append(blocks[existing].gen)
                elif existing is not None and blocks[existing].ref > 0:
                    self._cut(canon, canon_gen)   # a colliding block in use keeps its place
                else:
                    if existing is not None:
                        pool.uncache(existing)    # a colliding or orphaned free block
                    block_id = table[i]
                    pool.register(block_id, block_hash, tok, extras, link, link_gen,
                                  parent_hash)
                    if self._computed is not None:
                        self._computed.append(block_id)
                    canon.append(block_id)
                    canon_gen.append(blocks[block_id].gen)
            parent_hash = block_hash
            i += 1

    def _same_block(self, block_id: int, tokens: bytes, extras: bytes, link: int,
                    link_gen: int) -> bool:
        block = self._pool.blocks[block_id]
        return (block.parent == link and block.parent_gen == link_gen and block.tokens == tokens
                and block.extras == extras)

    @staticmethod
    def _cut(canon: list[int], canon_gen: list[int]) -> None:
        canon.append(NO_PARENT)
        canon_gen.append(0)

    def _encoded_extras(self, cache_salt: Optional[str]) -> tuple[bytes, bytes]:
        encoded = self._extras.get(cache_salt)
        if encoded is None:
            first, rest = request_extra_keys(cache_salt)
            encoded = (encode_extra_keys(first), encode_extra_keys(rest))
            if len(self._extras) >= _EXTRAS_CACHE_SIZE:
                self._extras.clear()
            self._extras[cache_salt] = encoded
        return encoded

    def _special(self, cache_salt: Optional[str], image_spans: Sequence[ImageSpan]) -> dict[int, bytes]:
        """The encoded keys of the blocks an image overlaps (none for a text-only request)."""
        try:
            return special_block_extras(cache_salt, image_spans, self.block_size)
        except ValueError as e:
            raise ValueError(f"image_spans: {e}") from None

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether num_blocks fresh blocks could be handed out now (free + evictable)."""
        if self._pins.may_expire:
            self.expire_pins()
        return self._pool.num_available >= num_blocks

    def num_blocks_needed(self, request_id: str, total_tokens: int) -> int:
        """Blocks to add so that request_id can hold total_tokens (copy-on-write not counted)."""
        req = self._requests.get(request_id)
        have = len(req.table) if req is not None else 0
        return max(0, -(-total_tokens // self.block_size) - have)

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] for a request without blocks)."""
        req = self._requests.get(request_id)
        return list(req.table) if req is not None else []

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    # --------------------------------------------------------------- lifecycle
    def free(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            if req.pending and req.pending[0][0] <= req.allocated_end:
                self._cache_partials(req, self._due_partials(req, req.allocated_end))
            # Tail first: under LRU a chain's tail is evicted before its head, which other
            # prompts are likelier to share.
            self._pool.release(reversed(req.table))

    def rewind(self, request_id: str, num_tokens: int) -> None:
        """Takes a request back to holding the K/V of its first num_tokens tokens, after a step
        that scheduled more of them failed: the blocks it registered for positions from
        num_tokens on leave the index (their K/V may never have been written) and the blocks
        past num_tokens go back to the pool. Blocks before num_tokens, and every hash another
        request registered, stay as they are."""
        req = self._requests.get(request_id)
        if req is None:
            raise ValueError(f"cannot rewind unknown request {request_id!r}")
        bs = self.block_size
        if not 0 <= num_tokens <= len(req.table) * bs:
            raise ValueError(f"request {request_id!r}: cannot rewind to {num_tokens} tokens with "
                             f"{len(req.table)} blocks")
        pool = self._pool
        blocks = pool.blocks
        keep_hashes = num_tokens // bs
        table, hashes = req.table, req.hashes
        for j in range(keep_hashes, len(hashes)):
            # Only this request's own registration at j is dropped: a block holding positions
            # at or past num_tokens was filled in the failed step, so nobody else can rely on it
            # except requests of that same step, which are rewound too.
            if blocks[table[j]].hash == hashes[j]:
                pool.uncache(table[j])
        del hashes[keep_hashes:]
        del req.canon[keep_hashes:]
        del req.canon_gen[keep_hashes:]
        req.allocated_end = num_tokens
        keep_blocks = -(-num_tokens // bs)
        released = table[keep_blocks:]
        del table[keep_blocks:]
        pool.release(reversed(released))

    def fork(self, parent_id: str, child_id: str) -> None:
        parent = self._requests.get(parent_id)
        if parent is None:
            raise ValueError(f"cannot fork unknown request {parent_id!r}")
        if child_id in self._requests:
            raise ValueError(f"cannot fork into {child_id!r}: that request already holds blocks")
        for block_id in parent.table:
            self._pool.share(block_id)
        self._requests[child_id] = parent.fork()

    # -------------------------------------------------------------------- pins
    def pin_prefix(self, token_ids: Sequence[int], *, cache_salt: Optional[str] = None,
                   num_tokens: Optional[int] = None,
                   ttl_s: Optional[float] = None, shorten: bool = False,
                   tenant: Optional[str] = None, exact: bool = False) -> PinInfo:
        """Pins the cached full blocks of token_ids' longest cached prefix (of its first
        num_tokens tokens if given), and with exact the partial block of a token-exact
        breakpoint at num_tokens when it is cached after them. Nothing cached: returns a PinInfo with pin_id None and no
        blocks, and pins nothing. Pinning a pinned prefix again refreshes its expiry, which only
        moves later unless shorten is set. A new pin counts against tenant's share
        (max_pinned_blocks_per_tenant); either cap raises PinLimitError."""
        if num_tokens is not None and (isinstance(num_tokens, bool)
                                       or not isinstance(num_tokens, int) or num_tokens < 0):
            raise ValueError(f"num_tokens must be None or an int >= 0, got {num_tokens!r}")
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be None or > 0 seconds, got {ttl_s!r}")
        self.expire_pins()
        limit = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
        ids: list[int] = []
        num_pinned = 0
        if self.enable_prefix_caching:
            extras_first, extras_rest = self._encoded_extras(cache_salt)
            self._walk(token_ids, limit // self.block_size, extras_first, extras_rest, ids, [])
            found = PrefixHit(ids, len(ids) * self.block_size)
            if exact and found.num_tokens == limit - limit % self.block_size:
                self._extend_to_breakpoint(found, token_ids, (limit,), limit,
                                           extras_rest if ids else extras_first)
            num_pinned = found.num_tokens
        expires_at = None if ttl_s is None else self._clock() + ttl_s
        if not ids:
            return PinInfo(None, [], 0, expires_at)
        key = tuple(ids)
        pin_id = self._pins.find(key)
        if pin_id is not None:
            return self._pins.refresh(pin_id, expires_at, shorten=shorten)
        self._pins.check_cap(key, tenant)
        for block_id in ids:
            self._pool.share(block_id)
        if self._pool.observer is not None:
            self._pool.observer.pinned(self._pool.blocks[b].hash for b in ids)
        return self._pins.add(key, num_pinned, expires_at, tenant)

    def unpin(self, pin_id: Optional[str]) -> bool:
        """Releases a pin; returns False (and does nothing) if no such pin lives, e.g. because
        it expired."""
        released = self._pins.remove(pin_id) if pin_id is not None else None
        if released is None:
            return False
        self._pool.release(reversed(released))
        return True

    def pins(self) -> list[PinInfo]:
        self.expire_pins()
        return self._pins.infos()

    def pin(self, pin_id: str) -> Optional[PinInfo]:
        """The pin of this id (None once it is unpinned, expired or reset), as of the last
        expire_pins(): a caller reading several pins expires once first, so none goes between reads."""
        return self._pins.info(pin_id)

    def watch_pin_removals(self, callback: Optional[Callable[[str], None]]) -> None:
        """callback(pin_id) runs whenever a pin goes: unpinned, expired or dropped by a reset."""
        self._pins.on_remove = callback

    def expire_pins(self) -> None:
        """Lets the pins whose time has come go (each call that reads pins does this first)."""
        if self._pins.may_expire:
            for released in self._pins.pop_expired(self._clock()):
                self._pool.release(reversed(released))

    # ------------------------------------------------------------ whole cache
    def reset_prefix_cache(self) -> int:
        """Drops every pin and every hash: cached free blocks become free-uncached and blocks in
        use stop being shareable. Returns how many hashes were dropped."""
        for released in self._pins.clear():
            self._pool.release(reversed(released))
        return self._pool.reset()

    def stats(self) -> KVCacheStats:
        self.expire_pins()
        pool, c = self._pool, self._counters
        return KVCacheStats(
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free,
            num_cached_free_blocks=pool.num_evictable,
            num_used_blocks=pool.num_blocks - pool.num_available,
            num_pinned_blocks=self._pins.num_pinned_blocks,
            num_cached_blocks=len(pool.index),
            num_requests=len(self._requests),
            queries=c.queries,
            query_tokens=c.query_tokens,
            hit_tokens=c.hit_tokens,
            recomputed_queries=c.recomputed_queries,
            recomputed_query_tokens=c.recomputed_query_tokens,
            recomputed_hit_tokens=c.recomputed_hit_tokens,
            evictions=pool.num_evictions,
            cow_copies=c.cow_copies,
            evictions_by_tenant={t: n for t, n in pool.evictions_of.items() if t is not None},
        )

    def watch(self, log) -> None:
        """Reports every hash the pool starts or stops holding to log (a KVEventLog), or stops
        reporting when log is None."""
        self._pool.observer = log

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash the pool holds now (a KV events snapshot)."""
        return list(self._pool.index)

    # ------------------------------------------------- stores beneath the pool
    def enable_store_journal(self, write_through: bool) -> None:
        """Starts recording evicted blocks (and, write_through, newly computed ones) for the
        KV stores to copy out (take_evicted, take_computed)."""
        self._pool.evicted = []
        self._computed = [] if write_through else None

    def disable_store_journal(self) -> None:
        self._pool.evicted = None
        self._computed = None

    def take_evicted(self) -> list[tuple[int, BlockMeta]]:
        """Blocks evicted since the last call, whose K/V are still in place until the next
        forward or load writes into them."""
        evicted, self._pool.evicted = self._pool.evicted or [], []
        # A breakpoint's partial block stays in the pool only: store lookups chain full blocks.
        return [(b, BlockMeta(h, parent, tok, extras)) for b, h, parent, tok, extras in evicted
                if not is_partial(tok, self.block_size)]

    def take_computed(self) -> list[tuple[int, BlockMeta]]:
        """Blocks registered as computed since the last call that still hold their hash."""
        ids, self._computed = self._computed or [], ([] if self._computed is not None else None)
        return self._metas(b for b in ids if self._pool.blocks[b].hash is not None)

    def discard_computed(self) -> None:
        """Forgets the journal of a step whose forward failed (its blocks were never written)."""
        if self._computed is not None:
            self._computed = []

    def cached_blocks(self) -> list[tuple[int, BlockMeta]]:
        """Every block in the hash index with what identifies its content."""
        blocks, bs = self._pool.blocks, self.block_size
        return self._metas(b for b in self._pool.index.values()
                           if not is_partial(blocks[b].tokens, bs))

    def _metas(self, ids) -> list[tuple[int, BlockMeta]]:
        blocks = self._pool.blocks
        return [(b, BlockMeta(blocks[b].hash, blocks[b].parent_hash, blocks[b].tokens,
                              blocks[b].extras)) for b in ids]

    def num_available_blocks(self) -> int:
        return self._pool.num_available

    def store_lookup(self, token_ids: Sequence[int], *, cache_salt: Optional[str] = None,
                     max_blocks: int, image_spans: Sequence[ImageSpan] = ()) -> StoreLookup:
        """The pool's hit for token_ids and up to max_blocks blocks after it (never the block
        holding the last token, which is always computed)."""
        extras_first, extras_rest = self._encoded_extras(cache_salt)
        special = self._special(cache_salt, image_spans)
        bs = self.block_size
        limit = (len(token_ids) - 1) // bs
        found = StoreLookup([], [])
        if not self.enable_prefix_caching:
            return found
        self._walk(token_ids, limit, extras_first, extras_rest, found.prefix_ids, found.prefix_gens, special)
        start = len(found.prefix_ids)
        # The walk returns blocks in the index, so the last one has its hash.
        last_hash = self._pool.blocks[found.prefix_ids[-1]].hash if start else None
        parent = last_hash if last_hash is not None else self.hasher.seed
        stop = min(limit, start + max(0, max_blocks))
        for i, (tok, h) in enumerate(self.hasher.iter_chain(
                parent, token_bytes(token_ids[start * bs:stop * bs]), bs, start,
                extras_first, extras_rest, special)):
            extras = extras_first if start + i == 0 else extras_rest
            found.candidates.append(BlockMeta(h, parent, tok, special.get(start + i, extras)))
            parent = h
        return found

    def import_blocks(self, lookup: StoreLookup, count: int) -> list[int]:
        """Allocates blocks for the first `count` candidates of a lookup (their records were
        verified against them), registers them in the index after the lookup's pool hit and
        leaves them cached and free, so the request's own lookup finds them. Returns their
        ids, in chain order: the caller writes their K/V before the next forward. The blocks
        this evicts are in take_evicted()."""
        pool = self._pool
        blocks, index = pool.blocks, pool.index
        for b, g in zip(lookup.prefix_ids, lookup.prefix_gens):
            if blocks[b].gen != g:
                raise ValueError("the lookup is stale: import in the same step as the lookup")
        count = max(0, min(count, len(lookup.candidates),
                           pool.num_available_for(None, lookup.prefix_ids)))
        if count == 0:
            return []
        # Held while allocating, so making room never evicts the chain being extended.
        for b in lookup.prefix_ids:
            pool.share(b)
        fresh = pool.allocate(count, 0)
        prev, prev_gen = ((lookup.prefix_ids[-1], blocks[lookup.prefix_ids[-1]].gen)
                          if lookup.prefix_ids else (NO_PARENT, 0))
        imported = []
        for meta, b in zip(lookup.candidates, fresh):
            existing = index.get(meta.block_hash)
            if existing is not None:
                if blocks[existing].ref > 0:
                    break   # a colliding block in use keeps its place
                pool.uncache(existing)
            pool.register(b, meta.block_hash, meta.tokens, meta.extras, prev, prev_gen,
                          meta.parent_hash)
            imported.append(b)
            prev, prev_gen = b, blocks[b].gen
        # Tail first, as a request's free: under LRU the chain's tail goes before its head.
        pool.release(reversed(fresh))
        pool.release(reversed(lookup.prefix_ids))
        return imported

    def forget_blocks(self, block_ids: Sequence[int]) -> None:
        """Drops imported blocks from the index again (their K/V could not be written)."""
        for b in block_ids:
            if self._pool.blocks[b].hash is not None:
                self._pool.uncache(b)

    def eviction_order(self) -> list[int]:
        """Free-cached blocks, next to be evicted first (for tests and diagnostics)."""
        return self._pool.policy.order()

    def check_integrity(self) -> None:
        """Raises AssertionError naming the first violated invariant."""
        check_integrity(self._pool, self._requests, self._pins.pin_counts(), self.hasher,
                        self.block_size)
