"""The stored form of one KV block, and its verification.

    magic "PSKV" | u16 format version | u32 header length | header | payload | checksum

header: scope digest, block hash, parent hash, token ids, extra keys (each u32-length
prefixed), u64 payload length. payload: the block's K and V for every layer, in the scope's
layout. checksum: XXH3-128 over everything before it. A record is accepted only if every
part checks out against what the reader expects (scope, hash, parent, tokens, extra keys,
payload size) and the checksum matches, so a truncated, corrupted, stale or colliding record
is a miss.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import xxhash

from prefixserve.kv.stores.scope import FORMAT_VERSION

MAGIC = b"PSKV"
_PREAMBLE = struct.Struct("<4sHI")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
CHECKSUM_BYTES = 16


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


def encode_parts(scope_digest: bytes, meta: BlockMeta, payload) -> tuple[bytes, memoryview, bytes]:
    """(head, payload, checksum): written one after the other they form the record, so a
    large payload is never copied to be framed."""
    body = memoryview(payload).cast("B")
    fields = (scope_digest, meta.block_hash, meta.parent_hash, meta.tokens, meta.extras)
    header = b"".join(_U32.pack(len(f)) + f for f in fields) + _U64.pack(body.nbytes)
    head = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header)) + header
    digest = xxhash.xxh3_128()
    digest.update(head)
    digest.update(body)
    return head, body, digest.digest()


def encode(scope_digest: bytes, meta: BlockMeta, payload) -> bytes:
    return b"".join(encode_parts(scope_digest, meta, payload))


def decode(data, scope_digest: bytes, expected: BlockMeta,
           payload_bytes: Optional[int] = None) -> memoryview:
    """The payload of a record that matches `expected` in every part; RecordError otherwise."""
    view = memoryview(data).cast("B")
    if view.nbytes < _PREAMBLE.size + CHECKSUM_BYTES:
        raise RecordError("truncated", f"{view.nbytes} bytes")
    magic, version, header_len = _PREAMBLE.unpack_from(view, 0)
    if magic != MAGIC:
        raise RecordError("corrupt", "bad magic")
    if version != FORMAT_VERSION:
        raise RecordError("version", f"format version {version}, this build reads {FORMAT_VERSION}")
    pos = _PREAMBLE.size
    end = pos + header_len
    if end + CHECKSUM_BYTES > view.nbytes:
        raise RecordError("truncated", "header runs past the end")
    fields = []
    for _ in range(5):
        if pos + 4 > end:
            raise RecordError("corrupt", "header fields run past the header")
        (n,) = _U32.unpack_from(view, pos)
        pos += 4
        if pos + n > end:
            raise RecordError("corrupt", "header fields run past the header")
        fields.append(view[pos:pos + n].tobytes())
        pos += n
    if pos + 8 != end:
        raise RecordError("corrupt", "header length mismatch")
    (payload_len,) = _U64.unpack_from(view, pos)
    if end + payload_len + CHECKSUM_BYTES != view.nbytes:
        raise RecordError("truncated", f"{view.nbytes} bytes, the header says "
                          f"{end + payload_len + CHECKSUM_BYTES}")
    digest = xxhash.xxh3_128()
    digest.update(view[:end + payload_len])
    if digest.digest() != view[end + payload_len:].tobytes():
        raise RecordError("checksum", "checksum mismatch")
    scope, block_hash, parent_hash, tokens, extras = fields
    if scope != scope_digest:
        raise RecordError("scope", "record of another key scope")
    if (block_hash, parent_hash, tokens, extras) != (expected.block_hash, expected.parent_hash,
                                                     expected.tokens, expected.extras):
        raise RecordError("mismatch", "hash, parent, tokens or extra keys differ")
    if payload_bytes is not None and payload_len != payload_bytes:
        raise RecordError("mismatch", f"payload of {payload_len} bytes, expected {payload_bytes}")
    return view[end:end + payload_len]
