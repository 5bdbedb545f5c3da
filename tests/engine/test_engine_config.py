"""EngineConfig checks the form of the device and attention backend it is given (it imports no torch);
the engine checks at start that they exist."""
from __future__ import annotations

import ast
import inspect

import pytest
import torch

from prefixserve import EngineConfig, LLMEngine
from prefixserve.engine import config as config_module
from prefixserve.engine.config import DEVICE_TYPES


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:0", "cuda:1", "mps", "xpu", "xpu:3", "cpu:0"])
def test_device_forms_torch_understands_are_accepted(device: str) -> None:
    assert EngineConfig(device=device).device == device
    torch.device(device)  # the accepted form is one torch parses


@pytest.mark.parametrize("device", ["", "gpu", "cuda:", "cuda:-1", "cuda:01", "CUDA", "cuda 1", "meta", 0, None])
def test_other_devices_are_rejected_with_the_accepted_types(device) -> None:
    with pytest.raises(ValueError, match=r"device must be one of \('cpu', 'cuda', 'mps', 'xpu'\)"):
        EngineConfig(device=device)


def test_every_accepted_device_type_is_one_torch_knows() -> None:
    for kind in DEVICE_TYPES:
        assert torch.device(kind).type == kind


@pytest.mark.parametrize("name", ["auto", "torch", "flash_attn", "triton-paged"])
def test_backend_names_are_accepted_by_form(name: str) -> None:
    assert EngineConfig(attention_backend=name).attention_backend == name


@pytest.mark.parametrize("name", ["", "Torch", "-x", "a b", None, 3])
def test_malformed_backend_names_are_rejected(name) -> None:
    with pytest.raises(ValueError, match="attention_backend must be 'auto' or a backend name"):
        EngineConfig(attention_backend=name)


def test_config_module_does_not_import_torch() -> None:
    tree = ast.parse(inspect.getsource(config_module))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name and name.split(".")[0] == "torch"}


def test_engine_refuses_a_device_this_machine_lacks_or_an_unknown_backend() -> None:
    missing = "cuda:7" if torch.cuda.is_available() else "cuda"
    with pytest.raises(ValueError, match=rf"device '{missing}' is not available"):
        LLMEngine(EngineConfig(device=missing))
    with pytest.raises(ValueError, match=r"attention backend 'flash' is not registered; registered: triton; torch"):
        LLMEngine(EngineConfig(attention_backend="flash"))
