"""Built-in models with seeded random weights, for tests, demos and benchmarks without downloads.

The cost of a forward pass does not depend on the weight values, so a random
model of a real model's shape times exactly like the real one.
"""
from __future__ import annotations

import torch

from prefixserve.model.config import ModelConfig
from prefixserve.model.decoder import CausalLM
from prefixserve.model.layers import RMSNorm

# Size of the project's shipped byte-level BPE tokenizer (prefixserve/tokenizer/data).
BUILTIN_TOKENIZER_VOCAB = 8192

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
}



def random_model(preset: str, *, dtype: torch.dtype, device: torch.device | str, seed: int,
                 attention_backend: str = "auto") -> CausalLM:
    """The preset's model with weights drawn from a generator seeded by `seed` (same seed, same weights)."""
    if preset not in RANDOM_PRESETS:
        raise KeyError(preset)
    model = CausalLM(RANDOM_PRESETS[preset], dtype=dtype, device=device, attention_backend=attention_backend)
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
    for param in model.parameters():
        if id(param) in norm_weights:
            param.fill_(1.0)
        elif param.dim() == 1:  # the only other vectors are biases
            param.zero_()
        else:
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
