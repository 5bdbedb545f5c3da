"""Images for vision-language models: decoding, the processor's resize and patches, content hashes,
placeholder expansion and M-RoPE positions. The engine's intake turns a prompt's images into a
MultimodalPrompt here; the worker reads it."""
from prefixserve.multimodal.inputs import ImageItem, MultimodalPrompt

__all__ = ["ImageItem", "MultimodalPrompt"]
