"""load_model: a checkpoint folder or a random:<preset> name -> a ready CausalLM."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from prefixserve.model.checkpoint import CheckpointFiles, find_checkpoint_files
from prefixserve.model.config import ModelConfig, dtype_name, resolve_dtype
from prefixserve.model.decoder import CausalLM
from prefixserve.model.errors import (MissingTensorError, ModelLoadError, TensorShapeMismatchError,
                                      UnexpectedTensorError, UnsupportedModelError)
from prefixserve.model.hf_weights import canonical_name, hf_weight_targets, is_ignorable
from prefixserve.model.random_models import RANDOM_PRESETS, random_model
from prefixserve.model.vision_language import VisionLanguageModel

RANDOM_PREFIX = "random:"
_LISTED = 5  # tensor names quoted in an error before "... and N more"


@dataclass(frozen=True)
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    # Stable across restarts; seeds the KV block hashes, so it covers whatever changes K/V:
    # the weights (preset + seed, or the checkpoint fingerprint) and the dtype.
    identity: str
    path: Path | None


def load_model(model: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
               device: torch.device | str = "cpu", seed: int = 0,
               attention_backend: str = "auto") -> LoadedModel:
    """Loads a local HF checkpoint folder or builds "random:<preset>" with weights seeded by `seed`.

    A bfloat16 model on a CPU with avx512_bf16 comes back with its projections packed for the packed
    GEMM (`CausalLM.pack_weights`).
    dtype None (or "auto") means float32 on CPU (bf16 matmuls lose accuracy there for
    little gain at small batch) and the checkpoint's own dtype on other devices.
    attention_backend: a registered backend's name, or "auto" for the best one for the
    device and dtype (model/attention/registry.py).
    """
    if isinstance(dtype, str) and dtype == "auto":
        dtype = None
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a folder path or 'random:<preset>', got {type(model).__name__}")
    name = os.fspath(model)
    if name.startswith(RANDOM_PREFIX):
        return _load_random(name.removeprefix(RANDOM_PREFIX), dtype, device, seed, attention_backend)
    return _load_checkpoint(Path(name), dtype, device, attention_backend)


def _load_random(preset: str, dtype: torch.dtype | str | None, device: torch.device | str,
                 seed: int, attention_backend: str) -> LoadedModel:
    if preset not in RANDOM_PRESETS:
        raise UnsupportedModelError(
            f"unknown random model preset {preset!r}; presets: {', '.join(sorted(RANDOM_PRESETS))}")
    torch_dtype = resolve_dtype(dtype if dtype is not None else torch.float32)
    built = random_model(preset, dtype=torch_dtype, device=device, seed=seed, attention_backend=attention_backend)
    built.pack_weights()
    identity = f"{RANDOM_PREFIX}{preset}:seed{seed}:{dtype_name(torch_dtype)}"
    return LoadedModel(model=built, config=built.config, identity=identity, path=None)


def _load_checkpoint(folder: Path, dtype: torch.dtype | str | None, device: torch.device | str,
                     attention_backend: str) -> LoadedModel:
    files = find_checkpoint_files(folder)
    config = ModelConfig.from_hf_config(files.config, _preprocessor_config(folder))
    if dtype is None:
        dtype = torch.float32 if torch.device(device).type == "cpu" else config.torch_dtype
    torch_dtype = resolve_dtype(dtype)
    model_class = CausalLM if config.vision is None else VisionLanguageModel
    model = model_class(config, dtype=torch_dtype, device=device, attention_backend=attention_backend)
    load_weights(model, files)
    model.pack_weights()
    identity = f"hf:{files.fingerprint()}:{dtype_name(torch_dtype)}"
    return LoadedModel(model=model.eval(), config=config, identity=identity, path=folder.resolve())


@torch.no_grad()
def load_weights(model: CausalLM, files: CheckpointFiles) -> None:
    """Copies every checkpoint tensor into its place, converting dtype; rejects gaps and extras.
    Runs before `CausalLM.pack_weights`: a packed projection has no row-major tensor to copy into."""
    targets = hf_weight_targets(model)
    tied = model.config.tie_word_embeddings
    seen: dict[str, str] = {}
    unexpected: list[str] = []
    for path in files.weight_files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as reader:
                for stored in reader.keys():
                    name = canonical_name(stored)
                    if name in seen:
                        raise ModelLoadError(f"tensor {name} appears in both {seen[name]} and {path.name}")
                    seen[name] = path.name
                    target = targets.get(name)
                    if target is None:
                        if not is_ignorable(name, tied):
                            unexpected.append(name)
                        continue
                    shape = tuple(reader.get_slice(stored).get_shape())
                    if shape != tuple(target.shape):
                        raise TensorShapeMismatchError(
                            f"tensor {name} in {path.name} has shape {shape}, but config.json implies "
                            f"{tuple(target.shape)}")
                    target.copy_(reader.get_tensor(stored))
        except SafetensorError as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from e
    if unexpected:
        raise UnexpectedTensorError(
            f"checkpoint {files.folder} has tensors the {model.config.architecture} architecture does not "
            f"use: {_listing(unexpected)}")
    missing = [name for name in targets if name not in seen]
    if missing:
        raise MissingTensorError(f"checkpoint {files.folder} lacks tensors: {_listing(missing)}")


def _preprocessor_config(folder: Path) -> dict | None:
    """preprocessor_config.json of a vision-language checkpoint (its image sizes), when present."""
    path = folder / "preprocessor_config.json"
    if not path.is_file():
        return None
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot parse {path}: {e}") from e
    return loaded if isinstance(loaded, dict) else None


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown + (f" ... and {len(names) - _LISTED} more" if len(names) > _LISTED else "")
