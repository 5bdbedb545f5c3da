/* Causal prefill attention read from the paged KV pool, blocked like a GEMM, float32, AVX2 + FMA
 * (AVX-512 tiles where the CPU runs them: the same bits, see tile_qk512).
 * The pool may hold float32 or bfloat16: keys are widened to float32 as they are packed, so the
 * products and the softmax run in float32 in both cases; where the CPU has avx512_bf16, a bfloat16
 * pool's keys stay bfloat16 and Q K^T runs on vdpbf16ps (exact products, float32 sums: see
 * pack_keys_bf16).
 *
 * Sequence b owns the query rows q[starts[b] : starts[b + 1]] of the flat batch; query i of
 * its n rows sits at position seq_lens[b] - n + i and sees keys 0..that position, whose K/V
 * (the chunk's own included) are already in the pool at the slots of tables[b, :]. Sequences
 * with fewer than min_qlen queries are skipped (decode has its own kernel).
 *
 * Phase 1 copies each (sequence, KV head)'s keys out of the pool once into `work`: K transposed
 * into panels of 16 keys ([D][16] each), V into slabs of 16 columns ([keys][16] each). Read in
 * place, one head's rows of the pool lie KVH*D floats apart (4 KB for 8 heads of 128), so every
 * key of a tile maps to the same few L1 sets and the products below would be served from L2.
 * Sequences starting on the same blocks (a cached document under several questions) pack those
 * keys once (find_shared_keys): 16 chunks of 34 tokens over one 1024-token document, bfloat16,
 * 21.2 -> 13.3 ms a layer, the copies no longer spilling out of the caches.
 *
 * Phase 2 splits (sequence, KV head, block of query tokens) into work items. An item's rows are
 * its tokens x the G query heads of the KV head (token-major), so each packed K panel and V tile
 * serves G heads. Per tile of 64 keys: S = Q K^T with a 6 x 16 register tile (Q pre-scaled by
 * scale * log2(e)), an online softmax in base 2 with a polynomial exp2, then O = alpha O + P V
 * with a 6 x 16 register tile over a V slab. Panels of 6 rows skip the 16-key panels above their
 * diagonal, so the causal square costs about half. Items run largest first, dynamically scheduled.
 *
 * 2-core AMD EPYC (Zen 3), 2 threads, 16 query / 8 KV heads of 128: 512 fresh causal tokens take
 * 9-11 ms a layer (100-120 GFLOP/s, near the matmul peak) against 22-24 ms for torch's CPU flash
 * kernel; a 512-token chunk over 1024 cached tokens 41-48 ms against 60-72 ms for gather + masked SDPA.
 * The AVX-512 tiles on a 2-core Zen 5 EPYC: 512 fresh tokens 5.6 -> 3.4 ms a layer (bfloat16 pool),
 * 32 tokens over 1024 cached 1.8 -> 1.1 ms. The bfloat16 keys on a 2-core Zen 4 EPYC against those
 * tiles: 32 tokens over 1024 cached 2.5 -> 1.9 ms, 512 fresh 10.1 -> 7.7 ms, 512 over 1024 36 -> 29 ms.
 *
 * q: token t, head j at q[t * q_stride + j * D]; out: [T, H, D] contiguous, only the rows of the
 * sequences served are written; work: the floats paged_prefill_workspace() asks for, which also
 * checks the arguments.
 * Requires D % 8 == 0.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#define MR 6            /* rows of a register tile */
#define KP 16           /* keys of a packed K panel = columns of a register tile */
#define KT 64           /* keys per softmax tile (a multiple of KP); 96 and 128 measured the same */
#define ROWS 96         /* about this many rows (tokens x group) per work item: 48-128 measured within a few %,
                           96-128 a little ahead over a long cached context (more rows per packed key) */

static long round_up(long x, long m) { return (x + m - 1) / m * m; }

/* 2^x for x <= 0, relative error ~2e-7; inputs below -125 give ~2^-125 (callers mask what must be 0). */
static inline __m256 exp2_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-125.0f));
    __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(x, n);                       /* [-0.5, 0.5] */
    __m256 p = _mm256_set1_ps(EXP2_C5);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C4));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C3));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C2));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C1));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(EXP2_C0));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* lanes j with base + j < limit */
static inline __m256 lanes_below(long base, long limit) {
    __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)base), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)limit), idx));
}

