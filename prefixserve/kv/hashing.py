"""Chained content hashes of full KV blocks.

A block's hash is H(message) over an unambiguous byte message:

    u16 len(parent) | u32 number of tokens | parent hash | token ids as u32 little-endian |
    u32 len(extras) | extras

where extras is a sequence of type-tagged keys, each `u16 len(tag) | tag | kind byte |
u32 len(value) | value` (kind b"s" str as UTF-8, b"b" bytes, b"i" int in decimal). Every
variable-length part is length-prefixed, so no salt can be read as a token or as another kind
of key. The first block's parent is a seed hashed from the algorithm and the model identity,
so the same tokens give the same hashes in every process and after a restart.

An image's placeholder tokens all carry one token id, so every block an image overlaps also
carries (image content hash, offset of the image's first token from the block's first token)
for each image it overlaps: two prompts that differ only in a picture fork at the first block
the picture touches, and the chain carries the difference on.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from typing import Callable, Iterator, Mapping, Optional, Sequence

import xxhash

from prefixserve.kv.config import HASH_ALGOS

BlockHash = bytes
HashFn = Callable[[bytes], BlockHash]
ExtraKeys = tuple  # tuple of (tag: str, value: str | bytes | int)

SALT_TAG = "salt"
IMAGE_TAG = "image"
IMAGE_OFFSET_TAG = "image_offset"
# (image content hash, index of its first placeholder token in the prompt, number of its tokens)
ImageSpan = tuple[bytes, int, int]
_SEED_DOMAIN = b"prefixserve/kv/seed/v1\x00"

_U32_TYPECODE = next(code for code in "ILH" if array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"
_HEADER = struct.Struct("<HI")
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_ALGO_FNS: dict[str, HashFn] = {
    "xxh3_64": xxhash.xxh3_64_digest,
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": _sha256,
}
assert set(_ALGO_FNS) == set(HASH_ALGOS)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian u32, the form hashed and stored per block."""
    try:
        arr = array(_U32_TYPECODE, token_ids)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be ints in [0, 2**32): {exc}") from None
    if _BIG_ENDIAN:
        arr.byteswap()
    return arr.tobytes()


def encode_extra_keys(extra_keys: ExtraKeys) -> bytes:
    """The length-prefixed, type-tagged encoding of a block's extra keys."""
    parts = []
    for key in extra_keys:
        if not (isinstance(key, tuple) and len(key) == 2 and isinstance(key[0], str)):
            raise ValueError(f"an extra key must be a (tag: str, value) pair, got {key!r}")
        tag, value = key
        if isinstance(value, str):
            kind, payload = b"s", value.encode("utf-8")
        elif isinstance(value, bytes):
            kind, payload = b"b", value
        elif isinstance(value, int) and not isinstance(value, bool):
            kind, payload = b"i", str(value).encode("ascii")
        else:
            raise ValueError(f"extra key {tag!r} has a value of unsupported type: {value!r}")
        tag_bytes = tag.encode("utf-8")
        parts.append(_U16.pack(len(tag_bytes)) + tag_bytes + kind
                     + _U32.pack(len(payload)) + payload)
    body = b"".join(parts)
    return _U32.pack(len(body)) + body


def request_extra_keys(cache_salt: Optional[str]) -> tuple[ExtraKeys, ExtraKeys]:
    """(keys of block 0, keys of every later block): the salt enters block 0 only (the chain
    carries it on); a request has no key of its own for later blocks."""
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise ValueError(f"cache_salt must be a str or None, got {cache_salt!r}")
    first: ExtraKeys = ((SALT_TAG, cache_salt),) if cache_salt is not None else ()
    return first, ()


