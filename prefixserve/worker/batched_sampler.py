"""The sampler as a fixed handful of tensor ops for the whole batch, whatever each row asks for: the
accelerator's sampler (one host-device round trip a step), and the CPU's where it is faster.

Every SamplingParams field is applied to all rows at once: penalties through one scatter of the rows'
output and prompt tokens, min_tokens through one masked write, the grammar masks as in `Sampler`,
temperature, top-k, top-p and min-p through one sort (sampler._filter), logprobs through one
log-softmax and one top-k at the widest k asked. Python touches each row only to read its parameters
into arrays.

Random draws need no per-row generator: each row draws the exponential race's noise (argmax p / E,
E ~ Exp(1), the existing sampler's method) from a counter-based hash of (its key, its output length, the
token id), so a seeded row's draw depends on its seed and position alone, never on its batch, and the
whole batch's noise is one elementwise computation. A seeded row's key is its generator's seed (the
engine derives one per sample of a request); an unseeded row's is drawn from the default generator,
one number a row a step. The sampled ids, their logprobs and the top logprobs reach the host in one
transfer. A batch this path cannot take (a row whose values raise) is sampled by `Sampler`, which
isolates the failing row.
"""
from __future__ import annotations

import concurrent.futures
from typing import Optional, Sequence

import torch

from prefixserve.structured.mask_worker import StepMasks
from prefixserve.worker.sampler import SampleResult, Sampler, SamplingRow, _filter

MASK32 = 0xFFFFFFFF
# the top 24 bits of a 32-bit hash make a float32 in (0, 1) exactly
UNIFORM_BITS = 24


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (xorshift-multiply, after Wellons' lowbias32) of int64 tensors holding values
    below 2**32. Both multipliers are odd and below 2**31, so no int64 product overflows."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x27D4EB2F) & MASK32
    return x ^ (x >> 16)


def exponential_noise(keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, vocab] float32 Exp(1) draws, a pure function of each row's (key, step) and the token id."""
    low, high = keys & MASK32, (keys >> 32) & MASK32
    row = hash32(hash32(low ^ hash32(high)) ^ (steps & MASK32))
    ids = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    bits = hash32((row[:, None] + ids[None, :] * 0x9E3779B9) & MASK32) >> (32 - UNIFORM_BITS)
    uniform = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << UNIFORM_BITS))
    return -torch.log(uniform)