/* s[r, 0..16) = sum_d qp[d, r] * kp[d, 0..16) for r < 6: qp is a [D][6] row panel, kp a [D][16] key panel */
static inline void tile_qk(const float* qp, const float* kp, long d, float* s, long lds) {
    __m256 c00 = _mm256_setzero_ps(), c01 = _mm256_setzero_ps(), c10 = _mm256_setzero_ps(), c11 = _mm256_setzero_ps();
    __m256 c20 = _mm256_setzero_ps(), c21 = _mm256_setzero_ps(), c30 = _mm256_setzero_ps(), c31 = _mm256_setzero_ps();
    __m256 c40 = _mm256_setzero_ps(), c41 = _mm256_setzero_ps(), c50 = _mm256_setzero_ps(), c51 = _mm256_setzero_ps();
    for (long i = 0; i < d; i++, qp += MR, kp += KP) {
        __m256 k0 = _mm256_loadu_ps(kp), k1 = _mm256_loadu_ps(kp + 8), a;
        a = _mm256_broadcast_ss(qp + 0); c00 = _mm256_fmadd_ps(a, k0, c00); c01 = _mm256_fmadd_ps(a, k1, c01);
        a = _mm256_broadcast_ss(qp + 1); c10 = _mm256_fmadd_ps(a, k0, c10); c11 = _mm256_fmadd_ps(a, k1, c11);
        a = _mm256_broadcast_ss(qp + 2); c20 = _mm256_fmadd_ps(a, k0, c20); c21 = _mm256_fmadd_ps(a, k1, c21);
        a = _mm256_broadcast_ss(qp + 3); c30 = _mm256_fmadd_ps(a, k0, c30); c31 = _mm256_fmadd_ps(a, k1, c31);
        a = _mm256_broadcast_ss(qp + 4); c40 = _mm256_fmadd_ps(a, k0, c40); c41 = _mm256_fmadd_ps(a, k1, c41);
        a = _mm256_broadcast_ss(qp + 5); c50 = _mm256_fmadd_ps(a, k0, c50); c51 = _mm256_fmadd_ps(a, k1, c51);
    }
    _mm256_storeu_ps(s + 0 * lds, c00); _mm256_storeu_ps(s + 0 * lds + 8, c01);
    _mm256_storeu_ps(s + 1 * lds, c10); _mm256_storeu_ps(s + 1 * lds + 8, c11);
    _mm256_storeu_ps(s + 2 * lds, c20); _mm256_storeu_ps(s + 2 * lds + 8, c21);
    _mm256_storeu_ps(s + 3 * lds, c30); _mm256_storeu_ps(s + 3 * lds + 8, c31);
    _mm256_storeu_ps(s + 4 * lds, c40); _mm256_storeu_ps(s + 4 * lds + 8, c41);
    _mm256_storeu_ps(s + 5 * lds, c50); _mm256_storeu_ps(s + 5 * lds + 8, c51);
}

/* o[r, 0..16) = alpha[r] * o[r, 0..16) + sum_{j<n} p[r, j] * v[j, 0..16) for r < 6 (named registers:
 * gcc spills an accumulator array to the stack on every step) */
static inline void tile_pv16(float* o, long ldo, const float* p, long ldp, const float* v, long ldv, long n,
                             const float* alpha) {
    __m256 a;
    a = _mm256_broadcast_ss(alpha + 0);
    __m256 c00 = _mm256_mul_ps(a, _mm256_loadu_ps(o + 0 * ldo)), c01 = _mm256_mul_ps(a, _mm256_loadu_ps(o + 0 * ldo + 8));
    a = _mm256_broadcast_ss(alpha + 1);
    __m256 c10 = _mm256_mul_ps(a, _mm256_loadu_ps(o + 1 * ldo)), c11 = _mm256_mul_ps(a, _mm256_loadu_ps(o + 1 * ldo + 8));
    a = _mm256_broadcast_ss(alpha + 2);
    __m256 c20 = _mm256_mul_ps(a, _mm256_loadu_ps(o + 2 * ldo)), c21 = _mm256_mul_ps(a, _mm256_loadu_ps(o + 2 * ldo + 8));
    a = _mm256_broadcast_ss(alpha + 3);
    __m256 c30 = _mm256_mul_ps(a, _mm256_loadu_ps(o + 3 * ldo)), c31 = _mm256_mul_ps(a, _mm256_loadu_ps(o + 3 * ldo + 8));
    a = _mm256_broadcast_ss(alpha + 4);
    __m256 c40 = _mm256_mul_ps(a, _mm256_loadu_ps(o + 4 * ldo)), c41 = _mm256_mul_ps(a, _mm256_loadu_ps(o + 4 * ldo + 8));
    a = _mm256_broadcast_ss(alpha + 5);
    __m256 c50 = _mm256_mul_ps(a, _mm256_loadu_ps(o + 5 * ldo)), c51 = _mm256_mul_ps(a, _mm256_loadu_ps(o + 5 * ldo + 8));
    const float *p0 = p, *p1 = p + ldp, *p2 = p + 2 * ldp, *p3 = p + 3 * ldp, *p4 = p + 4 * ldp, *p5 = p + 5 * ldp;
    for (long j = 0; j < n; j++, v += ldv) {
        __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        a = _mm256_broadcast_ss(p0 + j); c00 = _mm256_fmadd_ps(a, v0, c00); c01 = _mm256_fmadd_ps(a, v1, c01);
        a = _mm256_broadcast_ss(p1 + j); c10 = _mm256_fmadd_ps(a, v0, c10); c11 = _mm256_fmadd_ps(a, v1, c11);
        a = _mm256_broadcast_ss(p2 + j); c20 = _mm256_fmadd_ps(a, v0, c20); c21 = _mm256_fmadd_ps(a, v1, c21);
        a = _mm256_broadcast_ss(p3 + j); c30 = _mm256_fmadd_ps(a, v0, c30); c31 = _mm256_fmadd_ps(a, v1, c31);
        a = _mm256_broadcast_ss(p4 + j); c40 = _mm256_fmadd_ps(a, v0, c40); c41 = _mm256_fmadd_ps(a, v1, c41);
        a = _mm256_broadcast_ss(p5 + j); c50 = _mm256_fmadd_ps(a, v0, c50); c51 = _mm256_fmadd_ps(a, v1, c51);
    }
    _mm256_storeu_ps(o + 0 * ldo, c00); _mm256_storeu_ps(o + 0 * ldo + 8, c01);
    _mm256_storeu_ps(o + 1 * ldo, c10); _mm256_storeu_ps(o + 1 * ldo + 8, c11);
    _mm256_storeu_ps(o + 2 * ldo, c20); _mm256_storeu_ps(o + 2 * ldo + 8, c21);
    _mm256_storeu_ps(o + 3 * ldo, c30); _mm256_storeu_ps(o + 3 * ldo + 8, c31);
    _mm256_storeu_ps(o + 4 * ldo, c40); _mm256_storeu_ps(o + 4 * ldo + 8, c41);
    _mm256_storeu_ps(o + 5 * ldo, c50); _mm256_storeu_ps(o + 5 * ldo + 8, c51);
}

