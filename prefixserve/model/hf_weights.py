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
    visual = getattr(model, "visual", None)
    if visual is not None:
        targets.update(_vision_targets(visual))
    return targets


def _vision_targets(visual) -> dict[str, torch.Tensor]:
    c = visual.config
    targets = {
        "visual.patch_embed.proj.weight": visual.patch_embed.view(
            c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size),
        "visual.merger.ln_q.weight": visual.merger_norm,
        "visual.merger.mlp.0.weight": visual.merger_fc1, "visual.merger.mlp.0.bias": visual.merger_fc1_bias,
        "visual.merger.mlp.2.weight": visual.merger_fc2, "visual.merger.mlp.2.bias": visual.merger_fc2_bias,
    }
    for i, block in enumerate(visual.blocks):
        prefix = f"visual.blocks.{i}."
        targets.update({
            f"{prefix}norm1.weight": block.norm1, f"{prefix}norm2.weight": block.norm2,
            f"{prefix}attn.qkv.weight": block.qkv, f"{prefix}attn.qkv.bias": block.qkv_bias,
            f"{prefix}attn.proj.weight": block.proj, f"{prefix}attn.proj.bias": block.proj_bias,
            f"{prefix}mlp.gate_proj.weight": block.gate_proj, f"{prefix}mlp.gate_proj.bias": block.gate_bias,
            f"{prefix}mlp.up_proj.weight": block.up_proj, f"{prefix}mlp.up_proj.bias": block.up_bias,
            f"{prefix}mlp.down_proj.weight": block.down_proj, f"{prefix}mlp.down_proj.bias": block.down_bias,
        })
    return targets


def canonical_name(name: str) -> str:
    """A tensor's name in the hub layout: transformers 5 may write a VL model's language model under
    model.language_model. and its tower under model.visual."""
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    if name.startswith("model.visual."):
        return name.removeprefix("model.")
    return name


def is_ignorable(name: str, config_tied: bool) -> bool:
    """Tensors a checkpoint may carry that we deliberately skip."""
    # Tied checkpoints sometimes store the (identical) head anyway; HF ignores it too.
    return bool(_DERIVED.match(name)) or (config_tied and name == "lm_head.weight")
