"""A decode step of a bfloat16 model as one fixed sequence of native kernel calls.

A decode step does little arithmetic per layer: at one sequence the weights stream
in about 0.7 ms a layer, and the module path spent another 0.12 ms a layer in
Python around its nine kernel calls (module dispatch, attribute lookups, a fresh
tensor per result, the same operand checks every layer; 2-core Zen 5 EPYC). This
program checks the operands once when it is built (weights, pools) and once per
step (the step's tables and lengths, through the attention kernel's own
checks), keeps its activations in buffers that live as long as it does, and
then calls the C functions with their arguments already laid out, layer after
layer.

It runs the module path's kernels in the module path's order on the same
values, so its hidden states are the module path's bits
(`tests/test_model_decode_program.py` holds every step of a run to it). It
applies to steps whose every token is a decode token of a model whose every
projection is packed (`packed_weight.py`) and whose pointwise and attention
kernels are loaded; anything else runs the modules.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixserve.model.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata
from prefixserve.model.native import fused_pointwise, packed_gemm
from prefixserve.model.native.fused_pointwise import check_slots
from prefixserve.model.native.paged_decode_attention import DecodeState, PagedDecodeAttention
from prefixserve.model.packed_weight import PackedWeight, embedding


@dataclass(frozen=True)
class _Layer:
    """One layer's operands as the C calls take them: data pointers, a bias as float32 or None."""
    input_norm: int
    qkv: int
    qkv_bias: torch.Tensor | None
    q_norm: int
    k_norm: int
    o: int
    o_bias: torch.Tensor | None
    post_norm: int
    gate_up: int
    down: int
    k_pool: torch.Tensor      # [slots, KVH, D] views of the layer's pool
    v_pool: torch.Tensor
    pool: int
    k_rows: int               # k_pool's and v_pool's data pointers
    v_rows: int


