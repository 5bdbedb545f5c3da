"""The shape and options of a decoder-only model, independent of where its weights come from.

A checkpoint's config.json (written by transformers 4.x or 5.x) is normalised
into one ModelConfig; every other part of the model reads only this.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from prefixserve.model.errors import InvalidModelConfigError, UnsupportedModelError
from prefixserve.model.vision_config import VisionConfig, vision_config_from_hf

# HF "architectures" entry -> our family name.
HF_ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    # a Qwen2 language model with M-RoPE behind a vision tower (model/vision_language.py)
    "Qwen2_5_VLForConditionalGeneration": "qwen2",
}
VISION_LANGUAGE_ARCHITECTURES = frozenset({"Qwen2_5_VLForConditionalGeneration"})
SUPPORTED_FAMILIES = tuple(sorted(set(HF_ARCHITECTURES.values())))

# Rope scaling types this implementation computes, and the keys each one needs.
ROPE_SCALING_KEYS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Maps "float32"/"bfloat16"/"float16" (or the torch dtype itself) to a torch dtype."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"dtype {dtype!r} is not supported; use float32, bfloat16 or float16")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str                  # "qwen3" | "qwen2" | "llama"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    # None, or {"rope_type": "linear" | "llama3", ...that type's keys}
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool               # bias on q/k/v projections (qwen2)
    qk_norm: bool                      # per-head RMSNorm on q and k (qwen3)
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"       # dtype the checkpoint was saved in
    attention_output_bias: bool = False  # bias on o_proj (llama/qwen3 with attention_bias)
    # the vision tower and image settings of a vision-language model (Qwen2.5-VL); None: text only
    vision: VisionConfig | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_FAMILIES:
            raise ValueError(f"architecture {self.architecture!r} is not one of {SUPPORTED_FAMILIES}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (isinstance(self.rms_norm_eps, (int, float)) and self.rms_norm_eps > 0):
            raise ValueError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not (isinstance(self.rope_theta, (int, float)) and self.rope_theta > 0
                and math.isfinite(self.rope_theta)):
            raise ValueError(f"rope_theta must be a positive number, got {self.rope_theta!r}")
        self._validate_rope_scaling()
        for name in ("tie_word_embeddings", "attention_bias", "qk_norm", "attention_output_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.bos_token_id is not None and not _is_token_id(self.bos_token_id):
            raise ValueError(f"bos_token_id must be an int >= 0 or None, got {self.bos_token_id!r}")
        eos = self.eos_token_id
        if eos is not None and not (_is_token_id(eos) or (
                isinstance(eos, list) and all(_is_token_id(t) for t in eos))):
            raise ValueError(f"eos_token_id must be an int, a list of ints or None, got {eos!r}")
        if self.torch_dtype not in DTYPES:
            raise ValueError(f"torch_dtype {self.torch_dtype!r} is not one of {sorted(DTYPES)}")

    def _validate_rope_scaling(self) -> None:
        scaling = self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, dict):
            raise ValueError(f"rope_scaling must be a dict or None, got {scaling!r}")
        kind = scaling.get("rope_type")
        if kind not in ROPE_SCALING_KEYS:
            raise ValueError(f"rope_scaling rope_type {kind!r} is not one of {sorted(ROPE_SCALING_KEYS)}")
        for key in ROPE_SCALING_KEYS[kind]:
            value = scaling.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"rope_scaling {key!r} must be a positive number, got {value!r}")
        if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            raise ValueError("rope_scaling high_freq_factor must exceed low_freq_factor")

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any],
                       preprocessor: Mapping[str, Any] | None = None) -> "ModelConfig":
        """Builds a ModelConfig from a parsed config.json (transformers 4.x or 5.x layout); preprocessor:
        a vision-language checkpoint's preprocessor_config.json, where it has one."""
        if not isinstance(d, Mapping):
            raise InvalidModelConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        family = _family(d)
        vision = None
        if _architecture_name(d) in VISION_LANGUAGE_ARCHITECTURES:
            # transformers 5 nests the language model's keys under text_config; hub checkpoints are flat
            top = d
            d = {**d, **(d.get("text_config") or {})}
            vision = vision_config_from_hf(top, d, preprocessor)
            d["tie_word_embeddings"] = top.get("tie_word_embeddings", d.get("tie_word_embeddings", False))
            d = {**d, "rope_parameters": _without_mrope(d.get("rope_parameters")),
                 "rope_scaling": _without_mrope(d.get("rope_scaling"))}
        _reject_unsupported_options(d)

        def required(key: str) -> Any:
            if key not in d or d[key] is None:
                raise InvalidModelConfigError(f"config.json has no {key!r}")
            return d[key]

        heads = required("num_attention_heads")
        hidden = required("hidden_size")
        head_dim = d.get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else 0)
        theta, scaling = _rope(d)
        if family == "qwen2":
            # Qwen2 always has q/k/v biases and never an o_proj bias; the config has no switch.
            qkv_bias, out_bias = True, False
        else:
            qkv_bias = out_bias = bool(d.get("attention_bias", False))
        try:
            return cls(
                architecture=family,
                vocab_size=required("vocab_size"),
                hidden_size=hidden,
                num_hidden_layers=required("num_hidden_layers"),
                num_attention_heads=heads,
                num_key_value_heads=d.get("num_key_value_heads") or heads,
                head_dim=head_dim,
                intermediate_size=required("intermediate_size"),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                max_position_embeddings=required("max_position_embeddings"),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=qkv_bias,
                qk_norm=family == "qwen3",
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                torch_dtype=d.get("dtype") or d.get("torch_dtype") or "float32",
                attention_output_bias=out_bias,
                vision=vision,
            )
        except ValueError as e:
            if isinstance(e, InvalidModelConfigError):
                raise
            raise InvalidModelConfigError(f"config.json: {e}") from e


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _architecture_name(d: Mapping[str, Any]) -> Any:
    archs = d.get("architectures")
    return (archs[0] if isinstance(archs, list) else archs) if archs else None


