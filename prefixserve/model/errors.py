"""Errors raised while turning a model name into a ready model.

Every error names the problem (the file, tensor or field) so that a user can
fix the checkpoint without reading this code. All derive from ModelLoadError,
a LoadError of the project's error hierarchy (and so a ValueError).
"""
from __future__ import annotations

from prefixserve.errors import LoadError


class ModelLoadError(LoadError):
    """Base class: the model could not be loaded."""


class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """The checkpoint folder or one of its files does not exist."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture or one of its options is not implemented here."""


class InvalidModelConfigError(ModelLoadError):
    """config.json is unreadable or a required field is missing or malformed."""


class MissingTensorError(ModelLoadError):
    """A tensor the architecture needs is absent from the checkpoint."""


class UnexpectedTensorError(ModelLoadError):
    """The checkpoint holds a tensor the architecture has no place for."""


class TensorShapeMismatchError(ModelLoadError):
    """A checkpoint tensor's shape differs from the one the config implies."""
