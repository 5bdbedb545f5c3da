"""Model layer: configs, the decoder architectures, the checkpoint loader and attention backends."""
from prefixserve.model.config import ModelConfig
from prefixserve.model.decoder import CausalLM
from prefixserve.model.errors import (InvalidModelConfigError, MissingTensorError, ModelFileNotFoundError,
                                      ModelLoadError, TensorShapeMismatchError, UnexpectedTensorError,
                                      UnsupportedModelError)
from prefixserve.model.kv_layout import kv_cache_bytes_per_block, kv_cache_shape
from prefixserve.model.loader import LoadedModel, load_model
from prefixserve.model.random_models import RANDOM_PRESETS

__all__ = ["CausalLM", "InvalidModelConfigError", "LoadedModel", "MissingTensorError", "ModelConfig",
           "ModelFileNotFoundError", "ModelLoadError", "RANDOM_PRESETS", "TensorShapeMismatchError",
           "UnexpectedTensorError", "UnsupportedModelError", "kv_cache_bytes_per_block", "kv_cache_shape",
           "load_model"]
