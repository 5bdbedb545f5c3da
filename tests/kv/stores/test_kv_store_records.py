"""Store records, key scopes, URLs and the store clients, without a model.

The oracle for records is the record's own content: every single-byte change and every
truncation of a valid record must be refused, and only the exact expected block is accepted.
"""
from __future__ import annotations

import dataclasses
import os
import threading

import pytest

from prefixserve.kv.hashing import BlockHasher, encode_extra_keys, token_bytes
from prefixserve.kv.stores import (BackgroundWriter, BlockMeta, KeyScope, RecordError, StoreChain,
                                   open_store, parse_size, parse_store_url)
from prefixserve.kv.stores.mem import MemStore
from prefixserve.kv.stores.file import FileStore
from prefixserve.kv.stores.record import encode, encode_head, verify

SCOPE = KeyScope(weights_digest="w0", kv_dtype="float32", block_size=4, kv_layout="L2x[K,V]x4x1x2",
                 hash_algo="xxh3_64")


def chain_metas(tokens: list[int], block_size: int = 4, salt: str | None = None) -> list[BlockMeta]:
    hasher = BlockHasher("xxh3_64", "m")
    hashes = hasher.hash_prompt(tokens, block_size, cache_salt=salt)
    first = encode_extra_keys((("salt", salt),) if salt else ())
    metas, parent = [], hasher.seed
    for i, h in enumerate(hashes):
        metas.append(BlockMeta(h, parent, token_bytes(tokens[i * block_size:(i + 1) * block_size]),
                               first if i == 0 else encode_extra_keys(())))
        parent = h
    return metas


def decode(record: bytes, scope_digest: bytes, meta: BlockMeta, payload_len: int) -> bytes:
    """The payload of a record as a reader expecting `meta` takes it: split where the expected
    head ends (a store only reads a record of the expected size), then verified."""
    n = len(encode_head(scope_digest, meta, payload_len))
    payload = record[n:n + payload_len]
    verify(encode_head(scope_digest, meta, payload_len), len(record), record[:n], [payload],
           record[n + payload_len:])
    return payload


def load(chain: StoreChain, metas: list[BlockMeta], payload_len: int) -> list[bytes]:
    """The payloads chain.load_into serves, each read into two separate buffers (a pool's K
    and V are not adjacent)."""
    half = payload_len // 2
    bufs = [(bytearray(half), bytearray(payload_len - half)) for _ in metas]
    targets = [[memoryview(a), memoryview(b)] for a, b in bufs]
    n = chain.load_into(metas, lambda k: targets[:k])
    return [bytes(a + b) for a, b in bufs[:n]]


def test_a_record_round_trips_and_every_byte_is_covered() -> None:
    meta = chain_metas(list(range(8)))[1]
    payload = bytes(range(64))
    record = encode(SCOPE.digest, meta, payload)
    assert bytes(decode(record, SCOPE.digest, meta, len(payload))) == payload
    for i in range(len(record)):
        bad = bytearray(record)
        bad[i] ^= 0x01
        with pytest.raises(RecordError):
            decode(bytes(bad), SCOPE.digest, meta, len(payload))
    for n in range(len(record)):
        with pytest.raises(RecordError):
            decode(record[:n], SCOPE.digest, meta, len(payload))
    with pytest.raises(RecordError):
        decode(record + b"\0", SCOPE.digest, meta, len(payload))


def test_a_record_is_refused_for_any_other_block_or_scope() -> None:
    a, b = chain_metas(list(range(8)))
    payload = b"\x07" * 16
    record = encode(SCOPE.digest, b, payload)
    others = [
        BlockMeta(a.block_hash, b.parent_hash, b.tokens, b.extras),   # other hash
        BlockMeta(b.block_hash, b"\0" * 8, b.tokens, b.extras),        # other parent
        BlockMeta(b.block_hash, b.parent_hash, token_bytes([9, 9, 9, 9]), b.extras),
        BlockMeta(b.block_hash, b.parent_hash, b.tokens, encode_extra_keys((("salt", "t"),))),
    ]
    for other in others:
        # A head of another length shows as another size before any byte is compared.
        with pytest.raises(RecordError, match="mismatch|size"):
            decode(record, SCOPE.digest, other, len(payload))
    with pytest.raises(RecordError, match="size"):
        decode(record, SCOPE.digest, b, len(payload) + 1)
    other_scope = KeyScope(**{**vars(SCOPE), "weights_digest": "w1"})
    with pytest.raises(RecordError, match="mismatch"):
        decode(record, other_scope.digest, b, len(payload))


def test_a_record_of_another_format_version_is_refused_even_when_intact() -> None:
    import struct

    import xxhash

    meta = chain_metas(list(range(8)))[0]
    record = bytearray(encode(SCOPE.digest, meta, b"\x05" * 16))
    struct.pack_into("<H", record, 4, 2)            # version 2, checksum made to match
    record[-16:] = xxhash.xxh3_128(bytes(record[:-16])).digest()
    with pytest.raises(RecordError, match="version"):
        decode(bytes(record), SCOPE.digest, meta, 16)