/* the same over 8 columns, for the last columns when D % 16 == 8 */
static inline void tile_pv8(float* o, long ldo, const float* p, long ldp, const float* v, long ldv, long n,
                            const float* alpha) {
    __m256 c0 = _mm256_mul_ps(_mm256_broadcast_ss(alpha + 0), _mm256_loadu_ps(o + 0 * ldo));
    __m256 c1 = _mm256_mul_ps(_mm256_broadcast_ss(alpha + 1), _mm256_loadu_ps(o + 1 * ldo));
    __m256 c2 = _mm256_mul_ps(_mm256_broadcast_ss(alpha + 2), _mm256_loadu_ps(o + 2 * ldo));
    __m256 c3 = _mm256_mul_ps(_mm256_broadcast_ss(alpha + 3), _mm256_loadu_ps(o + 3 * ldo));
    __m256 c4 = _mm256_mul_ps(_mm256_broadcast_ss(alpha + 4), _mm256_loadu_ps(o + 4 * ldo));
    __m256 c5 = _mm256_mul_ps(_mm256_broadcast_ss(alpha + 5), _mm256_loadu_ps(o + 5 * ldo));
    for (long j = 0; j < n; j++, v += ldv) {
        __m256 v0 = _mm256_loadu_ps(v);
        c0 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + 0 * ldp + j), v0, c0);
        c1 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + 1 * ldp + j), v0, c1);
        c2 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + 2 * ldp + j), v0, c2);
        c3 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + 3 * ldp + j), v0, c3);
        c4 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + 4 * ldp + j), v0, c4);
        c5 = _mm256_fmadd_ps(_mm256_broadcast_ss(p + 5 * ldp + j), v0, c5);
    }
    _mm256_storeu_ps(o + 0 * ldo, c0); _mm256_storeu_ps(o + 1 * ldo, c1); _mm256_storeu_ps(o + 2 * ldo, c2);
    _mm256_storeu_ps(o + 3 * ldo, c3); _mm256_storeu_ps(o + 4 * ldo, c4); _mm256_storeu_ps(o + 5 * ldo, c5);
}

/* The AVX-512 tiles, for CPUs that run them: the same products as tile_qk / tile_pv16 over twice the
 * keys (two 16-key panels) or columns (two 16-column V slabs) per register tile, 12 accumulators of 16
 * lanes. Every lane goes through the same fused multiply-adds in the same order as in the AVX2 tiles,
 * so both bodies give the same bits (tests hold them to it), and chunking still changes nothing. */

