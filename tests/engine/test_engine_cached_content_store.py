"""The cached-content store's indexes against a brute-force list of live contents, over random
sequences of adds, deletes, pin removals and another owner's attempts on a content: what each
scope sees and finds, which names are taken, which pins are held, and how many contents each
tenant holds (the cap). Another owner (tenant or namespace) looking up, re-pinning or deleting a
content's id or name gets NotFoundError, the same answer as for an id that never existed, and
changes nothing."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.engine.cache_control import CacheControl
from prefixserve.engine.cached_contents import CachedContent, CachedContentStore
from prefixserve.errors import CachedContentLimitError, ConflictError, NotFoundError
from prefixserve.kv import KVCacheConfig, KVCacheManager

OWNERS = [None, "acme", "acme/salt", "zeta"]
TENANT_OF = {None: None, "acme": "acme", "acme/salt": "acme", "zeta": "zeta"}
NAMES = [None, None, "docs", "tools"]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), cap=st.integers(1, 5))
def test_random_operations_agree_with_a_brute_force_list(seed, cap):
    rng = random.Random(seed)
    store = CachedContentStore(cap)
    # The engine's own paths for another owner's keys: each must stop at the store's scoped
    # lookup, before it reads or places a pin (this manager holds none).
    cache = CacheControl(KVCacheManager(KVCacheConfig(num_blocks=4, block_size=4)), store)
    live: list[CachedContent] = []
    for step in range(80):
        op = rng.random()
        if op < 0.45:
            owner = rng.choice(OWNERS)
            c = CachedContent(f"cc-{step}", rng.choice(NAMES), [step], owner, 0, owner=owner,
                              pin_id=f"pin-{rng.randrange(4)}", tenant=TENANT_OF[owner])
            taken = c.name is not None and any(x.owner == owner and c.name in (x.id, x.name) for x in live)
            full = sum(x.tenant == c.tenant for x in live) >= cap
            if taken or full:
                with pytest.raises(ConflictError if taken else CachedContentLimitError):
                    store.add(c)
            else:
                store.add(c)
                live.append(c)
        elif op < 0.6 and live:
            c = rng.choice(live)
            stranger = rng.choice([o for o in OWNERS if o != c.owner])
            for key in {c.id, c.name} - {None}:
                if any(x.owner == stranger and key in (x.id, x.name) for x in live):
                    continue   # the stranger's own content of that name, not c
                with pytest.raises(NotFoundError):
                    store.find(key, stranger)
                with pytest.raises(NotFoundError):
                    cache.find_cached_content(key, stranger)
                with pytest.raises(NotFoundError):
                    cache.repin_cached_content(key, 60.0, stranger)
                with pytest.raises(NotFoundError):
                    cache.delete_cached_content(key, stranger)
                assert not cache.kv.pins()
        elif op < 0.8 and live:
            c = rng.choice(live)
            live.remove(c)
            assert store.remove(c) == all(x.pin_id != c.pin_id for x in live)
        else:
            pin = f"pin-{rng.randrange(4)}"
            store.pin_removed(pin)
            live = [x for x in live if x.pin_id != pin]
        for owner in OWNERS:
            mine = [x for x in live if x.owner == owner]
            assert store.visible(owner) == mine
            for x in mine:
                assert store.find(x.id, owner) is x
                if x.name is not None:
                    assert store.find(x.name, owner) is x and store.name_taken(x.name, owner)
            for name in ("docs", "tools"):
                if not any(x.name == name for x in mine):
                    assert not store.name_taken(name, owner)
                    with pytest.raises(NotFoundError):
                        store.find(name, owner)
        for tenant in set(TENANT_OF.values()):
            assert store.count(tenant) == sum(x.tenant == tenant for x in live) <= cap
        for i in range(4):
            assert store.holds(f"pin-{i}") == any(x.pin_id == f"pin-{i}" for x in live)
        assert len(store) == len(live)
