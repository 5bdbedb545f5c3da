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
from sim_worker import SimWorker, next_token

from prefixserve.kv import KVCacheConfig, KVCacheManager
from prefixserve.sampling_params import SamplingParams
from prefixserve.scheduler import Request, Scheduler, SchedulerConfig


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


class InjectedFailure(Exception):
    pass


@dataclass
class FlakyWorker(SimWorker):
    """Fails steps at random, at a random point of the step: before it applied the plan's
    block tables, after them, after the copy-on-write copies, or part-way through the writes,
    leaving junk in some of the step's slots (what a forward that dies mid-way may leave)."""
    rng: random.Random = field(default_factory=random.Random)
    fail_rate: float = 0.0

    def run(self, sched: Scheduler, plan) -> dict[str, list[int]]:
        if not plan.sequences or self.rng.random() >= self.fail_rate:
            # A request rolled back before the worker got its row is dropped all the same
            # (the real worker's drop ignores rows it lacks).
            for rid in plan.dropped_ids:
                self.tables.setdefault(rid, [])
            return super().run(sched, plan)
        stage = self.rng.randrange(4)
        if stage >= 1:
            for rid in plan.dropped_ids:
                self.tables.pop(rid, None)
            for seq in plan.sequences:
                if seq.full_block_table is not None:
                    self.tables[seq.request_id] = list(seq.full_block_table)
                else:
                    self.tables[seq.request_id].extend(seq.new_block_ids)
        if stage >= 2:
            for src, dst in plan.block_copies:
                for off in range(self.block_size):
                    if src * self.block_size + off in self.slots:
                        self.slots[dst * self.block_size + off] = self.slots[src * self.block_size + off]
        if stage >= 3:
            for seq in plan.sequences:
                table = self.tables[seq.request_id]
                for pos in range(seq.start_pos, seq.seq_len):
                    if self.rng.random() < 0.5:
                        slot = table[pos // self.block_size] * self.block_size + pos % self.block_size
                        self.slots[slot] = ("junk", self.rng.random())
        raise InjectedFailure()


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    block_size=st.sampled_from([1, 2, 4, 16]),
    num_blocks=st.integers(8, 64),
    budget=st.integers(1, 64),
    max_seqs=st.integers(1, 8),
    n_requests=st.integers(1, 12),
    caching=st.booleans(),
    fail_rate=st.sampled_from([0.1, 0.3, 0.6]),
)
def test_failed_steps_are_undone_without_losing_or_corrupting_anything(
        seed, block_size, num_blocks, budget, max_seqs, n_requests, caching, fail_rate):
    """Random steps fail and are rolled back, and random steps schedule only a subset (as the
    engine does while it searches a failed step's culprit): every request still produces
    exactly the tokens of a run without failures, no sequence ever reads a slot that does
    not hold its own prefix (junk from a failed step included), and the pool ends empty."""
    rng = random.Random(seed)
    kv = KVCacheManager(KVCacheConfig(num_blocks=num_blocks, block_size=block_size,
                                      enable_prefix_caching=caching))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                      max_model_len=4096), kv)
    worker = FlakyWorker(block_size, {}, rng=random.Random(seed + 1), fail_rate=fail_rate)
    prefixes = [[rng.randrange(3, 50) for _ in range(rng.randrange(0, 20))] for _ in range(3)]
    capacity = num_blocks * block_size
    arrivals, expected = [], {}
    for i in range(n_requests):
        prompt = rng.choice(prefixes) + [rng.randrange(3, 50) for _ in range(rng.randrange(1, 10))]
        max_tokens = rng.randrange(1, 8)
        n = rng.choice([1, 1, 2, 3])
        if len(prompt) + max_tokens > capacity:
            continue
        params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
        arrivals.append(Request(f"r{i}", prompt, params, max_tokens=max_tokens, arrival_time=float(i)))
        for k in range(n):
            seq = list(prompt)
            for _ in range(max_tokens):
                seq.append(next_token(seq, k))
            expected[f"r{i}" if k == 0 else f"r{i}#{k}"] = seq[len(prompt):]

    finished, failures = {}, 0
    for _ in range(20000):
        if arrivals and rng.random() < 0.5:
            sched.add_request(arrivals.pop(0))
        only = None
        live = [r.request_id for r in list(sched.running) + list(sched.waiting)]
        if live and rng.random() < 0.2:
            only = set(rng.sample(live, rng.randrange(1, len(live) + 1)))
        plan = sched.schedule(only=only)
        if only is not None:
            assert {s.request_id for s in plan.sequences} <= only
        try:
            sampled = worker.run(sched, plan)
        except InjectedFailure:
            failures += 1
            rolled = sched.rollback(plan)
            assert rolled == [s.request_id for s in plan.sequences]
            for rid in plan.dropped_ids:
                worker.tables.pop(rid, None)
            kv.check_integrity()
            continue
        for req in sched.update_from_output(plan, sampled):
            if req.is_finished:
                finished[req.request_id] = list(req.output_token_ids)
        kv.check_integrity()
        if not arrivals and not sched.has_unfinished():
            break
    assert not sched.has_unfinished()
    for rid in sched.take_dropped_ids():
        worker.tables.pop(rid, None)
    assert worker.tables == {}
    assert finished == expected
    stats = kv.stats()
    assert stats.num_used_blocks == 0
    assert stats.num_free_blocks + stats.num_cached_free_blocks == num_blocks
