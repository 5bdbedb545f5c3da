"""The decoder-only transformer shared by the Qwen3, Qwen2 and Llama families.

The families differ only in switches the config carries: q/k/v biases (Qwen2),
per-head RMSNorm on q and k (Qwen3), rope scaling (Llama 3), tied embeddings.
The forward pass runs on a flat batch: the new tokens of many sequences, each
with its position, attending through the paged KV pool described by the
attention metadata.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from prefixserve.model.attention.backend import AttentionBackend
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.attention.registry import AUTO, select_backend
from prefixserve.model.config import ModelConfig
from prefixserve.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, empty_parameter
from prefixserve.model.platform import Platform, platform_for


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend,
                 *, dtype: torch.dtype, device: torch.device | str, platform: Platform) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.scale = config.head_dim ** -0.5
        self.backend = backend
        # rows: q_proj, then k_proj, then v_proj
        self.qkv_proj = empty_parameter(self.q_size + 2 * self.kv_size, config.hidden_size,
                                        dtype=dtype, device=device)
        self.qkv_bias = (empty_parameter(self.q_size + 2 * self.kv_size, dtype=dtype, device=device)
                         if config.attention_bias else None)
        self.o_proj = empty_parameter(config.hidden_size, self.q_size, dtype=dtype, device=device)
        self.o_bias = (empty_parameter(config.hidden_size, dtype=dtype, device=device)
                       if config.attention_output_bias else None)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype, device=device, platform=platform)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype=dtype, device=device, platform=platform)
        else:
            self.q_norm = self.k_norm = None
        self._linear, self._qk_norm_rope = platform.linear, platform.qk_norm_rope

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: Any) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self._linear(x, self.qkv_proj, self.qkv_bias)
        v = qkv[:, self.q_size + self.kv_size:].view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is None:
            q_weight = k_weight = None
            eps = 0.0
        else:
            q_weight, k_weight, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        q, k = self._qk_norm_rope(qkv, self.num_heads, self.num_kv_heads, self.head_dim, q_weight, k_weight, eps,
                                  cos, sin)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self._linear(out.view(tokens, self.q_size), self.o_proj, self.o_bias)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend,
                 *, dtype: torch.dtype, device: torch.device | str, platform: Platform) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device, platform=platform)
        self.self_attn = Attention(config, backend, dtype=dtype, device=device, platform=platform)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device,
                                                platform=platform)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype=dtype, device=device,
                            platform=platform)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's MLP output, the residual stream before it): the caller adds the two, in the next
        layer's input norm, so each residual add and the norm after it are one pass."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_norm(
            self.self_attn(h, cos, sin, kv_cache, meta), residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """A Qwen3 / Qwen2 / Llama causal language model over a paged KV pool."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu",
                 attention_backend: AttentionBackend | str = AUTO) -> None:
        super().__init__()
        self.config = config
        # the device's ops, weight preparation and kernels (model/platform.py)
        self.platform = platform = platform_for(device)
        if isinstance(attention_backend, str):
            attention_backend = select_backend(attention_backend, device, dtype)
        # one instance shared by every layer: its per-step plan is built once and read by all
        self.attention_backend = backend = attention_backend
        self.embed_tokens = empty_parameter(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, dtype=dtype, device=device, platform=platform)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device, platform=platform)
        self.lm_head = (self.embed_tokens if config.tie_word_embeddings
                        else empty_parameter(config.vocab_size, config.hidden_size, dtype=dtype, device=device))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: Any, *, inputs_embeds: torch.Tensor | None = None,
                rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of every token in the flat batch.

        attn_metadata: what the backend's build_metadata made of the step's AttentionMetadata
        (the runner prepares it before the forward), or a plain AttentionMetadata, prepared here.
        Each new token's K/V lands in its slot of every layer's pool; each token
        attends to positions <= its own within its sequence.
        inputs_embeds: the token embeddings to use instead of looking input_ids up (image tokens);
        rope_positions: what the rotary turns by where that differs from `positions` (M-RoPE's [3, T]).
        """
        if isinstance(attn_metadata, AttentionMetadata):
            attn_metadata = self.attention_backend.build_metadata(attn_metadata)
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                             "must be equal-length 1-D tensors")
        x = self.platform.embedding(input_ids, self.embed_tokens) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary(positions if rope_positions is None else rope_positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cos, sin, kv_cache, attn_metadata)
        return self.norm(x) if residual is None else self.norm.add_norm(x, residual)[0]

    @torch.no_grad()
    def pack_weights(self) -> bool:
        """Re-lays the projections and the LM head for the platform's kernels, where its device and dtype
        allow (the CPU's packed GEMM: platforms/cpu/packed_weight.py); True if it changed any. Prepared
        weights are left as they are, so a second call changes nothing."""
        return self.platform.prepare_weights(self)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] for the given rows only (the caller selects the rows to sample)."""
        # A strided row selection makes low-precision oneDNN matmuls very slow; feed a dense copy.
        return self.platform.linear(hidden.contiguous(), self.lm_head, widened=True)
