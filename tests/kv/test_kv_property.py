"""Random operation sequences against a brute-force model of the cache.

The model plays the worker: every slot of every physical block holds the exact context its K/V
was computed from, (salt, all tokens up to and including that position). After each operation,
every computed token of every request must be found in its block table's slots, and every hit
must point at slots holding the requested context. That catches a wrong hit, a missing
copy-on-write and a block reused while still referenced. When no block was ever evicted or
reset, hits must also be exactly the longest prefix of full blocks ever computed.
"""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from prefixserve.kv import KVCacheConfig, KVCacheManager, PinLimitError

# Prompts share a few common prefixes, so hits, forks of shared blocks and evictions of shared
# chains happen often.
BASES = ([], [0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 2, 2, 1, 0], [2, 2, 2, 2])
TOKENS = st.builds(lambda base, tail: (base + tail) or [0], st.sampled_from(BASES),
                   st.lists(st.integers(0, 2), max_size=6))
SALTS = st.sampled_from([None, None, "s1", "s2"])
MAX_LEN = 24


class KVModel(RuleBasedStateMachine):
    @initialize(block_size=st.sampled_from([1, 2, 4]),
                num_blocks=st.sampled_from([3, 5, 8, 12, 400, 400]),
                policy=st.sampled_from(["lru", "lfu", "priority"]),
                algo=st.sampled_from(["xxh3_64", "xxh3_128", "sha256"]),
                collide=st.sampled_from([False, False, True]),
                caching=st.sampled_from([True, True, True, False]),
                max_pins=st.sampled_from([None, 2]))
    def setup(self, block_size, num_blocks, policy, algo, collide, caching, max_pins):
        self.now = 0.0
        self.bs = block_size
        self.collide = collide
        self.caching = caching
        self.kv = KVCacheManager(
            KVCacheConfig(num_blocks=num_blocks, block_size=block_size, hash_algo=algo,
                          eviction_policy=policy, enable_prefix_caching=caching,
                          max_pinned_blocks=max_pins),
            clock=lambda: self.now, hash_fn=(lambda data: b"x") if collide else None)
        self.reqs = {}            # rid -> {"tokens", "computed", "salt", "priority"}
        self.slots = {}           # (block, offset) -> (salt, context tokens)
        self.computed = set()     # (salt, prefix) of every full block ever computed
        self.reset_done = False
        self.next_id = 0
        self.query = [0, 0, 0, 0]  # query, hit, recomputed query, recomputed hit tokens
        self.pin_ids = []

    # ---------------------------------------------------------------- helpers
    def context(self, salt, tokens, pos):
        return (salt, tuple(tokens[:pos + 1]))

    def snapshot(self):
        kv = self.kv
        return (kv.stats(), kv.eviction_order(), {r: kv.block_table(r) for r in self.reqs})

    def exact(self):
        return (self.caching and not self.collide and not self.reset_done
                and self.kv.stats().evictions == 0)

    def check_hit(self, hit, tokens, salt):
        bs = self.bs
        assert hit.num_tokens == len(hit.block_ids) * bs
        if not self.caching:
            assert hit.num_tokens == 0
        assert hit.num_tokens <= (len(tokens) - 1) // bs * bs
        for j, block in enumerate(hit.block_ids):
            for off in range(bs):
                assert self.slots.get((block, off)) == self.context(salt, tokens, j * bs + off)
            assert (salt, tuple(tokens[:(j + 1) * bs])) in self.computed
        if self.exact():
            expected = 0
            while (expected < (len(tokens) - 1) // bs
                   and (salt, tuple(tokens[:(expected + 1) * bs])) in self.computed):
                expected += 1
            assert hit.num_tokens == expected * bs

    def forward(self, rid, alloc, start, count):
        """The worker: block copies, then K/V of the scheduled tokens into their slots."""
        req = self.reqs[rid]
        for src, dst in alloc.copies:
            for off in range(self.bs):
                self.slots[(dst, off)] = self.slots.get((src, off))
        table = self.kv.block_table(rid)
        for pos in range(start, start + count):
            self.slots[(table[pos // self.bs], pos % self.bs)] = self.context(
                req["salt"], req["tokens"], pos)
        req["computed"] = start + count
        if self.caching:
            for j in range(req["computed"] // self.bs):
                self.computed.add((req["salt"], tuple(req["tokens"][:(j + 1) * self.bs])))

    def admit(self, tokens, salt, priority, preempted, chunk):
        rid = f"r{self.next_id}"
        self.next_id += 1
        hit = self.kv.find_cached_prefix(rid, tokens, cache_salt=salt, preempted=preempted)
        self.check_hit(hit, tokens, salt)
        count = min(chunk, len(tokens) - hit.num_tokens)
        before = self.snapshot()
        alloc = self.kv.allocate_slots(rid, tokens, hit.num_tokens, count, hit=hit,
                                       cache_salt=salt, priority=priority)
        if alloc is None:
            assert self.snapshot() == before
            return None
        self.reqs[rid] = {"tokens": list(tokens), "computed": 0, "salt": salt,
                          "priority": priority}
        base = 2 if preempted else 0
        self.query[base] += len(tokens)
        self.query[base + 1] += hit.num_tokens
        self.forward(rid, alloc, hit.num_tokens, count)
        return rid

    # ------------------------------------------------------------------ rules
    @rule(tokens=TOKENS, salt=SALTS, priority=st.integers(0, 2), chunk=st.integers(1, 10))
    def new_request(self, tokens, salt, priority, chunk):
        self.admit(tokens, salt, priority, False, chunk)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=3), salt=SALTS)
    def repeat_prompt(self, data, extra, salt):
        """A new request whose prompt extends a live one's tokens: the likeliest hit."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.admit(self.reqs[rid]["tokens"] + extra, salt, 0, False, data.draw(st.integers(1, 30)))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def step(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        tokens, start = req["tokens"], req["computed"]
        if start == len(tokens):
            if len(tokens) >= MAX_LEN:
                return
            tokens.append(data.draw(st.integers(0, 2)))     # decode: feed the sampled token
            count = 1
        else:
            count = data.draw(st.integers(1, len(tokens) - start))
        before = self.snapshot()
        alloc = self.kv.allocate_slots(rid, tokens, start, count, cache_salt=req["salt"],
                                       priority=req["priority"])
        if alloc is None:
            assert self.snapshot() == before
            if start == len(tokens) - 1 and count == 1:
                tokens.pop()
            return
        self.forward(rid, alloc, start, count)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def fork(self, data):
        done = sorted(r for r, q in self.reqs.items() if q["computed"] == len(q["tokens"]))
        if not done:
            return
        parent = data.draw(st.sampled_from(done))
        child = f"r{self.next_id}"
        self.next_id += 1
        self.kv.fork(parent, child)
        p = self.reqs[parent]
        self.reqs[child] = {**p, "tokens": list(p["tokens"])}

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.kv.free(rid)
        del self.reqs[rid]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk=st.integers(1, 10))
    def preempt_and_resume(self, data, chunk):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs.pop(rid)
        self.kv.free(rid)
        self.admit(req["tokens"], req["salt"], req["priority"], True, chunk)

    @rule(tokens=TOKENS, salt=SALTS, ttl=st.sampled_from([None, 1.0, 5.0]))
    def pin(self, tokens, salt, ttl):
        try:
            info = self.kv.pin_prefix(tokens, cache_salt=salt, ttl_s=ttl)
        except PinLimitError:
            return
        for j, block in enumerate(info.block_ids):
            for off in range(self.bs):
                assert self.slots.get((block, off)) == self.context(salt, tokens, j * self.bs + off)
        if info.pin_id is not None:
            self.pin_ids.append(info.pin_id)

    @precondition(lambda self: self.pin_ids)
    @rule(data=st.data())
    def unpin(self, data):
        self.kv.unpin(data.draw(st.sampled_from(self.pin_ids)))

    @rule(seconds=st.sampled_from([0.5, 2.0]), reset=st.integers(0, 7))
    def advance_clock(self, seconds, reset):
        self.now += seconds
        if reset == 0:     # rare, so that most runs keep the exact-hit check
            self.kv.reset_prefix_cache()
            self.reset_done = True
            self.pin_ids.clear()

    # -------------------------------------------------------------- invariants
    @invariant()
    def consistent(self):
        kv = self.kv
        kv.check_integrity()
        for rid, req in self.reqs.items():
            table = kv.block_table(rid)
            assert len(table) == -(-req["computed"] // self.bs)
            for pos in range(req["computed"]):
                assert self.slots.get((table[pos // self.bs], pos % self.bs)) == self.context(
                    req["salt"], req["tokens"], pos)
        s = kv.stats()
        assert s.num_free_blocks + s.num_cached_free_blocks + s.num_used_blocks == s.num_blocks
        assert s.num_requests == len(self.reqs)
        assert [s.query_tokens, s.hit_tokens, s.recomputed_query_tokens,
                s.recomputed_hit_tokens] == self.query
        if not self.reqs and not kv.pins():
            assert s.num_used_blocks == 0


KVModel.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
TestKVModel = KVModel.TestCase


# ------------------------------------------------------------------------------------------------
# Token-exact breakpoints (kv/partial_blocks.py) and explicit write limits mixed into every kind of
# operation above: every slot a hit or a pin hands over still holds exactly the requested context,
# no request's computed slots change under it, and a refused call changes nothing.

MARKS = st.lists(st.integers(1, 24), max_size=3)


class KVPartialModel(KVModel):
    def check_hit(self, hit, tokens, salt):
        bs = self.bs
        full = hit.num_tokens // bs
        assert len(hit.block_ids) == -(-hit.num_tokens // bs)
        assert hit.num_tokens <= len(tokens) - 1 or hit.num_tokens == 0
        for pos in range(hit.num_tokens):
            assert self.slots.get((hit.block_ids[pos // bs], pos % bs)) == \
                self.context(salt, tokens, pos)
        if self.exact():
            expected = 0
            while (expected < (len(tokens) - 1) // bs
                   and (salt, tuple(tokens[:(expected + 1) * bs])) in self.computed):
                expected += 1
            # a breakpoint only ever adds its partial block to the full blocks' hit
            assert full == expected

    def admit_marked(self, tokens, salt, marks, limit, chunk, preempted=False):
        rid = f"r{self.next_id}"
        self.next_id += 1
        hit = self.kv.find_cached_prefix(rid, tokens, cache_salt=salt, preempted=preempted,
                                         breakpoints=marks)
        self.check_hit(hit, tokens, salt)
        count = min(chunk, len(tokens) - hit.num_tokens)
        for t in sorted(marks):   # as the scheduler ends a chunk at a breakpoint
            if t > hit.num_tokens and t % self.bs:
                count = min(count, t - hit.num_tokens)
                break
        before = self.snapshot()
        alloc = self.kv.allocate_slots(rid, tokens, hit.num_tokens, count, hit=hit,
                                       cache_salt=salt, breakpoints=marks, write_limit=limit)
        if alloc is None:
            assert self.snapshot() == before
            return
        self.reqs[rid] = {"tokens": list(tokens), "computed": 0, "salt": salt, "priority": 0,
                          "limit": limit}
        base = 2 if preempted else 0
        self.query[base] += len(tokens)
        self.query[base + 1] += hit.num_tokens
        self.forward(rid, alloc, hit.num_tokens, count)

    def forward(self, rid, alloc, start, count):
        """As the model's worker; a request under a write limit adds no full block past it to
        what the cache may hold (the exact-hit oracle's set)."""
        limit = self.reqs[rid].get("limit")
        if limit is None:
            return super().forward(rid, alloc, start, count)
        before = set(self.computed)
        super().forward(rid, alloc, start, count)
        self.computed = before | {c for c in self.computed - before if len(c[1]) <= limit}

    @rule(tokens=TOKENS, salt=SALTS, marks=MARKS, chunk=st.integers(1, 10),
          limit=st.sampled_from([None, None, 0, 5, 9]))
    def new_marked_request(self, tokens, salt, marks, chunk, limit):
        self.admit_marked(tokens, salt, marks, limit, chunk)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 2), max_size=3), salt=SALTS)
    def repeat_marked(self, data, extra, salt):
        """A prompt extending a live one's, marked where the live one's prompt could be."""
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        tokens = self.reqs[rid]["tokens"] + extra
        marks = data.draw(st.lists(st.integers(1, len(tokens)), max_size=3))
        self.admit_marked(tokens, salt, marks, None, data.draw(st.integers(1, 30)))

    @rule(tokens=TOKENS, salt=SALTS, n=st.integers(1, 24))
    def pin_exact(self, tokens, salt, n):
        try:
            info = self.kv.pin_prefix(tokens, cache_salt=salt, num_tokens=n, exact=True)
        except PinLimitError:
            return
        assert info.num_tokens <= min(n, len(tokens))
        for pos in range(info.num_tokens):
            assert self.slots.get((info.block_ids[pos // self.bs], pos % self.bs)) == \
                self.context(salt, tokens, pos)
        if info.pin_id is not None:
            self.pin_ids.append(info.pin_id)


KVPartialModel.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
TestKVPartialModel = KVPartialModel.TestCase
