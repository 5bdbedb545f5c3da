"""What the Ray service tests (tests/replicas/test_replicas_*service.py) share: the replicas' engine,
reading a response's cached tokens, and the routers' view of the replicas. The module-wide
local Ray cluster is the `cluster` fixture of tests/replicas/conftest.py."""
from __future__ import annotations

import asyncio
import time

ENGINE = dict(model="random:qwen3-tiny", block_size=16, num_kv_blocks=256, dtype="float32",
              max_num_batched_tokens=512)


def cached(resp: dict) -> int:
    return (resp["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def router_views(front) -> dict[str, dict]:
    """Each router's last report: decisions by reason, requests routed and blocks held, by replica."""
    views = asyncio.run(front.routing())
    assert len(views) >= 1
    return views


def routing(front) -> dict:
    """The routers' reports summed."""
    merged: dict[str, dict] = {"reasons": {}, "held": {}, "routed": {}}
    for view in router_views(front).values():
        for key in merged:
            for k, v in view[key].items():
                merged[key][k] = merged[key].get(k, 0) + v
    return merged


def routers_caught_up(front) -> bool:
    """Every replica is idle and every router's index holds exactly the blocks the replica's last
    published stats say it has cached: the routers have applied the replicas' events up to now.
    (A router adds a request's blocks when it routes it, so a router that has not yet seen a
    request's events still differs from stats published before the request.)"""
    stats = front.replica_stats()
    if not stats or any(s["blocks_in_use"] or s["blocks_pinned"] for s in stats.values()):
        return False
    return all(view["held"].get(replica, 0) == s["blocks_cached"]
               for view in router_views(front).values() for replica, s in stats.items())


def steady_routing(front, hold_s: float = 1.0, timeout: float = 120.0) -> dict:
    """routing(front) once no replica runs or queues a request and the report has not changed for
    hold_s: the baseline of a count. A report read just after a request can still lack it (a
    router reports as it polls the hub, and on a loaded machine it runs late), and a baseline
    that lacks it counts that request again among the next ones."""
    def idle() -> bool:
        return not any(s["num_running"] or s["num_waiting"] for s in front.replica_stats().values())

    deadline = time.monotonic() + timeout
    while True:
        if idle():
            view = routing(front)
            time.sleep(hold_s)
            if idle() and routing(front) == view:
                return view
        else:
            time.sleep(0.05)
        assert time.monotonic() < deadline, f"the routers' report did not stand still within {timeout} s"
