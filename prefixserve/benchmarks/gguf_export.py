"""Writes a benchmark checkpoint folder (Qwen3 / Qwen2 / Llama, HF layout) to one GGUF file for llama.cpp.

Tensors keep their dtype (float32, float16 or bfloat16), so llama.cpp runs the
very weights prefixserve and transformers run. The vocabulary is padded to the
embedding's row count, as llama.cpp requires one token per row. Tensors are
streamed one at a time: memory stays at about one tensor, not the model.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from prefixserve.model import ModelConfig

_ARCH = {"qwen3": gguf.MODEL_ARCH.QWEN3, "qwen2": gguf.MODEL_ARCH.QWEN2, "llama": gguf.MODEL_ARCH.LLAMA}
_FILE_TYPE = {torch.float32: gguf.LlamaFileType.ALL_F32, torch.float16: gguf.LlamaFileType.MOSTLY_F16,
              torch.bfloat16: gguf.LlamaFileType.MOSTLY_BF16}


# torch dtype -> (numpy dtype carrying its bits, GGML type); numpy has no bfloat16, so its bits travel as int16.
_STORAGE = {torch.float32: (np.float32, gguf.GGMLQuantizationType.F32),
            torch.float16: (np.float16, gguf.GGMLQuantizationType.F16),
            torch.bfloat16: (np.int16, gguf.GGMLQuantizationType.BF16)}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def _vocab(folder: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    if data["model"]["type"] != "BPE":
        raise ValueError(f"{folder}/tokenizer.json is a {data['model']['type']} tokenizer; only BPE exports")
    by_id = {i: tok for tok, i in data["model"]["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in by_id}
    for added in data.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    if max(by_id) >= vocab_size:
        raise ValueError(f"tokenizer has id {max(by_id)} but the model only {vocab_size} embedding rows")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    token_types = [int(types.get(i, gguf.TokenType.UNUSED)) for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, token_types, merges


def _special_id(folder: Path, key: str, tokens: list[str]) -> int | None:
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    value = config.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    return tokens.index(value) if value in tokens else None


# The quantized exports: llama.cpp users run quantized GGUFs; reported alongside, compared with nothing.
QUANTS = {"Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0)}


def _quantizes(shape: tuple[int, ...], quant: str | None) -> bool:
    """Whether a tensor is stored quantized: matrices whose rows split into whole quantization blocks
    (norms and biases stay as they are, as llama.cpp's converter keeps them)."""
    if quant is None or len(shape) != 2:
        return False
    block, _ = gguf.GGML_QUANT_SIZES[QUANTS[quant][0]]
    return shape[-1] % block == 0


def _stored_dtype(shape: tuple[int, ...], dtype: torch.dtype) -> torch.dtype:
    """Vectors (norm weights, biases) in float32 whatever the matrices' dtype: llama.cpp's CPU ops take
    them only so (a bfloat16 norm weight aborts its multiply), and its own converter stores them so."""
    return torch.float32 if len(shape) == 1 else dtype


def export_gguf(folder: Path, out: Path, quant: str | None = None) -> Path:
    """The checkpoint as a GGUF file, in its own dtype, or with its matrices quantized (`quant` in QUANTS)."""
    if quant is not None and quant not in QUANTS:
        raise ValueError(f"quant must be one of {sorted(QUANTS)}, got {quant!r}")
    config_dict = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config = ModelConfig.from_hf_config(config_dict)
    if config.rope_scaling is not None:
        raise ValueError("rope_scaling is not exported; the benchmark models have none")
    arch = _ARCH[config.architecture]
    tensor_map = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    files = sorted(folder.glob("*.safetensors"))
    names: list[tuple[Path, str, str]] = []
    for path in files:
        with safe_open(str(path), framework="pt") as reader:
            for name in reader.keys():
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                mapped = tensor_map.get_name(name, try_suffixes=(".weight", ".bias"))
                if mapped is None:
                    raise ValueError(f"no GGUF name for tensor {name}")
                names.append((path, name, mapped))
    tokens, token_types, merges = _vocab(folder, config.vocab_size)

    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(folder.name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    eos = _special_id(folder, "eos_token", tokens)
    pad = _special_id(folder, "pad_token", tokens)
    if eos is not None:
        writer.add_eos_token_id(eos)
    if pad is not None:
        writer.add_pad_token_id(pad)
        writer.add_bos_token_id(pad)  # Qwen's convention; no BOS is ever added
    writer.add_add_bos_token(False)

    dtype = None
    readers = {p: safe_open(str(p), framework="pt") for p in files}
    for path, name, mapped in names:
        sl = readers[path].get_slice(name)
        tensor_dtype = _SAFETENSORS_DTYPES[sl.get_dtype()]
        dtype = dtype or tensor_dtype
        shape = tuple(sl.get_shape())
        if _quantizes(shape, quant):
            qtype = QUANTS[quant][0]
            block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*shape[:-1], shape[-1] // block * block_bytes)
            writer.add_tensor_info(mapped, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qtype)
            continue
        stored = _stored_dtype(shape, tensor_dtype)
        np_dtype, raw = _STORAGE[stored]
        nbytes = int(np.prod(shape)) * torch.tensor([], dtype=stored).element_size()
        writer.add_tensor_info(mapped, shape, np.dtype(np_dtype), nbytes, raw_dtype=raw)
    writer.add_file_type(QUANTS[quant][1] if quant else _FILE_TYPE[dtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for path, name, _ in names:
        tensor = readers[path].get_tensor(name)
        if _quantizes(tuple(tensor.shape), quant):
            writer.write_tensor_data(gguf.quants.quantize(tensor.float().numpy(), QUANTS[quant][0]))
        else:
            writer.write_tensor_data(_as_numpy(tensor.to(_stored_dtype(tuple(tensor.shape), tensor.dtype))))
    writer.close()
    return out


def gguf_path_for(folder: Path, quant: str | None = None) -> Path:
    """The GGUF file next to a checkpoint folder (in its dtype, or quantized), written on first use."""
    out = folder / (f"model-{quant.lower()}.gguf" if quant else "model.gguf")
    if not out.is_file():
        tmp = out.with_suffix(".gguf.partial")
        export_gguf(folder, tmp, quant)
        tmp.rename(out)
    return out
