"""Tokenizer: a tokenizer.json (via the `tokenizers` library) plus the model's chat template and stop ids."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from prefixserve.tokenizer.builtin import (BUILTIN_DATA_DIR, BUILTIN_STOP_TOKENS, VISION_TOKENS,
                                           builtin_tokenizer_files)
from prefixserve.tokenizer.chat_template import render_chat, select_template
from prefixserve.tokenizer.errors import TokenizerFileMissingError, TokenizerLoadError
from prefixserve.tokenizer.hf_files import ChatTemplateSource, TokenizerFiles, read_tokenizer_files


def _load_backend(tokenizer_json: Path) -> tokenizers.Tokenizer:
    try:
        return tokenizers.Tokenizer.from_file(str(tokenizer_json))
    except Exception as exc:  # the Rust side raises plain Exception subclasses
        raise TokenizerLoadError(f"{tokenizer_json} cannot be loaded by the tokenizers library: {exc}") from exc


class Tokenizer:
    """Encodes and decodes text and renders chat templates for one model.

    vocab_size is one past the largest id the tokenizer knows (added tokens included). A model's
    embedding table is often larger (padded); ids at or beyond vocab_size are not tokens and are
    dropped by decode, never turned into garbage text.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: ChatTemplateSource = None,
                 special_tokens: dict[str, str] | None = None,
                 extra_eos_token_ids: Iterable[int] = (), model_max_length: int | None = None,
                 name: str = "") -> None:
        self.backend = backend
        self.name = name
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        vocab = backend.get_vocab(with_added_tokens=True)
        self.vocab_size: int = max(vocab.values()) + 1 if vocab else 0
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.pad_token: str | None = self.special_tokens.get("pad_token")
        self.bos_token_id: int | None = self._special_id("bos_token")
        self.eos_token_id: int | None = self._special_id("eos_token")
        self.pad_token_id: int | None = self._special_id("pad_token")
        extra = list(extra_eos_token_ids)
        if self.eos_token_id is None and extra:
            self.eos_token_id = extra[0]
        eos = set(extra)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.special_token_ids: frozenset[int] = frozenset(
            tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special)

    def _special_id(self, key: str) -> int | None:
        content = self.special_tokens.get(key)
        if content is None:
            return None
        tid = self.backend.token_to_id(content)
        if tid is None:
            raise TokenizerLoadError(f"{self.name or 'tokenizer'}: {key} {content!r} is not in the vocabulary")
        return tid

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Loads tokenizer.json with tokenizer_config.json, chat template files, config.json and
        generation_config.json when present; eos_token_ids is the union of the eos ids they name."""
        folder = Path(path)
        if not folder.is_dir():
            raise TokenizerFileMissingError(f"tokenizer folder {folder} does not exist")
        tokenizer_json = folder / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise TokenizerFileMissingError(
                f"{folder} has no tokenizer.json; prefixserve needs the fast-tokenizer file "
                f"(re-save the tokenizer with transformers' save_pretrained to produce it)")
        return cls._from_files(_load_backend(tokenizer_json), read_tokenizer_files(folder), name=str(folder))

    @classmethod
    def builtin(cls, *, vision: bool = False) -> Tokenizer:
        """The project's shipped byte-level BPE (8192 ids) with its ChatML chat template; `vision` adds
        the three image tokens after them (builtin.VISION_TOKENS)."""
        backend = _load_backend(BUILTIN_DATA_DIR / "tokenizer.json")
        if vision:
            backend.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                        for t in VISION_TOKENS])
        stop_ids = [backend.token_to_id(token) for token in BUILTIN_STOP_TOKENS]
        return cls._from_files(backend, builtin_tokenizer_files(), extra_eos_token_ids=stop_ids, name="builtin")

    @classmethod
    def _from_files(cls, backend: tokenizers.Tokenizer, files: TokenizerFiles, *,
                    extra_eos_token_ids: Iterable[int] = (), name: str) -> Tokenizer:
        return cls(backend, chat_template=files.chat_template, special_tokens=files.special_tokens,
                   extra_eos_token_ids=(*extra_eos_token_ids, *files.generation_eos_ids, *files.config_eos_ids),
                   model_max_length=files.model_max_length, name=name)

    # -- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. add_special_tokens applies tokenizer.json's post-processor (e.g. a BOS)."""
        return self.encoding(text, add_special_tokens).ids

    def encoding(self, text: str, add_special_tokens: bool = False) -> tokenizers.Encoding:
        """The backend's Encoding of `text` (ids plus character offsets).

        Goes through encode_batch: unlike encode, it releases the GIL while it works, so other
        threads of the process (an engine loop, an event loop) keep running during a long text
        (30k tokens: 45 ms in which encode let no other Python thread run)."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids >= vocab_size are dropped; skip_special_tokens drops special added tokens."""
        return self.backend.decode(self.known_ids(ids), skip_special_tokens=skip_special_tokens)

    def known_ids(self, ids: Iterable[int]) -> list[int]:
        """`ids` without those at or beyond vocab_size; a negative id is a caller bug and raises."""
        kept = []
        for raw in ids:
            tid = int(raw)
            if tid < 0:
                raise ValueError(f"token id {tid} is negative")
            if tid < self.vocab_size:
                kept.append(tid)
        return kept

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # -- chat -----------------------------------------------------------------------------------

    def template_variables(self) -> dict[str, Any]:
        """What transformers exposes to templates besides messages/tools: the set special tokens
        (bos_token, eos_token, pad_token, ...), not the additional ones."""
        return dict(self.special_tokens)

    def apply_chat_template(self, messages: list[dict], *, tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            chat_template: str | None = None, documents: list[dict] | None = None,
                            **kwargs: Any) -> str | list[int]:
        """Renders `messages` through the chat template (same text as transformers' apply_chat_template);
        tokenize=True returns the ids of that text, encoded without adding special tokens.
        chat_template: a template source, or the name of one of the model's named templates.
        Extra kwargs (e.g. enable_thinking=False) are passed to the template."""
        source = select_template(self.chat_template, name=chat_template, has_tools=tools is not None)
        text = render_chat(source, messages, tools=tools, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.template_variables(), documents=documents, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_token_ids={sorted(self.eos_token_ids)})"