def _without_mrope(rope: Any) -> Any:
    """A VL config's rope parameters less the M-RoPE keys (the VisionConfig keeps mrope_section)."""
    if not isinstance(rope, Mapping):
        return rope
    rest = {k: v for k, v in rope.items() if k != "mrope_section"}
    if rest.get("rope_type", rest.get("type")) == "mrope":
        rest["rope_type"] = "default"
        rest.pop("type", None)
    return rest


def _family(d: Mapping[str, Any]) -> str:
    archs = d.get("architectures")
    if archs:
        name = archs[0] if isinstance(archs, list) else archs
        if name not in HF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {name!r} is not supported; supported: {', '.join(HF_ARCHITECTURES)}")
        return HF_ARCHITECTURES[name]
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"config.json names no supported architecture (architectures missing, model_type "
            f"{model_type!r}); supported: {', '.join(HF_ARCHITECTURES)}")
    return model_type


def _reject_unsupported_options(d: Mapping[str, Any]) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only 'silu')")
    if d.get("use_sliding_window"):
        raise UnsupportedModelError("use_sliding_window=true is not supported (full attention only)")
    other_layers = sorted({t for t in d.get("layer_types") or [] if t != "full_attention"})
    if other_layers:
        raise UnsupportedModelError(f"layer_types {other_layers} are not supported (full attention only)")
    if d.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")


def _rope(d: Mapping[str, Any]) -> tuple[float, dict | None]:
    """Returns (theta, scaling) from either the 4.x keys or 5.x "rope_parameters"."""
    params = dict(d.get("rope_parameters") or {})
    nested_theta = params.pop("rope_theta", None)
    theta = d.get("rope_theta") or nested_theta or 10000.0
    raw = d.get("rope_scaling") or params
    if not raw:
        return float(theta), None
    if not isinstance(raw, Mapping):
        raise InvalidModelConfigError(f"rope_scaling must be an object, got {raw!r}")
    scaling = dict(raw)
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if kind == "default":
        return float(theta), None
    if kind not in ROPE_SCALING_KEYS:
        raise UnsupportedModelError(
            f"rope scaling type {kind!r} is not supported; supported: default, {', '.join(ROPE_SCALING_KEYS)}")
    return float(theta), {"rope_type": kind, **scaling}
