"""The encoder cache: least recently used out first under its byte budget; and in the engine, the vision
tower runs once per distinct picture, never for a picture the cached KV prefix covers, and a chunked
prefill that splits a picture encodes it once."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from prefixserve import LLM, SamplingParams
from prefixserve.worker.encoder_cache import EncoderCache

PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def picture(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (150, 230, 3), dtype=np.uint8))


def test_lru_under_a_byte_budget() -> None:
    cache = EncoderCache(max_bytes=3 * 64)   # three 4x4 float32 tensors
    tensors = {k: torch.full((4, 4), float(i)) for i, k in enumerate([b"a", b"b", b"c", b"d"])}
    for key in (b"a", b"b", b"c"):
        cache.get_or_encode(key, lambda key=key: tensors[key])
    cache.get_or_encode(b"a", lambda: torch.zeros(1))      # a hit: a becomes the most recent
    cache.get_or_encode(b"d", lambda: tensors[b"d"])       # b, the least recent, makes room
    assert (cache.runs, cache.hits, len(cache), cache.bytes) == (4, 1, 3, 3 * 64)
    assert torch.equal(cache.get_or_encode(b"a", lambda: torch.zeros(1)), tensors[b"a"])
    cache.get_or_encode(b"b", lambda: tensors[b"b"])
    assert cache.runs == 5   # b had been dropped
    too_big = EncoderCache(max_bytes=10)
    too_big.get_or_encode(b"x", lambda: tensors[b"a"])
    assert len(too_big) == 0 and too_big.bytes == 0


def test_second_question_on_the_same_picture_runs_no_encoder() -> None:
    llm = LLM("random:qwen2.5-vl-tiny", block_size=16)
    doc = " The report below covers the quarter in some detail and lists every figure." * 3
    llm.generate({"prompt": f"{PLACEHOLDER}{doc} First question?", "multi_modal_data": {"image": [picture(1)]}},
                 GREEDY)
    assert (llm.engine.stats().encoder_runs, llm.engine.stats().encoder_cache_hits) == (1, 0)
    for q in ("Second question?", "Third one?"):
        out = llm.generate({"prompt": f"{PLACEHOLDER}{doc} {q}", "multi_modal_data": {"image": [picture(1)]}},
                           GREEDY)[0]
        assert out.num_cached_tokens > out.prompt_token_ids.index(8193)  # the whole picture was cached
    stats = llm.engine.stats()
    assert (stats.encoder_runs, stats.encoder_cache_hits) == (1, 0)
    llm.generate({"prompt": f"{PLACEHOLDER} other", "multi_modal_data": {"image": [picture(2)]}}, GREEDY)
    assert llm.engine.stats().encoder_runs == 2


def test_a_picture_the_prefix_does_not_cover_comes_from_the_encoder_cache() -> None:
    llm = LLM("random:qwen2.5-vl-tiny", block_size=16)
    for q in ("one", "two"):   # the picture's last block is shared only up to its block boundary
        llm.generate({"prompt": f"{PLACEHOLDER}{q}", "multi_modal_data": {"image": [picture(3)]}}, GREEDY)
    stats = llm.engine.stats()
    assert (stats.encoder_runs, stats.encoder_cache_hits) == (1, 1)


def test_chunked_prefill_encodes_a_split_picture_once() -> None:
    chunked = LLM("random:qwen2.5-vl-tiny", block_size=16, max_num_batched_tokens=16)
    chunked.generate({"prompt": f"a b c {PLACEHOLDER} d", "multi_modal_data": {"image": [picture(4)]}}, GREEDY)
    stats = chunked.engine.stats()
    assert (stats.encoder_runs, stats.encoder_cache_hits) == (1, 2)   # three chunks touch the picture
    uncached = LLM("random:qwen2.5-vl-tiny", block_size=16, max_num_batched_tokens=16, encoder_cache_bytes=0)
    uncached.generate({"prompt": f"a b c {PLACEHOLDER} d", "multi_modal_data": {"image": [picture(4)]}}, GREEDY)
    assert uncached.engine.stats().encoder_runs == 3
