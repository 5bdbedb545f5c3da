"""Block hashing: chaining, reproducibility, type-tagged extra keys, algorithms."""
import hashlib
import os
import struct
import subprocess
import sys

import pytest

from prefixserve.kv import BlockHasher, KVCacheConfig, encode_extra_keys

TOKENS = [7, 1, 150000, 3, 9, 9, 2, 0, 5, 4, 4, 4, 1, 2, 3, 4, 5, 6, 7]


def test_digest_sizes_and_full_blocks_only():
    for algo, size in (("xxh3_64", 8), ("xxh3_128", 16), ("sha256", 32)):
        hasher = BlockHasher(algo, "m")
        hashes = hasher.hash_prompt(TOKENS, 4)
        assert len(hashes) == len(TOKENS) // 4
        assert all(isinstance(h, bytes) and len(h) == size for h in hashes)
        assert len(set(hashes)) == len(hashes)


def test_documented_message_format_with_sha256_as_oracle():
    # The format in hashing.py's docstring, rebuilt here by hand: persisted caches and routers
    # depend on it staying put.
    hasher = BlockHasher("sha256", "org/model@rev")
    seed = hashlib.sha256(b"prefixserve/kv/seed/v1\x00sha256\x00org/model@rev").digest()
    assert hasher.seed == seed

    def key(tag, value):
        return struct.pack("<H", len(tag)) + tag + b"s" + struct.pack("<I", len(value)) + value
    extras = key(b"salt", b"t1") + key(b"adapter", b"lora-a")
    message = (struct.pack("<HI", 32, 3) + seed + struct.pack("<3I", 5, 6, 7)
               + struct.pack("<I", len(extras)) + extras)
    expected = hashlib.sha256(message).digest()
    assert hasher.hash_block(None, [5, 6, 7], (("salt", "t1"), ("adapter", "lora-a"))) == expected
    assert hasher.hash_block(seed, [5, 6, 7], (("salt", "t1"), ("adapter", "lora-a"))) == expected


def test_chain_prefix_property_and_locality():
    hasher = BlockHasher("xxh3_64", "m")
    full = hasher.hash_prompt(TOKENS, 4)
    # A prefix's hashes are the prefix of the hashes.
    assert hasher.hash_prompt(TOKENS[:9], 4) == full[:2]
    # Changing a token in block 2 changes blocks 2.. only.
    changed = list(TOKENS)
    changed[9] += 1
    other = hasher.hash_prompt(changed, 4)
    assert other[:2] == full[:2]
    assert all(a != b for a, b in zip(other[2:], full[2:]))
    # hash_prompt agrees with chaining hash_block by hand.
    parent = None
    for i, h in enumerate(full):
        parent = hasher.hash_block(parent, TOKENS[4 * i:4 * i + 4])
        assert parent == h


def test_same_identity_same_hashes_other_identity_or_algo_differs():
    a = BlockHasher("xxh3_64", "qwen3-0.6b@abc").hash_prompt(TOKENS, 4)
    b = BlockHasher("xxh3_64", "qwen3-0.6b@abc").hash_prompt(TOKENS, 4)
    c = BlockHasher("xxh3_64", "qwen3-0.6b@def").hash_prompt(TOKENS, 4)
    assert a == b
    assert not set(a) & set(c)
    assert BlockHasher("xxh3_64", "m").seed != BlockHasher("xxh3_128", "m").seed[:8]


def test_hashes_are_reproducible_across_processes():
    code = ("from prefixserve.kv import BlockHasher; "
            f"print(','.join(h.hex() for h in BlockHasher('xxh3_128', 'm').hash_prompt({TOKENS}, 4, "
            "cache_salt='s')))")
    here = ",".join(h.hex() for h in BlockHasher("xxh3_128", "m").hash_prompt(
        TOKENS, 4, cache_salt="s"))
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.strip()
        assert out == here


def test_salt_enters_first_block_and_the_chain_carries_it():
    hasher = BlockHasher("xxh3_64", "m")
    plain = hasher.hash_prompt(TOKENS, 4)
    salted = hasher.hash_prompt(TOKENS, 4, cache_salt="tenant-1")
    other = hasher.hash_prompt(TOKENS, 4, cache_salt="tenant-2")
    assert len(set(plain) | set(salted) | set(other)) == 3 * len(plain)
    assert salted == hasher.hash_prompt(TOKENS, 4, cache_salt="tenant-1")
    # The salt is in block 0's extra keys only; later blocks differ through the parent.
    assert salted[1] == hasher.hash_block(salted[0], TOKENS[4:8])
    assert salted[0] == hasher.hash_block(None, TOKENS[:4], (("salt", "tenant-1"),))


def test_extra_keys_are_type_tagged_and_unambiguous():
    hasher = BlockHasher("xxh3_64", "m")
    salt = hasher.hash_prompt(TOKENS, 4, cache_salt="x")
    adapter = hasher.hash_block(None, TOKENS[:4], (("adapter", "x"),))
    assert salt[0] != adapter
    assert hasher.hash_prompt(TOKENS, 4, cache_salt="") != hasher.hash_prompt(TOKENS, 4)
    encodings = {encode_extra_keys(keys) for keys in (
        (), (("salt", "ab"),), (("salt", "a"), ("salt", "b")), (("sal", "tab"),),
        (("salt", b"ab"),), (("salt", 1),), (("salt", "1"),))}
    assert len(encodings) == 7
    # Tokens and extra keys cannot trade bytes either.
    assert hasher.hash_block(None, [1, 2]) != hasher.hash_block(None, [1], (("salt", "\x02"),))


def test_bad_input_is_rejected_with_a_clear_error():
    with pytest.raises(ValueError, match="algo"):
        BlockHasher("md5", "m")
    hasher = BlockHasher("xxh3_64", "m")
    for bad in ([-1], [2**32], [1.5]):
        with pytest.raises(ValueError, match="token ids"):
            hasher.hash_block(None, bad)
    with pytest.raises(ValueError, match="extra key"):
        hasher.hash_block(None, [1], ("salt",))
    with pytest.raises(ValueError, match="cache_salt"):
        hasher.hash_prompt([1, 2], 1, cache_salt=5)
    with pytest.raises(ValueError, match="block_size"):
        hasher.hash_prompt([1, 2], 0)


def test_injected_hash_fn_replaces_the_algorithm():
    hasher = BlockHasher("xxh3_64", "m", hash_fn=lambda data: b"\x00" * 4)
    assert hasher.seed == b"\x00" * 4
    assert set(hasher.hash_prompt(TOKENS, 2)) == {b"\x00" * 4}


@pytest.mark.parametrize("field,value", [
    ("num_blocks", 0), ("block_size", -1), ("hash_algo", "md5"), ("eviction_policy", "fifo"),
    ("enable_prefix_caching", 1), ("model_identity", None), ("max_pinned_blocks", -1),
])
def test_config_names_the_bad_field(field, value):
    kwargs = {"num_blocks": 4, field: value}
    with pytest.raises(ValueError, match=field):
        KVCacheConfig(**kwargs)