class BatchedSampler(Sampler):
    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 default_generator: Optional[torch.Generator] = None,
                 masks: Optional[concurrent.futures.Future[StepMasks]] = None) -> SampleResult:
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        if masks is not None:
            # the fallback may need the masks again; they are computed once
            masks.result()
        try:
            return self._batched(logits, rows, default_generator, masks)
        except Exception:
            return Sampler.__call__(self, logits, rows, default_generator, masks)

    def _batched(self, logits: torch.Tensor, rows: Sequence[SamplingRow],
                 default_generator: Optional[torch.Generator],
                 masks: Optional[concurrent.futures.Future[StepMasks]]) -> SampleResult:
        device = logits.device
        count, vocab = logits.shape
        params = [r.params for r in rows]
        penalized = [i for i, p in enumerate(params) if p.uses_penalties]
        blocked_rows, blocked_ids = [], []
        for i, row in enumerate(rows):
            if row.min_tokens_blocked and len(row.output_token_ids) < row.params.min_tokens:
                ids = [t for t in row.min_tokens_blocked if t < vocab]
                blocked_rows += [i] * len(ids)
                blocked_ids += ids
        limited = self.vocab_limit is not None and self.vocab_limit < vocab
        # written to in place: a copy, so the fallback sees the logits as they came (~10 MB at 16 rows)
        edits = limited or penalized or blocked_rows or any(r.constraint is not None for r in rows)
        logits = logits.to(torch.float32, copy=bool(edits))
        if limited:
            logits[:, self.vocab_limit:] = float("-inf")
        top_k_wanted = [p.logprobs for p in params]
        raw_logprobs = (torch.log_softmax(logits, dim=-1)
                        if any(k is not None for k in top_k_wanted) else None)
        if penalized:
            _apply_penalties(logits, rows, penalized, vocab)
        if blocked_rows:
            logits[torch.tensor(blocked_rows, device=device), torch.tensor(blocked_ids, device=device)] = float("-inf")
        errors: list[Optional[BaseException]] = [None] * count
        self._apply_constraints(logits, rows, errors, masks)
        if any(e is not None for e in errors):
            raise next(e for e in errors if e is not None)

        tokens = self._argmax(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            picked = torch.tensor(random_rows, dtype=torch.long, device=device)
            temps = torch.tensor([params[i].temperature for i in random_rows], dtype=torch.float32, device=device)
            sub = _filter(logits.index_select(0, picked) / temps[:, None], [params[i] for i in random_rows])
            probs = torch.softmax(sub, dim=-1)
            keys = self._keys(rows, random_rows, default_generator, device)
            steps = torch.tensor([len(rows[i].output_token_ids) for i in random_rows], dtype=torch.int64,
                                 device=device)
            drawn = torch.argmax(probs / exponential_noise(keys, steps, vocab), dim=-1)
            tokens = tokens.index_copy(0, picked, drawn.to(tokens.dtype))
        return self._collect(tokens, raw_logprobs, top_k_wanted)

    def _keys(self, rows: Sequence[SamplingRow], picked: list[int], default_generator: Optional[torch.Generator],
              device: torch.device) -> torch.Tensor:
        """Each random row's hash key: its own generator's seed, else a draw from the default generator."""
        seeds = [generator.initial_seed() % (1 << 63) if (generator := rows[i].generator) is not None else -1
                 for i in picked]
        keys = torch.tensor(seeds, dtype=torch.int64, device=device)
        if min(seeds) < 0:
            fresh = torch.randint(0, 2 ** 62, (len(picked),), generator=default_generator, device=device)
            keys = torch.where(keys < 0, fresh, keys)
        return keys

    def _collect(self, tokens: torch.Tensor, raw_logprobs: Optional[torch.Tensor],
                 top_k_wanted: list[Optional[int]]) -> SampleResult:
        """The step's ids and asked-for logprobs, brought to the host in one transfer."""
        count = len(top_k_wanted)
        parts = [tokens.to(torch.float64)]
        widest = max((k for k in top_k_wanted if k), default=0)
        if raw_logprobs is not None:
            parts.append(raw_logprobs.gather(1, tokens[:, None].long())[:, 0].double())
            if widest:
                values, ids = torch.topk(raw_logprobs, widest, dim=-1)
                parts += [values.double().flatten(), ids.double().flatten()]
        host = torch.cat(parts).tolist()
        token_ids = [int(t) for t in host[:count]]
        result = SampleResult(token_ids=token_ids)
        chosen = host[count: 2 * count] if raw_logprobs is not None else []
        top_values = host[2 * count: 2 * count + count * widest]
        top_ids = host[2 * count + count * widest:]
        for i, k in enumerate(top_k_wanted):
            if k is None:
                result.logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.logprobs.append(chosen[i])
            base = i * widest
            result.top_logprobs.append([(int(top_ids[base + j]), top_values[base + j]) for j in range(k)])
        return result


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow], penalized: list[int], vocab: int) -> None:
    """Repetition, frequency and presence penalties of the `penalized` rows, in place, in one pass each."""
    device = logits.device
    picked = torch.tensor(penalized, dtype=torch.long, device=device)
    out_rows, out_ids, prompt_rows, prompt_ids = [], [], [], []
    for j, i in enumerate(penalized):
        ids = [t for t in rows[i].output_token_ids if t < vocab]
        out_rows += [j] * len(ids)
        out_ids += ids
        if rows[i].params.repetition_penalty != 1.0:
            prompt = [t for t in rows[i].prompt_token_ids if t < vocab]
            prompt_rows += [j] * len(prompt)
            prompt_ids += prompt
    counts = torch.zeros((len(penalized), vocab), dtype=torch.float32, device=device)
    if out_ids:
        flat = torch.tensor(out_rows, device=device) * vocab + torch.tensor(out_ids, device=device)
        counts.view(-1).index_add_(0, flat, torch.ones(len(out_ids), device=device))
    seen = counts > 0
    if prompt_ids:
        seen[torch.tensor(prompt_rows, device=device), torch.tensor(prompt_ids, device=device)] = True

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)[:, None]

    params = [rows[i].params for i in penalized]
    sub = logits.index_select(0, picked)
    repetition = column([p.repetition_penalty for p in params])
    sub = torch.where(seen, torch.where(sub > 0, sub / repetition, sub * repetition), sub)
    sub = sub - column([p.frequency_penalty for p in params]) * counts
    sub = sub - column([p.presence_penalty for p in params]) * (counts > 0).float()
    logits.index_copy_(0, picked, sub)
