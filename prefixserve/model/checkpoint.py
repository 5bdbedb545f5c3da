"""The files of a local Hugging Face checkpoint folder, found and checked before any tensor is read."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixserve.model.errors import InvalidModelConfigError, ModelFileNotFoundError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class CheckpointFiles:
    folder: Path
    config: dict[str, Any]
    weight_files: tuple[Path, ...]   # every safetensors file to read, each once
    index_file: Path | None          # the shard index, when sharded

    def fingerprint(self) -> str:
        """sha256 over config.json, the index and each weight file's name and size.

        Stable across copies and moves of the folder; changes when the weights do
        (a re-export changes file sizes or the index) without hashing gigabytes.
        """
        digest = hashlib.sha256()
        digest.update((self.folder / "config.json").read_bytes())
        if self.index_file is not None:
            digest.update(self.index_file.read_bytes())
        for path in self.weight_files:
            digest.update(f"\0{path.name}\0{path.stat().st_size}".encode())
        return digest.hexdigest()


def find_checkpoint_files(folder: Path) -> CheckpointFiles:
    if not folder.is_dir():
        raise ModelFileNotFoundError(
            f"model {str(folder)!r} is neither a local checkpoint folder nor a random:<preset> name "
            "(downloading from the Hugging Face Hub is not supported)")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelFileNotFoundError(f"checkpoint folder {folder} has no config.json")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidModelConfigError(f"cannot parse {config_path}: {e}") from e
    if not isinstance(config, dict):
        raise InvalidModelConfigError(f"{config_path} must hold a JSON object")
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        return CheckpointFiles(folder, config, _shards_from_index(index_path), index_path)
    single = folder / SINGLE_FILE
    if single.is_file():
        return CheckpointFiles(folder, config, (single,), None)
    others = tuple(sorted(folder.glob("*.safetensors")))
    if others:
        return CheckpointFiles(folder, config, others, None)
    found = sorted(p.name for p in folder.glob("*.bin"))
    hint = f" (found {found}; only safetensors weights are supported)" if found else ""
    raise ModelFileNotFoundError(
        f"checkpoint folder {folder} has no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file{hint}")


def _shards_from_index(index_path: Path) -> tuple[Path, ...]:
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
        weight_map = index["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise InvalidModelConfigError(f"cannot read the weight_map of {index_path}: {e!r}") from e
    shards = tuple(index_path.parent / name for name in names)
    for shard in shards:
        if not shard.is_file():
            raise ModelFileNotFoundError(f"shard {shard.name} listed in {index_path.name} is missing from "
                                         f"{index_path.parent}")
    return shards
