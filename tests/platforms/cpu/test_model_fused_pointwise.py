"""The fused pointwise kernels against float64 references in every body this CPU runs, the bodies against
each other (bit for bit), their dispatch from the layers, and fallbacks.

As with the other kernels, these tests fail rather than skip where a project machine
(x86 with AVX2 and a C compiler) silently does not build them: every layer of every
step runs them.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixserve.platforms.cpu import platform as layers
from prefixserve.model.layers import GatedMLP, RMSNorm
from native_kernel_build import build_fresh, needs_kernel
from prefixserve.platforms.cpu.native.fused_pointwise import FusedPointwise, load
from prefixserve.platforms.cpu.native.isa import AVX2, ISAS, best_isa

BODIES = ISAS[: ISAS.index(best_isa()) + 1]


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> FusedPointwise:
    return build_fresh(load, tmp_path_factory)


@pytest.fixture(params=BODIES)
def kernel(request, library) -> FusedPointwise:
    return library.with_body(request.param)


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def rope_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The rotate_half convention, from the angles in float64: x [T, H, D]."""
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None, :], torch.cat([angles.sin()] * 2, -1)[:, None, :]
    x1, x2 = x.double().chunk(2, dim=-1)
    return x.double() * cos + torch.cat((-x2, x1), -1) * sin


def with_threads(threads: int):
    class Threads:
        def __enter__(self):
            self.before = torch.get_num_threads()
            torch.set_num_threads(threads)

        def __exit__(self, *exc):
            torch.set_num_threads(self.before)
    return Threads()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 513])
