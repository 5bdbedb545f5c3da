"""Waiting for something that happens in the background (another process, a Ray actor, a poll
loop): poll until it holds or a deadline passes, rather than sleep a fixed time and hope, so a
test neither fails on a slow machine nor waits longer than the condition takes."""
from __future__ import annotations

import time
from typing import Callable


def wait_until(predicate: Callable[[], object], timeout: float = 30.0, what: str = "condition") -> None:
    """Returns as soon as predicate() is true; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.05)
