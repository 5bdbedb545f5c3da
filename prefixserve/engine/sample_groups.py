"""The n-sample fan-out: a user request is a group of samples over one prompt.

The scheduler sees each sample as a request of its own (it forks the children from the first
once the prompt is computed); the engine answers per group. This table maps between the two
and holds each sample's output state: its detokenizer, its random stream and its grammar.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from prefixserve.engine.outputs import CachePin, PinResult
from prefixserve.sampling_params import SamplingParams
from prefixserve.scheduler import Request, ScheduledSequence, SchedulerOutput, child_request_id
from prefixserve.structured.constraint import Constraint
from prefixserve.tokenizer import IncrementalDetokenizer, Tokenizer
from prefixserve.worker.sampler import SamplingRow

# Sampled in place of a request whose own row could not be built: the forward still computes
# its tokens (others may read its K/V in the same step) and the token drawn is thrown away.
STAND_IN = SamplingRow(params=SamplingParams(temperature=0.0, max_tokens=1),
                       prompt_token_ids=(), output_token_ids=())


@dataclass
class Sample:
    """Output state of one of a request's n samples."""
    index: int
    detokenizer: IncrementalDetokenizer
    generator: Optional[torch.Generator]
    constraint: Optional[Constraint] = None  # the grammar its output must match
    text: str = ""
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None


@dataclass
class Group:
    """A user request: one prompt, n samples (forked after the prompt is computed)."""
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: Optional[str]
    arrival_time: float
    samples: dict[str, Sample] = field(default_factory=dict)  # scheduler request id -> sample
    cache_pins: tuple[CachePin, ...] = ()
    pin_results: list[PinResult] = field(default_factory=list)
    error: Optional[str] = None  # why the engine ended it when a step failed on it
    # Compiled once and never advanced: each sample's matcher is a fork of it.
    grammar: Optional[Constraint] = None
    image_spans: tuple = ()   # the prompt's images (Request.image_spans)
    tenant: Optional[str] = None


# Samples a step forks, by scheduler request id: (group id, sample), joining their group once
# the scheduler has applied the fork.
Children = dict[str, tuple[str, Sample]]


class SampleGroups:
    def __init__(self, tokenizer: Tokenizer, device: torch.device) -> None:
        self.tokenizer = tokenizer
        self.device = device
        self.groups: dict[str, Group] = {}
        self.group_of: dict[str, str] = {}   # sample (scheduler request) id -> group id
        self.requests_finished = 0

    def add(self, group: Group) -> None:
        """Holds a new request with its first sample."""
        group.samples[group.request_id] = self.new_sample(group, 0, group.params.seed)
        self.groups[group.request_id] = group
        self.group_of[group.request_id] = group.request_id

    def remove(self, gid: str) -> Optional[Group]:
        """Forgets a request that ended (finished, aborted or failed); None if not held."""
        group = self.groups.pop(gid, None)
        if group is None:
            return None
        for sid in group.samples:
            self.group_of.pop(sid, None)
        self.requests_finished += 1
        return group

    @property
    def num_seats(self) -> int:
        """Sequences the requests held hold or will hold, each its n (admission bounds these)."""
        return sum(group.params.n for group in self.groups.values())

    def seats_by_tenant(self) -> dict[str, int]:
        """num_seats of each named tenant's requests (admission holds each to its share)."""
        seats: dict[str, int] = {}
        for group in self.groups.values():
            if group.tenant is not None:
                seats[group.tenant] = seats.get(group.tenant, 0) + group.params.n
        return seats

    def new_sample(self, group: Group, index: int, seed: Optional[int]) -> Sample:
        generator = None
        if seed is not None:
            # Each sample of a seeded request gets its own stream, fixed by (seed, index).
            derived = seed if index == 0 else (seed * 1_000_003 + index) % (2**63 - 1)
            generator = torch.Generator(device=self.device).manual_seed(derived)
        detok = IncrementalDetokenizer(self.tokenizer, group.prompt_token_ids,
                                       skip_special_tokens=group.params.skip_special_tokens)
        return Sample(index=index, detokenizer=detok, generator=generator,
                      constraint=group.grammar.fork() if group.grammar is not None else None)

    def sampling_rows(self, plan: SchedulerOutput, get_request: Callable[[str], Request], children: Children
                      ) -> tuple[list[SamplingRow], list[tuple[str, int]], list[tuple[str, Exception]]]:
        """The step's sampling rows, the (request id, sample index) each belongs to, and the
        requests whose rows could not be built (group id, why), sampled with stand-ins."""
        rows: list[SamplingRow] = []
        row_owner: list[tuple[str, int]] = []
        broken: list[tuple[str, Exception]] = []
        for seq in plan.sequences:
            if not seq.sample:
                continue
            gid = self.group_of[seq.request_id]
            try:
                seq_rows = self._rows_of(seq, self.groups[gid], get_request(seq.request_id), children)
            except Exception as exc:
                broken.append((gid, exc))
                seq_rows = [STAND_IN] * seq.num_samples
            rows.extend(seq_rows)
            row_owner.extend((seq.request_id, k) for k in range(seq.num_samples))
        return rows, row_owner, broken

    def _rows_of(self, seq: ScheduledSequence, group: Group, req: Request, children: Children) -> list[SamplingRow]:
        blocked = req.eos_token_ids | frozenset(group.params.stop_token_ids)
        rows = []
        for k in range(seq.num_samples):
            if k > 0:
                # Joins the group once the scheduler has forked it, so a step that fails first
                # leaves no sample without a request behind.
                sample = self.new_sample(group, k, group.params.seed)
                children[child_request_id(seq.request_id, k)] = (group.request_id, sample)
            else:
                sample = group.samples[seq.request_id]
            rows.append(SamplingRow(
                params=group.params,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids,
                min_tokens_blocked=blocked,
                generator=sample.generator,
                constraint=sample.constraint,
            ))
        return rows

    def record_logprobs(self, row_owner: Sequence[tuple[str, int]], logprobs: Sequence[Optional[float]],
                        top_logprobs: Sequence[Optional[list[tuple[int, float]]]]) -> None:
        """Adds each row's logprobs to its sample, unless the engine failed on its request."""
        for (rid, k), logprob, top in zip(row_owner, logprobs, top_logprobs):
            sid = rid if k == 0 else child_request_id(rid, k)
            gid = self.group_of.get(sid)
            # a row with a logprob has its alternatives (an empty list when none were asked for)
            if logprob is not None and top is not None and gid is not None and self.groups[gid].error is None:
                self.groups[gid].samples[sid].logprobs.append((logprob, top))

    def adopt(self, children: Children, forked: Sequence[str]) -> None:
        """The children among forked (sample ids the scheduler now holds) join their groups."""
        for sid in forked:
            if sid in children:
                gid, sample = children.pop(sid)
                self.groups[gid].samples[sid] = sample
                self.group_of[sid] = gid
