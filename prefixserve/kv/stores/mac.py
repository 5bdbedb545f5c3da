"""Record authentication: a keyed MAC in place of a record's checksum.

Without a key a record ends in an XXH3-128 checksum, which anyone can recompute: it detects
damage, not forgery. With a key (`?mac_key_file=PATH` or `?mac_key_env=NAME` on the store's
URL) it ends in a keyed BLAKE2b-128 over the same bytes (head: scope, block hash, parent,
token ids, extra keys, payload length; then the payload), the same size, so a record written
without the key, with another key, or altered afterwards is refused like a damaged one.

The secret never travels on a command line (where `ps` and shell histories show it): only the
name of the file or environment variable that holds it does.
"""
from __future__ import annotations

import hashlib
import os
import stat
from typing import Iterable, Optional

TAG_BYTES = 16
MIN_SECRET_BYTES = 16
# Derives the BLAKE2b key from a secret of any length, in a domain of its own.
_PERSON = b"prefixserve.kv1"


class RecordMac:
    """A keyed MAC over a record's bytes. Holds the derived key; its repr never shows it."""

    def __init__(self, secret: bytes, source: str) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the KV store MAC key from {source} has {len(secret)} bytes; "
                             f"it needs at least {MIN_SECRET_BYTES}")
        self._key = hashlib.blake2b(secret, digest_size=32, person=_PERSON).digest()
        self.source = source

    def tag(self, parts: Iterable) -> bytes:
        h = hashlib.blake2b(key=self._key, digest_size=TAG_BYTES)
        for p in parts:
            h.update(p)
        return h.digest()

    def __repr__(self) -> str:
        return f"RecordMac(from {self.source})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RecordMac) and other._key == self._key

    def __hash__(self) -> int:
        return hash(self._key)


def load_mac(key_file: Optional[str], key_env: Optional[str]) -> Optional[RecordMac]:
    """The MAC a store's URL names, None when it names none. A missing, short or
    world-readable secret is an error at start, never a store that silently stops
    authenticating."""
    if key_file is not None:
        return RecordMac(_read_key_file(key_file), f"file {key_file}")
    if key_env is not None:
        value = os.environ.get(key_env)
        if value is None:
            raise ValueError(f"the KV store MAC key variable {key_env} is not set")
        return RecordMac(value.strip().encode(), f"environment variable {key_env}")
    return None


def _read_key_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"the KV store MAC key file {path} is not a regular file")
            if st.st_mode & 0o077:
                raise ValueError(f"the KV store MAC key file {path} has mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}: other users can read it, so it "
                                 "is no secret (chmod 600 it)")
            return f.read().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the KV store MAC key file {path}: {exc}") from None
