"""The decoder layer's pointwise work in one pass each (`fused_pointwise.c`): residual add + RMSNorm,
per-head q/k norm + rotary embedding, SiLU-gated product.

Used by the CPU platform's layer ops (`platforms/cpu/platform.py`) for float32 and bfloat16 CPU tensors;
the torch operators they replace take several passes over memory each (rotary embedding: seven), and in
bfloat16 each of those also converts to float32 and back.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from prefixserve.model.kv_layout import ROWS, check_layout
from prefixserve.platforms.cpu.panels import LAYOUT_CODES, PANELS, panels_fit
from prefixserve.platforms.cpu.native.build import load_default, load_kernel
from prefixserve.platforms.cpu.native.isa import AVX2, ISAS, best_isa

_float_p, _long, _int, _float = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


class FusedPointwise:
    """The loaded kernels. Operands must pass `supports` (float32, CPU, contiguous rows of whole vectors)."""

    NAMES = ("add_rms_norm", "qk_norm_rope", "silu_and_mul")

    def __init__(self, library: ctypes.CDLL, body: str | None = None) -> None:
        self._library = library
        # the widest body the CPU runs: the AVX-512 one gives the same bits in half the time
        self.body = best_isa() if body is None else body
        if self.body not in ISAS:
            raise ValueError(f"unknown body {self.body!r}; one of {ISAS}")
        wide = "" if self.body == AVX2 else "_512"
        argtypes = {"add_rms_norm": [_float_p, _float_p, _float_p, _float, _float_p, _long, _long, _int],
                    "qk_norm_rope": [_float_p, _long, _long, _long, _long, _float_p, _float_p, _float,
                                     _float_p, _float_p, _float_p, _float_p, _float_p, _float_p, _long, _long, _int,
                                     _int],
                    "silu_and_mul": [_float_p, _float_p, _long, _long, _int]}
        # float32 and bfloat16 take the same signatures (pointers are untyped here)
        self._fns = {}
        self._write_panels = library.write_panels
        self._write_panels.argtypes = ([_float_p, _long, _float_p, _long, _float_p, _float_p, _float_p]
                                       + [_long] * 5 + [_int])
        self._write_panels.restype = None
        for name in self.NAMES:
            for dtype, suffix in ((torch.float32, ""), (torch.bfloat16, "_bf16")):
                fn = getattr(library, name + suffix + wide)
                fn.argtypes, fn.restype = argtypes[name], None
                self._fns[name, dtype] = fn

    def with_body(self, body: str) -> "FusedPointwise":
        """The same library through another body (tests compare them; the caller checks the CPU)."""
        return FusedPointwise(self._library, body)

    def function(self, name: str, dtype: torch.dtype):
        """The C function `name` for `dtype` itself, unchecked: for callers that check their operands once
        and call it many times (platforms/cpu/decode_program.py). The methods below are the checked calls."""
        return self._fns[name, torch.bfloat16 if dtype == torch.bfloat16 else torch.float32]

    @staticmethod
    def supports(*tensors: torch.Tensor | None, multiple: int = 8) -> bool:
        """Every tensor given is on the CPU with contiguous rows whose width is a multiple of `multiple`, and
        all are float32 or all bfloat16."""
        # a plain loop: this runs several times per layer, and generators cost more than the checks
        dtype = None
        for t in tensors:
            if t is None:
                continue
            if dtype is None:
                dtype = t.dtype
                if dtype is not torch.float32 and dtype is not torch.bfloat16:
                    return False
            elif t.dtype is not dtype:
                return False
            if not t.is_cpu or t.dim() < 1 or t.stride(-1) != 1 or t.shape[-1] % multiple:
                return False
        return dtype is not None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        """x / rms(x) * weight over the last dimension; with `residual`, x is first added into it in place
        and the sum is normed."""
        n = weight.numel()
        if x.shape[-1] != n or not x.is_contiguous() or not weight.is_contiguous():
            raise ValueError(f"rms_norm: x {tuple(x.shape)} must be contiguous with last dimension {n}")
        target = x if residual is None else residual
        if residual is not None and (residual.shape != x.shape or not residual.is_contiguous()):
            raise ValueError(f"rms_norm: residual {tuple(residual.shape)} must be contiguous, shaped like x")
        out = torch.empty_like(x)
        self.function("add_rms_norm", x.dtype)(target.data_ptr(), _ptr(None if residual is None else x),
                                               weight.data_ptr(), eps, out.data_ptr(), x.numel() // n, n,
                                               torch.get_num_threads())
        return out

    def qk_norm_rope(self, qkv: torch.Tensor, q_heads: int, k_heads: int, head_dim: int,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor,
                     pools: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None, layout: str = ROWS
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q [T, q_heads, D] and k [T, k_heads, D], contiguous, from the leading columns of qkv [T, >= (q+k) D]:
        each head RMS-normed (when weights are given) and rotated by cos/sin [T, D / 2] (any view of those).
        pools = (k_pool, v_pool, slots): k is not returned but written into slot slots[t] of k_pool, and v (the
        k_heads heads after k in qkv, as they are) into the same slot of v_pool: pools of rows [S, k_heads, D]
        or, with layout "panels", a pool's K and V [NB, k_heads, BS, D] (panels.py)."""
        tokens = qkv.shape[0]
        half = head_dim // 2
        heads = q_heads + (2 if pools is not None else 1) * k_heads
        if (qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] < heads * head_dim
                or head_dim % 16 or (q_weight is None) != (k_weight is None)):
            raise ValueError(f"qk_norm_rope: qkv {tuple(qkv.shape)} does not hold the {heads} heads of {head_dim} "
                             "(a multiple of 16) it is asked for in contiguous rows")
        # the rotary embedding's [T, 1, D / 2] in the model's dtype already has the layout read here
        cos, sin = (t if (t.dtype is qkv.dtype and t.is_contiguous() and t.shape[0] == tokens
                          and t.numel() == tokens * half)
                    else t.reshape(tokens, half).to(qkv.dtype).contiguous() for t in (cos, sin))
        q = qkv.new_empty(tokens, q_heads, head_dim)
        block_size = 0
        if pools is None:
            k, v, slots = qkv.new_empty(tokens, k_heads, head_dim), None, None
        else:
            k, v, slots = pools
            block_size = check_slots(k, v, slots, tokens, (k_heads, head_dim), qkv.dtype, layout)
        self.function("qk_norm_rope", qkv.dtype)(qkv.data_ptr(), qkv.stride(0), q_heads, k_heads, head_dim,
                                                 _ptr(q_weight), _ptr(k_weight), eps, cos.data_ptr(), sin.data_ptr(),
                                                 q.data_ptr(), k.data_ptr(), _ptr(v), _ptr(slots), tokens,
                                                 block_size, LAYOUT_CODES[layout], torch.get_num_threads())
        return q, (k if pools is None else None)

    def write_panels(self, kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens' K and V [T, KVH, D] (rows of any stride, each token's heads contiguous) into their slots of
        one layer's pool of panels (panels.py; K/V in the pool's dtype): what kv_layout.write_kv does,
        natively."""
        _, _, kv_heads, _, head_dim = kv_cache.shape
        tokens, dtype = slots.shape[0], kv_cache.dtype
        for name, x in (("k", k), ("v", v)):
            if (x.shape != (tokens, kv_heads, head_dim) or x.dtype is not dtype or not x.is_cpu
                    or x.stride(2) != 1 or x.stride(1) != head_dim):
                raise ValueError(f"write_panels: {name} {tuple(x.shape)} {x.dtype} is not [{tokens}, {kv_heads}, "
                                 f"{head_dim}] {dtype} CPU rows of contiguous heads")
        block_size = check_slots(kv_cache[0], kv_cache[1], slots, tokens, (kv_heads, head_dim), dtype, PANELS)
        self._write_panels(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kv_cache[0].data_ptr(),
                           kv_cache[1].data_ptr(), slots.data_ptr(), tokens, kv_heads, head_dim, block_size,
                           kv_cache.element_size(), torch.get_num_threads())

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2 I] holding gate then up in each row: [T, I]."""
        if gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] % 16:
            raise ValueError(f"silu_and_mul: gate_up {tuple(gate_up.shape)} must be contiguous [T, 2 I], I % 8 == 0")
        tokens, width = gate_up.shape
        out = gate_up.new_empty(tokens, width // 2)
        self.function("silu_and_mul", gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), tokens, width // 2,
                                                     torch.get_num_threads())
        return out


