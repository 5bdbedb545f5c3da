"""The front's directory of cached contents, without Ray: names stay unique per owner and the
per-tenant maximum holds across replicas, counting contents still on their way to one."""
from __future__ import annotations

import pytest

from prefixserve.engine import CachedContent
from prefixserve.errors import CachedContentLimitError, ConflictError, NotFoundError
from prefixserve.replicas.contents import ContentDirectory, Placement


def content(cid: str, name=None, owner=None, tenant=None) -> CachedContent:
    return CachedContent(cid, name, [1] * 32, owner, 0, owner=owner, tenant=tenant)


def test_a_name_on_its_way_to_one_replica_is_taken_for_every_other():
    d = ContentDirectory()
    first = content("cc-1", "sys", owner="t1")
    d.reserve(first)
    assert d.name_taken("sys", "t1") and not d.name_taken("sys", "t2")
    with pytest.raises(ConflictError):
        d.reserve(content("cc-2", "sys", owner="t1"))
    d.reserve(content("cc-3", "sys", owner="t2"))   # another namespace's own name
    d.release(first)
    d.add(first, Placement("replica-a", expires_at=100.0))
    with pytest.raises(ConflictError):
        d.reserve(content("cc-4", "sys", owner="t1"))
    assert d.find("sys", "t1", "key") is first and d.placement(first).replica == "replica-a"
    with pytest.raises(NotFoundError):
        d.find("sys", "t3", "key")
    d.expire(now=100.0)
    assert not d.name_taken("sys", "t1") and len(d) == 0


def test_the_tenant_maximum_counts_every_replica_and_every_create_in_flight():
    d = ContentDirectory(max_per_tenant=2)
    a, b = content("cc-1", tenant="x"), content("cc-2", tenant="x")
    d.reserve(a)
    d.release(a)
    d.add(a, Placement("replica-a", None))
    d.reserve(b)   # on its way to replica-b
    with pytest.raises(CachedContentLimitError):
        d.reserve(content("cc-3", tenant="x"))
    d.reserve(content("cc-4", tenant="y"))
    d.release(b)   # its create failed
    d.reserve(content("cc-5", tenant="x"))
