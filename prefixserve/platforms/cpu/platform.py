"""The CPU platform: the project's native kernels where they take the operands, plain torch otherwise.

Each op tries its kernel (`native/`: fused pointwise, small-M and packed GEMMs, row argmax) and falls back
to the torch implementation of `Platform` where the kernel is not loaded or does not take the operands
(a dtype, a shape, a strided view, anything needing gradients). Projections are packed at load
(packed_weight.py), dtype="auto" reads the CPU's bfloat16 features (dtype_choice.py), the pool may be laid
out in panels (panels.py), and decode-only steps may run as one native program (decode_program.py).
"""
from __future__ import annotations

import torch

from prefixserve.model.kv_layout import ROWS
from prefixserve.model.platform import AUTO, DtypeChoice, Platform, register_platform
from prefixserve.platforms.cpu import dtype_choice
from prefixserve.platforms.cpu.decode_program import DecodeProgram
from prefixserve.platforms.cpu.linear import linear
from prefixserve.platforms.cpu.native import report, row_argmax
from prefixserve.platforms.cpu.native.fused_pointwise import FusedPointwise, default_kernel
from prefixserve.platforms.cpu.packed_weight import applies as packing_applies
from prefixserve.platforms.cpu.packed_weight import pack_attribute
from prefixserve.platforms.cpu.paged_attention import CpuPagedKernels
from prefixserve.platforms.cpu.panels import PANELS, panels_fit


def fused_kernel(*tensors: torch.Tensor | None, multiple: int = 8) -> FusedPointwise | None:
    """The fused pointwise kernels where they can take these operands (and nothing needs gradients)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return None
    kernel = default_kernel()
    return kernel if kernel is not None and FusedPointwise.supports(*tensors, multiple=multiple) else None


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    kv_layouts = (ROWS, PANELS)

    def __init__(self) -> None:
        self._paged_kernels = CpuPagedKernels()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.is_contiguous() and (kernel := fused_kernel(x, weight)) is not None:
            return kernel.rms_norm(x, weight, eps)
        return Platform.rms_norm(self, x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if (x.is_contiguous() and residual.is_contiguous() and x.shape == residual.shape
                and (kernel := fused_kernel(x, residual, weight)) is not None):
            return kernel.rms_norm(x, weight, eps, residual=residual), residual
        return Platform.add_rms_norm(self, x, residual, weight, eps)

    def qk_norm_rope(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kernel = fused_kernel(qkv, q_weight, k_weight, cos, sin, multiple=head_dim // 2)
        if kernel is not None and head_dim % 16 == 0:
            return kernel.qk_norm_rope(qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps, cos, sin)
        return Platform.qk_norm_rope(self, qkv, num_heads, num_kv_heads, head_dim, q_weight, k_weight, eps, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() == 2 and gate_up.is_contiguous() and (kernel := fused_kernel(gate_up, multiple=16)):
            return kernel.silu_and_mul(gate_up)
        return Platform.silu_and_mul(self, gate_up)

    # small-M GEMM, oneDNN with bounded primitive caches, packed weights (linear.py)
    linear = staticmethod(linear)

    def row_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        kernel = row_argmax.default_kernel()
        if kernel is not None and kernel.supports(logits):
            return kernel(logits)
        return torch.argmax(logits, dim=-1)

    @torch.no_grad()
    def prepare_weights(self, model) -> bool:
        """Re-lays every projection and the LM head of a `CausalLM` for the packed GEMM (packed_weight.py),
        where the CPU and dtype allow; True if it packed any. A tied embedding shares the packed LM head."""
        projections = [(module, name) for layer in model.layers
                       for module, name in ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
                                            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj"))]
        packed = False
        for module, name in projections:
            # a shape the kernel cannot take (an odd row length) stays row-major
            if packing_applies(getattr(module, name)):
                pack_attribute(module, name)
                packed = True
        if packing_applies(model.lm_head):
            tied = model.lm_head is model.embed_tokens
            head = pack_attribute(model, "lm_head")
            if tied:
                del model.embed_tokens
                model.embed_tokens = head
            packed = True
        return packed

    def choose_dtype(self, requested: str, device: torch.device) -> DtypeChoice:
        return dtype_choice.choose_dtype(requested, device)

    def choose_kv_layout(self, requested: str, model, dtype: torch.dtype, block_size: int) -> str:
        """Panels where asked for or, with "auto", wherever the model's attention backend reads them on this
        CPU; rows otherwise."""
        reads = getattr(model.attention_backend, "reads_layout", None)
        fits = panels_fit(dtype, block_size, model.config.head_dim) and reads is not None and reads(PANELS, dtype)
        if requested == PANELS and not fits:
            raise ValueError("kv_layout='panels' needs a model on a CPU whose attention kernels read its dtype's "
                             "panels (bfloat16: the avx512_bf16 tiles; float32: the AVX-512 tiles), with block_size "
                             "and head_dim multiples of 16")
        if requested == AUTO:
            return PANELS if fits else ROWS
        return Platform.choose_kv_layout(self, requested, model, dtype, block_size)

    def decode_program(self, model, kv_caches: list[torch.Tensor], layout: str, *,
                       max_batch: int | None = None, max_blocks: int | None = None) -> DecodeProgram | None:
        return DecodeProgram.build(model, kv_caches, layout)

    def paged_attention_kernels(self) -> CpuPagedKernels:
        return self._paged_kernels

    def load_kernels(self) -> dict[str, dict[str, object]]:
        return report.load_all()

    def kernel_report(self) -> dict[str, dict[str, object]]:
        return report.kernel_report()


register_platform(CpuPlatform())
