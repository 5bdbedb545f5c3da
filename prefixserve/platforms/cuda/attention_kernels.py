"""Triton kernels over the paged KV pool in the "rows" layout ([2, blocks, block_size, kv_heads, head_dim]).

The kernels are plain functions, compiled per device by triton_runtime.compiled; the device functions
they share (`_kv_tile`, `_softmax_step`, `_attend_split`; Triton inlines them) are `@triton.jit` here,
which settles them in this process's Triton mode: this module is imported only after
triton_runtime.prepare has settled it. Every key is found through a block table: token j of a context
lives in block table[j // BLOCK_SIZE] at offset j % BLOCK_SIZE. Softmax runs online in float32 in base 2
(scores scaled by log2(e)); the log-sum-exps these kernels hand each other are base 2 too. Head dims that
are not a power of two are padded up and masked.

- `prefill_kernel`: the query rows of every chunk of the step (new tokens over a cached context, causal
  within the chunk), one program per (tile of a chunk's rows, query head); the tiles of all chunks are
  listed on the host, so one launch serves a ragged batch.
- `decode_split_kernel`: one query token per sequence, the G query heads of a KV head together, each
  sequence's context cut into the launch's number of splits (flash-decoding); each split writes its
  normalised output and its LSE.
- `shared_run_kernel`: the cascade's shared prefix: many sequences' queries stacked over one run of
  blocks, read once per split, writing partial results beside the suffix splits.
- `combine_kernel`: the partial results of a sequence merged through their LSEs into its output row.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _kv_tile(K_CACHE, V_CACHE, TABLE, offs_n, key_ok, kv_head, offs_d, d_ok, stride_kb, stride_ks, stride_kh,
             BLOCK_SIZE: tl.constexpr):
    """The keys and values of one KV head at the context positions offs_n (zeros where not key_ok), found
    through the context's block table TABLE."""
    block = tl.load(TABLE + offs_n // BLOCK_SIZE, mask=key_ok, other=0)
    slot = block.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(K_CACHE + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V_CACHE + slot[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
    """One tile of keys into each query row's running max m_i, sum l_i and output acc; `visible`
    [rows, keys] says which keys a row attends to. The new max is finite only where a row sees a key of
    the tile: the callers make sure every row sees the tile's first one."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_split(q, K_CACHE, V_CACHE, TABLE, lo, hi, kv_head, offs_d, d_ok, scale, stride_kb, stride_ks,
                  stride_kh, NUM_ROWS: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The NUM_ROWS query rows q over the context positions [lo, hi) (a split, whole key tiles from lo): their
    normalised output and base-2 LSE. An empty split (past a short context) gives LSE -inf and zeros,
    which the combine gives no weight."""
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([NUM_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([NUM_ROWS], dtype=tl.float32)
    acc = tl.zeros([NUM_ROWS, HEAD_P2], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        key_ok = offs_n < hi
        k, v = _kv_tile(K_CACHE, V_CACHE, TABLE, offs_n, key_ok, kv_head, offs_d, d_ok, stride_kb, stride_ks,
                        stride_kh, BLOCK_SIZE)
        # the tile's first key is inside the split: every row sees it
        m_i, l_i, acc = _softmax_step(q, k, v, key_ok[None, :], m_i, l_i, acc, qk_scale, DOT_PRECISION)
    filled = l_i > 0
    out = tl.where(filled[:, None], acc / tl.where(filled, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(filled, m_i + tl.log2(tl.where(filled, l_i, 1.0)), float("-inf"))
    return out, lse


def prefill_kernel(Q, K_CACHE, V_CACHE, OUT, TILE_CHUNK, TILE_START, Q_START, Q_LEN, SEQ_LEN, TABLES,
                   scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh,
                   stride_table,
                   BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   HEAD_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    chunk = tl.load(TILE_CHUNK + tile)
    m_start = tl.load(TILE_START + tile)
    q_start = tl.load(Q_START + chunk)
    q_len = tl.load(Q_LEN + chunk)
    seq_len = tl.load(SEQ_LEN + chunk)
    context = seq_len - q_len
    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_P2)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_m < q_len
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    qk_scale = scale * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P2], dtype=tl.float32)
    # the tile's last row sees keys up to its own position: nothing past it is read
    key_end = tl.minimum(context + m_start + BLOCK_M, seq_len)
    for start in range(0, key_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        key_ok = offs_n < key_end
        k, v = _kv_tile(K_CACHE, V_CACHE, TABLES + chunk * stride_table, offs_n, key_ok, kv_head, offs_d, d_ok,
                        stride_kb, stride_ks, stride_kh, BLOCK_SIZE)
        visible = (offs_n[None, :] <= (context + offs_m)[:, None]) & key_ok[None, :]
        # key 0 is visible to every row, so the max is finite from the first tile on
        m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_PRECISION)
    out = acc / l_i[:, None]
    tl.store(OUT + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def decode_split_kernel(Q, K_CACHE, V_CACHE, PART_OUT, PART_LSE, ROWS, TABLES, LENS, scale,
                        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_table,
                        stride_pn, stride_ph, stride_ps, stride_ln, stride_lh,
                        BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
                        HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(ROWS + seq)
    length = tl.load(LENS + seq)
    # each sequence cuts its own context into the launch's splits (whole key tiles each), so the grid and
    # the arguments stay the same from step to step (a CUDA graph replays them) while lengths change
    split_tokens = tl.cdiv(tl.cdiv(length, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    lo = split * split_tokens
    hi = tl.minimum(lo + split_tokens, length)
    offs_g = tl.arange(0, GROUP_P2)
    g_ok = offs_g < GROUP
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, HEAD_P2)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    out, lse = _attend_split(q, K_CACHE, V_CACHE, TABLES + seq * stride_table, lo, hi, kv_head, offs_d, d_ok,
                             scale, stride_kb, stride_ks, stride_kh, GROUP_P2, HEAD_P2, BLOCK_SIZE, BLOCK_N,
                             DOT_PRECISION)
    tl.store(PART_OUT + seq * stride_pn + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
             out, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(PART_LSE + seq * stride_ln + heads * stride_lh + split, lse, mask=g_ok)


def shared_run_kernel(Q, K_CACHE, V_CACHE, PART_OUT, PART_LSE, ROWS, MEMBERS, RUN_BLOCKS, run_tokens,
                      num_members, scale, split_tokens, first_part,
                      stride_qt, stride_qh, stride_kb, stride_ks, stride_kh,
                      stride_pn, stride_ph, stride_ps, stride_ln, stride_lh,
                      BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HEAD_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # stacked rows: member r // GROUP, its query head kv_head * GROUP + r % GROUP
    offs_r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = offs_r < num_members * GROUP
    member = tl.load(MEMBERS + offs_r // GROUP, mask=r_ok, other=0)
    heads = kv_head * GROUP + offs_r % GROUP
    row = tl.load(ROWS + member, mask=r_ok, other=0)
    offs_d = tl.arange(0, HEAD_P2)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    lo = split * split_tokens
    hi = tl.minimum(lo + split_tokens, run_tokens)
    out, lse = _attend_split(q, K_CACHE, V_CACHE, RUN_BLOCKS, lo, hi, kv_head, offs_d, d_ok, scale, stride_kb,
                             stride_ks, stride_kh, BLOCK_M, HEAD_P2, BLOCK_SIZE, BLOCK_N, DOT_PRECISION)
    part = first_part + split
    tl.store(PART_OUT + member[:, None] * stride_pn + heads[:, None] * stride_ph + part * stride_ps
             + offs_d[None, :], out, mask=r_ok[:, None] & d_ok[None, :])
    tl.store(PART_LSE + member * stride_ln + heads * stride_lh + part, lse, mask=r_ok)


def combine_kernel(PART_OUT, PART_LSE, OUT, ROWS, num_parts, stride_pn, stride_ph, stride_ps,
                   stride_ln, stride_lh, stride_ot, stride_oh,
                   HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr, PARTS_P2: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_p = tl.arange(0, PARTS_P2)
    p_ok = offs_p < num_parts
    lse = tl.load(PART_LSE + seq * stride_ln + head * stride_lh + offs_p, mask=p_ok, other=float("-inf"))
    # every sequence has a non-empty part (its suffix holds at least the token just written)
    top = tl.max(lse, 0)
    used = lse > float("-inf")
    weight = tl.where(used, tl.exp2(lse - top), 0.0)
    offs_d = tl.arange(0, HEAD_P2)
    d_ok = offs_d < HEAD_DIM
    parts = tl.load(PART_OUT + seq * stride_pn + head * stride_ph + offs_p[:, None] * stride_ps + offs_d[None, :],
                    mask=used[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    row = tl.load(ROWS + seq)
    tl.store(OUT + row * stride_ot + head * stride_oh + offs_d, out.to(OUT.dtype.element_ty), mask=d_ok)