def check_slots(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, tokens: int,
                row: tuple[int, int], dtype: torch.dtype, layout: str = ROWS) -> int:
    """Raises ValueError unless the pools are contiguous CPU tensors in `dtype` of `layout`'s shape (rows:
    [S, *row]; panels: [NB, row[0], BS, row[1]], S = NB * BS slots) and slots holds `tokens` int64 indices
    into them: the C code writes where the slots say, unchecked. Returns the block size (0 for rows)."""
    check_layout(layout)
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if layout == PANELS:
            fits = (pool.dim() == 4 and (pool.shape[1], pool.shape[3]) == row
                    and panels_fit(pool.dtype, pool.shape[2], pool.shape[3]))
            shape = f"[blocks, {row[0]}, block_size, {row[1]}] panels of"
        else:
            fits, shape = tuple(pool.shape[1:]) == row, f"[slots, {row[0]}, {row[1]}]"
        if pool.dtype is not dtype or not pool.is_cpu or not pool.is_contiguous() or not fits:
            raise ValueError(f"qk_norm_rope: {name} {tuple(pool.shape)} {pool.dtype} is not a contiguous "
                             f"{shape} {dtype} CPU tensor")
    if k_pool.shape != v_pool.shape:
        raise ValueError("qk_norm_rope: k_pool and v_pool hold different numbers of slots")
    block_size = k_pool.shape[2] if layout == PANELS else 0
    capacity = k_pool.shape[0] * max(block_size, 1)
    if slots.dtype is not torch.int64 or slots.shape != (tokens,) or not slots.is_contiguous() or not slots.is_cpu:
        raise ValueError(f"qk_norm_rope: slots must be {tokens} contiguous int64 CPU indices")
    if tokens and (int(slots.min()) < 0 or int(slots.max()) >= capacity):
        raise ValueError(f"qk_norm_rope: a slot lies outside the pools' {capacity} slots")
    return block_size



