"""The vision side of a Qwen2.5-VL checkpoint: the vision tower's shape, the placeholder token ids, the
M-RoPE sections of the language model, and the image processor's settings (which decide how many
placeholder tokens a picture becomes)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from prefixserve.model.errors import InvalidModelConfigError, UnsupportedModelError

# OpenAI CLIP's normalisation, the Qwen2-VL image processor's default
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int               # the language model's hidden size
    fullatt_block_indexes: tuple[int, ...]
    window_size: int = 112             # pixels per side of an attention window
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    rope_theta: float = 10000.0
    # token ids of the language model
    image_token_id: int = 151655
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    # frequencies of the language model's rotary per position axis (temporal, height, width)
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    # the image processor: every one of these changes the pixels or the number of tokens
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "window_size",
                     "patch_size", "temporal_patch_size", "spatial_merge_size", "in_channels", "min_pixels",
                     "max_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"vision {name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 4:
            raise ValueError(f"vision hidden_size {self.hidden_size} over {self.num_heads} heads must give a "
                             "head size divisible by 4 (2D rotary)")
        if len(self.mrope_section) != 3:
            raise ValueError(f"mrope_section must have 3 entries, got {self.mrope_section!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} exceeds max_pixels {self.max_pixels}")

    @property
    def factor(self) -> int:
        """An image's sides are resized to multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.spatial_merge_size

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def processor_settings(self) -> tuple:
        """Every setting that changes an image's pixels or tokens: part of the image's content hash."""
        return (self.patch_size, self.temporal_patch_size, self.spatial_merge_size, self.min_pixels,
                self.max_pixels, self.image_mean, self.image_std)


def vision_config_from_hf(d: Mapping[str, Any], text: Mapping[str, Any],
                          preprocessor: Mapping[str, Any] | None) -> VisionConfig:
    """From a Qwen2.5-VL config.json (d), its text part (nested text_config or the flat top level) and
    preprocessor_config.json when the checkpoint has one."""
    vision = d.get("vision_config")
    if not isinstance(vision, Mapping):
        raise InvalidModelConfigError("config.json of a vision-language model has no vision_config object")
    act = vision.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"vision hidden_act {act!r} is not supported (only 'silu')")
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    section = rope.get("mrope_section")
    if section is None:
        raise InvalidModelConfigError("config.json has no rope mrope_section")
    vision_rope = vision.get("rope_parameters") or {}
    pre = dict(preprocessor or {})
    size = pre.get("size") or {}
    try:
        return VisionConfig(
            depth=vision["depth"], hidden_size=vision["hidden_size"],
            intermediate_size=vision["intermediate_size"], num_heads=vision["num_heads"],
            out_hidden_size=vision.get("out_hidden_size") or text["hidden_size"],
            fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes") or ()),
            window_size=vision.get("window_size", 112), patch_size=vision.get("patch_size", 14),
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            spatial_merge_size=vision.get("spatial_merge_size", 2), in_channels=vision.get("in_channels", 3),
            rope_theta=float(vision_rope.get("rope_theta", 10000.0)),
            image_token_id=d.get("image_token_id", 151655),
            vision_start_token_id=d.get("vision_start_token_id", 151652),
            vision_end_token_id=d.get("vision_end_token_id", 151653),
            mrope_section=tuple(section),
            min_pixels=pre.get("min_pixels") or size.get("shortest_edge") or DEFAULT_MIN_PIXELS,
            max_pixels=pre.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS,
            image_mean=tuple(pre.get("image_mean") or CLIP_MEAN),
            image_std=tuple(pre.get("image_std") or CLIP_STD),
        )
    except KeyError as e:
        raise InvalidModelConfigError(f"config.json vision_config has no {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise InvalidModelConfigError(f"config.json vision_config: {e}") from e
