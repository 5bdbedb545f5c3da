"""ModelConfig: parsing real-world config.json layouts, validation, and the KV pool layout."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from prefixserve.model.config import ModelConfig
from prefixserve.model.errors import InvalidModelConfigError, UnsupportedModelError
from prefixserve.model.kv_layout import kv_cache_bytes_per_block, kv_cache_shape
from prefixserve.model.random_models import RANDOM_PRESETS

# The published config.json of Qwen/Qwen3-0.6B (transformers 4.x layout).
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}

# Llama 3.1 style: rope scaling under "rope_scaling", no head_dim.
LLAMA_31 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 2048,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 128256,
}

QWEN2_5 = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 896,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 151936, "eos_token_id": 151643,
}


def test_real_qwen3_config_matches_the_random_preset_shape() -> None:
    parsed = ModelConfig.from_hf_config(QWEN3_0_6B)
    preset = RANDOM_PRESETS["qwen3-0.6b"]
    ignore = {"bos_token_id", "eos_token_id", "torch_dtype"}
    for field in dataclasses.fields(ModelConfig):
        if field.name not in ignore:
            assert getattr(parsed, field.name) == getattr(preset, field.name), field.name
    assert parsed.qk_norm and not parsed.attention_bias
    assert parsed.eos_token_id == 151645 and parsed.torch_dtype == "bfloat16"


def test_llama31_config() -> None:
    parsed = ModelConfig.from_hf_config(LLAMA_31)
    assert parsed.architecture == "llama"
    assert parsed.head_dim == 64 and not parsed.qk_norm and not parsed.attention_bias
    assert parsed.rope_theta == 500000.0
    assert parsed.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0,
                                   "low_freq_factor": 1.0, "original_max_position_embeddings": 8192}
    assert parsed.eos_token_id == [128001, 128008, 128009]


def test_qwen2_config_has_qkv_bias_but_no_output_bias() -> None:
    parsed = ModelConfig.from_hf_config(QWEN2_5)
    assert parsed.architecture == "qwen2" and parsed.head_dim == 64
    assert parsed.attention_bias and not parsed.attention_output_bias
    assert parsed.rope_scaling is None


def test_transformers5_rope_parameters_layout() -> None:
    d = dict(LLAMA_31)
    scaling = d.pop("rope_scaling")
    d.pop("rope_theta")
    d["rope_parameters"] = {**scaling, "rope_theta": 123456.0}
    parsed = ModelConfig.from_hf_config(d)
    assert parsed.rope_theta == 123456.0
    assert parsed.rope_scaling["rope_type"] == "llama3"
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 7.0}
    assert ModelConfig.from_hf_config(d).rope_scaling is None


@pytest.mark.parametrize("change, message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel"),
    ({"hidden_act": "gelu"}, "gelu"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
])
def test_unsupported_options_are_named(change: dict, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_config({**QWEN3_0_6B, **change})


def test_missing_architecture_falls_back_to_model_type() -> None:
    d = {k: v for k, v in QWEN3_0_6B.items() if k != "architectures"}
    assert ModelConfig.from_hf_config(d).architecture == "qwen3"
    with pytest.raises(UnsupportedModelError, match="bert"):
        ModelConfig.from_hf_config({**d, "model_type": "bert"})


@pytest.mark.parametrize("key", ["vocab_size", "intermediate_size", "num_hidden_layers"])
def test_missing_required_field_is_named(key: str) -> None:
    d = {k: v for k, v in QWEN3_0_6B.items() if k != key}
    with pytest.raises(InvalidModelConfigError, match=key):
        ModelConfig.from_hf_config(d)


@pytest.mark.parametrize("change, field", [
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"head_dim": 7}, "head_dim"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ({"architecture": "gpt2"}, "architecture"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"eos_token_id": "eos"}, "eos_token_id"),
    ({"torch_dtype": "int4"}, "torch_dtype"),
])
def test_validation_names_the_bad_field(change: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(RANDOM_PRESETS["qwen3-tiny"], **change)


def test_kv_layout_matches_allocated_pool() -> None:
    config = RANDOM_PRESETS["qwen3-0.6b"]
    shape = kv_cache_shape(config, num_blocks=10, block_size=16)
    assert shape == (2, 10, 16, 8, 128)
    for dtype in (torch.float32, torch.bfloat16):
        pool = torch.empty(shape, dtype=dtype, device="meta")
        per_layer_per_block = pool.numel() * pool.element_size() // 10
        assert kv_cache_bytes_per_block(config, 16, dtype) == per_layer_per_block * config.num_hidden_layers
    with pytest.raises(ValueError, match="block_size"):
        kv_cache_shape(config, 10, 0)
