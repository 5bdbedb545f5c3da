"""Reading the Hugging Face files around tokenizer.json: tokenizer_config.json, config.json,
generation_config.json and the chat template files."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixserve.tokenizer.errors import TokenizerLoadError

# Named templates: a dict name -> template source, as HF stores several templates.
ChatTemplateSource = str | dict[str, str] | None

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when the file does not exist."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TokenizerLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def token_content(value: Any, *, where: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, an AddedToken dict or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerLoadError(f"{where}: expected a string, a {{'content': ...}} object or null, got {value!r}")


def token_id_list(value: Any, *, where: str) -> list[int]:
    """eos_token_id / bos_token_id as config files write it: an int, a list of ints or null."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise TokenizerLoadError(f"{where}: expected a non-negative int or a list of them, got {value!r}")
    return list(items)


@dataclass(frozen=True)
class TokenizerFiles:
    """Everything read from a folder besides tokenizer.json itself."""
    special_tokens: dict[str, str]          # bos_token/eos_token/... -> content, only those set
    chat_template: ChatTemplateSource
    model_max_length: int | None
    config_eos_ids: tuple[int, ...]          # config.json eos_token_id
    generation_eos_ids: tuple[int, ...]      # generation_config.json eos_token_id


def _named_templates(value: Any, *, where: str) -> ChatTemplateSource:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise TokenizerLoadError(f"{where}: chat_template must be a string or a list of {{name, template}}, got {value!r}")


def _chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> ChatTemplateSource:
    # Same precedence as transformers: chat_template.jinja (+ additional_chat_templates/*.jinja)
    # replaces the template embedded in tokenizer_config.json; chat_template.json (the older
    # processor file) is used only when neither has one.
    templates: dict[str, str] = {}
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        templates["default"] = jinja.read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    embedded = _named_templates(tokenizer_config.get("chat_template"), where=str(folder / "tokenizer_config.json"))
    if embedded is not None:
        return embedded
    legacy = read_json(folder / "chat_template.json") or {}
    return _named_templates(legacy.get("chat_template"), where=str(folder / "chat_template.json"))


def read_tokenizer_files(folder: Path) -> TokenizerFiles:
    config_path = folder / "tokenizer_config.json"
    tokenizer_config = read_json(config_path) or {}
    special = {}
    for key in SPECIAL_TOKEN_KEYS:
        content = token_content(tokenizer_config.get(key), where=f"{config_path}: {key}")
        if content is not None:
            special[key] = content
    max_len = tokenizer_config.get("model_max_length")
    model_max_length = max_len if isinstance(max_len, int) and not isinstance(max_len, bool) else None
    config = read_json(folder / "config.json") or {}
    # Multimodal checkpoints keep the language model's ids under text_config.
    text_config = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    config_eos = token_id_list(config.get("eos_token_id", text_config.get("eos_token_id")),
                               where=f"{folder / 'config.json'}: eos_token_id")
    generation = read_json(folder / "generation_config.json") or {}
    generation_eos = token_id_list(generation.get("eos_token_id"),
                                   where=f"{folder / 'generation_config.json'}: eos_token_id")
    return TokenizerFiles(special_tokens=special, chat_template=_chat_template(folder, tokenizer_config),
                          model_max_length=model_max_length, config_eos_ids=tuple(config_eos),
                          generation_eos_ids=tuple(generation_eos))
