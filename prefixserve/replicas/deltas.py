"""What a replica's stream carries through Ray: only what changed since its last item.

An engine's outputs are cumulative (each holds the prompt's token ids and every token and
character generated so far), so sending each one whole costs bytes that grow with the square
of the output's length. The replica sends a delta instead: the tokens, text and logprobs
each sample gained, and the request's small fields where they changed; the front, which sent
the prompt, rebuilds the cumulative RequestOutput its consumers expect, equal to the
engine's. Deltas are plain tuples: a pickled dataclass repeats its class and field names in
every item, several times the size of one token's news.

    delta  = (num_cached_tokens, finished, error, metrics or None, pins or None, samples)
    sample = (index, text, token_ids, logprobs, finish_reason, stop_reason,
              cumulative_logprob, whole)

metrics and pins are None when unchanged since the last item. A sample's text, token_ids
and logprobs are what it gained, or all of it when `whole` (first seen, or not a mere
extension of what was sent).
"""
from __future__ import annotations

from typing import Optional, Sequence

from prefixserve.engine import RequestOutput
from prefixserve.engine.outputs import CompletionOutput, PinResult, RequestMetrics

Delta = tuple


class DeltaEncoder:
    """On the replica: each cumulative output of one request as the delta from the last one."""

    def __init__(self) -> None:
        self._sent: dict[int, CompletionOutput] = {}
        self._metrics: Optional[RequestMetrics] = None
        self._pins: list[PinResult] = []

    def encode(self, out: RequestOutput) -> Delta:
        samples = []
        for o in out.outputs:
            prev = self._sent.get(o.index)
            if prev is not None and o.text.startswith(prev.text) \
                    and o.token_ids[:len(prev.token_ids)] == prev.token_ids \
                    and (o.logprobs is None) == (prev.logprobs is None):
                samples.append((o.index, o.text[len(prev.text):], o.token_ids[len(prev.token_ids):],
                                None if o.logprobs is None else o.logprobs[len(prev.logprobs or ()):],
                                o.finish_reason, o.stop_reason, o.cumulative_logprob, False))
            else:
                samples.append((o.index, o.text, o.token_ids, o.logprobs, o.finish_reason,
                                o.stop_reason, o.cumulative_logprob, True))
            # What the front now holds: an output's lists are its own, never changed after.
            self._sent[o.index] = o
        metrics = None if out.metrics == self._metrics else out.metrics
        self._metrics = out.metrics
        pins = None if out.pins == self._pins else out.pins
        self._pins = out.pins
        return (out.num_cached_tokens, out.finished, out.error, metrics, pins, tuple(samples))


class DeltaDecoder:
    """On the front: the deltas of one request back into cumulative RequestOutputs."""

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 cache_salt: Optional[str], image_spans: tuple = ()) -> None:
        self.request_id = request_id
        self.image_spans = image_spans   # the front computed them: not sent back
        self.prompt_token_ids = list(prompt_token_ids)
        self.cache_salt = cache_salt
        self._samples: dict[int, CompletionOutput] = {}
        self._metrics: Optional[RequestMetrics] = None
        self._pins: list[PinResult] = []

    def decode(self, delta: Delta) -> RequestOutput:
        num_cached, finished, error, metrics, pins, samples = delta
        outputs = []
        for index, text, token_ids, logprobs, finish, stop, cum_logprob, whole in samples:
            prev = self._samples.get(index)
            if whole or prev is None:
                o = CompletionOutput(index, text, list(token_ids), finish, stop, cum_logprob,
                                     None if logprobs is None else list(logprobs))
            else:
                # New lists each time: a consumer may keep an earlier output.
                o = CompletionOutput(index, prev.text + text, prev.token_ids + token_ids,
                                     finish, stop, cum_logprob,
                                     None if logprobs is None else (prev.logprobs or []) + logprobs)
            self._samples[index] = o
            outputs.append(o)
        if metrics is not None:
            self._metrics = metrics
        if pins is not None:
            self._pins = pins
        assert self._metrics is not None, "a replica's first delta carries its metrics"
        # One prompt list for all of a request's outputs, as the engine does.
        return RequestOutput(request_id=self.request_id, prompt=None,
                             prompt_token_ids=self.prompt_token_ids,
                             num_cached_tokens=num_cached, outputs=outputs, finished=finished,
                             metrics=self._metrics, cache_salt=self.cache_salt, error=error,
                             pins=list(self._pins), image_spans=self.image_spans)
