"""Stores sealed with a MAC key, end to end on the tiny Qwen3 checkpoint (greedy, float32),
against a real directory and a real redis-server.

The attack: someone who can write to the store but has no key rewrites every record with its
K/V negated and the checksum recomputed (the format is public). Without a key the engine
takes those blocks and its outputs change (so the forgery matters); with the key each one is
refused and counted, the engine recomputes, and its outputs equal caching off. Records the
engine then writes with the key are hits for the next engine with that key.
"""
from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash

from kv_store_helpers import BLOCK, PARAMS, blocks_cached_after, documents, full_blocks, reference
from prefixserve import LLM

REDIS_PREFIX = "prefixserve:kv:"


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> str:
    return str(tiny_checkpoint("qwen3"))


@pytest.fixture(scope="module")
def docs() -> list[list[int]]:
    return documents(3, 100, seed=11)


@pytest.fixture(scope="module")
def want(docs, model) -> list[list[int]]:
    return reference(docs, model)


def forged(record: bytes) -> bytes:
    """The record with its float32 K/V negated and an XXH3-128 checksum that matches."""
    (header_len,) = struct.unpack_from("<I", record, 6)
    head = record[:10 + header_len]
    payload = (-np.frombuffer(record[len(head):-16], dtype=np.float32)).tobytes()
    return head + payload + xxhash.xxh3_128(head + payload).digest()


class FileRecords:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = f"file://{root}"

    def forge_all(self) -> int:
        paths = list(self.root.rglob("*.kvb"))
        for p in paths:
            p.write_bytes(forged(p.read_bytes()))
        return len(paths)


class RedisRecords:
    def __init__(self, url: str) -> None:
        import redis
        self.url = url
        self.client = redis.Redis.from_url(url)

    def forge_all(self) -> int:
        keys = list(self.client.scan_iter(REDIS_PREFIX + "*"))
        for k in keys:
            self.client.set(k, forged(self.client.get(k)))
        return len(keys)


def run(model: str, url: str, docs) -> tuple[list, object]:
    """Each document once through a fresh engine on the store; (cached tokens, outputs) and
    the store's stats. Closing flushes the pool into the store."""
    with LLM(model, dtype="float32", num_kv_blocks=64, kv_stores=[url]) as llm:
        outs = [llm.generate({"prompt_token_ids": d}, PARAMS)[0] for d in docs]
        llm.engine.kv.check_integrity()
        stats = llm.stats().kv_stores[0]
    return [(o.num_cached_tokens, o.outputs[0].token_ids) for o in outs], stats


def attack_and_defend(records, keyed: str, docs, want, model) -> None:
    first, _ = run(model, keyed, docs)                 # writes sealed records at close
    assert [t for _, t in first] == want
    n = records.forge_all()
    assert n == sum(blocks_cached_after(d) for d in docs)
    # Without the key the forged blocks are taken, and they are wrong.
    blind, stats = run(model, records.url, docs)
    assert [c for c, _ in blind] == [full_blocks(d) for d in docs] and stats.rejected == 0
    assert all(t != w for (_, t), w in zip(blind, want))
    # With the key: every record written without it (forged, or flushed by the blind engine)
    # is refused and counted, and the blocks are recomputed.
    defended, stats = run(model, keyed, docs)
    assert defended == [(0, w) for w in want]
    assert stats.hits == 0 and stats.forged == stats.rejected >= len(docs)
    # What that engine wrote with the key is a hit for the next one.
    again, stats = run(model, keyed, docs)
    assert again == [(full_blocks(d), w) for d, w in zip(docs, want)]
    assert stats.hits == sum(full_blocks(d) for d in docs) // BLOCK and stats.rejected == 0


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_a_file_store_with_a_key_refuses_forged_records(tmp_path, umask, docs, want, model):
    key = tmp_path / "kv.key"
    key.write_text("file store key: " + os.urandom(16).hex())
    key.chmod(0o600)
    records = FileRecords(tmp_path / "cache")
    old = os.umask(umask)
    try:
        attack_and_defend(records, f"{records.url}?mac_key_file={key}", docs, want, model)
    finally:
        os.umask(old)
    modes = {stat.S_IMODE(p.stat().st_mode) for p in records.root.rglob("*.kvb")}
    dirs = {stat.S_IMODE(p.stat().st_mode) for p in [records.root, *records.root.iterdir()]}
    assert modes == {0o600} and dirs == {0o700}


def test_a_redis_store_with_a_key_refuses_forged_records(redis_server, monkeypatch, docs, want, model):
    monkeypatch.setenv("PREFIXSERVE_TEST_KV_KEY", "redis store key: " + os.urandom(16).hex())
    records = RedisRecords(redis_server.url)
    attack_and_defend(records, f"{redis_server.url}?mac_key_env=PREFIXSERVE_TEST_KV_KEY", docs,
                      want, model)
