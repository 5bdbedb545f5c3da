"""Waiting for something that happens in the background (another process, a Ray actor, a poll
loop): poll until it holds or a deadline passes, rather than sleep a fixed time and hope, so a
test neither fails on a slow machine nor waits longer than the condition takes.

The default deadline is generous on purpose: CI runs on 2 cores that can be so loaded that the
suite takes 1.6 times its usual time, and a Ray replica, a subprocess or a poll loop then runs
late by tens of seconds. Waiting costs only as long as the condition takes; the deadline only
decides when a condition that never comes is reported."""
from __future__ import annotations

import time
from typing import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 120.0, what: str = "condition") -> None:
    """Returns as soon as predicate() is true; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.05)
