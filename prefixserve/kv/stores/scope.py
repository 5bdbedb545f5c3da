"""The key space of stored blocks.

A block's K/V depends on more than its tokens: the weights that computed it, the dtype and
layout its bytes are in, the block size and hash algorithm that define its hash. All of
them, and the record format's version, go into one scope digest that prefixes every key, so
a different checkpoint, dtype, block size or layout never even looks at another's records.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from prefixserve.kv.config import HASH_ALGOS

FORMAT_VERSION = 1
SCOPE_DIGEST_BYTES = 16


@dataclass(frozen=True)
class KeyScope:
    weights_digest: str    # digest of the tensors actually loaded (model/weights_digest.py)
    kv_dtype: str          # "float32", "bfloat16", ...
    block_size: int
    kv_layout: str         # the payload's layout, e.g. "L28x[K,V]x16x8x128"
    hash_algo: str
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        for name in ("weights_digest", "kv_dtype", "kv_layout"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name} must be a non-empty str, got {value!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {self.hash_algo!r}")
        if isinstance(self.format_version, bool) or not isinstance(self.format_version, int):
            raise ValueError(f"format_version must be an int, got {self.format_version!r}")

    @property
    def digest(self) -> bytes:
        fields = (f"v{self.format_version}", self.weights_digest, self.kv_dtype,
                  str(self.block_size), self.kv_layout, self.hash_algo)
        # NUL never occurs in these fields, so the join is unambiguous.
        return hashlib.sha256("\x00".join(fields).encode()).digest()[:SCOPE_DIGEST_BYTES]

    @property
    def name(self) -> str:
        """The digest in hex: the key prefix (file store: a directory) of this scope."""
        return self.digest.hex()

    def key(self, block_hash: bytes) -> str:
        return scoped_key(self.name, block_hash)


def scoped_key(scope_name: str, block_hash: bytes) -> str:
    """A block's key in a store: also built by a router that only knows the scope's name."""
    return f"{scope_name}/{block_hash.hex()}"
