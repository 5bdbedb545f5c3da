"""The batched sampler against the per-row sampler (worker/sampler.py) as the oracle: the same tokens and
logprobs for greedy rows under every filter and penalty, the same distributions for random rows (each
filter's, judged by the oracle's own filtered softmax), and seeded rows that depend on their seed and
position alone."""
from __future__ import annotations

import random

import pytest
import torch

from prefixserve.sampling_params import SamplingParams
from prefixserve.worker.batched_sampler import BatchedSampler, exponential_noise
from prefixserve.worker.sampler import Sampler, SamplingRow, _filter

VOCAB = 50


def random_rows(rng: random.Random, count: int, **fixed) -> list[SamplingRow]:
    rows = []
    for _ in range(count):
        fields = dict(temperature=0.0, repetition_penalty=rng.choice([1.0, 1.3]),
                      frequency_penalty=rng.choice([0.0, 0.4]), presence_penalty=rng.choice([0.0, 0.7]),
                      min_tokens=rng.choice([0, 3]), logprobs=rng.choice([None, 0, 3]))
        fields.update(fixed)
        rows.append(SamplingRow(SamplingParams(**fields),
                                prompt_token_ids=[rng.randrange(VOCAB) for _ in range(5)],
                                output_token_ids=[rng.randrange(VOCAB) for _ in range(rng.randrange(5))],
                                min_tokens_blocked=frozenset({rng.randrange(VOCAB)})))
    return rows


def test_greedy_rows_match_the_per_row_sampler_with_penalties_and_logprobs():
    rng = random.Random(0)
    torch.manual_seed(0)
    logits = torch.randn(24, VOCAB) * 3
    rows = random_rows(rng, 24)
    # clones: the per-row sampler penalises its float32 input in place
    expected = Sampler(vocab_limit=VOCAB - 4)(logits.clone(), rows)
    got = BatchedSampler(vocab_limit=VOCAB - 4)(logits, rows)
    assert got.token_ids == expected.token_ids
    assert got.logprobs == pytest.approx(expected.logprobs)
    for mine, theirs in zip(got.top_logprobs, expected.top_logprobs):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert [t for t, _ in mine] == [t for t, _ in theirs]
            assert [v for _, v in mine] == pytest.approx([v for _, v in theirs])


@pytest.mark.parametrize("fields", [dict(temperature=1.0), dict(temperature=0.7, top_k=3),
                                    dict(temperature=1.3, top_p=0.6), dict(temperature=1.0, min_p=0.2),
                                    dict(temperature=0.8, presence_penalty=1.0)])
def test_random_rows_follow_the_per_row_samplers_distribution(fields):
    torch.manual_seed(1)
    draws = 6000
    base = torch.randn(1, 8) * 1.5
    row = SamplingRow(SamplingParams(**fields), prompt_token_ids=[1], output_token_ids=[2, 2])
    # the oracle's distribution: its own penalties and filters on the same row
    work = base.clone()
    params = row.params
    if params.uses_penalties:
        from prefixserve.worker.sampler import _apply_penalties
        _apply_penalties(work[0], row, 8)
    expected = torch.softmax(_filter(work / params.temperature, [params]), dim=-1)[0]
    generator = torch.Generator().manual_seed(3)
    tokens = BatchedSampler()(base.repeat(draws, 1), [row] * draws, default_generator=generator).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=8).float() / draws
    assert torch.allclose(freq, expected, atol=0.025)
    assert set(torch.tensor(tokens).unique().tolist()) <= set(torch.nonzero(expected).flatten().tolist())


def test_seeded_rows_depend_on_seed_and_position_only():
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB)

    def seeded(seed: int, outputs: int) -> SamplingRow:
        return SamplingRow(SamplingParams(temperature=1.0, seed=seed), [1, 2], [5] * outputs,
                           generator=torch.Generator().manual_seed(seed))

    sampler = BatchedSampler()
    alone = sampler(logits, [seeded(7, 3)]).token_ids[0]
    others = [SamplingRow(SamplingParams(temperature=1.0), [1], []) for _ in range(5)]
    for position in range(4):
        batch = others[:position] + [seeded(7, 3)] + others[position:]
        got = sampler(logits.repeat(len(batch), 1), batch, default_generator=torch.Generator().manual_seed(position))
        assert got.token_ids[position] == alone
    # seeds draw from the distribution: over many seeds the frequencies follow softmax
    rows = [seeded(seed, 0) for seed in range(4000)]
    small = torch.tensor([[0.0, 1.0, 2.0]])
    tokens = sampler(small.repeat(4000, 1), rows).token_ids
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, torch.softmax(small[0], 0), atol=0.03)


def test_noise_is_exponential_and_a_function_of_key_and_step():
    keys = torch.tensor([1, 1, 2, 2 ** 40 + 1])
    steps = torch.tensor([0, 1, 0, 0])
    noise = exponential_noise(keys, steps, 20000)
    assert torch.equal(noise, exponential_noise(keys, steps, 20000))
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(noise[a], noise[b])
    # Exp(1): mean 1, P(E > 1) = 1/e
    assert noise.mean().item() == pytest.approx(1.0, abs=0.02)
    assert (noise > 1).float().mean().item() == pytest.approx(0.3679, abs=0.01)


def test_a_row_the_batch_cannot_take_falls_back_to_row_isolation():
    torch.manual_seed(4)
    logits = torch.randn(2, VOCAB)
    good = SamplingRow(SamplingParams(temperature=0.0), [1], [])
    # a value validation would refuse, slipped through: its row fails alone
    bad = SamplingRow(SamplingParams(temperature=1.0), [1], [])
    bad.params.__dict__["top_k"] = "three"
    result = BatchedSampler()(logits, [good, bad])
    assert result.token_ids == [int(torch.argmax(logits[0])), -1]
    assert result.errors[0] is None and result.errors[1] is not None
