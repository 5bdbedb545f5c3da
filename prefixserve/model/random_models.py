"""Built-in models with seeded random weights, for tests, demos and benchmarks without downloads.

The cost of a forward pass does not depend on the weight values, so a random
model of a real model's shape times exactly like the real one.
"""
from __future__ import annotations

import torch

from prefixserve.model.config import ModelConfig
from prefixserve.model.decoder import CausalLM
from prefixserve.model.layers import RMSNorm
from prefixserve.model.vision_config import VisionConfig
from prefixserve.model.vision_language import VisionLanguageModel

# Size of the project's shipped byte-level BPE tokenizer (prefixserve/tokenizer/data).
BUILTIN_TOKENIZER_VOCAB = 8192
# The built-in tokenizer with the three vision tokens added after its vocabulary
# (tokenizer/builtin.py VISION_TOKENS): <|vision_start|>, <|vision_end|>, <|image_pad|>.
BUILTIN_VISION_VOCAB = BUILTIN_TOKENIZER_VOCAB + 3
_VISION_IDS = dict(vision_start_token_id=8192, vision_end_token_id=8193, image_token_id=8194)

RANDOM_PRESETS: dict[str, ModelConfig] = {
    "qwen3-tiny": ModelConfig(
        architecture="qwen3", vocab_size=BUILTIN_TOKENIZER_VOCAB, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, max_position_embeddings=4096,
        tie_word_embeddings=True, attention_bias=False, qk_norm=True),
    # The exact shape of Qwen/Qwen3-0.6B.
    "qwen3-0.6b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
        rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, max_position_embeddings=40960,
        tie_word_embeddings=True, attention_bias=False, qk_norm=True),
    # Qwen2.5-VL of tiny shapes, with the image processor's default bounds (up to 1280 tokens an image)
    "qwen2.5-vl-tiny": ModelConfig(
        architecture="qwen2", vocab_size=BUILTIN_VISION_VOCAB, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, max_position_embeddings=4096,
        tie_word_embeddings=True, attention_bias=True, qk_norm=False,
        vision=VisionConfig(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                            fullatt_block_indexes=(1, 3), window_size=56, mrope_section=(2, 3, 3),
                            **_VISION_IDS)),
    # The shapes of Qwen/Qwen2.5-VL-3B-Instruct, with the built-in tokenizer's vision token ids.
    "qwen2.5-vl-3b": ModelConfig(
        architecture="qwen2", vocab_size=151936, hidden_size=2048, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, head_dim=128, intermediate_size=11008,
        rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None, max_position_embeddings=128000,
        tie_word_embeddings=True, attention_bias=True, qk_norm=False,
        vision=VisionConfig(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                            out_hidden_size=2048, fullatt_block_indexes=(7, 15, 23, 31), window_size=112,
                            mrope_section=(16, 24, 24), min_pixels=3136, max_pixels=12845056, **_VISION_IDS)),
}



def random_model(preset: str, *, dtype: torch.dtype, device: torch.device | str, seed: int,
                 attention_backend: str = "auto") -> CausalLM:
    """The preset's model with weights drawn from a generator seeded by `seed` (same seed, same weights)."""
    if preset not in RANDOM_PRESETS:
        raise KeyError(preset)
    config = RANDOM_PRESETS[preset]
    model_class = CausalLM if config.vision is None else VisionLanguageModel
    model = model_class(config, dtype=dtype, device=device, attention_backend=attention_backend)
    initialise_randomly(model, seed=seed)
    return model.eval()


@torch.no_grad()
def initialise_randomly(model: torch.nn.Module, *, seed: int) -> None:
    """Norm weights 1, biases 0, every matrix N(0, 1 / fan_in), in parameters() order.

    Not HF's N(0, 0.02): with it and tied embeddings a small model's output is dominated by the
    current token's own embedding, and its greedy continuation hardly depends on the context
    (qwen3-tiny repeated the last prompt token, and negating its whole K/V cache changed no
    output), so no test comparing outputs could tell right K/V from wrong. Scaled by fan-in,
    every layer's output is of the order of its input, and the context decides the output.

    Values are drawn directly in the parameter's dtype and device: no float32
    staging copy, so even a 0.6B model initialises in seconds.
    """
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    # the vision tower keeps its norm weights as plain parameters (norm1, norm2, merger_norm)
    norm_weights |= {id(p) for name, p in model.named_parameters() if "norm" in name.rsplit(".", 1)[-1]}
    for param in model.parameters():
        if id(param) in norm_weights:
            param.fill_(1.0)
        elif param.dim() == 1:  # the only other vectors are biases
            param.zero_()
        else:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