/* s[r, 0..16 np) = sum_d qp[d, r] * panel_i[d, 0..16) for r < 6 over np = 1 or 2 consecutive K panels */
AVX512_TARGET static ALWAYS_INLINE void tile_qk512(const float* qp, const float* kp, long d, float* s, long lds,
                                                  const int np) {
    __m512 c[MR][2];
    for (int r = 0; r < MR; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
    const float* kp1 = kp + KP * d;
    for (long i = 0; i < d; i++, qp += MR) {
        __m512 k0 = _mm512_loadu_ps(kp + i * KP), k1 = np == 2 ? _mm512_loadu_ps(kp1 + i * KP) : k0;
        for (int r = 0; r < MR; r++) {
            __m512 a = _mm512_set1_ps(qp[r]);
            c[r][0] = _mm512_fmadd_ps(a, k0, c[r][0]);
            if (np == 2) c[r][1] = _mm512_fmadd_ps(a, k1, c[r][1]);
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm512_storeu_ps(s + r * lds, c[r][0]);
        if (np == 2) _mm512_storeu_ps(s + r * lds + KP, c[r][1]);
    }
}

/* o[r, 0..16 ns) = alpha[r] * o[r, ..] + sum_{j<n} p[r, j] * slab_i[j, 0..16) for r < 6 over ns = 1 or 2
 * V slabs (16 floats a key) */
AVX512_TARGET static ALWAYS_INLINE void tile_pv512(float* o, long ldo, const float* p, long ldp, const float* v0,
                                                  const float* v1, long n, const float* alpha, const int ns) {
    __m512 c[MR][2];
    for (int r = 0; r < MR; r++) {
        __m512 a = _mm512_set1_ps(alpha[r]);
        c[r][0] = _mm512_mul_ps(a, _mm512_loadu_ps(o + r * ldo));
        c[r][1] = ns == 2 ? _mm512_mul_ps(a, _mm512_loadu_ps(o + r * ldo + 16)) : c[r][0];
    }
    for (long j = 0; j < n; j++) {
        __m512 x0 = _mm512_loadu_ps(v0 + j * 16), x1 = ns == 2 ? _mm512_loadu_ps(v1 + j * 16) : x0;
        for (int r = 0; r < MR; r++) {
            __m512 a = _mm512_set1_ps(p[r * ldp + j]);
            c[r][0] = _mm512_fmadd_ps(a, x0, c[r][0]);
            if (ns == 2) c[r][1] = _mm512_fmadd_ps(a, x1, c[r][1]);
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm512_storeu_ps(o + r * ldo, c[r][0]);
        if (ns == 2) _mm512_storeu_ps(o + r * ldo + 16, c[r][1]);
    }
}

/* One row of a tile: scores s[0..valid) (log2 domain) update the running max m and sum l, become
 * probabilities, and s[valid..cols) become 0; returns the factor the row's output must be scaled by. */
static inline float softmax_row(float* s, long valid, long cols, float* m, float* l) {
    if (valid <= 0) {
        for (long j = 0; j < cols; j += 8) _mm256_storeu_ps(s + j, _mm256_setzero_ps());
        return 1.0f;
    }
    __m256 top = _mm256_set1_ps(-INFINITY);
    long j = 0;
    for (; j + 8 <= valid; j += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
    if (j < valid)
        top = _mm256_max_ps(top, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(s + j),
                                                  lanes_below(j, valid)));
    float m_new = hmax(top);
    if (*m > m_new) m_new = *m;
    float alpha = exp2f(*m - m_new);                       /* 0 on a row's first tile (m = -inf) */
    __m256 mx = _mm256_set1_ps(m_new), sum = _mm256_setzero_ps();
    for (j = 0; j < cols; j += 8) {
        __m256 e = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), mx));
        if (j + 8 > valid) e = _mm256_and_ps(e, lanes_below(j, valid));
        sum = _mm256_add_ps(sum, e);
        _mm256_storeu_ps(s + j, e);
    }
    *l = *l * alpha + hsum(sum);
    *m = m_new;
    return alpha;
}

/* r[i][j] <- r[j][i] for an 8 x 8 block held in registers */
static inline void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    /* u_i: column i of rows 0-3 in the low lane, column i + 4 in the high lane; w_i the same for rows 4-7 */
    __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 w0 = _mm256_shuffle_ps(t4, t6, 0x44), w1 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 w2 = _mm256_shuffle_ps(t5, t7, 0x44), w3 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, w0, 0x20); r[1] = _mm256_permute2f128_ps(u1, w1, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, w2, 0x20); r[3] = _mm256_permute2f128_ps(u3, w3, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, w0, 0x31); r[5] = _mm256_permute2f128_ps(u1, w1, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, w2, 0x31); r[7] = _mm256_permute2f128_ps(u3, w3, 0x31);
}

/* floats col..col+8 of n <= 8 rows (NULL: zeros, as are rows n..8) transposed into dst[i * ldd + 0..8) */
static inline void gather_transposed(const float* const* rows, int n, long col, __m256 scale, float* dst, long ldd) {
    __m256 r[8];
    for (int i = 0; i < 8; i++)
        r[i] = i < n && rows[i] ? _mm256_mul_ps(scale, _mm256_loadu_ps(rows[i] + col)) : _mm256_setzero_ps();
    transpose8(r);
    /* in order: with ldd < 8 (a 6-row Q panel) each store overwrites the zeros the previous one left */
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + i * ldd, r[i]);
}

/* 8 pool elements from element `at` on, widened to float: the pool holds float32 or, with bf16 set,
 * bfloat16 (whose bits are a float's upper half); everything after packing is float32 either way */
static inline __m256 pool_load8(const void* pool, int bf16, long at) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i*)((const unsigned short*)pool + at));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float*)pool + at);
}

/* elements col..col+8 of the 8 pool rows starting at elements at[0..8) (negative: zeros) transposed
 * into dst[i * ldd + 0..8) */
static inline void gather_transposed_pool(const void* pool, int bf16, const long* at, long col, float* dst,
                                          long ldd) {
    __m256 r[8];
    for (int i = 0; i < 8; i++) r[i] = at[i] >= 0 ? pool_load8(pool, bf16, at[i] + col) : _mm256_setzero_ps();
    transpose8(r);
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(dst + i * ldd, r[i]);
}

/* The bfloat16 dot-product body (a bfloat16 pool, CPUs with avx512_bf16): keys stay bfloat16, packed
 * as pairs of neighbouring dimensions, one 32-bit word a pair ([D/2][16] words a panel: half the bytes
 * of a widened panel, and no widening), and S = Q K^T runs on vdpbf16ps, each lane summing the exact
 * products of two dimensions into float32. Queries arrive widened from bfloat16, so their pairs are
 * exact too; the scores are scaled after the products instead of the queries before. Everything past
 * the scores (softmax, P V) is the float32 path's: rounding the probabilities to bfloat16 for P V
 * (1.25-1.35x faster again) moved a greedy token when a preempted sequence recomputed, in a prefill, the
 * K/V its decode steps had made. Head dims of whole 16-element rows (every model's) take it. */

/* The 16 K rows of a panel (at[j]: where key j's row starts, negative past the sequence) as word pairs,
 * transposed into kt [D/2][16]: the 8 x 8 float transpose moves 32-bit words, here pairs of bfloat16 */
