"""A replica's stream as deltas, without Ray: every cumulative output an engine emits, encoded
on the replica's side and decoded on the front's, comes back equal to the engine's own; and
the bytes sent (pickled, as Ray sends them) grow linearly with the output, not quadratically.
"""
from __future__ import annotations

import pickle

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.replicas.deltas import DeltaDecoder, DeltaEncoder


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("random:qwen3-tiny", dtype="float32", num_kv_blocks=128)


def every_output(llm: LLM, request_id: str, tokens: list[int], params: SamplingParams) -> list:
    """Each output the engine emits for one request, step by step, until it finishes."""
    engine = llm.engine
    engine.add_request(request_id, {"prompt_token_ids": tokens}, params)
    outs = []
    while not outs or not outs[-1].finished:
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


def through_deltas(outs: list) -> tuple[list, list]:
    """(what the front rebuilds, what crossed Ray) for a replica's outputs."""
    encoder = DeltaEncoder()
    sent = [encoder.encode(o) for o in outs]
    decoder = DeltaDecoder(outs[0].request_id, outs[0].prompt_token_ids, outs[0].cache_salt)
    return [decoder.decode(pickle.loads(pickle.dumps(d))) for d in sent], sent


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=3, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=60, temperature=1.0, seed=5, stop=["e", " a"], n=2),
], ids=["n3-logprobs", "stop-strings"])
def test_the_front_rebuilds_every_output_the_engine_emitted(llm, params):
    prompt = list(range(10, 90))
    outs = every_output(llm, f"r-{params.n}-{params.max_tokens}", prompt, params)
    rebuilt, _ = through_deltas(outs)
    assert rebuilt == outs


def test_a_512_token_stream_sends_bytes_linear_in_its_length(llm):
    outs = every_output(llm, "long", list(range(10, 266)),
                        SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True))
    assert len(outs[-1].outputs[0].token_ids) == 512 and len(outs) >= 500
    rebuilt, sent = through_deltas(outs)
    assert rebuilt == outs
    whole = [len(pickle.dumps(o)) for o in outs]
    delta = [len(pickle.dumps(d)) for d in sent]
    # Whole outputs grow with every token (prompt and output each time); deltas do not.
    assert whole[-1] > whole[1] + 512 * 2
    early, late = delta[1:51], delta[-51:-1]
    assert sum(late) / len(late) <= 1.1 * sum(early) / len(early)
    assert sum(delta) * 10 < sum(whole)
