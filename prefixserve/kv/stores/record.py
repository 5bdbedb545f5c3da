"""The stored form of one KV block, and its verification.

    magic "PSKV" | u16 format version | u32 header length | header | payload | checksum

header: scope digest, block hash, parent hash, token ids, extra keys (each u32-length
prefixed), u64 payload length. payload: the block's K and V for every layer, in the scope's
layout. checksum: XXH3-128 over everything before it, or, in a store given a MAC key, a keyed
BLAKE2b-128 over the same bytes (mac.py): same size, so records differ only in who could
have written them. A reader knows the block it expects, so
it knows the whole head and the record's size before reading: it reads the payload straight
into the pool's memory and accepts the record only if its size and head are exactly the
expected ones and the checksum matches, so a truncated, corrupted, stale or colliding record
is a miss.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Sequence

import xxhash

from prefixserve.kv.stores.mac import TAG_BYTES, RecordMac
from prefixserve.kv.stores.scope import FORMAT_VERSION

MAGIC = b"PSKV"
_PREAMBLE = struct.Struct("<4sHI")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
CHECKSUM_BYTES = TAG_BYTES


class RecordError(Exception):
    """A stored record that must not be used; `reason` is a short word for the counters."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class BlockMeta:
    """What identifies a block's content: its chained hash and what the hash was made of."""
    block_hash: bytes
    parent_hash: bytes
    tokens: bytes     # token ids as kv.hashing.token_bytes
    extras: bytes     # encoded extra keys (kv.hashing.encode_extra_keys)


def encode_head(scope_digest: bytes, meta: BlockMeta, payload_len: int) -> bytes:
    """Everything before the payload: what a reader expecting `meta` compares byte for byte."""
    fields = (scope_digest, meta.block_hash, meta.parent_hash, meta.tokens, meta.extras)
    header = b"".join(_U32.pack(len(f)) + f for f in fields) + _U64.pack(payload_len)
    return _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header)) + header


def seal(parts: Sequence, mac: Optional[RecordMac] = None) -> bytes:
    """The record's last field over `parts` (everything before it): the checksum, or the MAC
    under a store's key."""
    if mac is not None:
        return mac.tag(parts)
    digest = xxhash.xxh3_128()
    for p in parts:
        digest.update(p)
    return digest.digest()


def encode_parts(scope_digest: bytes, meta: BlockMeta, payload,
                 mac: Optional[RecordMac] = None) -> tuple[bytes, memoryview, bytes]:
    """(head, payload, checksum or MAC): written one after the other they form the record, so
    a large payload is never copied to be framed."""
    body = memoryview(payload).cast("B")
    head = encode_head(scope_digest, meta, body.nbytes)
    return head, body, seal((head, body), mac)


def encode(scope_digest: bytes, meta: BlockMeta, payload, mac: Optional[RecordMac] = None) -> bytes:
    return b"".join(encode_parts(scope_digest, meta, payload, mac))


def reseal(record, old: Optional[RecordMac], new: Optional[RecordMac]) -> Optional[tuple]:
    """A whole record moving from a store sealed with `old` to one sealed with `new` (a
    spill): its parts under the new seal, or None when it does not verify under the old one,
    so a record forged in one store is never vouched for by the next store's key."""
    view = memoryview(record).cast("B")
    if old == new:
        return (view,)
    body, last = view[:-CHECKSUM_BYTES], view[-CHECKSUM_BYTES:]
    if view.nbytes <= CHECKSUM_BYTES or seal((body,), old) != last:
        return None
    return body, seal((body,), new)


def verify(expected_head: bytes, size: int, head, payload: Sequence, checksum,
           mac: Optional[RecordMac] = None) -> None:
    """Checks a record read as its parts against the head a reader expects (encode_head): a
    record of `size` bytes whose head equals it byte for byte (the same scope, hash, parent,
    tokens, extra keys and payload length) and whose checksum (MAC, with `mac`) covers head
    and payload. Raises RecordError otherwise ("forged" for a MAC that does not match); the
    parts may hold anything then."""
    payload_len = sum(memoryview(p).nbytes for p in payload)
    if size != len(expected_head) + payload_len + CHECKSUM_BYTES:
        raise RecordError("size", f"{size} bytes, the expected block's record has "
                          f"{len(expected_head) + payload_len + CHECKSUM_BYTES}")
    head = memoryview(head).cast("B")
    if head != expected_head:
        magic, version, _ = _PREAMBLE.unpack_from(head, 0)
        if magic != MAGIC:
            raise RecordError("corrupt", "bad magic")
        if version != FORMAT_VERSION:
            raise RecordError("version", f"format version {version}, this build reads "
                              f"{FORMAT_VERSION}")
        raise RecordError("mismatch", "scope, hash, parent, tokens or extra keys differ")
    if seal((head, *payload), mac) != memoryview(checksum).cast("B"):
        if mac is not None:
            raise RecordError("forged", f"MAC mismatch under the key from {mac.source}: "
                              "written without it, with another key, or altered")
        raise RecordError("checksum", "checksum mismatch")