static void pack_keys_bf16(const void* pool, const long* at, long d, float* kt) {
    const unsigned short* pk = (const unsigned short*)pool;
    for (long e = 0; e < d; e += 16)
        for (int half = 0; half < 2; half++) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) {
                const long row = at[half * 8 + i];
                r[i] = row >= 0 ? _mm256_loadu_ps((const float*)(pk + row + e)) : _mm256_setzero_ps();
            }
            transpose8(r);
            for (int w = 0; w < 8; w++) _mm256_storeu_ps(kt + (e / 2 + w) * KP + half * 8, r[w]);
        }
}

/* Word i of query row r holds its dimensions 2i (low half) and 2i + 1 (high half): the top halves of
 * the float32 values, which are bfloat16 values widened. Rows without a source are zeros. */
static void pack_queries_bf16(const float* const* rows, long d, unsigned* qw) {
    for (long i = 0; i < d / 2; i++)
        for (int r = 0; r < MR; r++) {
            unsigned lo = 0, hi = 0;
            if (rows[r]) {
                memcpy(&lo, rows[r] + 2 * i, 4);
                memcpy(&hi, rows[r] + 2 * i + 1, 4);
            }
            qw[i * MR + r] = (hi & 0xFFFF0000u) | (lo >> 16);
        }
}

/* s[r, 0..16 np) = qscale * sum_i qw[i, r] . panel_j[i, 0..16) over np = 1 or 2 consecutive word panels */
AVX512_BF16_TARGET static ALWAYS_INLINE void tile_qk512_bf16(const unsigned* qw, const float* kp, long d, float* s,
                                                            long lds, __m512 qscale, const int np) {
    __m512 c[MR][2];
    for (int r = 0; r < MR; r++) c[r][0] = c[r][1] = _mm512_setzero_ps();
    const float* kp1 = kp + KP * d / 2;
    for (long i = 0; i < d / 2; i++, qw += MR) {
        __m512bh k0 = (__m512bh)_mm512_loadu_ps(kp + i * KP);
        __m512bh k1 = np == 2 ? (__m512bh)_mm512_loadu_ps(kp1 + i * KP) : k0;
        for (int r = 0; r < MR; r++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)qw[r]);
            c[r][0] = _mm512_dpbf16_ps(c[r][0], a, k0);
            if (np == 2) c[r][1] = _mm512_dpbf16_ps(c[r][1], a, k1);
        }
    }
    for (int r = 0; r < MR; r++) {
        _mm512_storeu_ps(s + r * lds, _mm512_mul_ps(qscale, c[r][0]));
        if (np == 2) _mm512_storeu_ps(s + r * lds + KP, _mm512_mul_ps(qscale, c[r][1]));
    }
}

AVX512_BF16_TARGET static void scores512_bf16(const unsigned* qw, const float* kt, long d, float* s, const long* vis,
                                              long panels, float qscale) {
    const __m512 qs = _mm512_set1_ps(qscale);
    for (long kk = 0; kk * KP < KT; kk += 2)
        for (long p = 0; p < panels; p++) {
            float* sp = s + p * MR * KT + kk * KP;
            const unsigned* q = qw + p * MR * (d / 2);
            if (vis[p] > (kk + 1) * KP) tile_qk512_bf16(q, kt + kk * KP * d / 2, d, sp, KT, qs, 2);
            else if (vis[p] > kk * KP) tile_qk512_bf16(q, kt + kk * KP * d / 2, d, sp, KT, qs, 1);
        }
}

/* One panel of 16 keys, the first being key `first`, out of the pool: K rows (at[j]: the element
 * where key j's row starts, negative past the sequence; V rows lie v_offset elements after them)
 * into the transposed panel kt [D][16] (with key_words, bfloat16 word pairs [D/2][16]), V into the
 * column slabs of vr: slab c holds `keys` rows of w = min(16, D - c) floats from vr + c * keys on. */
static void pack_panel(const void* pool, int bf16, int key_words, const long* at, long v_offset, long d, float* kt,
                       float* vr, long keys, long first) {
    if (key_words)
        pack_keys_bf16(pool, at, d, kt);
    else
        for (long e = 0; e < d; e += 8) {
            gather_transposed_pool(pool, bf16, at, e, kt + e * KP, KP);
            gather_transposed_pool(pool, bf16, at + 8, e, kt + e * KP + 8, KP);
        }
    for (long jj = 0; jj < KP; jj++) {
        const long v = at[jj] >= 0 ? at[jj] + v_offset : -1;
        long c = 0;
        for (; c + 16 <= d; c += 16) {
            float* dst = vr + c * keys + (first + jj) * 16;
            _mm256_storeu_ps(dst, v >= 0 ? pool_load8(pool, bf16, v + c) : _mm256_setzero_ps());
            _mm256_storeu_ps(dst + 8, v >= 0 ? pool_load8(pool, bf16, v + c + 8) : _mm256_setzero_ps());
        }
        if (c < d)
            _mm256_storeu_ps(vr + c * keys + (first + jj) * 8, v >= 0 ? pool_load8(pool, bf16, v + c) : _mm256_setzero_ps());
    }
}

/* One tile's S = Q K^T: for each 6-row panel p of Q (qp, [D][6] each), the 16-key panels from kt on
 * (K^T panels [D][16], consecutive) that its rows see (vis[p] keys) into s (rows KT apart). */
