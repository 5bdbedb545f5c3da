"""The engine on a CUDA device, held to HF transformers on the same device, checkpoint and dtype.

Skipped where torch sees no CUDA device (CI). Every oracle is independent of our code:
- logits: HF transformers in float64 on the float32 checkpoint is the reference; the bfloat16
  tolerance is tests/bf16_reference.py's (twice what rounding a float64 model's weights and every
  linear's, norm's and layer's inputs and outputs to bfloat16 moves its logits; RMS 1.5 times),
  and float32 must stay within a hundredth of it. HF transformers on the device in the same dtype
  is held to the same bounds, which shows they are attainable there.
- greedy tokens: HF's own greedy choice on the device in the same dtype, wherever the reference's
  top-2 margin is wider than twice what each may be off by, so both must pick the same token;
- caching: outputs with prefix caching on equal outputs with it off; cached-token counts equal a
  brute-force longest shared block-aligned prefix;
- placement and block accounting: invariants (every weight and pool tensor on the device, all
  blocks free and the pool's integrity check clean once every request has finished or been aborted).
The models are the tiny HF checkpoints of tests/checkpoint_factory.py (conftest's tiny_checkpoints).
"""
from __future__ import annotations

import random

import pytest
import torch

from prefixserve import LLM, SamplingParams
from prefixserve.model.kv_layout import ROWS, kv_cache_shape
from bf16_reference import (BLOCK_SIZE, MIN_DECISIVE, bounds, hf_logits, hf_model, max_errors, our_logits, references,
                            sequences)
from prefix_caching_oracle import expected_cached, shared_prefix_prompts

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

DEVICE = "cuda"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLOAT32_SHARE = 100    # float32 logits stay within tolerance / FLOAT32_SHARE of the float64 reference
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


# ------------------------------------------------------------------------------------ references

def margin_bound(dtype: str, tolerance: float) -> float:
    """How far apart the reference's top two logits must be for an implementation within the dtype's
    tolerance of it to pick its top token: twice the tolerance."""
    return 2 * (tolerance if dtype == "bfloat16" else tolerance / FLOAT32_SHARE)


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama"])
def case(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param)
    tokens = sequences(seed=11)
    return request.param, path, tokens, *references(path, tokens, DEVICE)


def hf_greedy_chain(model, prompt: list[int], max_new: int) -> tuple[list[int], list[float], list[float]]:
    """HF's greedy continuation on the device, recomputing the whole sequence each step: its tokens,
    each step's top-2 logit margin and each chosen token's log-probability."""
    ids, chosen, margins, logprobs = list(prompt), [], [], []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids], device=DEVICE)).logits[0, -1].double()
            top2 = logits.topk(2)
            token = int(top2.indices[0])
            chosen.append(token)
            margins.append(float(top2.values[0] - top2.values[1]))
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids.append(token)
    return chosen, margins, logprobs


