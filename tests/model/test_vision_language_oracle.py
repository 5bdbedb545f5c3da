"""Qwen2.5-VL against HF transformers on the same tiny checkpoint (float32).

The image processor's patches and the vision tower's output against HF's; then the whole engine:
greedy tokens equal to HF's generate, and each generated token's log-probability close to HF's one
forward over the full sequence, on one image, two images, a prefix hit on the same picture, a
chunked prefill that splits an image, preemption, and n > 1. A different picture behind the same
text gives HF's answer for that picture, never the first one's (no KV of another image served).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint_factory import VL_MAX_PIXELS, build_tiny_vl_model, write_tiny_vl_checkpoint
from prefixserve import LLM, SamplingParams
from prefixserve.model.loader import load_model
from prefixserve.multimodal.processor import process_image
from vl_oracle import PLACEHOLDER, hf_greedy, hf_logprobs, hf_processor, random_image

MAX_TOKENS = 8
LOGPROB_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_vl_checkpoint(tmp_path_factory.mktemp("vl") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def hf_model():
    return build_tiny_vl_model()


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLM:
    return LLM(str(checkpoint), dtype="float32", block_size=16)


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, n=n, ignore_eos=True)


def assert_matches_hf(hf_model, out, images) -> None:
    ids = out.prompt_token_ids
    for sample in out.outputs:
        assert sample.token_ids == hf_greedy(hf_model, ids, images, MAX_TOKENS)
        reference = hf_logprobs(hf_model, ids + sample.token_ids, images)
        for j, token in enumerate(sample.token_ids):
            ours = sample.logprobs[j][0]
            assert abs(ours - reference[len(ids) - 1 + j, token].item()) < LOGPROB_TOLERANCE


@pytest.mark.parametrize("size", [(150, 230), (30, 40), (600, 90), (112, 112)])
def test_patches_equal_hf_image_processor(checkpoint: Path, size: tuple[int, int]) -> None:
    vision = load_model(str(checkpoint)).config.vision
    image = random_image(*size, seed=sum(size))
    ref = hf_processor()(images=[image], return_tensors="pt")
    ours = process_image(image, vision)
    assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
    assert ours.num_tokens * 4 == ours.pixel_values.shape[0] <= VL_MAX_PIXELS // 14 ** 2
    torch.testing.assert_close(ours.pixel_values, ref["pixel_values"], atol=1e-6, rtol=0)


def test_vision_tower_equals_hf(checkpoint: Path, hf_model) -> None:
    model = load_model(str(checkpoint), dtype="float32").model
    images = [random_image(150, 230, 1), random_image(60, 90, 2)]
    ref = hf_processor()(images=images, return_tensors="pt")
    with torch.no_grad():
        expected = hf_model.model.visual(ref["pixel_values"], grid_thw=ref["image_grid_thw"]).pooler_output
    grids = [tuple(g) for g in ref["image_grid_thw"].tolist()]
    torch.testing.assert_close(model.encode_images(ref["pixel_values"], grids), expected, atol=1e-4, rtol=1e-4)


def test_one_and_two_images(llm: LLM, hf_model) -> None:
    one = [random_image(150, 230, 3)]
    two = [random_image(100, 170, 4), random_image(60, 90, 5)]
    outs = llm.generate([
        {"prompt": f"Describe {PLACEHOLDER} briefly.", "multi_modal_data": {"image": one}},
        {"prompt": f"Compare {PLACEHOLDER} with {PLACEHOLDER} now", "multi_modal_data": {"image": two}},
    ], greedy())
    assert_matches_hf(hf_model, outs[0], one)
    assert_matches_hf(hf_model, outs[1], two)
    assert outs[1].prompt_token_ids.count(8194) == sum(
        process_image(i, llm.engine.model_config.vision).num_tokens for i in two)


def test_prefix_hit_on_the_same_picture_matches_hf(llm: LLM, hf_model) -> None:
    picture = [random_image(150, 230, 6)]
    first = llm.generate({"prompt": f"{PLACEHOLDER} What is in the picture?",
                          "multi_modal_data": {"image": picture}}, greedy())[0]
    second = llm.generate({"prompt": f"{PLACEHOLDER} What colour dominates?",
                           "multi_modal_data": {"image": picture}}, greedy())[0]
    image_end = first.prompt_token_ids.index(8193)
    assert second.num_cached_tokens >= image_end // 16 * 16 > 0
    assert_matches_hf(hf_model, first, picture)
    assert_matches_hf(hf_model, second, picture)


def test_chunked_prefill_splitting_an_image(checkpoint: Path, hf_model) -> None:
    chunked = LLM(str(checkpoint), dtype="float32", block_size=16, max_num_batched_tokens=16,
                  enable_prefix_caching=False)
    picture = [random_image(150, 230, 7)]
    out = chunked.generate({"prompt": f"a b c {PLACEHOLDER} d e", "multi_modal_data": {"image": picture}},
                           greedy())[0]
    ids = out.prompt_token_ids
    start = ids.index(8194)
    end = start + ids.count(8194)
    assert (end - 1) // 16 - start // 16 == 2  # the image's tokens span three 16-token chunks
    assert_matches_hf(hf_model, out, picture)


def test_preemption_recomputes_images(checkpoint: Path, hf_model) -> None:
    small = LLM(str(checkpoint), dtype="float32", block_size=16, num_kv_blocks=8)
    prompts = [([random_image(150, 230, 10 + i)], f"{PLACEHOLDER} question {i}") for i in range(3)]
    outs = small.generate([{"prompt": p, "multi_modal_data": {"image": im}} for im, p in prompts],
                          SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert small.engine.stats().preemptions > 0
    for out, (images, _) in zip(outs, prompts):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, out.prompt_token_ids, images, 24)


def test_n_samples_share_the_image(llm: LLM, hf_model) -> None:
    picture = [random_image(80, 300, 8)]
    out = llm.generate({"prompt": f"Tell me {PLACEHOLDER}", "multi_modal_data": {"image": picture}},
                       greedy(n=2))[0]
    assert len(out.outputs) == 2
    assert_matches_hf(hf_model, out, picture)


def test_another_picture_is_never_served_the_first_ones_kv(llm: LLM, hf_model) -> None:
    text = f"Caption: {PLACEHOLDER} in one line"
    a, b = [random_image(150, 230, 20)], [random_image(150, 230, 21)]
    first = llm.generate({"prompt": text, "multi_modal_data": {"image": a}}, greedy())[0]
    second = llm.generate({"prompt": text, "multi_modal_data": {"image": b}}, greedy())[0]
    assert first.prompt_token_ids == second.prompt_token_ids  # the token ids alone cannot tell them apart
    image_start = first.prompt_token_ids.index(8194)
    assert second.num_cached_tokens == image_start // 16 * 16
    assert_matches_hf(hf_model, second, b)
    assert second.outputs[0].token_ids != first.outputs[0].token_ids
