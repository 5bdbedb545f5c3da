"""Store URLs: `mem://?size=8GiB`, `file:///dir?size=100GiB`, `redis://host:6379/0`.

A file or Redis store takes `?mac_key_file=PATH` or `?mac_key_env=NAME`: where the secret
that authenticates its records is (mac.py); never the secret itself.

Parsed once when the engine is configured, so a mistyped URL is an error at start, never a
store that silently misses.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional
from urllib.parse import parse_qsl, urlsplit, urlunsplit

SCHEMES = ("mem", "file", "redis", "rediss")
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]i?B|B)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DEFAULT_MEM_SIZE = 2**30
# Seconds a Redis call may take before it counts as a fault (a miss, never a stalled step
# for longer than this).
DEFAULT_REDIS_TIMEOUT_S = 0.5


def parse_size(text: str) -> int:
    """'8GiB' -> 8589934592; plain numbers are bytes."""
    m = _SIZE.fullmatch(text)
    if m is None:
        raise ValueError(f"size must be a number of bytes with an optional unit (KiB, MB, GiB, "
                         f"...), got {text!r}")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]
    if value < 1:
        raise ValueError(f"size must be at least one byte, got {text!r}")
    return int(value)


@dataclass(frozen=True)
class StoreSpec:
    scheme: str
    url: str                       # as given; may hold a Redis password
    size: Optional[int] = None     # capacity in bytes (mem, file); None: unbounded (file)
    path: Optional[str] = None     # file: the directory
    timeout_s: float = DEFAULT_REDIS_TIMEOUT_S
    redis_url: Optional[str] = None  # redis: the URL handed to redis-py (our options removed)
    mac_key_file: Optional[str] = None  # file, redis: the file holding the records' MAC key
    mac_key_env: Optional[str] = None   # ... or the environment variable holding it

    @property
    def display(self) -> str:
        """The URL without credentials, for stats, logs and metric labels."""
        if self.scheme == "mem":
            return self.url
        parts = urlsplit(self.url)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _mac_source(url: str, query: dict) -> dict:
    """The MAC key's source named in a URL's query (taken out of it)."""
    if "mac_key" in query:
        raise ValueError(f"KV store URL {url.split('?')[0]}: a MAC key is never given on the "
                         "command line (ps and shell histories show it); put it in a file "
                         "(?mac_key_file=PATH, mode 600) or an environment variable "
                         "(?mac_key_env=NAME)")
    found = {k: query.pop(k) for k in ("mac_key_file", "mac_key_env") if k in query}
    if len(found) > 1:
        raise ValueError(f"KV store URL {url!r}: give mac_key_file or mac_key_env, not both")
    for k, v in found.items():
        if not v:
            raise ValueError(f"KV store URL {url!r}: {k} is empty")
    if not found.get("mac_key_file", "/").startswith("/"):
        raise ValueError(f"KV store URL {url!r}: mac_key_file must be an absolute path")
    return found


def parse_store_url(url: str) -> StoreSpec:
    if not isinstance(url, str) or not url:
        raise ValueError(f"a KV store URL must be a non-empty string, got {url!r}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise ValueError(f"KV store URL {url!r}: the scheme must be one of "
                         f"{', '.join(s + '://' for s in SCHEMES)}")
    try:
        query = dict(parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)))
    except ValueError:
        raise ValueError(f"KV store URL {url!r}: malformed query string") from None
    size = parse_size(query.pop("size")) if "size" in query else None
    mac = _mac_source(url, query)
    if scheme == "mem":
        if mac:
            raise ValueError(f"KV store URL {url!r}: a mem:// store is this process's own "
                             "memory, which no one else can write; it takes no MAC key")
        if parts.netloc or parts.path not in ("", "/") or query:
            raise ValueError(f"KV store URL {url!r}: mem:// takes only ?size=")
        return StoreSpec("mem", url, size=size or DEFAULT_MEM_SIZE)
    if scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path.startswith("/"):
            raise ValueError(f"KV store URL {url!r}: file:// needs an absolute directory "
                             "(file:///var/cache/prefixserve)")
        if query:
            raise ValueError(f"KV store URL {url!r}: file:// takes only ?size=, ?mac_key_file= "
                             f"and ?mac_key_env=, got {sorted(query)}")
        return StoreSpec("file", url, size=size, path=parts.path, **mac)
    if size is not None:
        raise ValueError(f"KV store URL {url!r}: a Redis server bounds itself (maxmemory); "
                         "size= is not taken")
    timeout = DEFAULT_REDIS_TIMEOUT_S
    if "timeout" in query:
        try:
            timeout = float(query.pop("timeout"))
        except ValueError:
            raise ValueError(f"KV store URL {url!r}: timeout must be seconds") from None
        if not 0 < timeout <= 60:
            raise ValueError(f"KV store URL {url!r}: timeout must be in (0, 60] seconds")
    if not parts.hostname:
        raise ValueError(f"KV store URL {url!r}: redis:// needs a host")
    rest = "&".join(f"{k}={v}" for k, v in query.items())
    redis_url = urlunsplit((parts.scheme, parts.netloc, parts.path, rest, ""))
    return StoreSpec(scheme, url, timeout_s=timeout, redis_url=redis_url, **mac)
