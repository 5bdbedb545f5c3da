"""A decode step of a bfloat16 or float32 model as one fixed sequence of native kernel calls.

A decode step does little arithmetic per layer: at one sequence the weights stream
in about 0.7 ms a layer, and the module path spent another 0.12 ms a layer in
Python around its nine kernel calls (module dispatch, attribute lookups, a fresh
tensor per result, the same operand checks every layer; 2-core Zen 5 EPYC). This
program checks the operands once when it is built (weights, pools) and once per
step (the step's tables and lengths, through the attention kernel's own
checks), keeps its activations in buffers that live as long as it does, lays
out the step's arguments once, and hands them to one C call that runs every
layer's kernels (`native/decode_loop.c`: calling them from Python, layer after
layer, still cost ~2 ms a step).

It runs the module path's kernels in the module path's order on the same
values, so its hidden states are the module path's bits
(`tests/platforms/cpu/test_model_decode_program.py` holds every step of a run to it). It
applies to steps whose every token is a decode token of a model whose every
projection is packed (`packed_weight.py`) and whose pointwise, attention and
loop kernels are loaded; anything else runs the modules.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from prefixserve.model.attention.torch_paged import TorchPagedAttention, TorchPagedMetadata
from prefixserve.model.kv_layout import pool_geometry
from prefixserve.model.prepared_weight import embedding
from prefixserve.platforms.cpu.native import decode_loop, fused_pointwise, packed_gemm
from prefixserve.platforms.cpu.native.decode_loop import AttentionCall, DecodeLayer, DecodeLoop, DecodeStep, address
from prefixserve.platforms.cpu.native.fused_pointwise import check_slots
from prefixserve.platforms.cpu.native.paged_decode_attention import DecodeState, PagedDecodeAttention
from prefixserve.platforms.cpu.packed_weight import PackedWeight
from prefixserve.platforms.cpu.panels import LAYOUT_CODES, PANELS


@dataclass(frozen=True)
class _Layer:
    """One layer as the loop takes it, and the tensors its addresses point into (kept alive here)."""
    operands: DecodeLayer
    biases: tuple[torch.Tensor | None, torch.Tensor | None]     # qkv's and o's, float32
    k_pool: torch.Tensor      # the layer's K and V: [slots, KVH, D] rows, or [blocks, KVH, BS, D] panels
    v_pool: torch.Tensor


class _Buffers:
    """The activations of steps of up to `rows` tokens, reused: views of their first n rows per step."""

    def __init__(self, rows: int, hidden: int, qkv: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, dtype: torch.dtype) -> None:
        self.rows = rows
        new = lambda *shape, dtype=dtype: torch.empty(rows, *shape, dtype=dtype)
        self.residual, self.h, self.mlp_out = new(hidden), new(hidden), new(hidden)
        self.qkv = new(qkv)
        self.q = new(heads, head_dim)
        # the attention kernel reads the queries where qk_norm_rope leaves them, as [rows, KVH, G, D]
        self.queries = self.q.view(rows, kv_heads, heads // kv_heads, head_dim)
        # a bfloat16 model's attention output, written there by the kernel for o_proj (a float32 model's
        # o_proj reads the kernel's float32 output in place)
        self.attn = None if dtype == torch.float32 else new(kv_heads, heads // kv_heads, head_dim)
        self.o = new(hidden)
        self.gate_up, self.act = new(2 * intermediate), new(intermediate)
        self.cos, self.sin = new(head_dim // 2), new(head_dim // 2)


class DecodeProgram:
    """`run(input_ids, positions, meta)`: what the model's forward returns for a decode-only step (the
    final-normed hidden states), through the pools it was built for. Built by `build`, where it applies."""

    def __init__(self, model, kv_caches: list[torch.Tensor], layers: list[_Layer],
                 pointwise: fused_pointwise.FusedPointwise, gemm: packed_gemm.PackedGemm,
                 attention: PagedDecodeAttention, loop: DecodeLoop, layout: str) -> None:
        config = model.config
        self._model = model
        self._pool = kv_caches[0]
        self._layout = layout
        self._layers = layers
        self._operands = (DecodeLayer * len(layers))(*(layer.operands for layer in layers))
        self._heads, self._kv_heads, self._head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                       config.head_dim)
        self._hidden, self._intermediate = config.hidden_size, config.intermediate_size
        self._q_size, self._kv_size = config.q_size, config.kv_size
        self._qkv_size = self._q_size + 2 * self._kv_size
        self._eps = config.rms_norm_eps
        self._qk_eps = model.layers[0].self_attn.q_norm.eps if model.layers[0].self_attn.q_norm is not None else 0.0
        self._scale = model.layers[0].self_attn.scale
        self._final_norm = model.norm.weight.data_ptr()
        self._dtype = dtype = self._pool.dtype
        self._norm_fn = pointwise.function("add_rms_norm", dtype)
        self._kernels = {"norm": address(self._norm_fn), "gemm": address(gemm.functions[dtype]),
                         "qk": address(pointwise.function("qk_norm_rope", dtype)),
                         "silu": address(pointwise.function("silu_and_mul", dtype)),
                         "attention": address(attention.function)}
        self._attention = attention
        self._loop = loop
        self._buffers: _Buffers | None = None

    @staticmethod
    def build(model, kv_caches: list[torch.Tensor], layout: str) -> "DecodeProgram | None":
        """The program for `model` over `kv_caches` (pools in `layout`), or None where it does not apply: a model
        not on the CPU with every projection packed (bfloat16 or float32, pools and weights all in that dtype),
        its head dim not whole 16-element rows, pools not all one contiguous shape, attention not through the
        torch backend itself (for bfloat16: through tiles that take its queries as they are), or a kernel it
        calls not loaded."""
        backend = model.attention_backend
        pointwise, gemm = fused_pointwise.default_kernel(), packed_gemm.default_kernel()
        loop = decode_loop.default_kernel()
        # the torch backend itself: a subclass may attend otherwise in forward, which the program would skip
        attention = backend.decode_kernel if type(backend) is TorchPagedAttention else None
        if layout == PANELS and attention is not None:
            attention = (attention.for_layout(PANELS) if kv_caches and backend.reads_layout(PANELS, kv_caches[0].dtype)
                         else None)
        config = model.config
        if (pointwise is None or gemm is None or attention is None or loop is None or config.head_dim % 16
                or config.hidden_size % 8 or config.intermediate_size % 16 or len(kv_caches) != len(model.layers)):
            return None
        pool = kv_caches[0]
        dtype = pool.dtype
        if pool_geometry(pool, layout)[2:] != (config.num_key_value_heads, config.head_dim):
            raise ValueError(f"pools {tuple(pool.shape)} do not hold the model's KV heads in {layout}")
        if dtype not in gemm.functions or any(c.shape != pool.shape or c.dtype != dtype or not c.is_contiguous()
                                              or not c.is_cpu for c in kv_caches):
            return None
        # a bfloat16 step's attention reads its bfloat16 queries and writes its output in bfloat16 (no copies)
        if dtype == torch.bfloat16 and not attention.reads_query_words(pool, config.head_dim):
            return None
        weights = (model.norm.weight,)
        layers = []
        for layer, cache in zip(model.layers, kv_caches):
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(isinstance(w, PackedWeight) and w.dtype == dtype for w in projections):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            qk = (attn.q_norm.weight, attn.k_norm.weight) if attn.q_norm is not None else (None, None)
            weights += norms + tuple(w for w in qk if w is not None)
            k_pool, v_pool = (cache[i] if layout == PANELS else cache[i].view(-1, config.num_key_value_heads,
                                                                              config.head_dim) for i in (0, 1))
            biases = (_float_bias(attn.qkv_bias), _float_bias(attn.o_bias))
            layers.append(_Layer(DecodeLayer(
                norms[0].data_ptr(), attn.qkv_proj.panels.data_ptr(), _ptr(biases[0]), _ptr(qk[0]), _ptr(qk[1]),
                attn.o_proj.panels.data_ptr(), _ptr(biases[1]), norms[1].data_ptr(), mlp.gate_up_proj.panels.data_ptr(),
                mlp.down_proj.panels.data_ptr(), cache.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr()),
                biases, k_pool, v_pool))
        if any(w.dtype != dtype or not w.is_contiguous() or not w.is_cpu for w in weights):
            return None
        return DecodeProgram(model, kv_caches, layers, pointwise, gemm, attention, loop, layout)

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
                                               self._head_dim, self._intermediate, self._dtype)
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
        q, queries, o = b.q[:n], b.queries[:n], b.o[:n]
        gate_up, act = b.gate_up[:n], b.act[:n]
        residual.copy_(x)
        b.cos[:n].copy_(cos.reshape(n, half))
        b.sin[:n].copy_(sin.reshape(n, half))
        slots = meta.common.slot_mapping
        first = self._layers[0]
        # layer 0's pools stand for every layer's (one shape, checked at build): qk_norm_rope writes there
        block_size = check_slots(first.k_pool, first.v_pool, slots, n, (self._kv_heads, self._head_dim), self._dtype,
                                 self._layout)

        # the attention calls of this step, checked once on layer 0's pool; the loop swaps in each layer's
        plan, tables = meta.decode, meta.native
        state = fill = None
        calls = []
        if plan.shared:
            state = DecodeState.fresh(queries.shape, filled=not plan.runs_cover_all)
            fill = None if plan.runs_cover_all else state
            for run_tables in tables.runs:
                calls.append(self._attention.prepare_run_partial(queries, self._pool, run_tables, self._scale, state))
        # the arguments hold addresses only: `written` and `lse` are locals so that they outlive the call
        attn = None if b.attn is None else b.attn[:n]
        arguments, written, lse = self._attention.prepare_run(queries, self._pool, tables.suffix, self._scale, state,
                                                              out=attn)
        calls.append(arguments)
        call_array = (AttentionCall * len(calls))(*(AttentionCall.from_arguments(c) for c in calls))

        step = DecodeStep(
            **self._kernels, rows=n, hidden=self._hidden, q_size=self._q_size, qkv_size=self._qkv_size,
            intermediate=self._intermediate, heads=self._heads, kv_heads=self._kv_heads, head_dim=self._head_dim,
            block_size=block_size, layout=LAYOUT_CODES[self._layout],
            eps=self._eps, qk_eps=self._qk_eps, residual=residual.data_ptr(), h=h.data_ptr(),
            mlp_out=mlp_out.data_ptr(), qkv=qkv.data_ptr(), q=q.data_ptr(), o=o.data_ptr(),
            # float32: o_proj reads the attention output where the kernel left it
            attn=written.acc.data_ptr() if attn is None else attn.data_ptr(),
            gate_up=gate_up.data_ptr(), act=act.data_ptr(), cos=b.cos.data_ptr(), sin=b.sin.data_ptr(),
            slots=slots.data_ptr(), fill_acc=0 if fill is None else fill.acc.data_ptr(),
            fill_m=0 if fill is None else fill.m.data_ptr(), fill_l=0 if fill is None else fill.l.data_ptr(),
            calls=ctypes.addressof(call_array), num_calls=len(calls), threads=torch.get_num_threads())
        self._loop.run(step, self._operands)
        out = torch.empty(n, self._hidden, dtype=self._dtype)
        self._norm_fn(residual.data_ptr(), mlp_out.data_ptr(), self._final_norm, self._eps, out.data_ptr(), n,
                      self._hidden, step.threads)
        return out


def _float_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    # the packed GEMM adds a float32 bias (PackedWeight.matmul converts it on every call)
    return None if bias is None else bias.detach().float().contiguous()


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()
