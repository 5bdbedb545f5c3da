"""One Hugging Face checkpoint folder that every benchmarked engine loads, so all run the same weights.

A `random:<preset>` model is materialised once (safetensors + config.json +
the shipped tokenizer's files); a folder given by the user is used as it is.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from prefixserve.model import ModelConfig, load_model
from prefixserve.model.hf_weights import hf_weight_targets
from prefixserve.tokenizer.builtin import write_builtin_tokenizer_files

RANDOM_PREFIX = "random:"
DEFAULT_CACHE_DIR = Path(os.environ.get("PREFIXSERVE_BENCH_CACHE", Path.home() / ".cache" / "prefixserve" / "bench"))
_SHARD_BYTES = 1 << 30  # bounds the extra memory of the export to about one shard
_HF_CLASS = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
_DONE = ".complete"


def hf_config_dict(config: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json for `config` in the keys transformers and our loader both read."""
    out = {
        "architectures": [_HF_CLASS[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if config.bos_token_id is not None:
        out["bos_token_id"] = config.bos_token_id
    if config.eos_token_id is not None:
        out["eos_token_id"] = config.eos_token_id
    return out


def checkpoint_folder(model: str, dtype: str, seed: int, cache_dir: Path = DEFAULT_CACHE_DIR) -> Path:
    """The checkpoint folder for `model`: the folder itself, or the materialised random preset."""
    if not model.startswith(RANDOM_PREFIX):
        folder = Path(model)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"model {model!r} is neither random:<preset> nor a checkpoint folder")
        return folder
    folder = cache_dir / f"{model.removeprefix(RANDOM_PREFIX)}-seed{seed}-{dtype}"
    if not (folder / _DONE).is_file():
        export_random_checkpoint(model, dtype, seed, folder)
    return folder


@torch.no_grad()
def export_random_checkpoint(model: str, dtype: str, seed: int, folder: Path) -> Path:
    """Writes the exact weights of `random:<preset>` (seed, dtype) as a sharded HF checkpoint."""
    loaded = load_model(model, dtype=dtype, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    targets = hf_weight_targets(loaded.model)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in targets.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # Views of our fused q/k/v and gate/up share storage, which safetensors refuses: copy per shard.
        save_file({k: v.contiguous().clone() for k, v in shard.items()}, str(folder / fname),
                  metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in targets.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1) + "\n")
    (folder / "config.json").write_text(
        json.dumps(hf_config_dict(loaded.config, loaded.model.embed_tokens.dtype), indent=2) + "\n")
    write_builtin_tokenizer_files(folder)
    (folder / _DONE).write_text(f"{model} seed={seed} dtype={dtype}\n")
    return folder
