"""Sampling behaviour through the whole engine, on the tiny built-in model."""
from __future__ import annotations

import math
import random

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.errors import InvalidRequestError


@pytest.fixture(scope="module")
def llm():
    return LLM("random:qwen3-tiny", block_size=16, num_kv_blocks=256, max_model_len=512)


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 4000) for _ in range(n)]


def test_seed_gives_same_output_whatever_else_is_in_the_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": ids(1, 20)}, params)[0]
    others = [{"prompt_token_ids": ids(s, 10 + s)} for s in range(2, 7)]
    noisy = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batch = llm.generate([others[0], {"prompt_token_ids": ids(1, 20)}] + others[1:],
                         [noisy, params] + [noisy] * 4)
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_n_samples_fork_the_prompt_blocks(llm):
    before = llm.stats()
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids(9, 40)}, params)[0]
    after = llm.stats()
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(len(o.token_ids) == 8 for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    # The prompt was computed once for four samples; its partial last block was
    # shared and copied on the first write of each sample but the last.
    assert after.computed_prompt_tokens - before.computed_prompt_tokens == 40
    assert after.cow_copies - before.cow_copies >= 3
    again = llm.generate({"prompt_token_ids": ids(9, 40)}, params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]
    assert llm.stats().blocks_in_use == 0
    llm.engine.kv.check_integrity()


def test_stop_string_is_excluded_from_text(llm):
    free = llm.generate({"prompt_token_ids": ids(11, 12)},
                        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    text = free.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate({"prompt_token_ids": ids(11, 12)},
                       SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    o = out.outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == text[:text.find(stop)]
    assert stop not in o.text


def test_stop_token_ids_and_min_tokens(llm):
    free = llm.generate({"prompt_token_ids": ids(12, 9)},
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    toks = free.outputs[0].token_ids
    target = toks[4]
    first = toks.index(target)
    out = llm.generate({"prompt_token_ids": ids(12, 9)},
                       SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                      stop_token_ids=[target]))[0]
    assert out.outputs[0].token_ids == toks[:first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == target
    late = llm.generate({"prompt_token_ids": ids(12, 9)},
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                       stop_token_ids=[target], min_tokens=first + 2))[0]
    assert target not in late.outputs[0].token_ids[:first + 2]


def test_logprobs_are_the_models_log_softmax(llm):
    prompt = ids(13, 15)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True))[0]
    o = out.outputs[0]
    assert len(o.logprobs) == 3
    for lp, top in o.logprobs:
        assert lp <= 0.0 and len(top) == 2
        assert math.isclose(lp, top[0][1], rel_tol=1e-5, abs_tol=1e-5)  # greedy = most likely
    assert math.isclose(o.cumulative_logprob, sum(lp for lp, _ in o.logprobs), rel_tol=1e-6)


def test_sampled_ids_stay_inside_the_tokenizer_vocab(tmp_path):
    # Like the random presets, a checkpoint whose embedding is larger than its tokenizer.
    from checkpoint_factory import write_tiny_checkpoint
    path = write_tiny_checkpoint(tmp_path / "padded", "qwen3", seed=3, vocab_size=12000)
    llm = LLM(str(path), num_kv_blocks=16, max_model_len=128)
    vocab = llm.tokenizer.vocab_size
    assert llm.engine.model_config.vocab_size > vocab
    out = llm.generate({"prompt_token_ids": ids(14, 8)},
                       SamplingParams(n=4, temperature=5.0, seed=1, max_tokens=30, ignore_eos=True))[0]
    sampled = [t for o in out.outputs for t in o.token_ids]
    assert all(t < vocab for t in sampled)


@pytest.mark.parametrize("bad,field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"), (dict(min_p=1.5), "min_p"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(stop=[""]), "stop"), (dict(logprobs=-1), "logprobs"), (dict(temperature="hot"), "temperature"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_sampling_params_name_the_bad_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_requests_that_can_never_fit_are_rejected_and_leave_nothing(llm):
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("long", {"prompt_token_ids": ids(1, 600)}, SamplingParams(max_tokens=4))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request("long2", {"prompt_token_ids": ids(1, 500)}, SamplingParams(max_tokens=100))
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("empty", {"prompt_token_ids": []}, SamplingParams())
    with pytest.raises(InvalidRequestError, match="token id"):
        engine.add_request("bad", {"prompt_token_ids": [1, -5]}, SamplingParams())
    small = LLM("random:qwen3-tiny", block_size=16, num_kv_blocks=4, max_model_len=512)
    with pytest.raises(InvalidRequestError, match="pool"):
        small.engine.add_request("huge", {"prompt_token_ids": ids(1, 60)}, SamplingParams(max_tokens=10))
    assert not engine.has_unfinished_requests()
    assert engine.stats().blocks_in_use == 0


def test_chat_renders_the_template(llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert out.prompt_token_ids == llm.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True)
