"""Failure isolation: a failure in one request's part of a step ends that request alone.

A failure with a culprit (its sampling row, its sampling, applying its token, its text, its
pins, its output) ends that request at once. A failed batched forward names none: the step is
undone and its requests re-run in groups, front group first, until the one that fails alone is
found (a bisection); strikes count each request's failed steps since it last completed one, a
backstop should groups keep failing without the search converging.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Optional

from prefixserve.engine.output_processor import OutputProcessor
from prefixserve.engine.outputs import RequestOutput
from prefixserve.engine.sample_groups import SampleGroups
from prefixserve.kv import KVCacheManager
from prefixserve.scheduler import RequestStatus, Scheduler, SchedulerOutput
from prefixserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)
# A request in this many failed steps in a row is ended even if never alone in one. A bisection
# puts a request in at most log2(step size) + 1 of them, far fewer for any batch that fits;
# this bounds the case where its retry group could not be scheduled and the search restarted.
MAX_FAILED_STEPS = 32


def why(stage: str, exc: BaseException, gid: str) -> str:
    # The type only: this text reaches clients, and an exception's message may show internals.
    logger.error("engine failed on request %s while %s", gid, stage, exc_info=exc)
    return f"the engine failed on this request while {stage} ({type(exc).__name__})"


def note_failure(failed: dict[str, str], gid: str, stage: str, exc: BaseException) -> None:
    """Records the first failure of a request in this step (the one its error names)."""
    if gid not in failed:
        failed[gid] = why(stage, exc, gid)


class FailureIsolation:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, kv: KVCacheManager,
                 groups: SampleGroups, output_processor: OutputProcessor) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.kv = kv
        self.groups = groups
        self.output_processor = output_processor
        self._probes: deque[list[str]] = deque()
        self._strikes: dict[str, int] = {}
        self.step_failures: dict[str, str] = {}

    def begin_step(self) -> Optional[set[str]]:
        """Forgets the previous step's failures; returns the requests this step may schedule
        while a bisection runs (None: any)."""
        self.step_failures = {}
        return self._next_probe()

    def forget(self, sid: str) -> None:
        """An aborted sample needs no more retries."""
        self._strikes.pop(sid, None)

    def fail_group(self, gid: str, reason: str) -> None:
        """Ends every sample of a request the engine failed on; its next output carries why."""
        group = self.groups.groups.get(gid)
        if group is None or group.error is not None:
            return
        group.error = reason
        self.step_failures[gid] = reason
        for sid, sample in group.samples.items():
            self.scheduler.finish_request(sid, RequestStatus.FINISHED_ABORTED)
            self._strikes.pop(sid, None)
            if sample.finish_reason is None:
                sample.finish_reason, sample.stop_reason = "abort", None

    def fail_groups(self, failed: dict[str, str]) -> set[str]:
        """Ends each request of failed (group id -> why); returns their ids."""
        for gid, reason in failed.items():
            self.fail_group(gid, reason)
        return set(failed)

    def emit_or_fail(self, gid: str) -> RequestOutput:
        try:
            return self.output_processor.emit(gid)
        except Exception as exc:
            self.fail_group(gid, why("building its output", exc, gid))
        return self.output_processor.emit_failed(gid)

    def _is_live(self, sid: str) -> bool:
        return sid in self.groups.group_of and not self.scheduler.get_request(sid).is_finished

    def _next_probe(self) -> Optional[set[str]]:
        while self._probes:
            live = [sid for sid in self._probes[0] if self._is_live(sid)]
            if live:
                self._probes[0] = live
                return set(live)
            self._probes.popleft()
        return None

    def step_passed(self, plan: SchedulerOutput, probing: bool) -> None:
        scheduled = [seq.request_id for seq in plan.sequences]
        if self._strikes:
            for sid in scheduled:
                self._strikes.pop(sid, None)
        if probing:
            # Cleared members leave the group; a group none of which could be scheduled
            # (memory held elsewhere) is dropped, and its requests run with the others again.
            done = set(scheduled)
            rest = [sid for sid in self._probes[0] if sid not in done]
            if rest and done:
                self._probes[0] = rest
            else:
                self._probes.popleft()

    def recover(self, plan: SchedulerOutput, probing: bool, failed: dict[str, str],
                exc: Exception) -> set[str]:
        """After a batched forward raised: undoes the step, ends the requests known to be at
        fault, and queues the rest to re-run in halves (a bisection: a request is in at most
        log2(step size) + 1 failed steps before it has failed alone or completed a step).
        Returns the requests whose outputs the step owes."""
        scheduled = [seq.request_id for seq in plan.sequences]
        logger.error("engine step of %d requests failed", len(scheduled), exc_info=exc)
        suspects = self.undo_step(plan)
        if probing:
            done = set(scheduled)
            rest = [sid for sid in self._probes[0] if sid not in done]
            if rest:
                self._probes[0] = rest
            else:
                self._probes.popleft()
        moved = self.fail_groups(failed)
        suspects = [sid for sid in suspects if self._is_live(sid)]
        stage = "running the batched forward pass"
        if len(scheduled) == 1 and suspects:
            gid = self.groups.group_of[suspects[0]]
            self.fail_group(gid, why(f"{stage} with it alone", exc, gid))
            moved.add(gid)
            suspects = []
        for sid in suspects:
            self._strikes[sid] = self._strikes.get(sid, 0) + 1
            if self._strikes[sid] >= MAX_FAILED_STEPS:
                gid = self.groups.group_of[sid]
                self.fail_group(gid, why(f"{stage}, in every retry", exc, gid))
                moved.add(gid)
        suspects = [sid for sid in suspects if self._is_live(sid)]
        half = (len(suspects) + 1) // 2
        for part in (suspects[half:], suspects[:half]):
            if part:
                self._probes.appendleft(part)
        return moved

    def undo_step(self, plan: SchedulerOutput) -> list[str]:
        """Puts the step's requests back as they were before it; returns their ids."""
        try:
            rolled = self.scheduler.rollback(plan)
            # The worker may not have dropped these before the forward failed.
            self.runner.drop_requests(plan.dropped_ids)
            return rolled
        except Exception as exc:
            # Which cached blocks were written is unknown after a broken undo: the step's
            # requests end and every hash goes, so no request can read K/V never computed.
            logger.error("undoing a failed step failed; ending its requests", exc_info=exc)
            reason = f"the engine failed to recover from a failed step ({type(exc).__name__})"
            for seq in plan.sequences:
                gid = self.groups.group_of.get(seq.request_id)
                if gid is not None:
                    self.fail_group(gid, reason)
            self.kv.reset_prefix_cache()
            return []