def random_prompts(n: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def assert_all_blocks_free(llm: LLM) -> None:
    assert llm.stats().blocks_in_use == 0
    assert not llm.engine.has_unfinished_requests()
    llm.engine.kv.check_integrity()


# ------------------------------------------------------------------------------------ placement

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_and_kv_pool_live_on_the_device(tiny_checkpoints, dtype):
    llm = LLM(str(tiny_checkpoints["qwen3"]), device=DEVICE, dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=64)
    engine, runner = llm.engine, llm.engine.runner
    assert engine.info.device.startswith(DEVICE) and engine.info.dtype == dtype
    for name, tensor in [*runner.model.named_parameters(), *runner.model.named_buffers()]:
        assert tensor.device.type == DEVICE, name
    assert all(p.dtype == DTYPES[dtype] for p in runner.model.parameters())
    # the pool: one tensor per layer, in rows (panels are a CPU kernels' layout), on the device
    assert engine.info.kv_layout == runner.kv_layout == ROWS
    assert len(runner.kv_caches) == runner.config.num_hidden_layers
    for cache in runner.kv_caches:
        assert cache.device.type == DEVICE and cache.dtype == DTYPES[dtype]
        assert tuple(cache.shape) == kv_cache_shape(runner.config, 64, BLOCK_SIZE)
        assert not cache.any()
    assert runner.generator.device.type == DEVICE
    # the native kernels are CPU code: none is active, and decode steps run the modules
    assert engine.info.kernels == {} and runner.decode_program is None
    stats = llm.stats()
    assert stats.kv_cache_bytes == sum(c.numel() * c.element_size() for c in runner.kv_caches)
    assert torch.cuda.memory_allocated() >= stats.kv_cache_bytes + stats.weights_bytes
    out = llm.generate({"prompt_token_ids": random_prompts(1, [40], seed=3)[0]}, GREEDY)[0]
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    # the step wrote its K/V into the device pool (45 of its 64 * 16 slots)
    assert all(cache.any() for cache in runner.kv_caches)
    assert_all_blocks_free(llm)


def test_random_model_and_default_pool_on_the_device():
    """A built-in random model initialised on the device, with the pool sized by default."""
    prompts = [{"prompt_token_ids": p} for p in shared_prefix_prompts(40, seed=2)]
    on = LLM("random:qwen3-tiny", device=DEVICE, max_model_len=512)
    off = LLM("random:qwen3-tiny", device=DEVICE, max_model_len=512, enable_prefix_caching=False)
    assert all(p.device.type == DEVICE for p in on.engine.runner.model.parameters())
    assert all(c.device.type == DEVICE for c in on.engine.runner.kv_caches)
    outs_on = [on.generate(p, GREEDY)[0] for p in prompts]
    outs_off = [off.generate(p, GREEDY)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs_on] == [o.outputs[0].token_ids for o in outs_off]
    history: list[list[int]] = []
    for prompt, out in zip(prompts, outs_on):
        assert out.num_cached_tokens == expected_cached(history, prompt["prompt_token_ids"])
        history.append(prompt["prompt_token_ids"] + out.outputs[0].token_ids)
    assert all(o.num_cached_tokens > 0 for o in outs_on[1:])
    for llm in (on, off):
        assert_all_blocks_free(llm)


# ------------------------------------------------------------------------------ against HF

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("implementation", ["prefixserve", "transformers"])
def test_logits_within_tolerance_of_float64(case, implementation, dtype) -> None:
    arch, path, tokens, reference, simulated = case
    tolerance, rms_bound = bounds(reference, simulated)
    logits = (our_logits(path, dtype, tokens, DEVICE) if implementation == "prefixserve"
              else hf_logits(hf_model(path, DTYPES[dtype], device=DEVICE), tokens))
    errors = max_errors(logits, reference)
    print(f"\n{arch} {implementation} {dtype} on {DEVICE}: max {errors.max():.2e} (bfloat16 tolerance "
          f"{tolerance:.3f}), rms {errors.pow(2).mean().sqrt():.2e} (bound {rms_bound:.3f})")
    if dtype == "float32":
        assert errors.max() < tolerance / FLOAT32_SHARE
    else:
        assert errors.max() <= tolerance
        assert errors.pow(2).mean().sqrt() <= rms_bound


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_served_first_tokens_match_transformers_where_decisive(case, dtype) -> None:
    """A batch of requests through the engine on the device (scheduler, runner, sampler), each prompt
    ending at a position where the reference's margin is decisive: each first greedy token is HF's
    on the device in the same dtype (and the reference's)."""
    arch, path, tokens, reference, simulated = case
    tolerance, _ = bounds(reference, simulated)
    top2 = reference.topk(2, dim=-1)
    decisive = ((top2.values[..., 0] - top2.values[..., 1]) > margin_bound(dtype, tolerance)).nonzero().tolist()
    assert len(decisive) >= MIN_DECISIVE, f"{arch}: too few decisive positions ({len(decisive)})"
    decisive = decisive[::max(1, len(decisive) // 48)]  # float32: nearly every position; a spread of them
    theirs = hf_logits(hf_model(path, DTYPES[dtype], device=DEVICE), tokens).argmax(-1)
    llm = LLM(str(path), device=DEVICE, dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=64)
    outs = llm.generate([{"prompt_token_ids": tokens[seq][:pos + 1]} for seq, pos in decisive],
                        SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    print(f"\n{arch} {dtype}: {len(decisive)} decisive prompts")
    for (seq, pos), out in zip(decisive, outs):
        assert out.outputs[0].token_ids == [int(theirs[seq, pos])] == [int(top2.indices[seq, pos, 0])], \
            f"{arch} {dtype}: sequence {seq}, position {pos}"
    assert_all_blocks_free(llm)


def test_served_float32_greedy_generation_matches_transformers(case) -> None:
    """Four prompts generated together, chunked (64-token steps) and paged, against HF's greedy
    continuation on the device in float32: the same tokens for as long as the two agree, a parting
    only at a step whose HF margin is within what float32 rounding may flip; each token's
    log-probability within twice the float32 logit bound of HF's."""
    arch, path, _, reference, simulated = case
    tolerance, _ = bounds(reference, simulated)
    bound = tolerance / FLOAT32_SHARE
    max_new = 12
    prompts = random_prompts(4, [5, 17, 40, 33], seed=1)
    llm = LLM(str(path), device=DEVICE, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=64,
              max_num_batched_tokens=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True, logprobs=0))
    hf = hf_model(path, torch.float32, device=DEVICE)
    compared = 0
    for prompt, out in zip(prompts, outs):
        ours = out.outputs[0].token_ids
        assert len(ours) == max_new
        tokens, margins, logprobs = hf_greedy_chain(hf, prompt, max_new)
        for i in range(max_new):
            if ours[i] != tokens[i]:
                assert margins[i] <= 2 * 2 * bound, f"{arch}: parted at token {i} with margin {margins[i]:.2e}"
                break
            assert abs(out.outputs[0].logprobs[i][0] - logprobs[i]) <= 2 * 2 * bound
            compared += 1
    print(f"\n{arch}: {compared} of {len(prompts) * max_new} tokens equal to HF's")
    assert compared >= len(prompts) * max_new // 2
    assert_all_blocks_free(llm)


# -------------------------------------------------------------------------- prefix caching

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prefix_len", [17, 33, 50])
def test_prefix_caching_on_equals_off_and_counts_cached_tokens(tiny_checkpoints, dtype, prefix_len):
    path = str(tiny_checkpoints["qwen3"])
    prompts = shared_prefix_prompts(prefix_len, seed=prefix_len)
    on = LLM(path, device=DEVICE, dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=128)
    off = LLM(path, device=DEVICE, dtype=dtype, block_size=BLOCK_SIZE, num_kv_blocks=128,
              enable_prefix_caching=False)
    outs_on = [on.generate({"prompt_token_ids": p}, GREEDY)[0] for p in prompts]
    outs_off = [off.generate({"prompt_token_ids": p}, GREEDY)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs_on] == [o.outputs[0].token_ids for o in outs_off]
    history: list[list[int]] = []
    for prompt, out in zip(prompts, outs_on):
        assert out.num_cached_tokens == expected_cached(history, prompt)
        history.append(prompt + out.outputs[0].token_ids)
    assert all(o.num_cached_tokens > 0 for o in outs_on[1:])
    assert all(o.num_cached_tokens == 0 for o in outs_off)
    for llm in (on, off):
        assert_all_blocks_free(llm)


def test_requests_arriving_together_compute_shared_prefix_once(tiny_checkpoints):
    """Ten prompts sharing 96 tokens in one step: the prefix is computed once, later requests of the step
    read the blocks the first writes in it, and decode steps read the shared run once for all ten (the
    cascade merge, equal to one pass up to float32 rounding: float32 here)."""
    path = str(tiny_checkpoints["qwen3"])
    rng = random.Random(5)
    prefix = [rng.randrange(10, 4000) for _ in range(100)]
    prompts = [prefix + [rng.randrange(10, 4000) for _ in range(5 + i)] for i in range(10)]
    llm = LLM(path, device=DEVICE, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=128,
              max_num_batched_tokens=4096)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    shared = 100 // BLOCK_SIZE * BLOCK_SIZE
    assert llm.stats().computed_prompt_tokens == len(prompts[0]) + sum(len(p) - shared for p in prompts[1:])
    assert [o.num_cached_tokens for o in outs] == [0] + [shared] * 9
    ref = LLM(path, device=DEVICE, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=128,
              max_num_batched_tokens=4096, enable_prefix_caching=False)
    ref_outs = ref.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref_outs]
    for engine in (llm, ref):
        assert_all_blocks_free(engine)


# ------------------------------------------------------------------------ block accounting

def test_small_pool_preempts_keeps_outputs_and_frees_every_block(tiny_checkpoints):
    path = str(tiny_checkpoints["qwen3"])
    prompts = random_prompts(8, [40 + 7 * i for i in range(8)], seed=6)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    roomy = LLM(path, device=DEVICE, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=256)
    tight = LLM(path, device=DEVICE, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=12)
    want = roomy.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = tight.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert tight.stats().preemptions > 0
    for llm in (roomy, tight):
        assert_all_blocks_free(llm)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_abort_frees_every_block(tiny_checkpoints, dtype):
    llm = LLM(str(tiny_checkpoints["qwen3"]), device=DEVICE, dtype=dtype, block_size=BLOCK_SIZE,
              num_kv_blocks=128)
    engine = llm.engine
    for i, prompt in enumerate(random_prompts(5, [30, 31, 32, 33, 34], seed=8)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.stats().blocks_in_use > 0
    engine.abort_request([f"r{i}" for i in range(5)])
    assert_all_blocks_free(llm)


def test_forks_and_seeded_sampling_on_the_device(tiny_checkpoints):
    """n > 1 shares the prompt's blocks and copies the partial last one on write (block copies in the
    device pool): greedy forks all equal the single greedy output. Seeded random sampling (generators
    on the device, top-k / top-p / penalties) gives the same tokens alone and in a batch."""
    llm = LLM(str(tiny_checkpoints["qwen3"]), device=DEVICE, dtype="float32", block_size=BLOCK_SIZE,
              num_kv_blocks=128)
    prompt = {"prompt_token_ids": random_prompts(1, [40], seed=9)[0]}
    single = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    before = llm.stats().cow_copies
    forks = llm.generate(prompt, SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert llm.stats().cow_copies - before >= 2
    assert [o.token_ids for o in forks.outputs] == [single.outputs[0].token_ids] * 3

    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=1234,
                            max_tokens=10, ignore_eos=True, logprobs=2)
    alone = llm.generate(prompt, seeded)[0].outputs[0]
    others = [{"prompt_token_ids": p} for p in random_prompts(4, [12, 20, 28, 36], seed=10)]
    noisy = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batch = llm.generate([others[0], prompt, *others[1:]], [noisy, seeded, noisy, noisy, noisy])
    assert batch[1].outputs[0].token_ids == alone.token_ids
    # log-probabilities under the model's own distribution: the two most likely first, the token drawn no likelier
    for logprob, top in alone.logprobs:
        assert len(top) == 2 and 0 >= top[0][1] >= top[1][1] and logprob <= top[0][1]
    assert_all_blocks_free(llm)
