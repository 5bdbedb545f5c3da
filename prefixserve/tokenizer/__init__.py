"""Tokenizer part: tokenizer.json via `tokenizers`, chat templates via sandboxed Jinja, streaming
detokenization, and the project's own byte-level BPE shipped in data/."""
from prefixserve.tokenizer.builtin import BUILTIN_VOCAB_SIZE, write_builtin_tokenizer_files
from prefixserve.tokenizer.chat_template import ChatTemplateError
from prefixserve.tokenizer.detokenizer import IncrementalDetokenizer
from prefixserve.tokenizer.errors import TokenizerFileMissingError, TokenizerLoadError
from prefixserve.tokenizer.loader import load_tokenizer
from prefixserve.tokenizer.tokenizer import Tokenizer

__all__ = [
    "BUILTIN_VOCAB_SIZE",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerFileMissingError",
    "TokenizerLoadError",
    "load_tokenizer",
    "write_builtin_tokenizer_files",
]
