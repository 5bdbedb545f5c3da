"""Images for vision-language models: decoding, the processor's resize and patches, content hashes,
placeholder expansion and M-RoPE positions. The engine's intake turns a prompt's images into a
MultimodalPrompt here; the worker reads it."""
from prefixserve.model.vision_config import VisionConfig
from prefixserve.multimodal.inputs import ImageItem, MultimodalPrompt

# VisionConfig: the settings images are processed under, for callers above the engine that prepare them
__all__ = ["ImageItem", "MultimodalPrompt", "VisionConfig"]
