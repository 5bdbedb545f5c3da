"""Blocks an image overlaps carry (image hash, offset) in their extra keys: two prompts that differ only
in a picture fork at the first block the picture touches, never later, and share every block before it.

The 1,000-pair test runs the real path from pixels to block hashes (content hash over decoded pixels,
then the chain) on random pictures that differ in one pixel, with no model.
"""
from __future__ import annotations

import numpy as np
from PIL import Image

from prefixserve.kv import KVCacheConfig, KVCacheManager
from prefixserve.kv.hashing import BlockHasher
from prefixserve.model.random_models import RANDOM_PRESETS
from prefixserve.multimodal.content_hash import image_content_hash

BS = 16
VISION = RANDOM_PRESETS["qwen2.5-vl-tiny"].vision
PAD = 8194


def content_hash(pixels: np.ndarray) -> bytes:
    return image_content_hash(Image.fromarray(pixels), VISION, VISION.min_pixels, VISION.max_pixels)


def prompt(start: int, length: int, total: int) -> list[int]:
    return [i % 7000 for i in range(start)] + [PAD] * length + [7 + i for i in range(total - start - length)]


def test_a_thousand_one_pixel_changes_never_share_a_block_from_the_image_on() -> None:
    rng = np.random.default_rng(53)
    hasher = BlockHasher("xxh3_64", "vl")
    for _ in range(1000):
        h, w = rng.integers(8, 40, size=2)
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        b = a.copy()
        y, x, c = rng.integers(h), rng.integers(w), rng.integers(3)
        b[y, x, c] = (int(b[y, x, c]) + int(rng.integers(1, 256))) % 256
        start, length = int(rng.integers(0, 70)), int(rng.integers(1, 60))
        tokens = prompt(start, length, start + length + int(rng.integers(1, 40)))
        ha, hb = content_hash(a), content_hash(b)
        assert len(ha) == 16 and ha != hb
        chain_a = hasher.hash_prompt(tokens, BS, image_spans=[(ha, start, length)])
        chain_b = hasher.hash_prompt(tokens, BS, image_spans=[(hb, start, length)])
        first = start // BS
        assert chain_a[:first] == chain_b[:first]
        assert not set(chain_a[first:]) & set(chain_b)


def test_the_same_picture_shares_and_its_offset_counts() -> None:
    hasher = BlockHasher("xxh3_64", "vl")
    pixels = np.random.default_rng(1).integers(0, 256, (30, 30, 3), dtype=np.uint8)
    digest = content_hash(pixels)
    assert content_hash(pixels.copy()) == digest
    tokens = prompt(20, 40, 90)
    same = hasher.hash_prompt(tokens, BS, image_spans=[(digest, 20, 40)])
    assert same == hasher.hash_prompt(tokens, BS, image_spans=[(digest, 20, 40)])
    # the same tokens with the picture placed one token later: the block holding its start differs
    shifted = hasher.hash_prompt(tokens, BS, image_spans=[(digest, 21, 39)])
    assert same[0] == shifted[0] and same[1] != shifted[1]
    # text only: the image's blocks are keyed, so no text-only prompt of these token ids matches
    assert not set(hasher.hash_prompt(tokens, BS)[1:]) & set(same)
    # salts still separate tenants
    assert not set(hasher.hash_prompt(tokens, BS, cache_salt="t", image_spans=[(digest, 20, 40)])) & set(same)


def test_manager_forks_at_the_first_block_the_other_picture_touches() -> None:
    kv = KVCacheManager(KVCacheConfig(num_blocks=32, block_size=BS))
    rng = np.random.default_rng(2)
    a = content_hash(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))
    b = content_hash(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))
    tokens = prompt(37, 30, 100)
    hit = kv.find_cached_prefix("a", tokens, image_spans=[(a, 37, 30)])
    assert kv.allocate_slots("a", tokens, 0, len(tokens), hit=hit, image_spans=[(a, 37, 30)]) is not None
    again = kv.find_cached_prefix("a2", tokens, image_spans=[(a, 37, 30)])
    other = kv.find_cached_prefix("b", tokens, image_spans=[(b, 37, 30)])
    assert again.num_tokens == (len(tokens) - 1) // BS * BS
    assert other.num_tokens == 37 // BS * BS
    kv.free("a")
    kv.check_integrity()


def test_a_breakpoints_partial_block_is_keyed_by_the_picture_in_it() -> None:
    """A token-exact breakpoint inside a block an image overlaps: the partial block kept for it
    carries the image's key, so the same tokens with another picture never hit it."""
    kv = KVCacheManager(KVCacheConfig(num_blocks=32, block_size=BS))
    rng = np.random.default_rng(3)
    a = content_hash(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))
    b = content_hash(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))
    tokens = prompt(37, 30, 100)
    mark = 70   # inside block 4, which the image (tokens 37-66) overlaps
    assert mark % BS and mark // BS * BS < 37 + 30
    spans = [(a, 37, 30)]
    hit = kv.find_cached_prefix("a", tokens, breakpoints=(mark,), image_spans=spans)
    # as the scheduler does: a chunk ends at the mark, the next one caches the partial block
    assert kv.allocate_slots("a", tokens, 0, mark, hit=hit, breakpoints=(mark,),
                             image_spans=spans) is not None
    assert kv.allocate_slots("a", tokens, mark, len(tokens) - mark) is not None
    kv.free("a")
    later = tokens[:mark] + [6000 + i for i in range(30)]   # the same prefix up to the mark only
    same = kv.find_cached_prefix("a2", later, breakpoints=(mark,), image_spans=spans)
    other = kv.find_cached_prefix("b", later, breakpoints=(mark,), image_spans=[(b, 37, 30)])
    assert same.num_tokens == mark
    assert other.num_tokens == 37 // BS * BS
    kv.check_integrity()
