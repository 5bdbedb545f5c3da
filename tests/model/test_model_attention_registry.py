"""Choosing an attention backend: by name, or the best registered one for a device and dtype.

A backend is a module that registers itself; a fake one written here, outside
the package, becomes selectable (and runs a whole engine) without any other
module changing.
"""
from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

import prefixserve.model.attention as attention_package
from prefixserve import LLM, SamplingParams
from prefixserve.model.attention import backend as backend_module, registry
from prefixserve.model.attention.registry import import_backend_modules, select_backend
from prefixserve.model.attention.torch_paged import TorchPagedAttention

FAKE_BACKEND = '''
import torch
from prefixserve.model.attention.registry import register_backend
from prefixserve.model.attention.torch_paged import TorchPagedAttention

CALLS = {"build_metadata": 0, "forward": 0}


@register_backend("{name}", devices=("cpu", "cuda"), dtypes=(torch.float32,), rank=10)
class FakeBackend(TorchPagedAttention):
    """The torch backend's numbers, counting its calls."""

    def build_metadata(self, common):
        CALLS["build_metadata"] += 1
        return super().build_metadata(common)

    def forward(self, q, k, v, kv_cache, meta, scale):
        CALLS["forward"] += 1
        return super().forward(q, k, v, kv_cache, meta, scale)
'''


@pytest.fixture
def scratch_registry(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """The registry as it is, restored after the test; tmp_path importable for fake backend modules."""
    monkeypatch.setattr(registry, "BACKENDS", dict(registry.BACKENDS))
    monkeypatch.setattr(registry, "FAILED_MODULES", dict(registry.FAILED_MODULES))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_torch_backend_is_registered_and_chosen_by_name_and_by_auto() -> None:
    assert isinstance(select_backend("torch", "cpu", torch.float32), TorchPagedAttention)
    assert isinstance(select_backend("auto", "cpu", torch.bfloat16), TorchPagedAttention)
    # a fresh instance each time: backends keep per-model scratch buffers
    assert select_backend("torch", "cpu", torch.float32) is not select_backend("torch", "cpu", torch.float32)


def test_unknown_name_lists_the_registered_backends() -> None:
    # the CUDA platform's "triton" registers when the platforms load, ranked above "torch"
    with pytest.raises(ValueError, match=r"'flash' is not registered; registered: triton; torch"):
        select_backend("flash", "cpu", torch.float32)


def test_unsupported_device_or_dtype_says_why() -> None:
    with pytest.raises(ValueError, match=r"'torch' does not run on device type 'hpu' \(runs on: cpu, cuda"):
        select_backend("torch", "hpu", torch.float32)
    with pytest.raises(ValueError, match=r"'torch' does not support dtype int8 \(supports: bfloat16, float16"):
        select_backend("torch", "cpu", torch.int8)
    with pytest.raises(ValueError, match=r"no attention backend supports device 'hpu'.*torch \(does not run"):
        select_backend("auto", "hpu", torch.float32)


def test_a_backend_module_registers_itself_and_auto_prefers_its_rank(scratch_registry) -> None:
    (scratch_registry / "fake_attention_backend.py").write_text(FAKE_BACKEND.replace("{name}", "fake"))
    import_backend_modules(["fake_attention_backend"])
    import fake_attention_backend as fake

    assert isinstance(select_backend("fake", "cpu", torch.float32), fake.FakeBackend)
    assert isinstance(select_backend("auto", "cpu", torch.float32), fake.FakeBackend)   # rank 10 > 0
    # where the fake cannot serve, auto falls back to the torch backend; by name it is refused
    assert type(select_backend("auto", "cpu", torch.bfloat16)) is TorchPagedAttention
    with pytest.raises(ValueError, match=r"'fake' does not support dtype bfloat16"):
        select_backend("fake", "cpu", torch.bfloat16)

    # a whole engine runs on it by name: one metadata build per step, read by every layer
    # float32, the fake's only dtype (auto may pick bfloat16 on this CPU)
    llm = LLM("random:qwen3-tiny", dtype="float32", attention_backend="fake", block_size=4, num_kv_blocks=32)
    reference = LLM("random:qwen3-tiny", dtype="float32", block_size=4, num_kv_blocks=32)
    assert isinstance(llm.engine.loaded.model.attention_backend, fake.FakeBackend)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}, {"prompt_token_ids": [12, 13, 14]}]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    layers = llm.engine.model_config.num_hidden_layers
    assert fake.CALLS["forward"] == layers * fake.CALLS["build_metadata"] > 0


def test_auto_picks_a_backend_only_on_its_auto_devices(scratch_registry) -> None:
    """A backend that runs on the CPU only as a test of its GPU kernels ("triton") is taken there by name,
    never by auto, whatever its rank."""
    source = FAKE_BACKEND.replace("{name}", "gpu_first").replace("rank=10)", "rank=10, auto_devices=('meta',))")
    source = source.replace('devices=("cpu", "cuda")', 'devices=("cpu", "meta")')
    (scratch_registry / "gpu_first_backend.py").write_text(source)
    import_backend_modules(["gpu_first_backend"])
    import gpu_first_backend as fake

    assert type(select_backend("auto", "cpu", torch.float32)) is TorchPagedAttention
    assert isinstance(select_backend("auto", "meta", torch.float32), fake.FakeBackend)
    assert isinstance(select_backend("gpu_first", "cpu", torch.float32), fake.FakeBackend)


def test_a_module_that_cannot_be_imported_is_named_in_errors(scratch_registry) -> None:
    (scratch_registry / "broken_attention_backend.py").write_text("import a_gpu_library_that_is_not_here\n")
    import_backend_modules(["broken_attention_backend"])
    with pytest.raises(ValueError, match=r"broken_attention_backend failed to import \(ModuleNotFoundError"):
        select_backend("flash", "cpu", torch.float32)
    assert isinstance(select_backend("auto", "cpu", torch.float32), TorchPagedAttention)


def test_registration_rejects_a_second_class_under_one_name(scratch_registry) -> None:
    with pytest.raises(ValueError, match="registered twice"):
        registry.register_backend("torch", devices=("cpu",), dtypes=(torch.float32,))(
            type("Other", (TorchPagedAttention,), {}))
    with pytest.raises(ValueError, match="'auto'"):
        registry.register_backend("auto", devices=("cpu",), dtypes=(torch.float32,))


def _imported_modules(module) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(module)))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_registry_and_the_interface_import_no_backend() -> None:
    backends = set(attention_package.BACKEND_MODULES)
    assert not _imported_modules(registry) & backends
    assert not _imported_modules(backend_module) & (backends | {registry.__name__})