@pytest.mark.parametrize("kind", ["mem", "file"])
def test_the_stores_read_path_refuses_every_flip_and_truncation(tmp_path, kind: str) -> None:
    """Through a store's own read (a file store's scattered read into separate buffers), every
    single-byte change and every truncation of a record is a miss, deleted and counted."""
    meta = chain_metas(list(range(8)))[1]
    payload = bytes(range(64))
    record = encode(SCOPE.digest, meta, payload)
    store = open_store("mem://" if kind == "mem" else f"file://{tmp_path}")
    chain = StoreChain([store], SCOPE)
    store.put(SCOPE.key(meta.block_hash), (record,))
    assert load(chain, [meta], len(payload)) == [payload]
    damaged = [bytes(record[:i]) + bytes([record[i] ^ 0x01]) + bytes(record[i + 1:])
               for i in range(len(record))]
    damaged += [bytes(record[:n]) for n in range(len(record))] + [bytes(record) + b"\0"]
    for bad in damaged:
        store.put(SCOPE.key(meta.block_hash), (bad,))
        assert load(chain, [meta], len(payload)) == []
        assert store.usage()[0] == 0     # a refused record is deleted
    assert chain.stats()[0].rejected == len(damaged)


def test_every_part_of_the_scope_changes_its_digest() -> None:
    changes = dict(weights_digest="w1", kv_dtype="bfloat16", block_size=8, kv_layout="other",
                   hash_algo="sha256", format_version=2)
    digests = {SCOPE.digest}
    for field, value in changes.items():
        digests.add(KeyScope(**{**vars(SCOPE), field: value}).digest)
    assert len(digests) == 1 + len(changes)


@pytest.mark.parametrize("url, scheme, size", [
    ("mem://?size=8GiB", "mem", 8 * 2**30), ("mem://", "mem", 2**30),
    ("file:///tmp/x?size=100MB", "file", 100 * 10**6), ("file:///tmp/x", "file", None),
    ("redis://localhost:6379/0", "redis", None), ("redis://:pw@h:1/2?timeout=0.2", "redis", None),
])
def test_store_urls_parse(url: str, scheme: str, size) -> None:
    spec = parse_store_url(url)
    assert (spec.scheme, spec.size) == (scheme, size)
    assert "pw" not in spec.display


@pytest.mark.parametrize("url", [
    "", "ftp://x", "mem://host", "mem://?size=-1", "mem://?size=12XB", "mem://?color=red",
    "file://relative/dir", "file:///x?mode=1", "redis://", "redis://h?size=1GiB",
    "redis://h?timeout=0", "redis://h?timeout=abc",
])
def test_bad_store_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        parse_store_url(url)


def test_sizes() -> None:
    assert parse_size("1") == 1 and parse_size("2KiB") == 2048 and parse_size("1.5GB") == 1_500_000_000


def test_a_full_memory_store_spills_its_oldest_records_into_the_next_store(tmp_path) -> None:
    metas = chain_metas(list(range(40)))
    payload = b"\x01" * 100
    size = len(encode(SCOPE.digest, metas[0], payload))
    mem = open_store(f"mem://?size={3 * size}")
    disk = open_store(f"file://{tmp_path}")
    chain = StoreChain([mem, disk], SCOPE)
    for m in metas:
        chain.write(m, payload)
    assert mem.usage() == (3, 3 * size)
    assert disk.usage()[0] == len(metas) - 3
    # Every block is still served, in chain order, from one store or the other.
    assert load(chain, metas, len(payload)) == [payload] * len(metas)
    stats = chain.stats()
    assert stats[0].hits == 3 and stats[1].hits == len(metas) - 3


class _WatchedFileStore(FileStore):
    """A file store that asks, as each record arrives, whether the chain above it can still
    serve that record (it is on its way down: a lookup now must not miss it)."""

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.chain: StoreChain | None = None
        self.unseen: list[str] = []

    def put(self, key, parts, spill=False):
        block_hash = next(m.block_hash for m in self.metas if SCOPE.key(m.block_hash) == key)
        if self.chain.holds([block_hash]) != [0]:
            self.unseen.append(key)
        return super().put(key, parts, spill)


@pytest.mark.parametrize("upper", ["mem", "file"])
def test_a_record_spilling_down_is_found_all_the_way(tmp_path, upper) -> None:
    metas = chain_metas(list(range(30)))
    payload = b"\x05" * 100
    size = len(encode(SCOPE.digest, metas[0], payload))
    top = open_store(f"mem://?size={3 * size}" if upper == "mem"
                     else f"file://{tmp_path / 'top'}?size={3 * size}")
    below = _WatchedFileStore(parse_store_url(f"file://{tmp_path / 'below'}"))
    chain = StoreChain([top, below], SCOPE)
    below.chain, below.metas = chain, metas
    for m in metas:
        chain.write(m, payload)
    assert below.usage()[0] == len(metas) - 3 and not below.unseen
    assert top.usage() == (3, 3 * size)   # what moved down has left the store above
    assert chain.holds([m.block_hash for m in metas]) == [1] * (len(metas) - 3) + [0] * 3
    assert load(chain, metas, len(payload)) == [payload] * len(metas)


