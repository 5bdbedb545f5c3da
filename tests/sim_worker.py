"""A simulated worker for scheduler tests: each slot it writes holds a fingerprint of the whole
prefix up to that token, and before "attending" it checks that every slot a sequence reads holds
the fingerprint of exactly its own prefix, so a wrong cache hit, a skipped copy-on-write or two
sequences writing one slot fail whatever the policy. Shared by tests/scheduler/."""
from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.scheduler import Scheduler


def next_token(seq: list[int], sample_index: int) -> int:
    return (hash(tuple(seq)) * 31 + sample_index) % 97 + 3


@dataclass
class SimWorker:
    block_size: int
    slots: dict
    # Block tables kept between steps from the plans' deltas, as the real worker does.
    tables: dict = field(default_factory=dict)

    def run(self, sched: Scheduler, plan) -> dict[str, list[int]]:
        for rid in plan.dropped_ids:
            del self.tables[rid]
        for seq in plan.sequences:
            if seq.full_block_table is not None:
                self.tables[seq.request_id] = list(seq.full_block_table)
            else:
                self.tables[seq.request_id].extend(seq.new_block_ids)
            assert self.tables[seq.request_id] == sched.kv.block_table(seq.request_id)
        for src, dst in plan.block_copies:
            for off in range(self.block_size):
                key = src * self.block_size + off
                if key in self.slots:
                    self.slots[dst * self.block_size + off] = self.slots[key]
        written: set[int] = set()
        for seq in plan.sequences:
            req = sched.requests[seq.request_id]
            full = req.all_token_ids[:seq.seq_len]
            table = self.tables[seq.request_id]
            for pos in range(seq.start_pos, seq.seq_len):
                slot = table[pos // self.block_size] * self.block_size + pos % self.block_size
                assert slot not in written, "two sequences wrote one slot in a step"
                written.add(slot)
                self.slots[slot] = hash(tuple(full[:pos + 1]))
        sampled = {}
        for seq in plan.sequences:
            req = sched.requests[seq.request_id]
            full = req.all_token_ids[:seq.seq_len]
            table = self.tables[seq.request_id]
            for pos in range(seq.seq_len):
                slot = table[pos // self.block_size] * self.block_size + pos % self.block_size
                assert self.slots.get(slot) == hash(tuple(full[:pos + 1])), (
                    f"{seq.request_id} reads wrong K/V at position {pos}")
            if seq.sample:
                base = req.sample_index
                sampled[seq.request_id] = [next_token(full, base + k) for k in range(seq.num_samples)]
        return sampled
