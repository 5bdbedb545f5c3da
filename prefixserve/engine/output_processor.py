"""Output processing: sampled tokens become text, stop strings end samples, groups become outputs.

Outputs are cumulative: each one a request's consumer receives holds everything so far, so a
consumer that keeps only the newest loses nothing. Streamed text never shrinks: a tail that may
still grow into a stop string is held back until it cannot.
"""
from __future__ import annotations

from typing import Optional

from prefixserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from prefixserve.engine.sample_groups import Group, SampleGroups
from prefixserve.sampling_params import SamplingParams
from prefixserve.scheduler import Request, RequestStatus, Scheduler


def visible_text(text: str, params: SamplingParams, finished: bool) -> str:
    """Holds back a tail that may still grow into a stop string, so streamed text never shrinks."""
    if finished or not params.stop:
        return text
    hold = 0
    for s in params.stop:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return text[:len(text) - hold] if hold else text


def find_stop(text: str, delta_len: int, params: SamplingParams) -> Optional[tuple[int, str]]:
    if not params.stop:
        return None
    best: Optional[tuple[int, str]] = None
    for s in params.stop:
        # Only the new text (plus a stop string's length of context) can hold a new match.
        start = max(0, len(text) - delta_len - len(s) + 1)
        at = text.find(s, start)
        if at != -1 and (best is None or at < best[0]):
            best = (at, s)
    return best


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, groups: SampleGroups) -> None:
        self.scheduler = scheduler
        self.groups = groups

    def advance_text(self, group: Group, req: Request) -> None:
        """Detokenizes the sample's newest token; a stop string in the new text ends the sample."""
        sample = group.samples[req.request_id]
        delta = sample.detokenizer.add(req.output_token_ids[-1])
        if not delta:
            return
        sample.text += delta
        stop = find_stop(sample.text, len(delta), group.params)
        if stop is None:
            return
        at, s = stop
        sample.text = sample.text[:at + (len(s) if group.params.include_stop_str_in_output else 0)]
        self.scheduler.stop_request(req.request_id, s)

    def emit(self, gid: str) -> RequestOutput:
        """The request's output now; once it is finished the engine forgets the request."""
        group = self.groups.groups[gid]
        outputs: list[CompletionOutput] = []
        all_done = True
        num_cached = 0
        metrics = RequestMetrics(arrival_time=group.arrival_time)
        for sid, sample in sorted(group.samples.items(), key=lambda kv: kv[1].index):
            req = self.scheduler.get_request(sid)
            if req.is_finished and sample.finish_reason is None:
                sample.finish_reason = req.status.value
                sample.stop_reason = req.stop_reason
                if not isinstance(req.stop_reason, str):
                    # A generation cut mid-character still shows what decode() of all ids shows.
                    sample.text += sample.detokenizer.finish()
            all_done &= req.is_finished
            if sample.index == 0:
                num_cached = max(req.num_cached_tokens, 0)
                metrics.first_scheduled_time = req.first_scheduled_time
                metrics.first_token_time = req.first_token_time
            if req.finished_time is not None:
                metrics.finished_time = max(metrics.finished_time or 0.0, req.finished_time)
            outputs.append(CompletionOutput(
                index=sample.index,
                text=visible_text(sample.text, group.params, req.is_finished),
                token_ids=list(req.output_token_ids),
                finish_reason=sample.finish_reason,
                stop_reason=sample.stop_reason,
                cumulative_logprob=(sum(lp for lp, _ in sample.logprobs)
                                    if group.params.logprobs is not None else None),
                logprobs=list(sample.logprobs) if group.params.logprobs is not None else None,
            ))
        # The group is complete once every one of its n samples exists and has
        # finished, or its first sample ended before the fork could happen, or the
        # engine failed on it (possibly part-way through the fork).
        first = self.scheduler.get_request(gid)
        finished = all_done and (len(outputs) == group.params.n or group.error is not None or
                                 (first.is_finished and first.num_output_tokens == 0))
        error = group.error
        if error is None and first.status is RequestStatus.FINISHED_ABORTED and \
                isinstance(first.stop_reason, str):
            error = first.stop_reason
        out = RequestOutput(
            request_id=gid, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            num_cached_tokens=num_cached, outputs=outputs, finished=finished, metrics=metrics,
            cache_salt=group.cache_salt, error=error, pins=list(group.pin_results), image_spans=group.image_spans)
        if finished:
            for sid in group.samples:
                self.scheduler.release(sid)
            self.groups.remove(gid)
        return out

    def emit_failed(self, gid: str) -> RequestOutput:
        """The final output of a request the engine failed on while building its output: what
        its samples hold, no metrics; the engine forgets the request."""
        group = self.groups.groups[gid]
        self.groups.remove(gid)
        outputs = []
        for sid, sample in sorted(group.samples.items(), key=lambda kv: kv[1].index):
            req = self.scheduler.release(sid)
            outputs.append(CompletionOutput(
                index=sample.index, text=sample.text,
                token_ids=list(req.output_token_ids) if req is not None else [],
                finish_reason=sample.finish_reason or "abort"))
        return RequestOutput(
            request_id=gid, prompt=group.prompt, prompt_token_ids=group.prompt_token_ids,
            num_cached_tokens=0, outputs=outputs, finished=True,
            metrics=RequestMetrics(arrival_time=group.arrival_time), cache_salt=group.cache_salt,
            error=group.error, pins=list(group.pin_results), image_spans=group.image_spans)
