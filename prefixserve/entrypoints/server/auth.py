"""API keys, tenants and the cache namespace a request lives in.

With keys configured (`--api-key`, `--api-keys FILE`), every /v1 route needs one
(`Authorization: Bearer KEY`, or Anthropic's `x-api-key: KEY`); a missing or wrong key is a
401. A key names a tenant. The tenant decides the request's cache namespace: its cache salt
is derived from the tenant, and a salt the request sends only subdivides that namespace, so
no request can name, hit, list, change or delete what another tenant's requests cached.
Routes that act on the whole server (`/reset_prefix_cache`, `/metrics`) need an admin key.

Without keys everyone is one anonymous tenant, as before, and the namespace is the salt the
request sends (the server says so at start).

A request's `priority` (scheduling and eviction under the priority policies) may not exceed its
key's `max_priority`: 0 for a tenant's key unless the keys file says otherwise, no limit for an
admin key or without keys. Otherwise any tenant could put its requests ahead of every other
tenant's, preempting them, and keep its blocks cached longest.

Keys file (JSON): {"KEY": "tenant", "KEY2": {"tenant": "ops", "admin": true},
"KEY3": {"tenant": "batch", "max_priority": 10, "weight": 2, "tokens_per_minute": 60000}, ...}.
Keys are kept only as SHA-256 digests and compared in constant time.

A tenant's `weight` (1 unless given; every key of one tenant must agree) sets its share of the
waiting queue, of each engine step and of the cached KV blocks (docs/tenants.md). A key's
`tokens_per_minute` bounds the prompt and output tokens its requests may spend (rate_limits.py).
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from prefixserve.errors import InvalidRequestError

# A single --api-key serves one tenant, who is also the admin.
DEFAULT_TENANT = "default"
_ENTRY_FIELDS = {"tenant", "admin", "max_priority", "weight", "tokens_per_minute"}
MAX_TENANT_NAME = 128


@dataclass(frozen=True)
class Principal:
    """Who sent a request: its tenant (None without keys), whether it may act on the whole server,
    and the highest priority its requests may ask for (None: any)."""
    tenant: Optional[str]
    admin: bool
    max_priority: Optional[int] = None
    tokens_per_minute: Optional[int] = None
    # Tells keys apart for their rate limits (a prefix of the key's digest; never shown).
    key_id: Optional[str] = None


ANONYMOUS = Principal(None, admin=True)


def cache_namespace(principal: Principal, salt: Optional[str]) -> Optional[str]:
    """The salt the engine sees: the tenant's namespace, subdivided by the request's salt.

    JSON of the pair, so no (tenant, salt) can spell another's; without keys, the salt as sent."""
    if principal.tenant is None:
        return salt
    return json.dumps(["tenant", principal.tenant, salt], ensure_ascii=False)


class KeyTable:
    """API key digest -> Principal."""

    def __init__(self, keys: Mapping[str, Principal],
                 weights: Optional[Mapping[str, float]] = None) -> None:
        if not keys:
            raise ValueError("an API key table needs at least one key")
        self._by_digest = {_digest(k): p for k, p in keys.items()}
        self._weights = {t: float((weights or {}).get(t, 1.0)) for t in sorted(self.tenants)}

    def __len__(self) -> int:
        return len(self._by_digest)

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(p.tenant for p in self._by_digest.values() if p.tenant is not None)

    @property
    def weights(self) -> dict[str, float]:
        """Each tenant's weight (the engine's tenant_weights)."""
        return dict(self._weights)

    @classmethod
    def single(cls, key: str) -> KeyTable:
        _check_key(key, "--api-key")
        return cls({key: Principal(DEFAULT_TENANT, admin=True)})

    @classmethod
    def from_file(cls, path: Path) -> KeyTable:
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read the API keys file {path}: {exc}") from None
        if not isinstance(raw, dict) or not raw:
            raise ValueError(f"{path} must hold a JSON object of API key -> tenant name")
        keys = {}
        weights: dict[str, float] = {}
        for key, entry in raw.items():
            _check_key(key, f"a key in {path}")
            if isinstance(entry, str):
                entry = {"tenant": entry}
            if not isinstance(entry, dict) or set(entry) - _ENTRY_FIELDS:
                raise ValueError(f"{path}: each key maps to a tenant name or {{\"tenant\": NAME, "
                                 "\"admin\": true|false, \"max_priority\": INT, \"weight\": NUMBER, "
                                 "\"tokens_per_minute\": INT}")
            tenant, admin = entry.get("tenant"), entry.get("admin", False)
            if not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_TENANT_NAME or not isinstance(admin, bool):
                raise ValueError(f"{path}: tenant names are strings of 1-{MAX_TENANT_NAME} characters "
                                 "and admin is true or false")
            max_priority = entry.get("max_priority", None if admin else 0)
            if max_priority is not None and (isinstance(max_priority, bool) or not isinstance(max_priority, int)):
                raise ValueError(f"{path}: max_priority is an integer (or null: any)")
            weight = entry.get("weight", 1)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < 1e9:
                raise ValueError(f"{path}: tenant {tenant!r}: weight is a positive number")
            if weights.setdefault(tenant, float(weight)) != weight:
                raise ValueError(f"{path}: tenant {tenant!r} is given two weights ({weights[tenant]} and "
                                 f"{weight}); give it one")
            rate = entry.get("tokens_per_minute")
            if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int) or rate < 1):
                raise ValueError(f"{path}: tokens_per_minute is a positive integer (or absent: no limit)")
            keys[key] = Principal(tenant, admin, max_priority, rate, _digest(key).hex()[:16])
        return cls(keys, weights)

    def lookup(self, key: Optional[str]) -> Optional[Principal]:
        """The key's principal, or None for a missing or unknown key."""
        if not key:
            return None
        digest = _digest(key)
        found = None
        for known, principal in self._by_digest.items():
            # every entry compared, in constant time: the answer's timing says nothing of the key
            if hmac.compare_digest(known, digest):
                found = principal
        return found


def key_of(authorization: Optional[str], x_api_key: Optional[str]) -> Optional[str]:
    """The key a request presents: OpenAI's bearer token or Anthropic's x-api-key header."""
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return x_api_key or None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def _check_key(key: object, where: str) -> None:
    if not isinstance(key, str) or len(key) < 8 or not key.isprintable() or " " in key:
        raise InvalidRequestError(f"{where}: an API key is a printable string of at least 8 characters "
                                  "without spaces")
