"""Private and tamper-evident stores, without a model: a file store's modes whatever the umask,
the directories it refuses, and records sealed with a MAC key (forged ones refused, counted,
and never vouched for by the next store's key when they spill).

The forger below knows the record format (it is documented) and has write access to the
store, but not the key: it builds records with xxhash and struct alone.
"""
from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import pytest
import xxhash

from prefixserve.kv.hashing import BlockHasher, encode_extra_keys, token_bytes
from prefixserve.kv.stores import (BlockMeta, KeyScope, RecordError, StoreChain, StoreError,
                                   open_store, parse_store_url)
from prefixserve.kv.stores.record import encode, encode_head, verify

SCOPE = KeyScope(weights_digest="w0", kv_dtype="float32", block_size=4, kv_layout="L2x[K,V]x4x1x2",
                 hash_algo="xxh3_64")
PAYLOAD = bytes(range(64))


def metas_of(tokens: list[int]) -> list[BlockMeta]:
    hasher = BlockHasher("xxh3_64", "m")
    metas, parent = [], hasher.seed
    for i, h in enumerate(hasher.hash_prompt(tokens, 4)):
        metas.append(BlockMeta(h, parent, token_bytes(tokens[i * 4:(i + 1) * 4]), encode_extra_keys(())))
        parent = h
    return metas


def load(chain: StoreChain, metas: list[BlockMeta]) -> list[bytes]:
    bufs = [bytearray(len(PAYLOAD)) for _ in metas]
    n = chain.load_into(metas, lambda k: [[memoryview(b)] for b in bufs[:k]])
    return [bytes(b) for b in bufs[:n]]


def forge(record: bytes, payload: bytes) -> bytes:
    """What a writer without the key can make of a record: any payload, checksum recomputed."""
    (header_len,) = struct.unpack_from("<I", record, 6)
    head = record[:10 + header_len]
    return head + payload + xxhash.xxh3_128(head + payload).digest()


@pytest.fixture
def key_file(tmp_path) -> str:
    path = tmp_path / "kv.key"
    path.write_bytes(os.urandom(32).hex().encode() + b"\n")
    path.chmod(0o600)
    return str(path)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_a_file_store_is_private_whatever_the_umask(tmp_path, umask) -> None:
    root = tmp_path / "new" / "store"
    old = os.umask(umask)
    try:
        store = open_store(f"file://{root}")
        meta = metas_of(list(range(8)))[0]
        chain = StoreChain([store], SCOPE)
        chain.write(meta, PAYLOAD)
    finally:
        os.umask(old)
    record = root / SCOPE.name / f"{meta.block_hash.hex()}.kvb"
    assert mode(tmp_path / "new") == mode(root) == mode(root / SCOPE.name) == 0o700
    assert mode(record) == 0o600
    assert load(chain, [meta]) == [PAYLOAD]


def test_a_scope_directory_left_open_by_an_older_build_is_closed_at_start(tmp_path) -> None:
    scope_dir = tmp_path / SCOPE.name
    scope_dir.mkdir(mode=0o755)
    scope_dir.chmod(0o755)
    open_store(f"file://{tmp_path}")
    assert mode(scope_dir) == 0o700


@pytest.mark.parametrize("bits", [0o020, 0o002, 0o1777])
def test_a_directory_others_can_write_is_refused(tmp_path, bits) -> None:
    tmp_path.chmod(0o700 | bits)
    with pytest.raises(StoreError, match="other users can write"):
        open_store(f"file://{tmp_path}")
    (tmp_path / "inner").mkdir()
    tmp_path.chmod(0o700)
    (tmp_path / "inner").chmod(0o700 | bits)
    with pytest.raises(StoreError, match="other users can write"):
        open_store(f"file://{tmp_path}")   # a scope directory someone opened up


def test_a_directory_another_user_owns_is_refused(tmp_path) -> None:
    if os.geteuid() == 0:
        other = tmp_path / "theirs"
        other.mkdir(mode=0o700)
        os.chown(other, 65534, 65534)
    else:
        other = Path("/")   # root's
    with pytest.raises(StoreError, match="owned by uid"):
        open_store(f"file://{other}")


def test_a_mac_key_is_never_taken_from_the_command_line(key_file) -> None:
    with pytest.raises(ValueError, match="never given on the command line") as err:
        parse_store_url("redis://h:6379/0?mac_key=s3cr3t-s3cr3t-s3cr3t")
    assert "s3cr3t" not in str(err.value)
    for bad in ("mem://?mac_key_file=/k", f"file:///x?mac_key_file={key_file}&mac_key_env=K",
                "file:///x?mac_key_file=rel/path", "file:///x?mac_key_env="):
        with pytest.raises(ValueError):
            parse_store_url(bad)
    spec = parse_store_url(f"redis://h:6379/0?mac_key_file={key_file}&timeout=1")
    assert spec.mac_key_file == key_file and "mac_key" not in spec.redis_url


