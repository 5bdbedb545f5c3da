"""The image-qa workload: one picture of about 1,000 image tokens plus a short document, asked 16
questions at once. prefixserve with its prefix cache, the same with the cache off, and HF transformers'
Qwen2.5-VL of the same shapes (random weights: the cost of a forward does not depend on them) running
each question with no reuse. Reported: wall time, prompt tokens computed against the ideal (every
token of the first prompt, then only what each question adds), and how often the vision tower ran.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from prefixserve import LLM, SamplingParams
from prefixserve.benchmarks.runner import machine_info
from prefixserve.prompt.conversation import IMAGE_PLACEHOLDER

# 812 x 980 pixels: 58 x 70 patches of 14, 29 x 35 = 1,015 image tokens
IMAGE_SIZE = (812, 980)
QUESTIONS = 16
MAX_TOKENS = 8
DOCUMENT = ("Quarterly operations report. Shipments rose in every region; the northern warehouse ran at "
            "capacity for six weeks and the southern one opened a second shift. Returns fell by a tenth. ") * 3


@dataclass(frozen=True)
class ImageQaRun:
    engine: str
    seconds: float
    prompt_tokens: int
    computed_prompt_tokens: int
    vision_runs: int


def picture(seed: int = 0) -> Image.Image:
    """A photograph-like picture: smooth colour fields with noise (no two runs of pixels alike)."""
    rng = np.random.default_rng(seed)
    h, w = IMAGE_SIZE
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([128 + 100 * np.sin(xx / 97 + c) * np.cos(yy / 71 - c) for c in range(3)], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8))


def prompts(n: int) -> list[str]:
    return [f"{IMAGE_PLACEHOLDER}\n{DOCUMENT}\nQuestion {i}: what does the chart show about region {i}?"
            for i in range(n)]


def ideal_prompt_tokens(token_lists: list[list[int]]) -> int:
    """Every token of the first prompt, then each later prompt's tokens past its longest common prefix with
    an earlier one: what a perfect cache computes."""
    total = len(token_lists[0])
    for i, tokens in enumerate(token_lists[1:], 1):
        shared = max(_common(tokens, earlier) for earlier in token_lists[:i])
        total += len(tokens) - shared
    return total


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_prefixserve(model: str, n: int, *, caching: bool, seed: int) -> tuple[ImageQaRun, list[list[int]]]:
    llm = LLM(model, dtype="float32", seed=seed, enable_prefix_caching=caching, max_num_batched_tokens=4096)
    image = picture()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm.generate("warm up", SamplingParams(max_tokens=2))   # first-call costs (thread pools, kernels) not timed
    start = time.perf_counter()
    outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": [image]}} for p in prompts(n)], params)
    seconds = time.perf_counter() - start
    stats = llm.engine.stats()
    name = "prefixserve" if caching else "prefixserve (cache off)"
    return (ImageQaRun(name, seconds, stats.prompt_tokens, stats.computed_prompt_tokens, stats.encoder_runs),
            [o.prompt_token_ids for o in outs])


def run_hf(model: str, token_lists: list[list[int]], seed: int) -> ImageQaRun:
    """HF's Qwen2.5-VL of the preset's shapes, one question at a time, nothing reused."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from prefixserve.model.random_models import RANDOM_PRESETS
    c = RANDOM_PRESETS[model.removeprefix("random:")]
    v = c.vision
    assert v is not None
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
                         max_position_embeddings=c.max_position_embeddings, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta,
                                          "mrope_section": list(v.mrope_section)}),
        vision_config=dict(depth=v.depth, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                           num_heads=v.num_heads, patch_size=v.patch_size, spatial_merge_size=v.spatial_merge_size,
                           temporal_patch_size=v.temporal_patch_size, window_size=v.window_size,
                           out_hidden_size=v.out_hidden_size, fullatt_block_indexes=list(v.fullatt_block_indexes)),
        image_token_id=v.image_token_id, video_token_id=v.image_token_id,
        vision_start_token_id=v.vision_start_token_id, vision_end_token_id=v.vision_end_token_id,
        tie_word_embeddings=c.tie_word_embeddings)
    torch.manual_seed(seed)
    hf = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    runs = 0

    def count(*_args) -> None:
        nonlocal runs
        runs += 1
    hf.model.visual.register_forward_hook(count)
    processor = Qwen2VLImageProcessorPil(min_pixels=v.min_pixels, max_pixels=v.max_pixels)
    image = picture()
    with torch.no_grad():   # first-call costs not timed
        hf.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    with torch.no_grad():
        for ids in token_lists:
            pixels = processor(images=[image], return_tensors="pt")
            input_ids = torch.tensor([ids])
            hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                        mm_token_type_ids=(input_ids == v.image_token_id).int(), pixel_values=pixels["pixel_values"],
                        image_grid_thw=pixels["image_grid_thw"], max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                        do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - start
    total = sum(len(t) for t in token_lists)
    return ImageQaRun("hf transformers (no reuse)", seconds, total, total, runs)


def image_qa_markdown(model: str, quick: bool, threads: int, seed: int = 0) -> str:
    torch.set_num_threads(threads)
    n = 4 if quick else QUESTIONS
    ours, token_lists = run_prefixserve(model, n, caching=True, seed=seed)
    off, _ = run_prefixserve(model, n, caching=False, seed=seed)
    hf = run_hf(model, token_lists, seed)
    ideal = ideal_prompt_tokens(token_lists)
    machine = machine_info(threads)
    lines = [f"### image-qa: {model}, {n} questions on one picture of "
             f"{token_lists[0].count(token_lists[0][1])} image tokens",
             "", f"CPU: {machine['cpu']}, {threads} threads of {os.cpu_count()}; float32; "
             f"{MAX_TOKENS} tokens out each", "",
             "| engine | seconds | vs prefixserve | prompt tokens computed | computed / ideal | vision-tower runs |",
             "|---|---|---|---|---|---|"]
    for run in (ours, off, hf):
        lines.append(f"| {run.engine} | {run.seconds:.2f} | {run.seconds / ours.seconds:.1f}x | "
                     f"{run.computed_prompt_tokens} | {run.computed_prompt_tokens / ideal:.2f} | {run.vision_runs} |")
    lines += ["", f"ideal prompt tokens: {ideal} (the first prompt, then what each question adds); distinct "
              "pictures: 1"]
    return "\n".join(lines)
