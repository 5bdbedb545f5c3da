"""Continuous batching with chunked prefill over the paged KV cache.

Each step spends a token budget: running requests first (decodes and prompt
chunks already under way), in priority-then-arrival order, then new requests
from the waiting queue. When the pool runs dry the least important, latest
running request is preempted: its blocks go back to the pool (still cached),
and it is recomputed later, mostly from those cached blocks.

With several tenants having work (and fair_scheduling on), the step is shared
between them instead (_schedule_shares): each gets up to its weighted slice of
the budget in counter order (scheduler/tenants.py), then what is left goes to
whoever can use it, lowest counter first; within a tenant the order above holds.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Optional

from prefixserve.errors import DuplicateRequestError, InvalidRequestError, PromptTooLongError, QueueFullError
from prefixserve.kv import Allocation, KVCacheManager
from prefixserve.scheduler.config import SchedulerConfig
from prefixserve.scheduler.output import ScheduledSequence, SchedulerOutput
from prefixserve.scheduler.request import Request, RequestStatus, child_request_id
from prefixserve.scheduler.tenants import TenantLedger, tenant_share


@dataclass
class SchedulerStats:
    requests_admitted: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    computed_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    steps: int = 0


@dataclass
class _Undo:
    """What a step changed in a request it admitted or copied blocks for, beyond its blocks.
    A running request without copies needs no record: its plan entry's start_pos is where
    it stood."""
    status: RequestStatus        # before the step: RUNNING, or WAITING / PREEMPTED if admitted
    admitted: bool
    copied: bool                 # copy-on-write replaced one of its blocks in this step
    num_cached_tokens: int
    first_scheduled_time: Optional[float]


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self.tenants = TenantLedger(dict(config.tenant_weights))
        self._failed: list[str] = []
        # Requests the worker holds a block table row for, and those whose rows it must drop next.
        self._worker_rows: set[str] = set()
        self._dropped: list[str] = []
        # The latest plan and how to undo it, should its forward fail.
        self._last_plan: Optional[SchedulerOutput] = None
        self._undo: dict[str, _Undo] = {}
        # Requests ended while their sampled tokens were applied: id -> the exception.
        self._errors: dict[str, BaseException] = {}

    # ----------------------------------------------------------------- intake
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise DuplicateRequestError(f"request id {req.request_id!r} is already in use",
                                        param="request_id")
        self.check_fits(req.num_prompt_tokens, req.max_tokens)
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full ({self.config.max_waiting} requests)")
        if self.config.max_waiting is not None and self.config.fair_scheduling:
            share = tenant_share(self.config.max_waiting, self.tenants.weights, req.tenant)
            if share is not None and sum(r.tenant == req.tenant for r in self.waiting) >= share:
                raise QueueFullError(f"tenant {req.tenant!r} has its share of the waiting queue "
                                     f"({share} of {self.config.max_waiting} requests) waiting")
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)
        self.tenants.arrived(req.tenant)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raises an InvalidRequestError for a request that no amount of waiting would let run."""
        if num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens >= self.config.max_model_len:
            raise PromptTooLongError(
                f"prompt has {num_prompt_tokens} tokens; max_model_len is {self.config.max_model_len} "
                "and at least one token must be generated", param="prompt")
        if total > self.config.max_model_len:
            # the client asked for too many tokens, not for too long a prompt: name max_tokens and
            # the most this prompt leaves room for
            largest = self.config.max_model_len - num_prompt_tokens
            raise PromptTooLongError(
                f"max_tokens must be at most {largest} for this prompt: its {num_prompt_tokens} tokens "
                f"+ max_tokens {max_tokens} = {total} exceed max_model_len ({self.config.max_model_len})",
                param="max_tokens")
        blocks = -(-total // self.kv.block_size)
        if blocks > self.kv.num_blocks:
            raise PromptTooLongError(
                f"prompt + max_tokens needs {blocks} KV blocks but the whole pool has "
                f"{self.kv.num_blocks}; raise kv_cache_memory or num_kv_blocks", param="prompt")

    # --------------------------------------------------------------- planning
    def schedule(self, only: Optional[Collection[str]] = None) -> SchedulerOutput:
        """Plans the next step. With `only`, just those requests are scheduled or admitted (the
        engine re-runs the requests of a failed step in smaller groups to find the one that
        fails); others may still be preempted to make room for them."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        self.stats.steps += 1
        self.running.sort(key=self._importance)
        self._undo = {}
        self._last_plan = out

        if self._fair_step():
            self._schedule_shares(out, budget, scheduled, only)
        else:
            for req in list(self.running):
                if budget == 0:
                    break
                if req.status is not RequestStatus.RUNNING:
                    continue  # preempted earlier in this loop
                if only is not None and req.request_id not in only:
                    continue
                num_new = self._chunk(req, req.num_computed_tokens,
                                      min(req.num_tokens - req.num_computed_tokens, budget))
                if num_new <= 0:
                    continue
                if self._run_one(req, num_new, scheduled, out):
                    budget -= num_new
            # New work only joins a step that did not have to take memory back.
            if not out.preempted_ids:
                self._admit_waiting(out, budget, scheduled, only)
        if out.is_empty and not self.running and self.waiting and only is None:
            self._fail_unservable(self.waiting[0])
        out.dropped_ids = self.take_dropped_ids()
        return out

    def _run_one(self, req: Request, num_new: int, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Allocates a running request's next num_new tokens, preempting others (or itself)
        while the pool is short; whether it was scheduled."""
        while True:
            alloc = self.kv.allocate_slots(
                req.request_id, req.all_token_ids, req.num_computed_tokens, num_new,
                cache_salt=req.cache_salt, priority=req.priority,
                breakpoints=req.cache_breakpoints, write_limit=req.cache_write_limit,
                image_spans=req.image_spans, tenant=req.tenant)
            if alloc is not None:
                break
            victim = self._pick_victim(scheduled)
            self._preempt(victim, out)
            if victim is req:
                return False
        out.block_copies.extend(alloc.copies)
        scheduled.add(req.request_id)
        if alloc.copies:
            self._undo[req.request_id] = _Undo(RequestStatus.RUNNING, False, True,
                                               req.num_cached_tokens, req.first_scheduled_time)
        out.sequences.append(self._plan(req, num_new, alloc))
        return True

    def _fair_step(self) -> bool:
        return self.config.fair_scheduling and self.tenants.num_active > 1

    def _schedule_shares(self, out: SchedulerOutput, budget: int, scheduled: set[str],
                         only: Optional[Collection[str]]) -> None:
        """The step shared across tenants. Pass one serves each tenant with work, lowest
        counter first, up to its weighted slice of the budget (at least one token), so every
        tenant able to run gets tokens in every step; pass two hands what is left to whoever can
        use it, lowest counter first (work-conserving). A tenant's running requests go before
        its waiting ones, each list in importance order. A waiting request short of memory
        preempts work of a tenant holding more of the pool per weight than its own (_preempt_for);
        one it still cannot place (no slot within its share, no memory) stops its tenant's
        admissions, not the others'; after a preemption only the tenant that made room for
        itself is admitted, as the one-tenant step admits nobody."""
        ledger = self.tenants
        if len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=self._importance))
        running: dict[Optional[str], deque[Request]] = {}
        waiting: dict[Optional[str], deque[Request]] = {}
        for req in self.running:
            if only is None or req.request_id in only:
                running.setdefault(req.tenant, deque()).append(req)
        for req in self.waiting:
            if only is None or req.request_id in only:
                waiting.setdefault(req.tenant, deque()).append(req)
        tenants = set(running) | set(waiting)
        total_weight = sum(ledger.weight(t) for t in tenants)
        step_budget = budget
        admitting = set(waiting)
        made_room: set[Optional[str]] = set()   # tenants that preempted others' work to be admitted

        holding = self._holding()

        def order(t: Optional[str]) -> tuple[float, float, tuple[int, float, int]]:
            # lowest counter first; on a tie (a tenant just lifted to the others' minimum) the
            # one holding less, then the more important head
            queue = running.get(t) or waiting[t]
            return ledger.counter(t), holding.get(t, 0.0), self._importance(queue[0])

        def serve(t: Optional[str], quota: Optional[int]) -> None:
            nonlocal budget
            left = budget if quota is None else min(quota, budget)
            queue = running.get(t, deque())
            while queue and left > 0:
                req = queue.popleft()
                num_new = self._chunk(req, req.num_computed_tokens,
                                      min(req.num_tokens - req.num_computed_tokens, left))
                if req.status is not RequestStatus.RUNNING or num_new <= 0:
                    continue  # preempted earlier in this step, or nothing to compute
                if self._run_one(req, num_new, scheduled, out):
                    budget -= num_new
                    left -= num_new
            queue = waiting.get(t, deque())
            while queue and left > 0 and t in admitting and (not out.preempted_ids or t in made_room):
                req = queue[0]
                granted = None
                if self._slot_within_share(req, waiting, admitting, total_weight):
                    granted = self._admit_one(req, left, out, scheduled)
                    while granted is None and self._preempt_for(req, scheduled, out):
                        made_room.add(t)
                        granted = self._admit_one(req, left, out, scheduled)
                if granted is None:
                    admitting.discard(t)
                    break
                queue.popleft()
                budget -= granted
                left -= granted

        for t in sorted(tenants, key=order):
            if budget == 0:
                return
            serve(t, max(1, int(step_budget * ledger.weight(t) / total_weight)))
        for t in sorted(tenants, key=lambda t: ledger.counter(t)):
            if budget == 0:
                return
            serve(t, None)

    def _holding(self) -> dict[Optional[str], float]:
        """Computed tokens each tenant's running requests hold, per unit of its weight: how far
        over its share of the pool it is, in comparison with the others."""
        held: dict[Optional[str], float] = {}
        for r in self.running:
            held[r.tenant] = held.get(r.tenant, 0.0) + r.num_computed_tokens / self.tenants.weight(r.tenant)
        return held

    def _preempt_for(self, req: Request, scheduled: set[str], out: SchedulerOutput) -> bool:
        """Memory for a waiting request whose tenant holds less of the pool (per weight) than
        another: preempts the least important request, not yet scheduled in this step, of the
        tenant holding the most. Whether one was preempted (False: none holds more)."""
        held = self._holding()
        mine = held.get(req.tenant, 0.0)
        candidates = [r for r in self.running
                      if r.request_id not in scheduled and r.tenant != req.tenant and held[r.tenant] > mine]
        if not candidates:
            return False
        most = max(held[r.tenant] for r in candidates)
        victim = max((r for r in candidates if held[r.tenant] == most), key=self._importance)
        self._preempt(victim, out)
        return True

    def _slot_within_share(self, req: Request, waiting: dict[Optional[str], deque[Request]],
                           admitting: set[Optional[str]], total_weight: float) -> bool:
        """Whether req may take running slots now: a free one within its tenant's weighted
        share of max_num_seqs, or beyond it one that no other waiting tenant still needs to
        reach its own share (an idle tenant's slots go to the others)."""
        seats = self._seats(req)
        limit = self.config.max_num_seqs
        if not self.running:
            return True
        if len(self.running) + seats > limit:
            return False
        ledger = self.tenants
        holding: dict[Optional[str], int] = {}
        for r in self.running:
            holding[r.tenant] = holding.get(r.tenant, 0) + 1

        def share(t: Optional[str]) -> int:
            return max(1, int(limit * ledger.weight(t) / total_weight))

        if holding.get(req.tenant, 0) + seats <= share(req.tenant):
            return True
        reserved = sum(max(0, share(t) - holding.get(t, 0)) for t, queue in waiting.items()
                       if queue and t != req.tenant and t in admitting)
        return len(self.running) + seats + reserved <= limit

    @staticmethod
    def _seats(req: Request) -> int:
        return req.sampling_params.n if req.sample_index == 0 and req.num_output_tokens == 0 else 1

    def _admit_waiting(self, out: SchedulerOutput, budget: int, scheduled: set[str],
                       only: Optional[Collection[str]]) -> None:
        if len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=self._importance))
        candidates = None if only is None else [r for r in self.waiting if r.request_id in only]
        while budget > 0:
            if candidates is None:
                if not self.waiting:
                    break
                req = self.waiting[0]
            elif candidates:
                req = candidates.pop(0)
            else:
                break
            if self.running and len(self.running) + self._seats(req) > self.config.max_num_seqs:
                break
            granted = self._admit_one(req, budget, out, scheduled)
            if granted is None:
                break
            budget -= granted

    def _admit_one(self, req: Request, budget: int, out: SchedulerOutput,
                   scheduled: set[str]) -> Optional[int]:
        """Admits a waiting request with up to budget tokens: the tokens granted, or None (and
        nothing changed) when its blocks cannot be allocated."""
        resumed = req.num_preemptions > 0
        hit = self.kv.find_cached_prefix(
            req.request_id, req.all_token_ids, cache_salt=req.cache_salt, preempted=resumed,
            breakpoints=req.cache_breakpoints, image_spans=req.image_spans)
        num_new = self._chunk(req, hit.num_tokens, min(req.num_tokens - hit.num_tokens, budget))
        alloc = self.kv.allocate_slots(
            req.request_id, req.all_token_ids, hit.num_tokens, num_new, hit=hit,
            cache_salt=req.cache_salt, priority=req.priority,
            breakpoints=req.cache_breakpoints, write_limit=req.cache_write_limit,
            image_spans=req.image_spans, tenant=req.tenant)
        if alloc is None:
            return None
        if self.waiting and self.waiting[0] is req:
            self.waiting.popleft()
        else:
            self.waiting.remove(req)
        out.block_copies.extend(alloc.copies)
        self._undo[req.request_id] = _Undo(req.status, True, bool(alloc.copies),
                                           req.num_cached_tokens, req.first_scheduled_time)
        req.num_computed_tokens = hit.num_tokens
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = hit.num_tokens
            req.first_scheduled_time = self.clock()
            self.stats.requests_admitted += 1
            self.stats.prompt_tokens += req.num_prompt_tokens
            self.stats.cached_prompt_tokens += hit.num_tokens
            self.tenants.admitted(req.tenant, req.num_prompt_tokens, hit.num_tokens)
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        scheduled.add(req.request_id)
        out.sequences.append(self._plan(req, num_new, alloc))
        return num_new

    def _chunk(self, req: Request, start: int, num_new: int) -> int:
        """num_new, cut so that the chunk ends at the request's next token-exact breakpoint
        inside a block: the K/V up to it is then written before any later token's, and the next
        allocation can cache that block as the breakpoint's partial block."""
        bs = self.kv.block_size
        for t in req.cache_breakpoints:
            if t > start and t % bs and self.kv.enable_prefix_caching:
                return min(num_new, t - start)
        return num_new

    def _plan(self, req: Request, num_new: int, alloc: Allocation) -> ScheduledSequence:
        start = req.num_computed_tokens
        end = start + num_new
        self.stats.computed_prompt_tokens += max(0, min(end, req.num_prompt_tokens) - start)
        self.stats.computed_tokens += num_new
        self.tenants.charge(req.tenant, num_new)
        req.num_computed_tokens = end
        sample = end == req.num_tokens
        fan_out = req.sampling_params.n if (sample and req.sample_index == 0
                                            and req.num_output_tokens == 0) else 1
        seq = ScheduledSequence(request_id=req.request_id, token_ids=req.all_token_ids[start:end],
                                start_pos=start, sample=sample, num_samples=fan_out,
                                multimodal=req.multimodal)
        # The worker's row is the table as last sent plus the blocks appended since; a copy-on-write
        # swap changes an entry in place, so then (and for a row it lacks) the whole table goes.
        if alloc.copies or req.request_id not in self._worker_rows:
            self._worker_rows.add(req.request_id)
            seq.full_block_table = self.kv.block_table(req.request_id)
        else:
            seq.new_block_ids = alloc.new_block_ids
        return seq

    def _drop_worker_row(self, request_id: str) -> None:
        if request_id in self._worker_rows:
            self._worker_rows.remove(request_id)
            self._dropped.append(request_id)

    def take_dropped_ids(self) -> list[str]:
        """Requests freed since the last call whose block tables the worker still holds.

        Every plan carries them; an engine going idle hands them to the worker itself."""
        dropped, self._dropped = self._dropped, []
        return dropped

    def _importance(self, req: Request) -> tuple[int, float, int]:
        # Smaller sorts first: higher priority (under the priority policy), then
        # earlier arrival, then the first of a group of forked samples.
        rank = -req.priority if self.config.policy == "priority" else 0
        return (rank, req.arrival_time, req.sample_index)

    def _pick_victim(self, scheduled: set[str]) -> Request:
        candidates = [r for r in self.running if r.request_id not in scheduled]
        # The request being placed is always a candidate, so this is never empty.
        if self._fair_step():
            # From the tenant most over its share: the most computed tokens held per weight.
            held = self._holding()
            most = max(held[r.tenant] for r in candidates)
            candidates = [r for r in candidates if held[r.tenant] == most]
        return max(candidates, key=self._importance)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv.free(req.request_id)
        self._drop_worker_row(req.request_id)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_ids.append(req.request_id)

    def _fail_unservable(self, req: Request) -> None:
        # Only reachable when pinned blocks hold the memory this request needs.
        req.stop_reason = "not enough free KV blocks (pinned prefixes hold the rest)"
        self.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED, req.stop_reason)
        self._failed.append(req.request_id)

    def take_failed(self) -> list[str]:
        """Ids of requests the scheduler ended on its own since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def rollback(self, out: SchedulerOutput) -> list[str]:
        """Puts every request the latest plan scheduled back where it was before that plan,
        after the step's forward raised: its tokens are scheduled again, the hashes registered
        for them leave the cache (their K/V may never have been written) and a request the plan
        admitted waits again. Preemptions and failures the plan decided stand, being valid
        whatever the forward did. Returns the ids put back, in plan order."""
        if out is not self._last_plan:
            raise ValueError("only the latest plan can be rolled back, before the next is made")
        undo, self._undo, self._last_plan = self._undo, {}, None
        rolled: list[str] = []
        for seq in out.sequences:
            req = self.requests.get(seq.request_id)
            if req is None or req.is_finished:
                continue
            u = undo.get(seq.request_id)
            self.stats.computed_tokens -= seq.num_tokens
            self.tenants.charge(req.tenant, -seq.num_tokens)
            self.stats.computed_prompt_tokens -= max(
                0, min(seq.seq_len, req.num_prompt_tokens) - seq.start_pos)
            # The worker may hold this step's blocks in its row, or no row at all: it gets the
            # whole table again when the request is next scheduled.
            self._drop_worker_row(req.request_id)
            self.kv.rewind(req.request_id, seq.start_pos)
            if u is None:
                req.num_computed_tokens = seq.start_pos
                rolled.append(req.request_id)
                continue
            self.kv.free(req.request_id)
            self.running.remove(req)
            req.num_computed_tokens = 0
            if u.admitted:
                req.status = u.status
                if u.num_cached_tokens < 0:  # its first admission: undone as if never made
                    self.stats.requests_admitted -= 1
                    self.stats.prompt_tokens -= req.num_prompt_tokens
                    self.stats.cached_prompt_tokens -= seq.start_pos
                    self.tenants.admitted(req.tenant, -req.num_prompt_tokens, -seq.start_pos)
                req.num_cached_tokens = u.num_cached_tokens
                req.first_scheduled_time = u.first_scheduled_time
            else:
                # A copy-on-write target may never have received its copy, so its table
                # cannot be trusted: the request is recomputed as after a preemption, its
                # blocks from before this step still cached.
                req.status = RequestStatus.PREEMPTED
                req.num_preemptions += 1
            self.waiting.appendleft(req)
            rolled.append(req.request_id)
        return rolled

    def take_errors(self) -> dict[str, BaseException]:
        """Requests ended since the last call because applying their sampled tokens raised
        (forked samples included), each with its exception."""
        errors, self._errors = self._errors, {}
        return errors

    # ---------------------------------------------------------------- results
    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[Request]:
        """Applies sampled tokens; returns every request that gained tokens or finished."""
        touched: list[Request] = []
        now = self.clock()
        self._undo, self._last_plan = {}, None
        for seq in out.sequences:
            req = self.requests.get(seq.request_id)
            if req is None or req.is_finished or not seq.sample:
                continue
            forked: list[Request] = []
            try:
                tokens = sampled[seq.request_id]
                if seq.num_samples > 1:
                    for index, token in enumerate(tokens[1:], start=1):
                        child = self._fork(req, index)
                        forked.append(child)
                        self._accept_token(child, token, now)
                self._accept_token(req, tokens[0], now)
            except Exception as exc:
                # A value of this request's that slipped through validation (its stop ids,
                # say) ends this request alone; the step's others keep their tokens.
                for r in (req, *forked):
                    self.finish_request(r.request_id, RequestStatus.FINISHED_ABORTED)
                    self._errors[r.request_id] = exc
                continue
            touched.extend(forked)
            touched.append(req)
        return touched

    def _accept_token(self, req: Request, token: int, now: float) -> None:
        req.append_output_token(token)
        self.stats.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
                return
            if token in params.stop_token_ids:
                self.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED, token)
                return
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            self.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)

    def _fork(self, parent: Request, index: int) -> Request:
        child = Request(
            request_id=child_request_id(parent.request_id, index),
            prompt_token_ids=parent.prompt_token_ids,
            sampling_params=parent.sampling_params,
            max_tokens=parent.max_tokens,
            eos_token_ids=parent.eos_token_ids,
            cache_salt=parent.cache_salt,
            priority=parent.priority,
            tenant=parent.tenant,
            arrival_time=parent.arrival_time,
            sample_index=index,
            image_spans=parent.image_spans,
            multimodal=parent.multimodal,
        )
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        child.first_scheduled_time = parent.first_scheduled_time
        child.status = RequestStatus.RUNNING
        self.kv.fork(parent.request_id, child.request_id)
        self.requests[child.request_id] = child
        self.running.append(child)
        self.tenants.arrived(child.tenant)
        return child

    # -------------------------------------------------------------- lifecycle
    def finish_request(self, request_id: str, status: RequestStatus,
                       stop_reason: int | str | None = None) -> None:
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(request_id)
        self._drop_worker_row(request_id)
        self.tenants.left(req.tenant)
        req.status = status
        if stop_reason is not None:
            req.stop_reason = stop_reason
        req.finished_time = self.clock()

    def stop_request(self, request_id: str, stop_reason: str) -> None:
        """Ends a request on a stop string its engine found in the text. The token that
        completed the string may also have ended the request in this step (a length limit, a
        stop token): the stop string explains the end better, so it wins."""
        req = self.requests.get(request_id)
        if req is None or req.status is RequestStatus.FINISHED_ABORTED:
            return
        if req.is_finished:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop_reason
        else:
            self.finish_request(request_id, RequestStatus.FINISHED_STOPPED, stop_reason)

    def get_request(self, request_id: str) -> Request:
        """A request the scheduler holds, for reading: only the scheduler changes its state."""
        return self.requests[request_id]

    def abort(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.finish_request(rid, RequestStatus.FINISHED_ABORTED)

    def release(self, request_id: str) -> Optional[Request]:
        """Forgets a finished request once its output has been delivered."""
        req = self.requests.get(request_id)
        if req is not None and req.is_finished:
            del self.requests[request_id]
            return req
        return None

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting)
