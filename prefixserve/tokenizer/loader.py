"""Choosing the tokenizer for a model name."""
from __future__ import annotations

from pathlib import Path

from prefixserve.tokenizer.errors import TokenizerFileMissingError
from prefixserve.tokenizer.tokenizer import Tokenizer

RANDOM_MODEL_PREFIX = "random:"


def load_tokenizer(model: str) -> Tokenizer:
    """The built-in tokenizer for "random:<preset>" models, else the tokenizer in the checkpoint folder."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty string (a folder or 'random:<preset>'), got {model!r}")
    if model.startswith(RANDOM_MODEL_PREFIX):
        # the vision-language presets (random:qwen2.5-vl-*) place images with the added vision tokens
        return Tokenizer.builtin(vision=model.removeprefix(RANDOM_MODEL_PREFIX).startswith("qwen2.5-vl"))
    folder = Path(model).expanduser()
    if not folder.is_dir():
        raise TokenizerFileMissingError(
            f"model {model!r} is neither a 'random:<preset>' name nor an existing checkpoint folder")
    return Tokenizer.from_folder(folder)
