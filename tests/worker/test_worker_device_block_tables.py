"""The device copy of the block tables updated by deltas against a full rebuild from the host array (its
oracle), through random writes, appends, copy-on-write rewrites, drops and reallocations; and the deltas
stay deltas: a step that appends one block sends one cell."""
from __future__ import annotations

import random

import numpy as np
import torch

from prefixserve.worker.block_tables import BlockTables
from prefixserve.worker.device_block_tables import DeviceBlockTables


def test_deltas_keep_the_device_copy_equal_to_a_full_rebuild():
    rng = random.Random(0)
    host = BlockTables(rows=4, columns=4)
    device = DeviceBlockTables(host, "cpu")
    live: list[str] = []
    for step in range(300):
        action = rng.random()
        if action < 0.25 or not live:
            rid = f"r{step}"
            host.write(rid, [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 9))])
            live.append(rid)
        elif action < 0.6:
            host.append(rng.choice(live), [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 3))])
        elif action < 0.75:
            rid = rng.choice(live)
            host.write(rid, [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 5))])
        else:
            rid = live.pop(rng.randrange(len(live)))
            host.drop(rid)
        device.sync()
        assert torch.equal(device.tensor, torch.from_numpy(host.array))
        if live:
            rows = np.array([host.row(r) for r in live])
            width = int(host.lengths[rows].max())
            assert torch.equal(device.gather(rows, width), torch.from_numpy(host.array[rows, :width]))


def test_a_step_sends_only_what_changed():
    host = BlockTables(rows=8, columns=16)
    device = DeviceBlockTables(host, "cpu")
    host.write("a", list(range(1, 11)))
    host.write("b", list(range(20, 25)))
    device.sync()
    assert device.last_sent == 15
    host.append("a", [99])
    device.sync()
    assert device.last_sent == 1
    device.sync()
    assert device.last_sent == 0
    assert torch.equal(device.tensor, torch.from_numpy(host.array))


def test_without_a_device_copy_the_host_tables_record_nothing():
    host = BlockTables()
    host.write("a", [1, 2])
    host.append("a", [3])
    assert host.changes is None