static void scores(const float* qp, const float* kt, long d, float* s, const long* vis, long panels) {
    for (long kk = 0; kk * KP < KT; kk++)
        for (long p = 0; p < panels; p++)
            if (vis[p] > kk * KP) tile_qk(qp + p * MR * d, kt + kk * KP * d, d, s + p * MR * KT + kk * KP, KT);
}

AVX512_TARGET static void scores512(const float* qp, const float* kt, long d, float* s, const long* vis,
                                    long panels) {
    for (long kk = 0; kk * KP < KT; kk += 2)
        for (long p = 0; p < panels; p++) {
            float* sp = s + p * MR * KT + kk * KP;
            if (vis[p] > (kk + 1) * KP) tile_qk512(qp + p * MR * d, kt + kk * KP * d, d, sp, KT, 2);
            else if (vis[p] > kk * KP) tile_qk512(qp + p * MR * d, kt + kk * KP * d, d, sp, KT, 1);
        }
}

/* One tile's O = alpha O + P V for every row panel that sees a key of it: V in column slabs of 16
 * (slab c holds `keys` rows of 16 floats from vr + c * keys; the last 8 columns where D % 16 == 8). */
static void values(float* o, long d, const float* s, const float* vr, long keys, long k0, const long* vis,
                   const float* alpha, long panels) {
    long c = 0;
    for (; c + 16 <= d; c += 16)
        for (long p = 0; p < panels; p++)
            if (vis[p]) tile_pv16(o + p * MR * d + c, d, s + p * MR * KT, KT, vr + c * keys + k0 * 16, 16, vis[p],
                                  alpha + p * MR);
    if (c < d)
        for (long p = 0; p < panels; p++)
            if (vis[p]) tile_pv8(o + p * MR * d + c, d, s + p * MR * KT, KT, vr + c * keys + k0 * 8, 8, vis[p],
                                 alpha + p * MR);
}

AVX512_TARGET static void values512(float* o, long d, const float* s, const float* vr, long keys, long k0,
                                    const long* vis, const float* alpha, long panels) {
    long c = 0;
    for (; c + 32 <= d; c += 32)
        for (long p = 0; p < panels; p++)
            if (vis[p]) tile_pv512(o + p * MR * d + c, d, s + p * MR * KT, KT, vr + c * keys + k0 * 16,
                                   vr + (c + 16) * keys + k0 * 16, vis[p], alpha + p * MR, 2);
    if (c + 16 <= d) {
        for (long p = 0; p < panels; p++)
            if (vis[p]) tile_pv512(o + p * MR * d + c, d, s + p * MR * KT, KT, vr + c * keys + k0 * 16, NULL, vis[p],
                                   alpha + p * MR, 1);
        c += 16;
    }
    if (c < d)
        for (long p = 0; p < panels; p++)
            if (vis[p]) tile_pv8(o + p * MR * d + c, d, s + p * MR * KT, KT, vr + c * keys + k0 * 8, 8, vis[p],
                                 alpha + p * MR);
}

typedef struct {
    long b, h, t0, nt;  /* sequence, KV head, first query token of the block and its count */
    long cost;          /* query-key pairs visible, for ordering */
} Item;

static int by_cost_desc(const void* x, const void* y) {
    long a = ((const Item*)x)->cost, c = ((const Item*)y)->cost;
    return (a < c) - (a > c);
}

/* sequence b has queries and at least min_qlen of them */
static int served(const long* starts, long b, long min_qlen) {
    long n = starts[b + 1] - starts[b];
    return n > 0 && n >= min_qlen;
}

/* Floats of `work` a call needs (per served sequence and KV head: its keys rounded up to 16, K and V),
 * or, for arguments the kernel must not run on: -1 starts that fall or leave the `tokens` rows of q,
 * -2 a sequence with more queries than positions, -3 a length past the `capacity` of its block table. */
long paged_prefill_workspace(const long* seq_lens, const long* starts, long batch, long kv_heads, long head_dim,
                             long min_qlen, long tokens, long capacity) {
    long total = 0;
    if (batch > 0 && (starts[0] < 0 || starts[batch] > tokens)) return -1;
    for (long b = 0; b < batch; b++) {
        if (starts[b + 1] < starts[b]) return -1;
        if (starts[b + 1] - starts[b] > seq_lens[b]) return -2;
        if (seq_lens[b] > capacity) return -3;
        if (served(starts, b, min_qlen)) total += 2 * kv_heads * round_up(seq_lens[b], KP) * head_dim;
    }
    return total;
}

/* Sequences whose block tables begin with the same blocks (a shared prefix, the documents and system
 * prompts prefix caching exists for) read the same keys: each such key is packed once. leader[b] is the
 * first served sequence starting on b's first block (-1 when that is b itself, or b is not served), and
 * shared[b] how many of b's leading keys it reads from the leader's packing: the positions both hold
 * in the same blocks, rounded down to whole softmax tiles so that no tile mixes the two packings. */
