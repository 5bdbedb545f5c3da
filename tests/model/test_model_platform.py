"""The platform registry (model/platform.py): each device type gets its platform without anyone importing
one, and the plain-torch platform every other device gets computes what the CPU platform's kernels do."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from prefixserve.model.platform import Platform, platform_for


def test_the_registry_loads_the_platforms_on_first_lookup() -> None:
    code = textwrap.dedent("""
        import sys
        from prefixserve.model import load_model
        from prefixserve.model.platform import platform_for
        assert not any(name.startswith("prefixserve.platforms") for name in sys.modules), "imported early"
        assert platform_for("cpu").name == "cpu"
        assert load_model("random:qwen3-tiny", dtype="float32").model.platform is platform_for("cpu")
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


def test_devices_without_a_platform_get_plain_torch() -> None:
    base = platform_for("meta")
    assert type(base) is Platform and platform_for("cpu") is not base
    assert base.kernel_report() == {} and base.load_kernels() == {}
    choice = base.choose_dtype("auto", torch.device("meta"))
    assert choice.dtype is None and "checkpoint's own dtype" in choice.reason
    assert base.choose_dtype("bfloat16", torch.device("meta")).dtype == "bfloat16"
    assert base.choose_kv_layout("auto", None, torch.float32, 16) == "rows"
    assert base.choose_kv_layout("rows", None, torch.float32, 16) == "rows"
    with pytest.raises(ValueError, match="kv_layout='panels' needs"):
        base.choose_kv_layout("panels", None, torch.float32, 16)
    assert base.decode_program(None, [], "rows") is None and base.paged_attention_kernels() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_ops_compute_what_the_torch_ops_do(dtype: torch.dtype) -> None:
    base, cpu = Platform(), platform_for("cpu")
    gen = torch.Generator().manual_seed(0)
    tokens, heads, kv_heads, head_dim, hidden = 5, 4, 2, 64, 128
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    x, residual = (torch.randn(tokens, hidden, generator=gen).to(dtype) for _ in range(2))
    weight = torch.randn(hidden, generator=gen).to(dtype)
    torch.testing.assert_close(cpu.rms_norm(x, weight, 1e-6), base.rms_norm(x, weight, 1e-6), **tol)
    got = cpu.add_rms_norm(x, residual.clone(), weight, 1e-6)
    want = base.add_rms_norm(x, residual.clone(), weight, 1e-6)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    gate_up = torch.randn(tokens, 2 * hidden, generator=gen).to(dtype)
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), base.silu_and_mul(gate_up), **tol)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q_weight, k_weight = (torch.randn(head_dim, generator=gen).to(dtype) for _ in range(2))
    angles = torch.randn(tokens, 1, head_dim // 2, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = cpu.qk_norm_rope(qkv, heads, kv_heads, head_dim, q_weight, k_weight, 1e-6, cos, sin)
    want = base.qk_norm_rope(qkv, heads, kv_heads, head_dim, q_weight, k_weight, 1e-6, cos, sin)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **tol)
    w = torch.randn(96, hidden, generator=gen).to(dtype)
    torch.testing.assert_close(cpu.linear(x, w, widened=True), base.linear(x, w, widened=True), **tol)
    logits = torch.randn(3, 1000, generator=gen)
    assert torch.equal(cpu.row_argmax(logits), base.row_argmax(logits))
