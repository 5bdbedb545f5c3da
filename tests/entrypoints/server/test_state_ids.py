"""Request ids drawn from batched random bytes: each one fresh, across refills and across a fork."""
from __future__ import annotations

import os
import re

from prefixserve.entrypoints.server.state import RandomIds, new_id


def test_ids_are_128_bit_hex_and_never_repeat_across_refills():
    ids = RandomIds(batch=3)
    drawn = [ids.next_hex() for _ in range(1000)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", d) for d in drawn)
    assert len(set(drawn)) == len(drawn)


def test_new_id_keeps_its_prefix():
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", new_id("cmpl"))


def test_a_forked_child_never_draws_the_parents_next_ids():
    new_id("warm")  # the parent holds unread bytes
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.close(read)
        os.write(write, " ".join(new_id("x") for _ in range(8)).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = set(pipe.read().split())
    os.waitpid(pid, 0)
    parent = {new_id("x") for _ in range(8)}
    assert len(child) == 8 and not child & parent