class _Buffers:
    """The activations of steps of up to `rows` tokens, reused: views of their first n rows per step."""

    def __init__(self, rows: int, hidden: int, qkv: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, dtype: torch.dtype) -> None:
        self.rows = rows
        new = lambda *shape, dtype=dtype: torch.empty(rows, *shape, dtype=dtype)  # noqa: E731
        self.residual, self.h, self.mlp_out = new(hidden), new(hidden), new(hidden)
        self.qkv = new(qkv)
        self.q = new(heads, head_dim)
        self.queries = new(kv_heads, heads // kv_heads, head_dim, dtype=torch.float32)
        self.attn = new(heads * head_dim)
        self.o = new(hidden)
        self.gate_up, self.act = new(2 * intermediate), new(intermediate)
        self.cos, self.sin = new(head_dim // 2), new(head_dim // 2)


class DecodeProgram:
    """`run(input_ids, positions, meta)`: what the model's forward returns for a decode-only step (the
    final-normed hidden states), through the pools it was built for. Built by `build`, where it applies."""

    def __init__(self, model, kv_caches: list[torch.Tensor], layers: list[_Layer],
                 pointwise: fused_pointwise.FusedPointwise, gemm: packed_gemm.PackedGemm,
                 attention: PagedDecodeAttention) -> None:
        config = model.config
        self._model = model
        self._pool = kv_caches[0]
        self._layers = layers
        self._heads, self._kv_heads, self._head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                       config.head_dim)
        self._hidden, self._intermediate = config.hidden_size, config.intermediate_size
        self._q_size, self._kv_size = config.q_size, config.kv_size
        self._qkv_size = self._q_size + 2 * self._kv_size
        self._eps = config.rms_norm_eps
        self._qk_eps = model.layers[0].self_attn.q_norm.eps if model.layers[0].self_attn.q_norm is not None else 0.0
        self._scale = model.layers[0].self_attn.scale
        self._final_norm = model.norm.weight.data_ptr()
        self._norm_fn = pointwise.function("add_rms_norm", torch.bfloat16)
        self._qk_fn = pointwise.function("qk_norm_rope", torch.bfloat16)
        self._silu_fn = pointwise.function("silu_and_mul", torch.bfloat16)
        self._gemm = gemm.functions[torch.bfloat16]
        self._attention = attention
        self._buffers: _Buffers | None = None

    @staticmethod
    def build(model, kv_caches: list[torch.Tensor]) -> "DecodeProgram | None":
        """The program for `model` over `kv_caches`, or None where it does not apply: a model not in
        bfloat16 on the CPU with every projection packed, its head dim not whole 16-element rows, pools
        not all one contiguous shape, or a kernel it calls not loaded."""
        backend = model.attention_backend
        pointwise, gemm = fused_pointwise.default_kernel(), packed_gemm.default_kernel()
        attention = backend.decode_kernel if isinstance(backend, TorchPagedAttention) else None
        config = model.config
        if (pointwise is None or gemm is None or attention is None or config.head_dim % 16
                or config.hidden_size % 8 or config.intermediate_size % 16 or len(kv_caches) != len(model.layers)):
            return None
        pool = kv_caches[0]
        if any(c.shape != pool.shape or c.dtype != torch.bfloat16 or not c.is_contiguous() or not c.is_cpu
               for c in kv_caches):
            return None
        weights = (model.norm.weight,)
        layers = []
        for layer, cache in zip(model.layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(w, PackedWeight) for w in projections):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            qk = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
            weights += norms + tuple(w for w in qk if w is not None)
            k_pool, v_pool = (cache[i].view(-1, config.num_key_value_heads, config.head_dim) for i in (0, 1))
            layers.append(_Layer(
                norms[0].data_ptr(), attn.qkv_proj.panels.data_ptr(), _float_bias(attn.qkv_bias),
                0 if qk[0] is None else qk[0].data_ptr(), 0 if qk[1] is None else qk[1].data_ptr(),
                attn.o_proj.panels.data_ptr(), _float_bias(attn.o_bias), norms[1].data_ptr(),
                mlp.gate_up_proj.panels.data_ptr(), mlp.down_proj.panels.data_ptr(), k_pool, v_pool,
                cache.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr()))
        if any(w.dtype != torch.bfloat16 or not w.is_contiguous() or not w.is_cpu for w in weights):
            return None
        return DecodeProgram(model, kv_caches, layers, pointwise, gemm, attention)

    @staticmethod
    def applies(meta, tokens: int) -> bool:
        """Whether a step with this metadata (the torch backend's) is one the program runs: every token a
        decode token, attention through the native kernel's tables."""
        return (isinstance(meta, TorchPagedMetadata) and meta.native is not None and meta.decode is not None
                and meta.decode.all_rows and meta.common.max_query_len == 1 and meta.common.num_seqs == tokens)

    def _views(self, n: int) -> _Buffers:
        buffers = self._buffers
        if buffers is None or buffers.rows < n:
            rows = max(n, 2 * buffers.rows if buffers is not None else 16)
            buffers = self._buffers = _Buffers(rows, self._hidden, self._qkv_size, self._heads, self._kv_heads,
                                               self._head_dim, self._intermediate, torch.bfloat16)
        return buffers

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: TorchPagedMetadata) -> torch.Tensor:
        n = input_ids.numel()
        if input_ids.shape != (n,) or positions.shape != (n,) or not self.applies(meta, n):
            raise ValueError(f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} are not "
                             "the tokens of a decode-only step with native attention tables")
        model = self._model
        x = embedding(input_ids, model.embed_tokens)
        cos, sin = model.rotary(positions, x.dtype)
        half = self._head_dim // 2
        b = self._views(n)
        residual, h, mlp_out, qkv = b.residual[:n], b.h[:n], b.mlp_out[:n], b.qkv[:n]
        q, queries, attn, o = b.q[:n], b.queries[:n], b.attn[:n], b.o[:n]
        gate_up, act = b.gate_up[:n], b.act[:n]
        residual.copy_(x)
        b.cos[:n].copy_(cos.reshape(n, half))
        b.sin[:n].copy_(sin.reshape(n, half))
        q_as_rows = q.view(n, self._kv_heads, -1, self._head_dim)
        slots = meta.common.slot_mapping
        first = self._layers[0]
        # layer 0's pools stand for every layer's (one shape, checked at build): qk_norm_rope writes there
        check_slots(first.k_pool, first.v_pool, slots, n, (self._kv_heads, self._head_dim), torch.bfloat16)
        slot_ptr = slots.data_ptr()

        # the attention calls of this step, checked once on layer 0's pool; each layer swaps in its own
        plan, tables = meta.decode, meta.native
        state = None
        calls = []
        if plan.shared:
            state = DecodeState.fresh(queries.shape, filled=not plan.runs_cover_all)
            fill = None if plan.runs_cover_all else (state.acc, state.m, state.l)
            for run_tables in tables.runs:
                calls.append(self._attention.prepare_run_partial(queries, self._pool, run_tables, self._scale, state))
        else:
            fill = None
        # the arguments hold addresses only: `written` and `lse` are locals so that they outlive the loop
        arguments, written, lse = self._attention.prepare_run(queries, self._pool, tables.suffix, self._scale, state)
        calls.append(arguments)
        at = PagedDecodeAttention.POOL_ARGUMENT
        calls = [(c[:at], c[at + 1:]) for c in calls]
        attention = self._attention.function
        result_rows = written.acc.view(n, self._heads * self._head_dim)

        threads = torch.get_num_threads()
        hidden, inter, gemm, norm = self._hidden, self._intermediate, self._gemm, self._norm_fn
        ptr = _Pointers(residual, h, mlp_out, qkv, q, attn, o, gate_up, act, b.cos, b.sin)
        for i, layer in enumerate(self._layers):
            # the first layer norms the embedding; the others add the last MLP output into the residual first
            norm(ptr.residual, ptr.mlp_out if i else 0, layer.input_norm, self._eps, ptr.h, n, hidden, threads)
            gemm(ptr.h, layer.qkv, _ptr(layer.qkv_bias), ptr.qkv, n, self._qkv_size, hidden, threads)
            # the step's K/V rows go straight into the layer's pools
            self._qk_fn(ptr.qkv, self._qkv_size, self._heads, self._kv_heads, self._head_dim, layer.q_norm,
                        layer.k_norm, self._qk_eps, ptr.cos, ptr.sin, ptr.q, layer.k_rows, layer.v_rows, slot_ptr,
                        n, threads)
            queries.copy_(q_as_rows)
            if fill is not None:
                fill[0].zero_()
                fill[1].fill_(float("-inf"))
                fill[2].zero_()
            for before, after in calls:
                attention(*before, layer.pool, *after)
            attn.copy_(result_rows)
            gemm(ptr.attn, layer.o, _ptr(layer.o_bias), ptr.o, n, hidden, self._q_size, threads)
            norm(ptr.residual, ptr.o, layer.post_norm, self._eps, ptr.h, n, hidden, threads)
            gemm(ptr.h, layer.gate_up, 0, ptr.gate_up, n, 2 * inter, hidden, threads)
            self._silu_fn(ptr.gate_up, ptr.act, n, inter, threads)
            gemm(ptr.act, layer.down, 0, ptr.mlp_out, n, hidden, inter, threads)
        out = torch.empty(n, hidden, dtype=torch.bfloat16)
        norm(ptr.residual, ptr.mlp_out, self._final_norm, self._eps, out.data_ptr(), n, hidden, threads)
        return out


@dataclass(frozen=True)
class _Pointers:
    """The step's buffers' data pointers (the C calls take addresses; reading them once per step)."""
    residual: int
    h: int
    mlp_out: int
    qkv: int
    q: int
    attn: int
    o: int
    gate_up: int
    act: int
    cos: int
    sin: int

    def __init__(self, *tensors: torch.Tensor) -> None:
        for name, t in zip(self.__dataclass_fields__, tensors):
            object.__setattr__(self, name, t.data_ptr())


def _float_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    # the packed GEMM adds a float32 bias (PackedWeight.matmul converts it on every call)
    return None if bias is None else bias.detach().float().contiguous()


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()
