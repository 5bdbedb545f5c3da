"""The layer loop of a bfloat16 or float32 decode step in C (`decode_loop.c`): `platforms/cpu/decode_program.py`
lays out a step's operands in a `DecodeStep` and its layers' in `DecodeLayer`s, and one call runs every layer's
kernels, reached through their addresses."""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

from prefixserve.platforms.cpu.native.build import load_default, load_kernel

_p, _long, _int, _float = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float


class DecodeLayer(ctypes.Structure):
    """One layer's operands, as `decode_loop.c` declares them: data pointers (0 for an absent bias or
    q/k norm)."""
    _fields_ = [(name, _p) for name in ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias",
                                        "post_norm", "gate_up", "down", "pool", "k_rows", "v_rows")]


class AttentionCall(ctypes.Structure):
    """One attention call's arguments but the pool (each layer's)."""
    _fields_ = ([("q", _p), ("tables", _p), ("lens", _p)]
                + [(name, _long) for name in ("batch", "kv_heads", "rows", "head_dim", "num_blocks", "block_size",
                                              "table_width")]
                + [("scale", _float), ("out", _p), ("lse", _p), ("state_m", _p), ("state_l", _p), ("members", _p),
                   ("group", _long)]
                + [(name, _int) for name in ("pool_bf16", "carry_in", "finalize", "body", "layout", "q_bf16")]
                + [("out_bf16", _p)])

    # the attention kernel's C arguments in order (paged_decode_attention.c), pool and threads left out
    ARGUMENTS = ("q", None, "pool_bf16", "tables", "lens", "batch", "kv_heads", "rows", "head_dim", "num_blocks",
                 "block_size", "table_width", "scale", "out", "lse", "state_m", "state_l", "carry_in", "finalize",
                 "members", "group", "body", "layout", "q_bf16", "out_bf16", None)

    @classmethod
    def from_arguments(cls, arguments: list) -> "AttentionCall":
        """The call `PagedDecodeAttention.prepare_run(_partial)` laid out as a C argument list."""
        if len(arguments) != len(cls.ARGUMENTS):
            raise ValueError(f"{len(arguments)} attention arguments, expected {len(cls.ARGUMENTS)}")
        return cls(**{name: value for name, value in zip(cls.ARGUMENTS, arguments) if name is not None})


class DecodeStep(ctypes.Structure):
    """A step's kernels (function addresses), shapes, buffers and attention calls."""
    _fields_ = ([(name, _p) for name in ("norm", "gemm", "qk", "silu", "attention")]
                + [(name, _long) for name in ("rows", "hidden", "q_size", "qkv_size", "intermediate", "heads",
                                              "kv_heads", "head_dim", "block_size")]
                + [("layout", _int), ("eps", _float), ("qk_eps", _float)]
                + [(name, _p) for name in ("residual", "h", "mlp_out", "qkv", "q", "attn", "o", "gate_up", "act",
                                           "cos", "sin", "slots", "fill_acc", "fill_m", "fill_l", "calls")]
                + [("num_calls", _long), ("threads", _int)])


def address(fn) -> int:
    """A loaded C function's address, for a DecodeStep field."""
    return ctypes.cast(fn, ctypes.c_void_p).value


class DecodeLoop:
    """`run(step, layers)`: every layer of a step. Unchecked: the caller (the decode program) checks the
    operands when it builds the layers and each step."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._run = library.decode_layers
        self._run.restype = None
        self._run.argtypes = [ctypes.POINTER(DecodeStep), ctypes.POINTER(DecodeLayer), _long]

    def run(self, step: DecodeStep, layers: ctypes.Array) -> None:
        self._run(ctypes.byref(step), layers, len(layers))


def _loads(kernel: DecodeLoop) -> bool:
    """The loop computes nothing of its own: the kernels it calls are checked by their own probes, and
    tests/platforms/cpu/test_model_decode_program.py holds its steps to the module path's bits."""
    return True


def load(cc: str | None, out_dir: Path) -> DecodeLoop | None:
    """Build and load the loop; None where it cannot be used."""
    return load_kernel("decode_loop", cc, out_dir, DecodeLoop, _loads)


@functools.cache
def default_kernel() -> DecodeLoop | None:
    """The process's loop, built on first use; None where unavailable or turned off."""
    return load_default("decode_loop", DecodeLoop, _loads)
