"""Turns the logits of the rows being sampled into tokens, one set of params per row.

Work is batched across rows wherever the rows agree (greedy argmax, the
sorting filters); a per-row loop remains only where each row owns state: its
penalty counts and its random generator. A request's generator is its own, so
a seeded request samples the same tokens whatever else shares the batch.

Rows fail alone: what a row's own parameters drive runs under a guard per row,
and a batched stage that raises is redone row by row, so a row whose values
cannot be sampled (a field that slipped through validation) is reported in
`SampleResult.errors` while every other row gets the token it would have got
without it. Random draws happen only in the per-row part, so a failing row never
advances another row's generator.
"""
from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from prefixserve.model.platform import platform_for
from prefixserve.sampling_params import SamplingParams
from prefixserve.structured.constraint import Constraint
from prefixserve.structured.mask import add_bias
from prefixserve.structured.mask_worker import MaskJob, MaskWorker, StepMasks


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Token ids masked until min_tokens outputs exist (EOS and stop ids).
    min_tokens_blocked: frozenset[int] = frozenset()
    generator: Optional[torch.Generator] = None
    # The grammar this row's output must match (structured output, tool calls).
    constraint: Optional[Constraint] = None


@dataclass
class SampleResult:
    token_ids: list[int]
    # Log-probability of each sampled token under the model's raw distribution,
    # and the k most likely alternatives, for rows that asked for logprobs.
    logprobs: list[Optional[float]] = field(default_factory=list)
    top_logprobs: list[Optional[list[tuple[int, float]]]] = field(default_factory=list)
    # Per row, the exception that kept it from being sampled (its token is then -1), else
    # None; empty when nothing failed.
    errors: list[Optional[BaseException]] = field(default_factory=list)


