"""The project's own tokenizer: shipped data files and their Hugging Face layout.

data/tokenizer.json is produced by scripts/train_tokenizer.py (byte-level BPE, 8192 ids; see that
script for the corpus and how to reproduce it). data/chat_template.jinja is the ChatML template in
the style of Qwen2.5/Qwen3 written for this project.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from prefixserve.tokenizer.hf_files import TokenizerFiles

BUILTIN_DATA_DIR = Path(__file__).resolve().parent / "data"
BUILTIN_VOCAB_SIZE = 8192
BUILTIN_MODEL_MAX_LENGTH = 32768

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Chat turns end with <|im_end|>, raw text with <|endoftext|>: generation stops at either.
BUILTIN_STOP_TOKENS = (IM_END, ENDOFTEXT)
# No BOS: like Qwen, prompts start with the first text or <|im_start|> token.
BUILTIN_SPECIAL_TOKENS = {"eos_token": IM_END, "pad_token": ENDOFTEXT}
# Added after the vocabulary (ids 8192, 8193, 8194) for the vision-language random models and the
# checkpoints tests build: where a picture goes in a prompt (Qwen2-VL's tokens).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")


def builtin_chat_template() -> str:
    return (BUILTIN_DATA_DIR / "chat_template.jinja").read_text(encoding="utf-8")


def builtin_tokenizer_files() -> TokenizerFiles:
    return TokenizerFiles(special_tokens=dict(BUILTIN_SPECIAL_TOKENS),
                          chat_template=builtin_chat_template(), model_max_length=BUILTIN_MODEL_MAX_LENGTH,
                          config_eos_ids=(), generation_eos_ids=())


def _added_tokens_decoder(tokenizer_json: dict[str, Any]) -> dict[str, dict[str, Any]]:
    keys = ("content", "lstrip", "normalized", "rstrip", "single_word", "special")
    return {str(tok["id"]): {k: tok[k] for k in keys} for tok in tokenizer_json["added_tokens"]}


def builtin_tokenizer_config() -> dict[str, Any]:
    """tokenizer_config.json for the built-in tokenizer, loadable by transformers' AutoTokenizer."""
    tokenizer_json = json.loads((BUILTIN_DATA_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    return {
        # The generic fast tokenizer loads tokenizer.json as it is; model-specific classes may
        # rebuild the pipeline (normalizer, regex) and would no longer match this file.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": _added_tokens_decoder(tokenizer_json),
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "model_max_length": BUILTIN_MODEL_MAX_LENGTH,
        "chat_template": builtin_chat_template(),
    }


def builtin_tokenizer_json(*, vision: bool = False) -> dict[str, Any]:
    """The built-in tokenizer.json, with VISION_TOKENS added after the vocabulary when `vision`."""
    data = json.loads((BUILTIN_DATA_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    if vision:
        next_id = BUILTIN_VOCAB_SIZE
        for token in VISION_TOKENS:
            data["added_tokens"].append({"id": next_id, "content": token, "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": True})
            next_id += 1
    return data


def write_builtin_tokenizer_files(folder: str | Path, *, vision: bool = False) -> None:
    """Writes tokenizer.json, tokenizer_config.json (with the chat template) and special_tokens_map.json
    into `folder` (created if needed), in the layout transformers' AutoTokenizer.from_pretrained reads;
    `vision` adds VISION_TOKENS."""
    target = Path(folder)
    target.mkdir(parents=True, exist_ok=True)
    if vision:
        tokenizer_json = builtin_tokenizer_json(vision=True)
        (target / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
        config = {**builtin_tokenizer_config(), "added_tokens_decoder": _added_tokens_decoder(tokenizer_json)}
    else:
        shutil.copyfile(BUILTIN_DATA_DIR / "tokenizer.json", target / "tokenizer.json")
        config = builtin_tokenizer_config()
    (target / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (target / "special_tokens_map.json").write_text(
        json.dumps(BUILTIN_SPECIAL_TOKENS, indent=2) + "\n", encoding="utf-8")