def _agrees_with_torch(kernel: FusedPointwise) -> bool:
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(3, 16, generator=gen), torch.randn(3, 16, generator=gen)
    w = torch.randn(16, generator=gen)
    want_residual = x + residual
    normed = kernel.rms_norm(x, w, 1e-6, residual.clone())
    gate_up = torch.randn(3, 32, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    bf16 = [t.bfloat16() for t in (x, residual, w, gate_up)]
    normed_bf16 = kernel.rms_norm(bf16[0], bf16[2], 1e-6, bf16[1].clone()).float()
    gate_bf16, up_bf16 = bf16[3].float().chunk(2, dim=-1)
    return (torch.allclose(normed, torch.nn.functional.rms_norm(want_residual, (16,), w, 1e-6), atol=1e-5)
            and torch.allclose(kernel.silu_and_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=1e-5)
            and torch.allclose(normed_bf16, torch.nn.functional.rms_norm(bf16[0].float() + bf16[1].float(), (16,),
                                                                         bf16[2].float(), 1e-6), rtol=2e-2, atol=2e-2)
            and torch.allclose(kernel.silu_and_mul(bf16[3]).float(), torch.nn.functional.silu(gate_bf16) * up_bf16,
                               rtol=1e-2, atol=1e-2))


def load(cc: str | None, out_dir: Path) -> FusedPointwise | None:
    """Build and load the kernels, checked against torch on a probe; None where they cannot be used."""
    return load_kernel("fused_pointwise", cc, out_dir, FusedPointwise, _agrees_with_torch)


@functools.cache
def default_kernel() -> FusedPointwise | None:
    """The process's kernels, built on first use; None where unavailable or turned off."""
    return load_default("fused_pointwise", FusedPointwise, _agrees_with_torch)
