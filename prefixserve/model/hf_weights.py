"""Where each tensor of a Hugging Face checkpoint goes in our (partly fused) parameters."""
from __future__ import annotations

import re

import torch

from prefixserve.model.decoder import CausalLM
from prefixserve.model.prepared_weight import matrix

# Buffers some older checkpoints saved; we recompute them from the config.
_DERIVED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def hf_weight_targets(model: CausalLM) -> dict[str, torch.Tensor]:
    """HF tensor name -> the view of our parameter it fills (q/k/v and gate/up are row slices).

    Packed projections (`CausalLM.pack_weights`) give unpacked copies: right for reading the weights
    out, not for loading into them (loading happens before packing)."""
    config = model.config
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    targets: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": matrix(model.embed_tokens),
        "model.norm.weight": model.norm.weight,
    }
    if not config.tie_word_embeddings:
        targets["lm_head.weight"] = matrix(model.lm_head)
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        attn = layer.self_attn
        qkv, gate_up = matrix(attn.qkv_proj), matrix(layer.mlp.gate_up_proj)
        parts = {"q_proj": slice(0, q), "k_proj": slice(q, q + kv), "v_proj": slice(q + kv, q + 2 * kv)}
        for proj, rows in parts.items():
            targets[f"{prefix}self_attn.{proj}.weight"] = qkv[rows]
            if attn.qkv_bias is not None:
                targets[f"{prefix}self_attn.{proj}.bias"] = attn.qkv_bias[rows]
        targets[f"{prefix}self_attn.o_proj.weight"] = matrix(attn.o_proj)
        if attn.o_bias is not None:
            targets[f"{prefix}self_attn.o_proj.bias"] = attn.o_bias
        if attn.q_norm is not None:
            targets[f"{prefix}self_attn.q_norm.weight"] = attn.q_norm.weight
            targets[f"{prefix}self_attn.k_norm.weight"] = attn.k_norm.weight
        targets[f"{prefix}mlp.gate_proj.weight"] = gate_up[:inter]
        targets[f"{prefix}mlp.up_proj.weight"] = gate_up[inter:]
        targets[f"{prefix}mlp.down_proj.weight"] = matrix(layer.mlp.down_proj)
        targets[f"{prefix}input_layernorm.weight"] = layer.input_layernorm.weight
        targets[f"{prefix}post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
    return targets


def is_ignorable(name: str, config_tied: bool) -> bool:
    """Tensors a checkpoint may carry that we deliberately skip."""
    # Tied checkpoints sometimes store the (identical) head anyway; HF ignores it too.
    return bool(_DERIVED.match(name)) or (config_tied and name == "lm_head.weight")
