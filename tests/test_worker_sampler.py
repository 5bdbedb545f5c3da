"""The sampler's filters against a brute-force reference on small vocabularies."""
from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st

from prefixserve.sampling_params import SamplingParams
from prefixserve.worker.sampler import Sampler, SamplingRow, _filter


def brute_allowed(logits: list[float], top_k: int, top_p: float, min_p: float) -> set[int]:
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    if top_k > 0:
        order = order[:top_k]
    m = max(logits[i] for i in order)
    w = {i: torch.tensor(logits[i] - m).exp().item() for i in order}
    z = sum(w.values())
    probs = {i: w[i] / z for i in order}
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p - 1e-9 and kept:
            break
        kept.append(i)
        mass += probs[i]
    top = probs[order[0]]
    return {i for i in kept if probs[i] >= min_p * top - 1e-12} | {order[0]}


@settings(max_examples=150, deadline=None)
@given(st.lists(st.floats(-5, 5, width=32), min_size=2, max_size=12, unique=True),
       st.integers(0, 12), st.floats(0.05, 1.0), st.floats(0.0, 0.9))
def test_filters_match_brute_force(logits, top_k, top_p, min_p):
    p = SamplingParams(top_k=top_k, top_p=top_p, min_p=min_p)
    out = _filter(torch.tensor([logits]), [p])[0]
    allowed = {i for i, v in enumerate(out.tolist()) if v != float("-inf")}
    assert allowed == brute_allowed(logits, top_k, top_p, min_p)


def test_greedy_ignores_ids_beyond_the_vocab_limit():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0]])
    row = SamplingRow(SamplingParams(temperature=0.0), [], [])
    assert Sampler(vocab_limit=3)(logits, [row]).token_ids == [2]


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.7])
    logits = probs.log().repeat(4000, 1)
    rows = [SamplingRow(SamplingParams(temperature=1.0), [], []) for _ in range(4000)]
    gen = torch.Generator().manual_seed(0)
    toks = torch.tensor(Sampler()(logits, rows, default_generator=gen).token_ids)
    freq = torch.bincount(toks, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    row = SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5,
                                     presence_penalty=0.25), prompt_token_ids=[1], output_token_ids=[0, 0])
    work = logits.clone()
    from prefixserve.worker.sampler import _apply_penalties
    _apply_penalties(work[0], row, 4)
    # token 0: seen twice in the output; token 1: in the prompt only; others untouched.
    assert torch.allclose(work[0], torch.tensor([2.0 / 2 - 0.5 * 2 - 0.25, -2.0 * 2, 1.0, 0.5]))