def image_block_keys(image_spans: Sequence[ImageSpan], block_size: int) -> dict[int, ExtraKeys]:
    """block index -> the (image, offset) keys of every image that block overlaps, in prompt order."""
    keys: dict[int, ExtraKeys] = {}
    for span in image_spans:
        if not (isinstance(span, tuple) and len(span) == 3 and isinstance(span[0], bytes)
                and all(isinstance(v, int) and not isinstance(v, bool) for v in span[1:])
                and span[1] >= 0 and span[2] > 0):
            raise ValueError(f"an image span must be (hash bytes, start >= 0, length > 0), got {span!r}")
        digest, start, length = span
        for block in range(start // block_size, (start + length - 1) // block_size + 1):
            keys[block] = keys.get(block, ()) + ((IMAGE_TAG, digest), (IMAGE_OFFSET_TAG, start - block * block_size))
    return keys


def special_block_extras(cache_salt: Optional[str], image_spans: Sequence[ImageSpan],
                         block_size: int) -> dict[int, bytes]:
    """block index -> encoded extra keys, for the blocks whose keys differ from the request's usual
    ones (request_extra_keys): those an image overlaps. Empty for a text-only request."""
    if not image_spans:
        return {}
    first, rest = request_extra_keys(cache_salt)
    return {block: encode_extra_keys((first if block == 0 else rest) + keys)
            for block, keys in image_block_keys(image_spans, block_size).items()}


class BlockHasher:
    def __init__(self, algo: str = "xxh3_64", model_identity: str = "",
                 hash_fn: Optional[HashFn] = None) -> None:
        if algo not in _ALGO_FNS:
            raise ValueError(f"algo must be one of {HASH_ALGOS}, got {algo!r}")
        if not isinstance(model_identity, str):
            raise ValueError(f"model_identity must be a str, got {model_identity!r}")
        self.algo = algo
        self.model_identity = model_identity
        # hash_fn replaces the algorithm (tests inject a colliding one).
        self._fn: HashFn = hash_fn if hash_fn is not None else _ALGO_FNS[algo]
        self.seed: BlockHash = self._fn(
            _SEED_DOMAIN + algo.encode("ascii") + b"\x00" + model_identity.encode("utf-8"))

    def hash_block(self, parent: Optional[BlockHash], token_ids: Sequence[int],
                   extra_keys: ExtraKeys = ()) -> BlockHash:
        return self.hash_encoded(self.seed if parent is None else parent,
                                 token_bytes(token_ids), encode_extra_keys(extra_keys))

    def hash_encoded(self, parent: BlockHash, tokens: bytes, extras: bytes) -> BlockHash:
        """Hash of one block from its encoded parts (tokens from token_bytes, extras from
        encode_extra_keys)."""
        return self._fn(_HEADER.pack(len(parent), len(tokens) >> 2) + parent + tokens + extras)

    def iter_chain(self, parent: BlockHash, tokens: bytes, block_size: int, first_index: int,
                   extras_first: bytes, extras_rest: bytes,
                   special: Optional[Mapping[int, bytes]] = None) -> Iterator[tuple[bytes, BlockHash]]:
        """(block tokens, hash) of each full block in `tokens`, whose first block has index
        first_index in its request and `parent` as its parent hash; `special`: the encoded keys
        of blocks that differ from extras_first/extras_rest (special_block_extras)."""
        if special:
            yield from self._iter_chain_special(parent, tokens, block_size, first_index, extras_first,
                                                extras_rest, special)
            return
        fn = self._fn
        step = block_size * 4
        # Built-in algorithms give fixed-length digests, so the header is built once; an injected
        # hash_fn may return digests of any length.
        parent_len = len(parent)
        header = _HEADER.pack(parent_len, block_size)
        extras = extras_first if first_index == 0 else extras_rest
        for offset in range(0, len(tokens) - step + 1, step):
            if len(parent) != parent_len:
                parent_len = len(parent)
                header = _HEADER.pack(parent_len, block_size)
            block = tokens[offset:offset + step]
            parent = fn(header + parent + block + extras)
            extras = extras_rest
            yield block, parent

    def _iter_chain_special(self, parent: BlockHash, tokens: bytes, block_size: int, first_index: int,
                            extras_first: bytes, extras_rest: bytes,
                            special: Mapping[int, bytes]) -> Iterator[tuple[bytes, BlockHash]]:
        step = block_size * 4
        index = first_index
        for offset in range(0, len(tokens) - step + 1, step):
            block = tokens[offset:offset + step]
            extras = special.get(index, extras_rest if index else extras_first)
            parent = self._fn(_HEADER.pack(len(parent), block_size) + parent + block + extras)
            index += 1
            yield block, parent

    def hash_prompt(self, token_ids: Sequence[int], block_size: int,
                    cache_salt: Optional[str] = None,
                    image_spans: Sequence[ImageSpan] = ()) -> list[BlockHash]:
        """Hashes of all full blocks of token_ids."""
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        first, rest = request_extra_keys(cache_salt)
        num_full = len(token_ids) // block_size * block_size
        tokens = token_bytes(token_ids[:num_full])
        special = special_block_extras(cache_salt, image_spans, block_size)
        return [h for _, h in self.iter_chain(self.seed, tokens, block_size, 0,
                                              encode_extra_keys(first), encode_extra_keys(rest), special)]
