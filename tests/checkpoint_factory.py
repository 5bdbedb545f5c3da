"""Writes tiny random checkpoints in the exact Hugging Face layout, using transformers itself.

The checkpoints are small (hidden 64, head_dim 16, GQA, 2-3 layers) but have
the real vocabulary size of the project tokenizer (8192), so tokenizer and
model fit together. Weights are drawn wider than HF's default init (std 0.15,
norm weights 1 + N(0, 0.1)) so logits are far from uniform and argmax
comparisons between implementations mean something.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, PreTrainedModel, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

from prefixserve.tokenizer import Tokenizer, write_builtin_tokenizer_files

VOCAB_SIZE = 8192  # the project tokenizer's vocabulary
WEIGHT_STD = 0.15
NORM_NOISE_STD = 0.1

# Special ids follow the project tokenizer (no BOS; generation stops at <|im_end|> or <|endoftext|>)
# rather than each config class's defaults, which would point at ordinary tokens of this vocabulary.
_COMMON = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_key_value_heads=2,
               rms_norm_eps=1e-6, max_position_embeddings=4096, bos_token_id=None,
               eos_token_id=sorted(Tokenizer.builtin().eos_token_ids))

# One entry per architecture; together they cover tied and untied heads, head_dim != hidden/heads
# (qwen3), q/k/v biases (qwen2) and Llama 3 rope scaling whose three frequency bands all occur
# at head_dim 16 with original_max_position_embeddings 64.
ARCHITECTURES: dict[str, tuple[type, type[PreTrainedModel], dict]] = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(
        _COMMON, num_hidden_layers=2, num_attention_heads=8, head_dim=16, rope_theta=1e6,
        tie_word_embeddings=True)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(
        _COMMON, num_hidden_layers=3, num_attention_heads=4, rope_theta=1e6,
        tie_word_embeddings=True)),
    "llama": (LlamaConfig, LlamaForCausalLM, dict(
        _COMMON, num_hidden_layers=2, num_attention_heads=4, head_dim=16, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        tie_word_embeddings=False)),
}


def build_tiny_model(arch: str, *, seed: int = 0, **config_overrides) -> PreTrainedModel:
    """A transformers model of the tiny shape for `arch`, with seeded wide random weights."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch {arch!r} is not one of {sorted(ARCHITECTURES)}")
    config_cls, model_cls, kwargs = ARCHITECTURES[arch]
    config = config_cls(**{**kwargs, **config_overrides})
    model = model_cls(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + NORM_NOISE_STD * noise)
            else:
                param.copy_(WEIGHT_STD * noise)
    return model


def write_tiny_checkpoint(folder: Path, arch: str, *, seed: int = 0, max_shard_size: str | None = None,
                          **config_overrides) -> Path:
    """Saves build_tiny_model(arch) with save_pretrained (float32 safetensors) and the project
    tokenizer's files (tokenizer.json, tokenizer_config.json with the chat template) into `folder`.

    max_shard_size (e.g. "200KB") splits the weights into shards plus
    model.safetensors.index.json, as large real checkpoints are.
    """
    model = build_tiny_model(arch, seed=seed, **config_overrides)
    folder.mkdir(parents=True, exist_ok=True)
    if max_shard_size is None:
        model.save_pretrained(folder)
    else:
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    write_builtin_tokenizer_files(folder)
    return folder


# A Qwen2.5-VL of tiny shapes over the project tokenizer with its vision tokens added (8192-8194).
# window_size 56 makes windows of 2x2 merged cells, so images of more than 4x4 patches have several
# windows, some cut short at the edges; blocks 1 and 3 attend over the whole image.
VL_TEXT = dict(vocab_size=VOCAB_SIZE + 3, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, max_position_embeddings=4096,
               bos_token_id=None, eos_token_id=sorted(Tokenizer.builtin().eos_token_ids),
               rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]})
VL_VISION = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
                 temporal_patch_size=2, window_size=56, out_hidden_size=64, fullatt_block_indexes=[1, 3])
VL_IDS = dict(vision_start_token_id=VOCAB_SIZE, vision_end_token_id=VOCAB_SIZE + 1, image_token_id=VOCAB_SIZE + 2,
              video_token_id=VOCAB_SIZE + 2)
VL_MAX_PIXELS = 28 * 28 * 64


def build_tiny_vl_model(*, seed: int = 0) -> PreTrainedModel:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    config = Qwen2_5_VLConfig(text_config=dict(VL_TEXT), vision_config=dict(VL_VISION), tie_word_embeddings=True,
                              **VL_IDS)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name or "ln_q" in name:
                param.copy_(1.0 + NORM_NOISE_STD * noise)
            else:
                param.copy_(WEIGHT_STD * noise)
    return model


def write_tiny_vl_checkpoint(folder: Path, *, seed: int = 0) -> Path:
    """build_tiny_vl_model saved in the hub layout, with the vision tokenizer and a preprocessor_config.json
    capping images at VL_MAX_PIXELS (64 tokens)."""
    import json
    model = build_tiny_vl_model(seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_builtin_tokenizer_files(folder, vision=True)
    (folder / "preprocessor_config.json").write_text(json.dumps(
        {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56, "max_pixels": VL_MAX_PIXELS,
         "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2}))
    return folder
