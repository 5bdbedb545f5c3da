"""Errors raised while loading a tokenizer."""
from __future__ import annotations

from prefixserve.errors import LoadError


class TokenizerLoadError(LoadError):
    """A tokenizer folder or one of its files cannot be used; the message names the file and the problem."""


class TokenizerFileMissingError(TokenizerLoadError, FileNotFoundError):
    """A file the tokenizer needs (tokenizer.json) is not in the folder."""