@pytest.mark.parametrize("width", [8, 136, 1024])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rms_norm_with_and_without_residual(kernel: FusedPointwise, rows: int, width: int, threads: int) -> None:
    gen = torch.Generator().manual_seed(rows * 1009 + width)
    x, residual = torch.randn(rows, width, generator=gen), torch.randn(rows, width, generator=gen) * 3
    w = torch.randn(width, generator=gen)
    x_before, want_sum = x.clone(), residual + x
    with with_threads(threads):
        plain = kernel.rms_norm(x, w, 1e-6)
        fused = kernel.rms_norm(x, w, 1e-6, residual=residual)
    torch.testing.assert_close(plain.double(), rms_norm_reference(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual, want_sum, rtol=0, atol=0)  # the sum, written in place
    torch.testing.assert_close(fused.double(), rms_norm_reference(want_sum, w, 1e-6), rtol=1e-5, atol=1e-5)
    assert torch.equal(x, x_before)


@needs_kernel
@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_qk_norm_rope_reads_heads_out_of_qkv(kernel: FusedPointwise, head_dim: int, with_norm: bool,
                                             tokens: int) -> None:
    q_heads, k_heads = 4, 2
    gen = torch.Generator().manual_seed(head_dim * 31 + tokens)
    # q, k, v columns as the fused projection writes them, plus a sliced-off column to make rows strided
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim + 8, generator=gen)[:, :-8]
    positions = torch.randint(0, 40000, (tokens,), generator=gen)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    qw, kw = (torch.randn(head_dim, generator=gen), torch.randn(head_dim, generator=gen)) if with_norm else (None, None)
    with with_threads(2):
        q, k = kernel.qk_norm_rope(qkv, q_heads, k_heads, head_dim, qw, kw, 1e-6, cos, sin)
    q_in = qkv[:, :q_heads * head_dim].reshape(tokens, q_heads, head_dim)
    k_in = qkv[:, q_heads * head_dim:(q_heads + k_heads) * head_dim].reshape(tokens, k_heads, head_dim)
    if with_norm:
        q_in, k_in = rms_norm_reference(q_in, qw, 1e-6), rms_norm_reference(k_in, kw, 1e-6)
    assert q.is_contiguous() and k.is_contiguous()
    # angles up to 4e4 rad are rounded in float32 before cos/sin, as in the model: rotate by those
    x1, x2 = q_in.double().chunk(2, -1)
    c, s = cos.double(), sin.double()
    want_q = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    x1, x2 = k_in.double().chunk(2, -1)
    want_k = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    torch.testing.assert_close(q.double(), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k.double(), want_k, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_qk_norm_rope_writes_k_and_v_into_their_pool_slots(kernel: FusedPointwise, dtype: torch.dtype,
                                                         tokens: int) -> None:
    """With pools, k goes to row slots[t] of the K pool and v (qkv's heads after k's, as they are) to the same
    row of the V pool: bit for bit what the returned k and two index_copy_ calls write, nothing else touched."""
    q_heads, k_heads, head_dim, slots_total = 4, 2, 64, 700
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * head_dim + 8, generator=gen)[:, :-8].to(dtype)
    angles = torch.randint(0, 4000, (tokens,), generator=gen).float()[:, None] * torch.rand(head_dim // 2,
                                                                                           generator=gen)
    cos, sin = angles.cos()[:, None, :].to(dtype), angles.sin()[:, None, :].to(dtype)
    qw, kw = torch.randn(head_dim, generator=gen).to(dtype), torch.randn(head_dim, generator=gen).to(dtype)
    slots = torch.randperm(slots_total, generator=gen)[:tokens]
    k_pool, v_pool = (torch.randn(slots_total, k_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    want_k_pool, want_v_pool = k_pool.clone(), v_pool.clone()
    with with_threads(2):
        want_q, want_k = kernel.qk_norm_rope(qkv, q_heads, k_heads, head_dim, qw, kw, 1e-6, cos, sin)
        q, none = kernel.qk_norm_rope(qkv, q_heads, k_heads, head_dim, qw, kw, 1e-6, cos, sin,
                                      pools=(k_pool, v_pool, slots))
    want_k_pool.index_copy_(0, slots, want_k)
    want_v_pool.index_copy_(0, slots, qkv[:, (q_heads + k_heads) * head_dim:].reshape(tokens, k_heads, head_dim))
    assert none is None and torch.equal(q, want_q)
    assert torch.equal(k_pool, want_k_pool) and torch.equal(v_pool, want_v_pool)


@needs_kernel
def test_qk_norm_rope_refuses_slots_outside_the_pools(library: FusedPointwise) -> None:
    qkv, cos, sin = torch.randn(2, 4 * 16), torch.randn(2, 8), torch.randn(2, 8)
    pool = torch.zeros(5, 1, 16)
    before = pool.clone()
    for slots in (torch.tensor([0, 5]), torch.tensor([-1, 2]), torch.tensor([0, 1], dtype=torch.int32),
                  torch.tensor([0])):
        with pytest.raises(ValueError, match="qk_norm_rope"):
            library.qk_norm_rope(qkv, 2, 1, 16, None, None, 0.0, cos, sin, pools=(pool, pool.clone(), slots))
    with pytest.raises(ValueError, match="qk_norm_rope"):     # a pool row of another shape
        library.qk_norm_rope(qkv, 2, 1, 16, None, None, 0.0, cos, sin,
                             pools=(torch.zeros(5, 2, 16), torch.zeros(5, 2, 16), torch.tensor([0, 1])))
    with pytest.raises(ValueError, match="qk_norm_rope"):     # qkv without the v heads
        library.qk_norm_rope(qkv[:, :3 * 16], 2, 1, 16, None, None, 0.0, cos, sin,
                             pools=(pool, pool.clone(), torch.tensor([0, 1])))
    assert torch.equal(pool, before)


@needs_kernel
def test_rope_agrees_with_float64_angles_at_small_positions(kernel: FusedPointwise) -> None:
    """Independent of how cos/sin are computed: positions small enough that float32 angles are exact enough."""
    gen = torch.Generator().manual_seed(5)
    head_dim, tokens = 64, 50
    qkv = torch.randn(tokens, 3 * head_dim, generator=gen)
    positions = torch.arange(tokens)
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    angles = positions.double()[:, None] * inv_freq[None, :]
    q, k = kernel.qk_norm_rope(qkv, 1, 1, head_dim, None, None, 0.0, angles.cos().float(), angles.sin().float())
    want = rope_reference(qkv[:, :2 * head_dim].reshape(tokens, 2, head_dim), positions, inv_freq)
    torch.testing.assert_close(torch.stack([q[:, 0], k[:, 0]], 1).double(), want, rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 4, 257])
def test_silu_and_mul_over_the_float_range(kernel: FusedPointwise, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    width = 3072
    gate = torch.randn(rows, width, generator=gen) * 6
    gate[0, :8] = torch.tensor([-1e4, -100.0, -88.0, -20.0, 0.0, 20.0, 89.0, 1e4])
    up = torch.randn(rows, width, generator=gen)
    got = kernel.silu_and_mul(torch.cat([gate, up], dim=1))
    want = F.silu(gate.double()) * up.double()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,head_dim", [(8, 16), (24, 48), (136, 80), (1024, 128)])
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_every_body_gives_the_avx2_bits(library: FusedPointwise, dtype, width: int, head_dim: int, rows: int) -> None:
    """A token computes the same bits whichever body runs it: its K/V cached by one process (or written
    to a shared store) meets queries computed by another on a CPU of another width. Widths and half
    head dims that are not whole 16-lane vectors run the wider bodies' tails."""
    gen = torch.Generator().manual_seed(rows * 7 + width)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, width, generator=gen).to(dtype)
    w = torch.randn(width, generator=gen).to(dtype)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 6).to(dtype)
    qkv = torch.randn(rows, 4 * head_dim, generator=gen).to(dtype)
    qw, kw = torch.randn(head_dim, generator=gen).to(dtype), torch.randn(head_dim, generator=gen).to(dtype)
    angles = torch.randint(0, 4096, (rows, 1), generator=gen).float() * torch.rand(head_dim // 2, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def everything(kernel: FusedPointwise) -> list[torch.Tensor]:
        summed = residual.clone()
        return [kernel.rms_norm(x, w, 1e-6), kernel.rms_norm(x, w, 1e-6, summed), summed,
                kernel.silu_and_mul(gate_up), *kernel.qk_norm_rope(qkv, 2, 1, head_dim, qw, kw, 1e-6, cos, sin),
                *kernel.qk_norm_rope(qkv, 2, 1, head_dim, None, None, 0.0, cos, sin)]

    with with_threads(2):
        want = everything(library.with_body(AVX2))
        for body in BODIES[1:]:
            for got, expected in zip(everything(library.with_body(body)), want):
                assert torch.equal(got, expected), body


@needs_kernel
def test_layers_dispatch_float32_to_the_kernels(monkeypatch) -> None:
    real = layers.default_kernel()
    assert real is not None, "the kernels must build on a machine that can build them"
    calls = []

    class Spy:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(layers, "default_kernel", lambda: Spy())
    norm = RMSNorm(64, 1e-6, dtype=torch.float32, device="cpu")
    norm.weight.data.normal_()
    mlp = GatedMLP(64, 32, dtype=torch.float32, device="cpu")
    mlp.gate_up_proj.data.normal_()
    mlp.down_proj.data.normal_()
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    want_sum = x + residual
    normed, new_residual = norm.add_norm(x, residual)
    torch.testing.assert_close(normed.double(), rms_norm_reference(want_sum, norm.weight, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new_residual, want_sum)
    gate, up = F.linear(x.double(), mlp.gate_up_proj.double()).chunk(2, -1)
    torch.testing.assert_close(mlp(x).double(), F.linear(F.silu(gate) * up, mlp.down_proj.double()),
                               rtol=1e-4, atol=1e-4)
    assert calls == ["rms_norm", "silu_and_mul"]


@pytest.mark.parametrize("dtype", [torch.float64])  # bfloat16 has kernels too: tests/platforms/cpu/test_bf16_kernels.py
def test_other_dtypes_take_the_torch_path(dtype: torch.dtype) -> None:
    norm = RMSNorm(64, 1e-6, dtype=dtype, device="cpu")
    norm.weight.data.normal_()
    x, residual = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    assert layers.fused_kernel(x, norm.weight) is None
    normed, new_residual = norm.add_norm(x, residual)
    torch.testing.assert_close(new_residual, residual + x)
    # both normalise in float32, as the torch path does for every dtype but float32's own
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(normed.double(), rms_norm_reference(residual + x, norm.weight, 1e-6), **tol)


def test_non_contiguous_and_grad_inputs_take_the_torch_path() -> None:
    norm = RMSNorm(64, 1e-6, dtype=torch.float32, device="cpu")
    norm.weight.data.normal_()
    strided = torch.randn(64, 5).T
    torch.testing.assert_close(norm(strided).double(), rms_norm_reference(strided, norm.weight, 1e-6),
                               rtol=1e-5, atol=1e-5)
    needs_grad = torch.randn(5, 64, requires_grad=True)
    assert layers.fused_kernel(needs_grad) is None
    norm(needs_grad).sum().backward()
    assert needs_grad.grad is not None


@needs_kernel
def test_rejects_operands_it_cannot_read(kernel: FusedPointwise) -> None:
    with pytest.raises(ValueError, match="head"):
        kernel.qk_norm_rope(torch.randn(3, 40), 1, 1, 24, None, None, 0.0, torch.randn(3, 12), torch.randn(3, 12))
    with pytest.raises(ValueError, match="gate_up"):
        kernel.silu_and_mul(torch.randn(3, 24))
    with pytest.raises(ValueError, match="residual"):
        kernel.rms_norm(torch.randn(3, 16), torch.randn(16), 1e-6, residual=torch.randn(2, 16))