static void find_shared_keys(const long* tables, const long* seq_lens, const long* starts, long batch,
                             long block_size, long table_width, long min_qlen, long* leader, long* shared) {
    for (long b = 0; b < batch; b++) {
        leader[b] = -1;
        shared[b] = 0;
        if (!served(starts, b, min_qlen) || seq_lens[b] <= 0) continue;
        for (long a = 0; a < b; a++) {
            if (leader[a] != -1 || !served(starts, a, min_qlen) || seq_lens[a] <= 0
                || tables[a * table_width] != tables[b * table_width])
                continue;
            long len = seq_lens[a] < seq_lens[b] ? seq_lens[a] : seq_lens[b];
            long blocks = (len + block_size - 1) / block_size, same = 0;
            while (same < blocks && tables[a * table_width + same] == tables[b * table_width + same]) same++;
            long keys = same * block_size < len ? same * block_size : len;
            keys = keys / KT * KT;
            if (keys > 0) { leader[b] = a; shared[b] = keys; }
            break;
        }
    }
}

/* query tokens per work item: about ROWS rows, a whole number of 6-row panels where the group allows,
 * and small enough to give every thread several items */
static long block_tokens(long group, long work_tokens_heads, int threads) {
    long rows = ROWS;
    for (long r = ROWS; r <= ROWS + 48; r++)
        if (r % MR == 0 && r % group == 0) { rows = r; break; }
    long nt = rows / group > 0 ? rows / group : 1;
    /* at least ~4 items per thread where the work allows, down to 2 panels' worth of rows */
    while (nt > 1 && nt * group > 2 * MR && (work_tokens_heads + nt - 1) / nt < 4L * threads) nt = (nt + 1) / 2;
    return nt;
}

