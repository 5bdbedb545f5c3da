"""Built-in random models: deterministic by seed, the advertised shapes."""
from __future__ import annotations

import math

import torch

from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.decoder import CausalLM
from prefixserve.model.kv_layout import kv_cache_shape
from prefixserve.model.loader import load_model
from prefixserve.model.prepared_weight import matrix
from prefixserve.model.random_models import RANDOM_PRESETS
from prefixserve.tokenizer import Tokenizer


def _logits(loaded, ids: list[int]) -> torch.Tensor:
    config = loaded.config
    caches = [torch.zeros(kv_cache_shape(config, 4, 16)) for _ in range(config.num_hidden_layers)]
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[2, 0]], 16)
    with torch.inference_mode():
        hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
        return loaded.model.compute_logits(hidden)


def test_same_seed_same_weights_and_outputs() -> None:
    a, b = load_model("random:qwen3-tiny", seed=3), load_model("random:qwen3-tiny", seed=3)
    for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(x, y), name
    ids = [5, 900, 77, 8000, 12, 12, 3]
    assert torch.equal(_logits(a, ids), _logits(b, ids))
    assert a.identity == b.identity == "random:qwen3-tiny:seed3:float32"


def test_different_seed_different_weights() -> None:
    a, b = load_model("random:qwen3-tiny", seed=0), load_model("random:qwen3-tiny", seed=1)
    assert not torch.equal(matrix(a.model.embed_tokens), matrix(b.model.embed_tokens))
    assert a.identity != b.identity


def test_tiny_preset_weights_are_scaled_by_fan_in() -> None:
    model = load_model("random:qwen3-tiny").model
    assert model.lm_head is model.embed_tokens
    down = matrix(model.layers[0].mlp.down_proj)
    assert abs(down.std().item() - down.shape[-1] ** -0.5) < 0.1 * down.shape[-1] ** -0.5
    assert torch.equal(model.layers[1].self_attn.q_norm.weight, torch.ones(16))
    assert torch.isfinite(_logits(load_model("random:qwen3-tiny"), [1, 2, 3])).all()


def test_tiny_preset_vocabulary_is_the_builtin_tokenizers() -> None:
    assert RANDOM_PRESETS["qwen3-tiny"].vocab_size == Tokenizer.builtin().vocab_size


def test_default_and_auto_dtype_is_float32_on_cpu() -> None:
    for dtype in (None, "auto"):
        loaded = load_model("random:qwen3-tiny", dtype=dtype)
        assert all(p.dtype == torch.float32 for p in loaded.model.parameters())


def test_bf16_random_model() -> None:
    loaded = load_model("random:qwen3-tiny", dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert loaded.identity.endswith(":bfloat16")


def test_qwen3_06b_preset_has_the_published_parameter_count() -> None:
    # Qwen3-0.6B: 0.44B non-embedding parameters (PERF-NOTES: 440.5M), 151936 x 1024 embeddings, tied.
    model = CausalLM(RANDOM_PRESETS["qwen3-0.6b"], device="meta")
    total = sum(p.numel() for p in model.parameters())
    embedding = 151936 * 1024
    assert abs((total - embedding) - 440.5e6) < 0.05e6


def test_the_tiny_model_reads_its_cached_context():
    """Comparing outputs with caching on and off is an oracle for K/V only if outputs depend on
    the K/V: with the whole pool negated after the prompts were cached, every greedy
    continuation of the same prompts (now served from the cache) changes."""
    from prefixserve import LLM, SamplingParams
    llm = LLM("random:qwen3-tiny", dtype="float32", num_kv_blocks=256)
    prompts = [{"prompt_token_ids": [(i * 37 + k * 11) % 900 + 20 for i in range(100)]} for k in range(6)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    for cache in llm.engine.runner.kv_caches:
        cache.mul_(-1.0)
    again = llm.generate(prompts, params)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert all(o.outputs[0].token_ids != f for o, f in zip(again, first))


def test_qwen2_5_vl_3b_preset_has_the_3b_parameters() -> None:
    """random:qwen2.5-vl-3b against HF's Qwen2.5-VL built from Qwen2.5-VL-3B-Instruct's config.json values
    (on the meta device: shapes only)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from prefixserve.model.vision_language import VisionLanguageModel
    hf_config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=128000,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                           fullatt_block_indexes=[7, 15, 23, 31], window_size=112, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        tie_word_embeddings=True)
    with torch.device("meta"):
        hf = Qwen2_5_VLForConditionalGeneration(hf_config)
    ours = VisionLanguageModel(RANDOM_PRESETS["qwen2.5-vl-3b"], device="meta")
    shapes = sorted(tuple(p.shape) for p in ours.parameters())
    hf_shapes = sorted(tuple(p.shape) for p in hf.parameters())
    assert sum(math.prod(s) for s in shapes) == sum(math.prod(s) for s in hf_shapes)
