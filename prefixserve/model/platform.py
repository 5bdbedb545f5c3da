"""What one kind of device brings to the model: its layer ops, weight preparation, dtype and KV layouts.

`Platform` is the seam. Its own implementation is plain torch and runs on every device torch runs on
(cuda, mps, meta: a model built for its shapes only); a platform for a device type (platforms/cpu) derives
from it and overrides what its kernels do faster, falling back to these methods where they do not apply.
Layers take their ops from the platform once, at construction (`platform_for(device)`), so no call on the
hot path looks anything up and no model or worker code names a kernel.

Platforms register themselves on import (`register_platform`). The registry imports the platforms package,
whose `__init__` lists the platform modules, by name on the first lookup: model/ and worker/ never import
a platform, and every caller of `load_model` gets the platform of its device without importing it.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from prefixserve.model.kv_layout import ROWS, layout_named
from prefixserve.model.prepared_weight import PreparedWeight, embedding

AUTO = "auto"
PLATFORMS_PACKAGE = "prefixserve.platforms"


@dataclass(frozen=True)
class DtypeChoice:
    requested: str
    # "float32", "bfloat16", "float16", or None: the checkpoint's own dtype
    dtype: Optional[str]
    reason: str


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] -> rotated copy, contiguous."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Platform:
    """Plain torch on any device; a device's platform overrides what its kernels do."""
    name = "torch"
    # the device type (torch.device(...).type) this platform serves; None: the fallback for every type
    device_type: Optional[str] = None
    # the KV layouts its attention reads, by name (model/kv_layout.py)
    kv_layouts: tuple[str, ...] = (ROWS,)

    # --- layer ops -------------------------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x / rms(x) * weight over the last dimension."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        # Low precision: normalise in float32 and round once before the weight, the
        # order HF uses, so bf16 outputs follow the reference implementation closely.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x); the sum may be written into `residual` in place."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def qk_norm_rope(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                     q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
                     cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k [T, KVH, D] out of the fused qkv rows, each RMS-normed per head (where the
        weights are given) and rotated."""
        tokens = qkv.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q = qkv[:, :q_size].view(tokens, num_heads, head_dim)
        k = qkv[:, q_size: q_size + kv_size].view(tokens, num_kv_heads, head_dim)
        if q_weight is not None and k_weight is not None:
            q, k = self.rms_norm(q, q_weight, eps), self.rms_norm(k, k_weight, eps)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of the fused [..., 2I] gate/up rows."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def linear(self, x: torch.Tensor, weight: torch.Tensor | PreparedWeight, bias: torch.Tensor | None = None,
               widened: bool = False) -> torch.Tensor:
        """x [..., in] @ weight[out, in].T (+ bias), like F.linear; `widened`: as `.float()` of that (a
        prepared weight may store it so in the same pass, the others widen after it)."""
        if isinstance(weight, PreparedWeight):
            return weight.matmul(x, bias, widened)
        y = F.linear(x, weight, bias)
        return y.float() if widened else y

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor | PreparedWeight) -> torch.Tensor:
        """F.embedding(ids, weight), for a row-major or a prepared weight."""
        return embedding(ids, weight)

    def row_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax over each row."""
        return torch.argmax(logits, dim=-1)

    # --- loading ---------------------------------------------------------------------------------------

    def prepare_weights(self, model: Any) -> bool:
        """Re-lays the model's weights for this platform's kernels, in place; True if it changed any."""
        return False

    def choose_dtype(self, requested: str, device: torch.device) -> DtypeChoice:
        """What the engine's dtype setting means here; an explicit dtype always wins."""
        if requested != AUTO:
            return DtypeChoice(requested, requested, "asked for explicitly")
        return DtypeChoice(requested, None, f"auto on {device.type}: the checkpoint's own dtype")

    def choose_kv_layout(self, requested: str, model: Any, dtype: torch.dtype, block_size: int) -> str:
        """The pool's layout for the engine's kv_layout setting: "auto" picks rows here."""
        if requested == AUTO:
            return ROWS
        layout_named(requested)
        if requested not in self.kv_layouts:
            raise ValueError(f"kv_layout={requested!r} needs a platform whose attention kernels read it; "
                             f"the {self.name} platform lays pools out in: {', '.join(self.kv_layouts)}")
        return requested

    def decode_program(self, model: Any, kv_caches: list[torch.Tensor], layout: str, *,
                       max_batch: int | None = None, max_blocks: int | None = None) -> Any:
        """An object whose `applies(meta, tokens)` / `run(input_ids, positions, meta)` run decode-only steps
        faster than the modules, or None where none applies. max_batch and max_blocks: the most sequences a
        step holds and the most blocks a sequence's table holds (where the program sizes buffers for them)."""
        return None

    def paged_attention_kernels(self) -> Any:
        """The kernels the torch attention backend reads the pool with (model/attention/paged_kernels.py),
        or None: gathers and SDPA."""
        return None

    def load_kernels(self) -> dict[str, dict[str, object]]:
        """Builds and loads the platform's kernels now and returns `kernel_report()`."""
        return self.kernel_report()

    def kernel_report(self) -> dict[str, dict[str, object]]:
        """{kernel name: {"active", "reason", ...}}, JSON-ready, for start-up logs, stats() and /health."""
        return {}


_BASE = Platform()
# device type -> platform; filled by the platform modules as they are imported
_PLATFORMS: dict[str, Platform] = {}
_loaded = False


def register_platform(platform: Platform) -> Platform:
    """Makes `platform` the one for its device type."""
    kind = platform.device_type
    if not kind:
        raise ValueError(f"platform {platform.name!r} names no device type")
    known = _PLATFORMS.get(kind)
    if known is not None and type(known) is not type(platform):
        raise ValueError(f"two platforms for device type {kind!r}: {known.name!r} and {platform.name!r}")
    _PLATFORMS[kind] = platform
    return platform


def load_platforms() -> None:
    """Imports the platforms package (which imports every platform module) once a process."""
    global _loaded
    if not _loaded:
        # marked only once imported: a thread asking meanwhile waits on the import lock, never sees a partial
        # registry (an import from inside the package's own import gets the module as it stands)
        importlib.import_module(PLATFORMS_PACKAGE)
        _loaded = True


def platform_for(device: torch.device | str) -> Platform:
    """The platform of `device`'s type, or the plain-torch one where no platform serves it."""
    load_platforms()
    return _PLATFORMS.get(torch.device(device).type, _BASE)