void paged_prefill_attention(const float* q, long q_stride, const void* pool, int pool_bf16, const long* tables,
                             const long* seq_lens, const long* starts, long batch, long heads,
                             long kv_heads, long head_dim, long num_blocks, long block_size, long table_width,
                             long min_qlen, float scale, float* out, float* work, int body, int threads) {
    const long d = head_dim, group = heads / kv_heads;
    /* body: 0 the AVX2 tiles, 1 the AVX-512 tiles, 2 those with a bfloat16 pool's keys in word pairs */
    /* a bfloat16 pool's keys in word pairs (head dims of whole 16-element rows: every model's) */
    const int avx512 = body >= 1, key_words = body == 2 && pool_bf16 && d % 16 == 0;
    const long kstride = key_words ? KP * d / 2 : KP * d;     /* floats from one K panel to the next */
    const long token_stride = kv_heads * d;
    const long block_stride = block_size * token_stride;

    /* where each served sequence's packed keys start in `work` */
    long* offset = malloc(sizeof(long) * (4 * batch + 1));
    long* qlens = offset + batch + 1;
    long* leader = qlens + batch;
    long* shared = leader + batch;
    for (long b = 0; b < batch; b++) qlens[b] = starts[b + 1] - starts[b];
    find_shared_keys(tables, seq_lens, starts, batch, block_size, table_width, min_qlen, leader, shared);
    long tokens_heads = 0, panels_total = 0;
    offset[0] = 0;
    for (long b = 0; b < batch; b++) {
        long keys = served(starts, b, min_qlen) ? round_up(seq_lens[b], KP) : 0;
        offset[b + 1] = offset[b] + 2 * kv_heads * keys * d;
        if (keys) { tokens_heads += qlens[b] * kv_heads; panels_total += kv_heads * keys / KP; }
    }
    const long nt_max = block_tokens(group, tokens_heads, threads);
    long items_total = 0;
    for (long b = 0; b < batch; b++)
        if (served(starts, b, min_qlen)) items_total += kv_heads * ((qlens[b] + nt_max - 1) / nt_max);
    Item* items = malloc(sizeof(Item) * (items_total > 0 ? items_total : 1));
    long n_items = 0;
    for (long b = 0; b < batch; b++) {
        if (!served(starts, b, min_qlen)) continue;
        long ctx = seq_lens[b] - qlens[b];
        for (long t0 = 0; t0 < qlens[b]; t0 += nt_max) {
            long nt = qlens[b] - t0 < nt_max ? qlens[b] - t0 : nt_max;
            for (long h = 0; h < kv_heads; h++)
                items[n_items++] = (Item){b, h, t0, nt, nt * (ctx + t0 + nt)};
        }
    }
    qsort(items, n_items, sizeof(Item), by_cost_desc);
    const float qscale = scale * 1.44269504088896341f;     /* scores in base 2 */
    const __m256 qs = _mm256_set1_ps(qscale);

    #pragma omp parallel num_threads(threads)
    {
        /* phase 1: (sequence, panel of 16 keys, head) -> K^T panel and 16 V rows; the heads of a panel are
         * neighbours in the pool, so a thread's run of tasks reads whole token rows (2x faster than by head) */
        #pragma omp for schedule(dynamic, 64)
        for (long task = 0; task < panels_total; task++) {
            /* a sequence's tasks are its share of `work`, 2 * D * 16 floats each: find the one holding this */
            long at = task * 2 * d * KP, b = 0, hi = batch;      /* offset[b] <= at < offset[hi] */
            while (hi - b > 1) {
                long mid = (b + hi) / 2;
                if (offset[mid] <= at) b = mid; else hi = mid;
            }
            long rest = (at - offset[b]) / (2 * d * KP);
            long npan = round_up(seq_lens[b], KP) / KP, pan = rest / kv_heads, h = rest % kv_heads;
            if (pan * KP < shared[b]) continue;         /* its leader packs these keys */
            float* kt = work + offset[b] + h * 2 * npan * KP * d;
            long rows[KP];                /* where the panel's K rows start in the pool, -1 past the sequence */
            for (long jj = 0; jj < KP; jj++) {
                long j = pan * KP + jj;
                long slot = j < seq_lens[b] ? tables[b * table_width + j / block_size] * block_size + j % block_size : 0;
                rows[jj] = j < seq_lens[b] ? slot * token_stride + h * d : -1;
            }
            /* the V pool follows the K pool */
            pack_panel(pool, pool_bf16, key_words, rows, num_blocks * block_stride, d, kt + pan * kstride, kt + npan * KP * d,
                       npan * KP, pan * KP);
        }
        /* the barrier closing the loop above: every panel is packed before any item reads one */

        const long rows_max = round_up(nt_max * group, MR);
        /* Q panels (+ 2 floats the last 8-wide store of a 6-row panel spills), O, S, running max and sum */
        float* qp = malloc(sizeof(float) * (rows_max * d * 2 + 8 + rows_max * KT + rows_max * 3));
        float* o = qp + rows_max * d + 8;
        float* s = o + rows_max * d;
        float* m = s + rows_max * KT;
        float* l = m + rows_max;
        float* alpha = l + rows_max;
        long* pos = malloc(sizeof(long) * rows_max * 2);
        unsigned* qw = key_words ? malloc(sizeof(unsigned) * rows_max * d / 2) : NULL;   /* Q panels in word pairs */
        long* vis = pos + rows_max;

        /* phase 2: work items */
        #pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < n_items; it++) {
            const Item w = items[it];
            const long len = seq_lens[w.b], ctx = len - qlens[w.b];
            const long npan = round_up(len, KP) / KP;
            const float* kt = work + offset[w.b] + w.h * 2 * npan * KP * d;
            const float* vr = kt + npan * KP * d;
            /* the keys before shared[b] are read where the sequence's leader packed them */
            const long lead = leader[w.b], lead_pan = lead >= 0 ? round_up(seq_lens[lead], KP) / KP : 0;
            const float* lead_kt = lead >= 0 ? work + offset[lead] + w.h * 2 * lead_pan * KP * d : kt;
            const float* lead_vr = lead_kt + lead_pan * KP * d;
            const long rows = w.nt * group, panels = (rows + MR - 1) / MR;
            const long first = starts[w.b] + w.t0;

            /* Q panels [D][6], scaled; rows past the item's are zeros at its last token's position */
            for (long p = 0; p < panels; p++) {
                const float* src[MR];
                for (long r = p * MR; r < p * MR + MR; r++) {
                    long t = r < rows ? r / group : w.nt - 1;
                    src[r - p * MR] = r < rows ? q + (first + t) * q_stride + (w.h * group + r % group) * d : NULL;
                    pos[r] = ctx + w.t0 + t;
                    m[r] = -INFINITY;
                    l[r] = 0.0f;
                }
                if (key_words)
                    pack_queries_bf16(src, d, qw + p * MR * (d / 2));
                else
                    for (long e = 0; e < d; e += 8) gather_transposed(src, MR, e, qs, qp + p * MR * d + e * MR, MR);
            }
            memset(o, 0, sizeof(float) * panels * MR * d);

            const long last = ctx + w.t0 + w.nt - 1;             /* the block's furthest position */
            for (long k0 = 0; k0 <= last; k0 += KT) {
                /* keys of the tile each panel sees: its last row's (rows are token-major) */
                for (long p = 0; p < panels; p++) {
                    long n = pos[p * MR + MR - 1] - k0 + 1;
                    vis[p] = n <= 0 ? 0 : n > KT ? KT : n;
                }
                /* S = Q K^T, only the 16-key panels at or below each row panel's diagonal */
                const int led = k0 < shared[w.b];
                const float* kpan = (led ? lead_kt : kt) + (k0 / KP) * kstride;
                if (key_words)
                    scores512_bf16(qw, kpan, d, s, vis, panels, qscale);
                else
                    (avx512 ? scores512 : scores)(qp, kpan, d, s, vis, panels);
                for (long p = 0; p < panels; p++) {
                    if (!vis[p]) continue;
                    long cols = round_up(vis[p], 8);
                    for (long r = p * MR; r < p * MR + MR; r++) {
                        long valid = pos[r] - k0 + 1;
                        valid = valid <= 0 ? 0 : valid > KT ? KT : valid;
                        alpha[r] = softmax_row(s + r * KT, valid, cols, m + r, l + r);
                    }
                }
                /* O = alpha O + P V, a slab of V at a time across the row panels */
                (avx512 ? values512 : values)(o, d, s, led ? lead_vr : vr, (led ? lead_pan : npan) * KP, k0, vis,
                                              alpha, panels);
            }

            for (long r = 0; r < rows; r++) {
                long t = r / group, g = r % group;
                float* dst = out + ((first + t) * heads + w.h * group + g) * d;
                __m256 inv = _mm256_set1_ps(1.0f / l[r]);
                for (long e = 0; e < d; e += 8)
                    _mm256_storeu_ps(dst + e, _mm256_mul_ps(inv, _mm256_loadu_ps(o + r * d + e)));
            }
        }
        free(qw);
        free(pos);
        free(qp);
    }
    free(items);
    free(offset);
}