class Sampler:
    def __init__(self, vocab_limit: Optional[int] = None, device: torch.device | str = "cpu",
                 overlap_masks: bool = False) -> None:
        # Ids at or beyond the tokenizer's vocabulary decode to nothing; the
        # model's embedding may be larger (padded), so they are never sampled.
        self.vocab_limit = vocab_limit
        # Where the logits arrive and sampling happens: every generator used here lives there too.
        self.device = torch.device(device)
        # torch.argmax over each row, through the platform's kernel where it takes the logits (the same answer)
        self._argmax = platform_for(self.device).row_argmax
        # Whether start_masks hands the grammar masks to the worker thread (see ModelRunner).
        self.overlap_masks = overlap_masks
        self.mask_worker = MaskWorker()

    def start_masks(self, rows: Sequence[SamplingRow]) -> Optional[concurrent.futures.Future[StepMasks]]:
        """Starts computing the grammar masks of `rows` on the mask worker (None when no row is
        constrained, or masks are not overlapped: __call__ computes them then); pass the future
        to __call__ with the same rows, and wait for it before anything else touches those
        rows' constraints."""
        if not self.overlap_masks:
            return None
        jobs = _mask_jobs(rows)
        return self.mask_worker.start(jobs) if jobs else None

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 default_generator: Optional[torch.Generator] = None,
                 masks: Optional[concurrent.futures.Future[StepMasks]] = None) -> SampleResult:
        """`masks`: what start_masks(rows) returned; without it the masks are computed here."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        logits = logits.float()
        vocab = logits.shape[-1]
        if self.vocab_limit is not None and self.vocab_limit < vocab:
            logits[:, self.vocab_limit:] = float("-inf")
        errors: list[Optional[BaseException]] = [None] * len(rows)

        want_logprobs = [r.params.logprobs is not None for r in rows]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        random_rows = []
        for i, row in enumerate(rows):
            try:
                params = row.params
                if params.uses_penalties:
                    _apply_penalties(logits[i], row, vocab)
                if row.min_tokens_blocked and len(row.output_token_ids) < params.min_tokens:
                    ids = [t for t in row.min_tokens_blocked if t < vocab]
                    logits[i, ids] = float("-inf")
                if not params.greedy:
                    random_rows.append(i)
            except Exception as exc:
                errors[i] = exc
        self._apply_constraints(logits, rows, errors, masks)

        tokens = self._argmax(logits)
        if random_rows:
            probs = self._random_probs(logits, rows, random_rows, errors)
            for i in random_rows:
                if errors[i] is not None:
                    continue
                try:
                    gen = rows[i].generator or default_generator
                    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p,
                    # using exactly one draw per vocabulary entry from this row's stream.
                    noise = torch.empty(vocab, dtype=probs[i].dtype,
                                        device=self.device).exponential_(generator=gen)
                    tokens[i] = torch.argmax(probs[i] / noise)
                except Exception as exc:
                    errors[i] = exc

        token_list = tokens.tolist()
        result = SampleResult(token_ids=token_list)
        for i, row in enumerate(rows):
            logprob, top = None, None
            if raw_logprobs is not None and want_logprobs[i] and errors[i] is None:
                try:
                    logprob = float(raw_logprobs[i, token_list[i]])
                    top = []
                    k = row.params.logprobs
                    if k:
                        values, ids = torch.topk(raw_logprobs[i], k)
                        top = list(zip(ids.tolist(), values.tolist()))
                except Exception as exc:
                    errors[i] = exc
                    logprob, top = None, None
            result.logprobs.append(logprob)
            result.top_logprobs.append(top)
        if any(e is not None for e in errors):
            for i, e in enumerate(errors):
                if e is not None:
                    result.token_ids[i] = -1
            result.errors = errors
        return result

    def _apply_constraints(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                           errors: list[Optional[BaseException]],
                           started: Optional[concurrent.futures.Future[StepMasks]]) -> None:
        """Masks the grammar-constrained rows with the masks started before the forward (or
        computes them now); a batch without any costs a scan of the rows."""
        if started is not None:
            masks = started.result()
        else:
            jobs = _mask_jobs(rows)
            if not jobs:
                return
            masks = self.mask_worker.compute(jobs)
        for i, exc in masks.errors.items():
            if errors[i] is None:
                errors[i] = exc
        # A row that failed earlier in this call keeps its error and is not masked.
        keep = [j for j, i in enumerate(masks.rows) if errors[i] is None]
        if not keep:
            return
        bias = masks.bias if len(keep) == len(masks.rows) else masks.bias[keep]
        add_bias(logits, [masks.rows[j] for j in keep], bias, masked_from=self.vocab_limit)

    def _random_probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                      random_rows: list[int], errors: list[Optional[BaseException]]
                      ) -> dict[int, torch.Tensor]:
        """Each random row's distribution after temperature, top-k, top-p and min-p: for all
        rows at once, or row by row when that raises, so the row that breaks it is found."""
        try:
            probs = self._filtered_probs(logits, rows, random_rows)
            return {i: probs[j] for j, i in enumerate(random_rows)}
        except Exception:
            pass
        out: dict[int, torch.Tensor] = {}
        for i in random_rows:
            try:
                out[i] = self._filtered_probs(logits, rows, [i])[0]
            except Exception as exc:
                errors[i] = exc
        return out

    def _filtered_probs(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                        picked: list[int]) -> torch.Tensor:
        idx = torch.tensor(picked, dtype=torch.long, device=self.device)
        sub = logits.index_select(0, idx)
        temps = torch.tensor([rows[i].params.temperature for i in picked],
                             dtype=sub.dtype, device=self.device).unsqueeze(1)
        sub = _filter(sub / temps, [rows[i].params for i in picked])
        return torch.softmax(sub, dim=-1)


def _mask_jobs(rows: Sequence[SamplingRow]) -> list[MaskJob]:
    return [MaskJob(i, row.constraint, row.output_token_ids)
            for i, row in enumerate(rows) if row.constraint is not None]


def _apply_penalties(row_logits: torch.Tensor, row: SamplingRow, vocab: int) -> None:
    p = row.params
    device = row_logits.device
    out = torch.tensor([t for t in row.output_token_ids if t < vocab], dtype=torch.long, device=device)
    counts = torch.bincount(out, minlength=vocab).to(row_logits.dtype)
    if p.repetition_penalty != 1.0:
        prompt = torch.tensor([t for t in row.prompt_token_ids if t < vocab], dtype=torch.long, device=device)
        seen = counts > 0
        seen[prompt] = True
        picked = row_logits[seen]
        row_logits[seen] = torch.where(picked > 0, picked / p.repetition_penalty,
                                       picked * p.repetition_penalty)
    if p.frequency_penalty:
        row_logits -= p.frequency_penalty * counts
    if p.presence_penalty:
        row_logits -= p.presence_penalty * (counts > 0).to(row_logits.dtype)


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Applies top-k, top-p and min-p row by row, in one sort for the batch."""
    device = logits.device
    top_k = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if not any(top_k) and all(v >= 1.0 for v in top_p) and not any(min_p):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    k = torch.tensor([v if v > 0 else vocab for v in top_k], device=device).unsqueeze(1)
    drop = ranks >= k
    # top-p and min-p judge the distribution that top-k left, renormalised.
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    p = torch.tensor(top_p, dtype=probs.dtype, device=device).unsqueeze(1)
    # Keep the smallest set whose mass reaches p: drop a token once the mass
    # before it already reaches p (the first token always survives).
    drop |= (torch.cumsum(probs, dim=-1) - probs) >= p
    m = torch.tensor(min_p, dtype=probs.dtype, device=device).unsqueeze(1)
    drop |= probs < m * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