def test_a_missing_short_or_readable_key_is_an_error_at_start(tmp_path, key_file, monkeypatch) -> None:
    monkeypatch.delenv("PS_TEST_KV_KEY", raising=False)
    with pytest.raises(ValueError, match="PS_TEST_KV_KEY is not set"):
        open_store(f"file://{tmp_path}/s?mac_key_env=PS_TEST_KV_KEY")
    monkeypatch.setenv("PS_TEST_KV_KEY", "short")
    with pytest.raises(ValueError, match="needs at least 16"):
        open_store(f"file://{tmp_path}/s?mac_key_env=PS_TEST_KV_KEY")
    os.chmod(key_file, 0o644)
    with pytest.raises(ValueError, match="other users can read it"):
        open_store(f"file://{tmp_path}/s?mac_key_file={key_file}")
    with pytest.raises(ValueError, match="cannot read"):
        open_store(f"file://{tmp_path}/s?mac_key_file={tmp_path}/absent")
    os.chmod(key_file, 0o600)
    assert repr(open_store(f"file://{tmp_path}/s?mac_key_file={key_file}").mac) == \
        f"RecordMac(from file {key_file})"


def test_a_record_sealed_with_a_key_verifies_only_under_that_key(key_file, monkeypatch) -> None:
    meta = metas_of(list(range(8)))[1]
    mac = open_store(f"file://{os.path.dirname(key_file)}/a?mac_key_file={key_file}").mac
    monkeypatch.setenv("PS_TEST_KV_KEY", "another key, long enough")
    other = open_store(f"file://{os.path.dirname(key_file)}/b?mac_key_env=PS_TEST_KV_KEY").mac
    head = encode_head(SCOPE.digest, meta, len(PAYLOAD))
    sealed = encode(SCOPE.digest, meta, PAYLOAD, mac)
    plain = encode(SCOPE.digest, meta, PAYLOAD)
    assert len(sealed) == len(plain) and sealed[:-16] == plain[:-16]

    def check(record: bytes, key) -> None:
        verify(head, len(record), record[:len(head)], [record[len(head):-16]], record[-16:], key)

    check(sealed, mac)
    for record, key in ((plain, mac), (sealed, other), (sealed, None),
                        (forge(sealed, PAYLOAD[::-1]), mac)):
        with pytest.raises(RecordError) as err:
            check(record, key)
        assert err.value.reason == ("forged" if key is not None else "checksum")
    flipped = bytearray(sealed)
    for i in range(len(sealed)):   # every byte, the key and hash in the head included
        flipped[i] ^= 1
        with pytest.raises(RecordError):
            check(bytes(flipped), mac)
        flipped[i] ^= 1


@pytest.mark.parametrize("kind", ["file", "redis"])
def test_a_forged_record_is_a_miss_counted_and_deleted(tmp_path, key_file, kind, request) -> None:
    url = f"file://{tmp_path / 'store'}" if kind == "file" else \
        request.getfixturevalue("redis_server").url
    metas = metas_of(list(range(16)))
    store = open_store(f"{url}?mac_key_file={key_file}")
    chain = StoreChain([store], SCOPE)
    for m in metas:
        chain.write(m, PAYLOAD)
    assert load(chain, metas) == [PAYLOAD] * len(metas)
    # Someone with write access but not the key replaces the third block's record.
    key = SCOPE.key(metas[2].block_hash)
    store.put(key, (forge(bytes(store.get(key)), bytes(len(PAYLOAD))),))
    assert load(chain, metas) == [PAYLOAD] * 2
    st = chain.stats()[0]
    assert (st.rejected, st.forged, st.hits) == (1, 1, len(metas) + 2)
    assert store.contains([key]) == [False]


def test_a_forged_record_spilling_down_is_not_sealed_by_the_next_store(tmp_path, key_file,
                                                                       monkeypatch) -> None:
    monkeypatch.setenv("PS_TEST_KV_KEY", "a second key, for the lower store")
    metas = metas_of(list(range(24)))
    size = len(encode(SCOPE.digest, metas[0], PAYLOAD))
    top = open_store(f"file://{tmp_path / 'top'}?size={3 * size}&mac_key_file={key_file}")
    below = open_store(f"file://{tmp_path / 'below'}?mac_key_env=PS_TEST_KV_KEY")
    chain = StoreChain([top, below], SCOPE)
    chain.write(metas[0], PAYLOAD)
    key = SCOPE.key(metas[0].block_hash)
    top.put(key, (forge(bytes(top.get(key)), bytes(len(PAYLOAD))),))
    for m in metas[1:]:
        chain.write(m, PAYLOAD)   # pushes the forged record out of the top store
    assert below.contains([key]) == [False] and top.contains([key]) == [False]
    assert below.usage()[0] == len(metas) - 4
    a, b = chain.stats()
    assert (a.rejected, a.forged) == (1, 1)
    assert load(chain, metas) == []
    assert load(chain, metas[1:]) == [PAYLOAD] * (len(metas) - 1)
    # The honest records moved down were resealed under the lower store's key.
    a, b = chain.stats()
    assert b.hits == len(metas) - 4 and b.rejected == 0
