"""The scheduler and the KV manager driven by a simulated model, no torch.

The simulated worker stores, in each slot it writes, a fingerprint of the
whole prefix up to that token, and before "attending" checks that every slot a
sequence reads holds the fingerprint of exactly its own prefix. So a block
reused from the cache with the wrong contents, a copy-on-write that was
skipped, or two sequences writing one slot, fail here, whatever the policy.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import given, settings, strategies as st

from prefixserve.kv import KVCacheConfig, KVCacheManager
from prefixserve.sampling_params import SamplingParams
from prefixserve.scheduler import Request, Scheduler, SchedulerConfig


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


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(8, 64),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 8),
    n_requests=st.integers(1, 12),
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    eviction=st.sampled_from(["lru", "lfu", "priority"]),
)
def test_random_workloads_keep_kv_consistent(seed, block_size, num_blocks, budget, max_seqs,
                                             n_requests, caching, policy, eviction):
    rng = random.Random(seed)
    kv = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=block_size,
                                      enable_prefix_caching=caching, eviction_policy=eviction))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                      max_model_len=4096, policy=policy), kv)
    worker = SimWorker(block_size, {})
    prefixes = [[rng.randrange(3, 50) for _ in range(rng.randrange(0, 20))] for _ in range(3)]
    pending = []
    capacity = num_blocks * block_size
    for i in range(n_requests):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 10))]
        max_tokens = rng.randrange(1, 8)
        n = rng.choice([1, 1, 1, 2, 3])
        if len(prompt) + max_tokens > capacity:
            continue
        params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        pending.append(Request(f"r{i}", prompt, params, max_tokens=max_tokens,
                               priority=rng.randrange(0, 3), arrival_time=float(i)))
    expected = {}
    for req in pending:
        for k in range(req.sampling_params.n):
            rid = req.request_id if k == 0 else f"{req.request_id}#{k}"
            seq = list(req.prompt_token_ids)
            for _ in range(req.max_tokens):
                seq.append(next_token(seq, k))
            expected[rid] = seq[len(req.prompt_token_ids):]

    arrivals = list(pending)
    finished = {}
    for _ in range(5000):
        if arrivals and rng.random() < 0.5:
            sched.add_request(arrivals.pop(0))
        plan = sched.schedule()
        assert plan.num_batched_tokens <= budget
        sampled = worker.run(sched, plan)
        for req in sched.update_from_output(plan, sampled):
            if req.is_finished:
                finished[req.request_id] = list(req.output_token_ids)
        kv.check_integrity()
        if not arrivals and not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    for rid in sched.take_dropped_ids():
        del worker.tables[rid]
    assert worker.tables == {}
    assert finished == expected
    stats = kv.stats()
    assert stats.num_used_blocks == 0
    assert stats.num_free_blocks + stats.num_cached_free_blocks == num_blocks
