"""The brute-force model of tests/kv/test_kv_property.py, with token-exact breakpoints and
explicit write limits mixed into every kind of operation (forks, preemption, eviction, pins,
resets): every slot a hit or a pin hands over still holds exactly the requested context, and
no request's computed slots ever change under it."""
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from prefixserve.kv import PinLimitError
from test_kv_property import SALTS, TOKENS, KVModel

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