def test_a_file_store_indexes_its_directory_without_reading_blocks(tmp_path, monkeypatch) -> None:
    import builtins

    metas = chain_metas(list(range(16)))
    store = open_store(f"file://{tmp_path}")
    chain = StoreChain([store], SCOPE)
    for m in metas:
        chain.write(m, b"\x02" * 32)
    assert len(list(tmp_path.rglob("*.kvb"))) == len(metas)
    opened = []
    real_open, real_os_open = builtins.open, os.open

    def spy_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_open(path, *args, **kwargs)

    def spy_os_open(path, *args, **kwargs):
        opened.append(str(path))
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy_open)
    monkeypatch.setattr(os, "open", spy_os_open)
    reopened = open_store(f"file://{tmp_path}")
    monkeypatch.undo()
    assert not [p for p in opened if p.endswith(".kvb")]
    assert reopened.usage() == store.usage()
    assert reopened.contains([SCOPE.key(m.block_hash) for m in metas]) == [True] * len(metas)


def test_a_file_store_over_its_size_deletes_its_oldest_records(tmp_path) -> None:
    metas = chain_metas(list(range(40)))
    size = len(encode(SCOPE.digest, metas[0], b"\x03" * 50))
    store = open_store(f"file://{tmp_path}?size={4 * size}")
    chain = StoreChain([store], SCOPE)
    for m in metas:
        chain.write(m, b"\x03" * 50)
    assert store.usage() == (4, 4 * size)
    assert len(list(tmp_path.rglob("*.kvb"))) == 4
    assert chain.holds([m.block_hash for m in metas]) == [None] * 6 + [0] * 4


class _GatedMemStore(MemStore):
    """A memory store whose writes wait for a gate, to hold the writer busy."""

    def __init__(self, spec, gate: threading.Event) -> None:
        super().__init__(spec)
        self.gate = gate

    def put(self, key, parts, spill=False):
        # the bound only keeps a failed test from hanging: a write let through early by it would make
        # the checks of what is still queued fail on a machine slow enough to take that long
        self.gate.wait(300)
        return super().put(key, parts, spill)


def test_the_writer_drops_and_counts_when_its_queue_is_full() -> None:
    gate = threading.Event()
    store = _GatedMemStore(parse_store_url("mem://?size=1MiB"), gate)
    chain = StoreChain([store], SCOPE)
    writer = BackgroundWriter(chain, max_queue_bytes=250)
    metas = chain_metas(list(range(40)))
    accepted = [writer.submit(m, b"\x04" * 100, 100) for m in metas]
    gate.set()
    writer.close(timeout=120)
    # One block may be in the writer's hands, two more fit the queue; the rest are dropped.
    assert 2 <= sum(accepted) <= 3
    assert chain.stats()[0].dropped_writes == len(metas) - sum(accepted)
    assert store.usage()[0] == sum(accepted)


def test_blocks_queued_for_the_writer_are_found_before_they_are_written() -> None:
    gate = threading.Event()
    store = _GatedMemStore(parse_store_url("mem://?size=1MiB"), gate)
    chain = StoreChain([store], SCOPE)
    writer = BackgroundWriter(chain, max_queue_bytes=450)
    metas = chain_metas(list(range(32)))
    payloads = [bytes([i + 1]) * 100 for i in range(len(metas))]
    accepted = [writer.submit(m, p, 100) for m, p in zip(metas, payloads)]
    queued = 4   # 450 bytes take four (the one the writer holds counts until written)
    assert accepted == [True] * queued + [False] * (len(metas) - queued)
    assert store.usage()[0] == 0   # nothing written yet: the gate holds the writer
    assert chain.holds([m.block_hash for m in metas]) == [0] * queued + [None] * (len(metas) - queued)
    assert load(chain, metas, 100) == payloads[:queued]
    gate.set()
    writer.close(timeout=120)
    assert store.usage()[0] == queued and not chain._staged
    assert load(chain, metas, 100) == payloads[:queued]
    # Staged under the same hash but another meta: never served for this one.
    chain.stage(dataclasses.replace(metas[0], tokens=metas[1].tokens), payloads[7])
    assert load(chain, [metas[0]], 100) == [payloads[0]]   # the stored record, not the staged


def test_a_refused_record_is_served_by_the_next_store_that_holds_it(tmp_path):
    metas = chain_metas(list(range(24)))
    payloads = [bytes([i]) * 64 for i in range(len(metas))]
    fast, slow = open_store(f"file://{tmp_path / 'a'}"), open_store(f"file://{tmp_path / 'b'}")
    for store in (fast, slow):
        solo = StoreChain([store], SCOPE)
        for m, p in zip(metas, payloads):
            solo.write(m, p)
    damaged = tmp_path / "a" / SCOPE.name / f"{metas[2].block_hash.hex()}.kvb"
    damaged.write_bytes(damaged.read_bytes()[:-1] + b"\xff")
    chain = StoreChain([fast, slow], SCOPE)
    assert load(chain, metas, 64) == payloads
    a, b = chain.stats()
    assert (a.hits, a.rejected, b.hits) == (len(metas) - 1, 1, 1)
    assert not damaged.exists()
