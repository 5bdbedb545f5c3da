"""load_model on HF checkpoint folders: bad checkpoints fail with errors that name the problem,
dtypes convert, sharded and single-file layouts load the same weights."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_factory import build_tiny_model
from prefixserve.model.attention.metadata import AttentionMetadata
from prefixserve.model.errors import (InvalidModelConfigError, MissingTensorError, ModelFileNotFoundError,
                                      ModelLoadError, TensorShapeMismatchError, UnexpectedTensorError,
                                      UnsupportedModelError)
from prefixserve.model.kv_layout import kv_cache_shape
from prefixserve.model.loader import load_model
from prefixserve.model.prepared_weight import matrix
from prefixserve.tokenizer import Tokenizer


@pytest.fixture
def qwen3_copy(tiny_checkpoint, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint("qwen3"), tmp_path / "qwen3"))


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _edit_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_fixture_checkpoints_are_complete_hf_folders(arch: str, tiny_checkpoint) -> None:
    path = tiny_checkpoint(arch)
    config = json.loads((path / "config.json").read_text())
    tokenizer = Tokenizer.from_folder(path)
    assert config["vocab_size"] == tokenizer.vocab_size
    assert set(config["eos_token_id"]) <= set(tokenizer.eos_token_ids)
    assert load_model(path).config.architecture == arch


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelFileNotFoundError, match="nowhere"):
        load_model(tmp_path / "nowhere")


def test_missing_config(qwen3_copy: Path) -> None:
    (qwen3_copy / "config.json").unlink()
    with pytest.raises(ModelFileNotFoundError, match="config.json"):
        load_model(qwen3_copy)


def test_missing_weights_file(qwen3_copy: Path) -> None:
    (qwen3_copy / "model.safetensors").unlink()
    with pytest.raises(ModelFileNotFoundError, match="model.safetensors"):
        load_model(qwen3_copy)


def test_missing_shard(tiny_sharded_checkpoint: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny_sharded_checkpoint, tmp_path / "sharded"))
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelFileNotFoundError, match=shard.name):
        load_model(folder)


def test_unparseable_config(qwen3_copy: Path) -> None:
    (qwen3_copy / "config.json").write_text("{not json")
    with pytest.raises(InvalidModelConfigError, match="config.json"):
        load_model(qwen3_copy)


def test_unsupported_architecture(qwen3_copy: Path) -> None:
    _edit_config(qwen3_copy, architectures=["MixtralForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="MixtralForCausalLM.*Qwen3ForCausalLM"):
        load_model(qwen3_copy)


def test_unsupported_rope_scaling(qwen3_copy: Path) -> None:
    _edit_config(qwen3_copy, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        load_model(qwen3_copy)


def test_missing_tensor(qwen3_copy: Path) -> None:
    _edit_tensors(qwen3_copy, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_model(qwen3_copy)


def test_untied_config_without_lm_head(qwen3_copy: Path) -> None:
    _edit_config(qwen3_copy, tie_word_embeddings=False)
    with pytest.raises(MissingTensorError, match=r"lm_head\.weight"):
        load_model(qwen3_copy)


def test_unexpected_tensor(qwen3_copy: Path) -> None:
    def add(tensors: dict) -> None:
        tensors["model.layers.0.self_attn.gate.weight"] = torch.zeros(3)
    _edit_tensors(qwen3_copy, add)
    with pytest.raises(UnexpectedTensorError, match=r"model\.layers\.0\.self_attn\.gate\.weight"):
        load_model(qwen3_copy)


def test_shape_mismatch_names_tensor_and_both_shapes(qwen3_copy: Path) -> None:
    _edit_config(qwen3_copy, intermediate_size=96)
    with pytest.raises(TensorShapeMismatchError,
                       match=r"mlp\.(gate|up|down)_proj\.weight.*\((128, 64|64, 128)\).*\((96, 64|64, 96)\)"):
        load_model(qwen3_copy)


def test_corrupt_safetensors_file(qwen3_copy: Path) -> None:
    (qwen3_copy / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(qwen3_copy)


def test_unknown_random_preset() -> None:
    with pytest.raises(UnsupportedModelError, match="qwen3-tiny"):
        load_model("random:gpt-17")


def test_bad_dtype(tiny_checkpoint) -> None:
    with pytest.raises(ValueError, match="int8"):
        load_model(tiny_checkpoint("qwen3"), dtype="int8")


def test_sharded_checkpoint_loads_the_same_weights(tiny_checkpoint, tiny_sharded_checkpoint: Path) -> None:
    assert (tiny_sharded_checkpoint / "model.safetensors.index.json").is_file()
    assert len(list(tiny_sharded_checkpoint.glob("model-*.safetensors"))) > 1
    single = load_model(tiny_checkpoint("qwen3")).model.state_dict()
    sharded = load_model(tiny_sharded_checkpoint).model.state_dict()
    assert single.keys() == sharded.keys()
    for name in single:
        assert torch.equal(single[name], sharded[name]), name


def test_loaded_weights_equal_the_checkpoint_tensors(tiny_checkpoint) -> None:
    """Every HF tensor lands unchanged in its (possibly fused) place."""
    path = tiny_checkpoint("qwen2")
    hf = load_file(path / "model.safetensors")
    model = load_model(path).model
    layer, attn = model.layers[1], model.layers[1].self_attn
    q, kv = model.config.q_size, model.config.kv_size
    assert torch.equal(matrix(attn.qkv_proj)[q:q + kv], hf["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(attn.qkv_bias[q + kv:], hf["model.layers.1.self_attn.v_proj.bias"])
    assert torch.equal(matrix(layer.mlp.gate_up_proj)[model.config.intermediate_size:],
                       hf["model.layers.1.mlp.up_proj.weight"])
    assert model.lm_head is model.embed_tokens  # tied


def test_bf16_checkpoint_and_bf16_model(tmp_path: Path) -> None:
    folder = tmp_path / "bf16"
    build_tiny_model("llama").to(torch.bfloat16).save_pretrained(folder)
    stored = load_file(folder / "model.safetensors")
    assert stored["lm_head.weight"].dtype == torch.bfloat16

    as_fp32 = load_model(folder)  # CPU default: float32
    assert as_fp32.model.embed_tokens.dtype == torch.float32
    assert torch.equal(matrix(as_fp32.model.lm_head), stored["lm_head.weight"].float())

    as_bf16 = load_model(folder, dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in as_bf16.model.parameters())
    assert as_bf16.identity != as_fp32.identity

    logits = {}
    for name, loaded in (("fp32", as_fp32), ("bf16", as_bf16)):
        dtype = next(loaded.model.parameters()).dtype
        caches = [torch.zeros(kv_cache_shape(loaded.config, 4, 16), dtype=dtype)
                  for _ in range(loaded.config.num_hidden_layers)]
        meta = AttentionMetadata.build([20], [20], [[3, 1]], 16)
        with torch.inference_mode():
            hidden = loaded.model(torch.arange(100, 120), torch.arange(20), caches, meta)
            logits[name] = loaded.model.compute_logits(hidden[[5, 19]])
    assert logits["bf16"].dtype == torch.float32
    assert torch.isfinite(logits["bf16"]).all()
    spread = logits["fp32"].std().item()
    # bf16 keeps ~3 significant digits; after a few layers errors stay well under the logit spread
    assert (logits["bf16"] - logits["fp32"]).abs().max().item() < 0.2 * spread


def test_identity_is_stable_and_tracks_content(tiny_checkpoints, tmp_path: Path) -> None:
    path = tiny_checkpoints["qwen3"]
    first = load_model(path).identity
    assert load_model(path).identity == first
    moved = Path(shutil.copytree(path, tmp_path / "elsewhere"))
    assert load_model(moved).identity == first
    assert load_model(tiny_checkpoints["qwen2"]).identity != first
    assert load_model(path, dtype=torch.bfloat16).identity != first
