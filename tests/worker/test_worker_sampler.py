"""The sampler's filters against a brute-force reference on small vocabularies."""
from __future__ import annotations

import pytest
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


def _good_rows() -> list[SamplingRow]:
    def seeded(seed: int, **kw) -> SamplingRow:
        return SamplingRow(SamplingParams(seed=seed, **kw), [1, 2], [3],
                           generator=torch.Generator().manual_seed(seed))
    return [
        SamplingRow(SamplingParams(temperature=0.0), [1], []),
        seeded(11, temperature=0.9, top_p=0.8, logprobs=2),
        SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=0), [4, 5], [6]),
        seeded(12, temperature=1.2, top_k=5, min_p=0.05),
        seeded(13, temperature=0.7, frequency_penalty=0.5, min_tokens=3),
    ]


def _bad(field: str, value) -> SamplingRow:
    params = SamplingParams(temperature=0.8, seed=99, logprobs=1)
    setattr(params, field, value)  # a value that slipped past validation
    return SamplingRow(params, [1], [2], generator=torch.Generator().manual_seed(99))


@pytest.mark.parametrize("field,value", [
    ("logprobs", 10**6),            # topk beyond the vocabulary, after the draw
    ("top_k", "five"),              # breaks the batched filter
    ("temperature", "hot"),         # breaks the batched temperature division
    ("repetition_penalty", None),   # breaks the row's own penalty pass
])
def test_a_row_that_cannot_be_sampled_fails_alone(field, value):
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    alone = Sampler()(logits[[0, 1, 2, 4, 5]].clone(), _good_rows())
    rows = _good_rows()
    rows.insert(3, _bad(field, value))
    got = Sampler()(logits.clone(), rows)
    assert got.errors[3] is not None and got.token_ids[3] == -1 and got.logprobs[3] is None
    assert [e for i, e in enumerate(got.errors) if i != 3] == [None] * 5
    keep = [0, 1, 2, 4, 5]
    assert [got.token_ids[i] for i in keep] == alone.token_ids
    assert [got.logprobs[i] for i in keep] == alone.logprobs
    assert [got.top_logprobs[i] for i in keep] == alone.top_logprobs
    assert alone.errors == []
