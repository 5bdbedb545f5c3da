/* The tiles both attention kernels are built from: Q K^T over packed 16-key panels, the online softmax
 * of a 64-key tile in base 2, and O = alpha O + P V over 16-column V slabs, in AVX2 (8 lanes), AVX-512
 * (16 lanes, the same bits) and, for a bfloat16 pool, vdpbf16ps word pairs (keys in pairs of dimensions,
 * probabilities and values in pairs of keys).
 *
 * One set of tiles for prefill and decode is what makes a token's attention output the same bits
 * whichever kernel computes it: with prefix caching a prompt's last uncached token may run alone
 * (decode) where without caching it ran in a chunk (prefill), and a later turn's prompt reuses K/V
 * that decode steps wrote. A query row's result depends only on its scaled query, its keys and
 * values, and where the 64-key softmax tiles start (key 0 of the sequence, and every KT keys on):
 * each score lane is one chain of fused multiply-adds over the head dimension, each tile updates
 * the running max and sum the same way, each output lane one chain over the tile's keys.
 */
#ifndef PREFIXSERVE_ATTENTION_TILES_H
#define PREFIXSERVE_ATTENTION_TILES_H

#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "simd.h"

#define MR 6            /* rows of a register tile */
#define KP 16           /* keys of a packed K panel = columns of a register tile */
#define KT 64           /* keys per softmax tile (a multiple of KP); 96 and 128 measured the same */

static long round_up(long x, long m) { return (x + m - 1) / m * m; }

/* Of the (at most 4) 16-key panels from panel kk on, how many hold a key of the `vis` a row panel sees:
 * panels above a row panel's diagonal, or past the sequence, are never read. */
static inline int panels_seen(long vis, long kk) {
    long n = (vis - kk * KP + KP - 1) / KP;
    return n <= 0 ? 0 : n > 4 ? 4 : (int)n;
}

/* 2^x for x <= 0, relative error ~2e-7; inputs below -125 give ~2^-125 (callers mask what must be 0).
 * Defined once over the vector width (W: the intrinsics' prefix, BITS: the register width, ROUND: the
 * round-to-integer intrinsic), so exp2_ps (8 lanes) and exp2_512 (16) run the same operations on each
 * lane: the softmax gives the same bits in both bodies. */
#define DEFINE_EXP2(NAME, W, BITS, ROUND, ...)                                                             \
__VA_ARGS__ static ALWAYS_INLINE __m##BITS NAME(__m##BITS x) {                                            \
    x = W##_max_ps(x, W##_set1_ps(-125.0f));                                                               \
    __m##BITS n = ROUND(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                 \
    __m##BITS f = W##_sub_ps(x, n);                       /* [-0.5, 0.5] */                                \
    __m##BITS p = W##_set1_ps(EXP2_C5);                                                                    \
    p = W##_fmadd_ps(p, f, W##_set1_ps(EXP2_C4));                                                          \
    p = W##_fmadd_ps(p, f, W##_set1_ps(EXP2_C3));                                                          \
    p = W##_fmadd_ps(p, f, W##_set1_ps(EXP2_C2));                                                          \
    p = W##_fmadd_ps(p, f, W##_set1_ps(EXP2_C1));                                                          \
    p = W##_fmadd_ps(p, f, W##_set1_ps(EXP2_C0));                                                          \
    __m##BITS##i e = W##_slli_epi32(W##_add_epi32(W##_cvtps_epi32(n), W##_set1_epi32(127)), 23);           \
    return W##_mul_ps(p, W##_castsi##BITS##_ps(e));                                                        \
}
DEFINE_EXP2(exp2_ps, _mm256, 256, _mm256_round_ps)
DEFINE_EXP2(exp2_512, _mm512, 512, _mm512_roundscale_ps, AVX512_TARGET)

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

/* The AVX-512 tiles, for CPUs that run them: the same products as tile_qk / tile_pv16 over up to four
 * times the keys (a whole 64-key tile: four 16-key panels) or columns (four 16-column V slabs) per
 * register tile, 24 accumulators of 16 lanes, so each K or V load feeds six multiply-adds and each
 * broadcast up to four (against two of each with 12 accumulators: 1.02-1.11x for prefill attention,
 * 32-512 tokens over 0-2048 cached, bfloat16 pool, Zen 5 EPYC, 2 threads). Every lane goes through the
 * same fused multiply-adds in the same order as in the AVX2 tiles, so both bodies give the same bits
 * (tests hold them to it), and neither the tile width nor chunking changes anything. */

/* s[r, 0..16 np) = sum_d qp[d, r] * panel_j[d, 0..16) for r < nr over np = 1-4 K panels (kp[j]: where panel j
 * starts, packed or in a pool of panels; a whole 64-key tile in 24 accumulators: every K load feeds nr
 * multiply-adds and every broadcast np) */
AVX512_TARGET static ALWAYS_INLINE void tile_qk512(const float* qp, const float* const* kp, long d, float* s,
                                                  long lds, const int np, const int nr) {
    __m512 c[MR][4];
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < np; j++) c[r][j] = _mm512_setzero_ps();
    for (long i = 0; i < d; i++, qp += MR) {
        __m512 k[4];
        for (int j = 0; j < np; j++) k[j] = _mm512_loadu_ps(kp[j] + i * KP);
        for (int r = 0; r < nr; r++) {
            __m512 a = _mm512_set1_ps(qp[r]);
            for (int j = 0; j < np; j++) c[r][j] = _mm512_fmadd_ps(a, k[j], c[r][j]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < np; j++) _mm512_storeu_ps(s + r * lds + j * KP, c[r][j]);
}

/* o[r, 0..16 ns) = alpha[r] * o[r, ..] + sum_{j<n} p[r, j] * V_j[16 i..16 i + 16) for r < nr, i < ns = 1-4: key j
 * is key j % 16 of the tile's panel j / 16, whose 16 columns i lie at vp[panel] + i * slab + (j % 16) * ldv
 * (column slabs packed for `keys` keys: slab = 16 * keys, ldv = 16; a pool of panels' rows: slab = 16,
 * ldv = D) */
AVX512_TARGET static ALWAYS_INLINE void tile_pv512(float* o, long ldo, const float* p, long ldp,
                                                  const float* const* vp, long slab, long ldv, long n,
                                                  const float* alpha, const int ns, const int nr) {
    __m512 c[MR][4];
    for (int r = 0; r < nr; r++) {
        __m512 a = _mm512_set1_ps(alpha[r]);
        for (int i = 0; i < ns; i++) c[r][i] = _mm512_mul_ps(a, _mm512_loadu_ps(o + r * ldo + 16 * i));
    }
    for (long j0 = 0, pan = 0; j0 < n; j0 += KP, pan++) {
        const float* v = vp[pan];
        const long keys = n - j0 < KP ? n - j0 : KP;
        for (long j = 0; j < keys; j++) {
            __m512 x[4];
            for (int i = 0; i < ns; i++) x[i] = _mm512_loadu_ps(v + i * slab + j * ldv);
            for (int r = 0; r < nr; r++) {
                __m512 a = _mm512_set1_ps(p[r * ldp + j0 + j]);
                for (int i = 0; i < ns; i++) c[r][i] = _mm512_fmadd_ps(a, x[i], c[r][i]);
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < ns; i++) _mm512_storeu_ps(o + r * ldo + 16 * i, c[r][i]);
}

/* One row of a tile: scores s[0..valid) (log2 domain) update the running max m and sum l, become
 * probabilities, and s[valid..cols) become 0; returns the factor the row's output must be scaled by.
 * The row's sum runs in the order softmax_rows_of512 runs it: blocks of 8 in two accumulators, alternately
 * (one 16-lane accumulator's halves), added before the lane sum, so both bodies give the same bits. */
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
    __m256 mx = _mm256_set1_ps(m_new), sum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (j = 0; j < cols; j += 8) {
        __m256 e = exp2_ps(_mm256_sub_ps(_mm256_loadu_ps(s + j), mx));
        if (j + 8 > valid) e = _mm256_and_ps(e, lanes_below(j, valid));
        sum[(j / 8) & 1] = _mm256_add_ps(sum[(j / 8) & 1], e);
        _mm256_storeu_ps(s + j, e);
    }
    *l = *l * alpha + hsum(_mm256_add_ps(sum[0], sum[1]));
    *m = m_new;
    return alpha;
}

/* softmax_row in 16 lanes (cols a multiple of 8) over G rows (KT apart) with the same valid > 0 keys, each
 * step of every row before the next step: 16 lanes take half the instructions of the exponentials, which
 * were a third of prefill attention's time outside its products; and a row's steps wait on one another
 * (its maximum, that maximum's lane reduction, the new running maximum, the exponentials, their lane sum),
 * so taken a row at a time they left the core waiting. Every row runs the same operations in the same
 * order whatever G, so the same bits. 32 rows stacked over 1024 keys, decode, K/V in cache (2-core Zen 5
 * EPYC): G = 4 took the softmax from 56 to 36 us a layer of ~380. */
#define SOFTMAX_GROUP 4
AVX512_TARGET static ALWAYS_INLINE void softmax_rows_of512(float* s, long valid, long cols, float* m, float* l,
                                                           float* alpha, const int G) {
    __m512 top[SOFTMAX_GROUP], sum[SOFTMAX_GROUP];
    float m_new[SOFTMAX_GROUP];
    for (int g = 0; g < G; g++) top[g] = _mm512_set1_ps(-INFINITY);
    for (long j = 0; j < valid; j += 16) {
        const __mmask16 in = valid - j >= 16 ? 0xFFFF : (__mmask16)((1u << (valid - j)) - 1);
        for (int g = 0; g < G; g++)
            top[g] = _mm512_max_ps(top[g], _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), in, s + g * KT + j));
    }
    for (int g = 0; g < G; g++) {
        m_new[g] = _mm512_reduce_max_ps(top[g]);
        if (m[g] > m_new[g]) m_new[g] = m[g];
        alpha[g] = exp2f(m[g] - m_new[g]);
        sum[g] = _mm512_setzero_ps();
    }
    for (long j = 0; j < cols; j += 16) {
        const __mmask16 stored = cols - j >= 16 ? 0xFFFF : 0xFF;
        const __mmask16 in = valid - j >= 16 ? 0xFFFF : valid <= j ? 0 : (__mmask16)((1u << (valid - j)) - 1);
        for (int g = 0; g < G; g++) {
            __m512 e = _mm512_maskz_mov_ps(in, exp2_512(_mm512_sub_ps(_mm512_maskz_loadu_ps(stored, s + g * KT + j),
                                                                      _mm512_set1_ps(m_new[g]))));
            sum[g] = _mm512_add_ps(sum[g], e);
            _mm512_mask_storeu_ps(s + g * KT + j, stored, e);
        }
    }
    for (int g = 0; g < G; g++) {
        l[g] = l[g] * alpha[g] + hsum(_mm256_add_ps(_mm512_castps512_ps256(sum[g]), _mm512_extractf32x8_ps(sum[g], 1)));
        m[g] = m_new[g];
    }
}

/* rows [r0, r1) of a tile (s, m, l and alpha indexed by row), row r seeing valid[r * vstride] keys:
 * runs of SOFTMAX_GROUP rows with the same valid > 0 keys go together, others one at a time */
AVX512_TARGET static void softmax_rows512(float* s, long r0, long r1, const long* valid, long vstride, long cols,
                                          float* m, float* l, float* alpha) {
    for (long r = r0; r < r1;) {
        const long v = valid[r * vstride];
        int same = r + SOFTMAX_GROUP <= r1 && v > 0;
        for (long g = 1; same && g < SOFTMAX_GROUP; g++) same = valid[(r + g) * vstride] == v;
        if (same) {
            softmax_rows_of512(s + r * KT, v, cols, m + r, l + r, alpha + r, SOFTMAX_GROUP);
            r += SOFTMAX_GROUP;
        } else if (v > 0) {
            softmax_rows_of512(s + r * KT, v, cols, m + r, l + r, alpha + r, 1);
            r++;
        } else {          /* a row seeing none of the tile's keys: zeros, its state unchanged */
            for (long j = 0; j < cols; j += 16)
                _mm512_mask_storeu_ps(s + r * KT + j, (__mmask16)(cols - j >= 16 ? 0xFFFF : 0xFF), _mm512_setzero_ps());
            alpha[r++] = 1.0f;
        }
    }
}

/* softmax_rows512, or softmax_row a row at a time, in the widest body the caller's CPU runs (both give
 * the same bits) */
static inline void softmax_rows_in(int avx512, float* s, long r0, long r1, const long* valid, long vstride, long cols,
                                   float* m, float* l, float* alpha) {
    if (avx512) {
        softmax_rows512(s, r0, r1, valid, vstride, cols, m, l, alpha);
        return;
    }
    for (long r = r0; r < r1; r++) alpha[r] = softmax_row(s + r * KT, valid[r * vstride], cols, m + r, l + r);
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

/* The K and V rows of keys [j, j1) of one KV head (at element `head` of a token's row), requested
 * while the tile before them is computed: the hardware prefetcher cannot follow rows scattered over the
 * pool's blocks, and a tile's compute would otherwise wait on each of them (decode: 16 sequences stacked
 * over a 1024-token run, K/V from memory, 1.23x; one sequence's 110 keys 1.09x). request_more asks for
 * `per` lines of K, and as many of V, at a time, and the tiles call it once per row panel (a few rows'
 * tiles: per 16 or 32 keys) they run, so the requests spread over the tile: issued all at once they
 * filled the core's queue of misses and stalled it until memory drained it. Against one burst a tile,
 * K/V from memory: decode of 16 sequences x 48 own keys 1.37-1.39x, one sequence x 110-1024 keys
 * 1.17-1.30x, 32 rows stacked over 1024 keys 1.11-1.20x; a streamed prefill chunk of 16-32 tokens over
 * 1024-2048 cached 1.07-1.20x. Each key looks its block up on its own: walking a block's slots with one
 * lookup per block issued the requests faster than the memory took them (0.89-0.94x). All: bfloat16
 * pool, Zen 5 EPYC, 2 threads. A key's row is looked up once, not once per line (its 8 lines of a 128-dim
 * float32 head): decode of 16 sequences x 48 own keys, float32, 0.90x the time (K/V in cache), 0.92x (from
 * memory); the decode program's float32 step, 16 sequences over a shared 1024, 0.976x (Zen 4 EPYC).
 * Decode asks for them into L2 (`to_l2`): into L1 (32 KB on Zen 4) a tile's K and V rows (32 KB at 64
 * keys of a 128-dim bfloat16 head) pushed out the tile being computed (Zen 4 EPYC, 2 threads, bfloat16,
 * the decode program's layers with the two builds alternating every step, 16 sequences over a shared
 * 1024-token run: 1.03-1.08x; L1 for the stacked or the few-row tasks alone: 1.04x slower). Prefill
 * reuses each tile over many query panels and keeps L1: L2 measured no faster there. */
typedef struct {
    const char* pool;
    const long* table;          /* the block table of the keys' sequence */
    long elt, block_size, token_stride, v_bytes, row_bytes;
    long head, slot_stride;     /* where the head's row (panel) of slot 0 lies in its block, elements a slot */
    long step;                  /* keys a row: 1, or KP in a pool of panels (a panel's K, and its V pairs) */
    long j, j1, c;              /* the next key and byte of its row to request; the key to stop before */
    long block, slot;           /* key j's entry of the table and slot in its block (no division per line) */
    const char* row;            /* where key j's K row starts (looked up once a key, not once a line) */
    long per;                   /* lines of K (and as many of V) a request_more asks for */
    int to_l2;                  /* requested into L2 rather than L1 */
} TileRequest;

static inline const char* request_row(const TileRequest* t) {
    return t->pool + t->elt * (t->table[t->block] * t->block_size * t->token_stride + t->slot * t->slot_stride
                               + t->head);
}

/* keys [j0, j1) (none where j1 <= j0; j0 a multiple of KP in a pool of panels), asked for over `points`
 * calls of request_more; `head` the head's element in a token's row (h * d) */
static inline TileRequest tile_request(const void* pool, int panels, long elt, const long* table, long block_size,
                                       long token_stride, long v_offset, long head, long d, long j0, long j1,
                                       long points, int to_l2) {
    const long step = panels ? KP : 1, row_bytes = d * elt * step;
    if (panels && j1 > j0) j1 = round_up(j1, KP);
    const long lines = j1 > j0 ? (j1 - j0) / step * ((row_bytes + 63) / 64) : 0;
    TileRequest t = {(const char*)pool, table, elt, block_size, token_stride, elt * v_offset, row_bytes,
                     panels ? head * block_size : head, panels ? d : token_stride, step,
                     j0, j1, 0, j0 / block_size, j0 % block_size, NULL, (lines + points - 1) / points, to_l2};
    if (j1 > j0) t.row = request_row(&t);
    return t;
}

/* the next `per` lines of the request (t NULL: none) */
static inline void request_more(TileRequest* t) {
    if (!t) return;
    for (long n = 0; n < t->per && t->j < t->j1; n++) {
        request_line(t->row + t->c, t->to_l2);
        request_line(t->row + t->v_bytes + t->c, t->to_l2);
        if ((t->c += 64) >= t->row_bytes) {
            t->c = 0;
            t->j += t->step;
            if ((t->slot += t->step) == t->block_size) { t->slot = 0; t->block++; }
            if (t->j < t->j1) t->row = request_row(t);
        }
    }
}

/* whatever the request has not asked for yet (a tile whose panels skipped some of the calls) */
static inline void request_rest(TileRequest* t) {
    t->per = t->j1 > t->j ? (t->j1 - t->j) / t->step * ((t->row_bytes + 63) / 64) : 0;
    request_more(t);
}

/* calls of request_more a tile's scores512 (_bf16) and values512 make when each of `panels` row panels
 * sees keys of it: one per panel in the scores, one per panel and block of 64 value columns */
static inline long request_points(long panels, long d) { return panels * (1 + (d / 16 + 3) / 4); }

/* The bfloat16 dot-product body (a bfloat16 pool, CPUs with avx512_bf16): keys stay bfloat16, packed
 * as pairs of neighbouring dimensions, one 32-bit word a pair ([D/2][16] words a panel: half the bytes
 * of a widened panel, and no widening), and S = Q K^T runs on vdpbf16ps, each lane summing the exact
 * products of two dimensions into float32. Queries are bfloat16 values (prefill reads their word pairs
 * as they are, decode gets them widened), so their pairs are exact too; the scores are scaled after the
 * products instead of the queries before. The softmax runs in float32; P V runs on vdpbf16ps too:
 * the probabilities rounded once to bfloat16 (to nearest even, as a bfloat16 GPU kernel rounds them
 * for its P V GEMM) and V kept bfloat16, both as pairs of neighbouring keys, so each lane sums exact
 * products in float32. Every row of both kernels, decode's few-row tasks included, goes through
 * these same tiles, so prefill and decode still give a token the same bits (an earlier try rounded P
 * in the prefill tiles only: a preempted sequence, recomputing in a prefill the K/V its decode steps
 * had made, then moved a greedy token). Head dims of whole 16-element rows (every model's) take it. */

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

/* Word i of query row r holds its dimensions 2i (low half) and 2i + 1 (high half), 16 dimensions a step:
 * from bfloat16 rows (prefill's queries) two neighbouring elements are that word already; from float32
 * rows holding bfloat16 values (`widened`: decode's queries) it is their top halves, shifted down and
 * narrowed, bit for bit. Rows without a source are zeros. An 8 x 8 transpose of 32-bit words puts each
 * block of 8 words in the panel's layout, qw[i * MR + r]; its stores run in order, each writing 2 words
 * past its MR that the next store overwrites, so panels are packed in order and the last writes QW_SPILL
 * words past its end (the buffer keeps them). Against a word at a time, decode's own-block call
 * (16 sequences x 8 KV heads x 2 rows over 40 keys, a task per sequence and head, in cache) took 0.86x
 * the time on a 2-core Zen 4 EPYC. */
#define QW_SPILL 2
AVX512_TARGET static void pack_query_words(const void* const* rows, int widened, long d, unsigned* qw) {
    for (long e = 0; e < d; e += 16) {
        __m256 r[8];
        for (int i = 0; i < 8; i++) {
            if (i >= MR || !rows[i])
                r[i] = _mm256_setzero_ps();
            else if (widened)
                r[i] = _mm256_castsi256_ps(_mm512_cvtepi32_epi16(
                    _mm512_srli_epi32(_mm512_loadu_si512((const float*)rows[i] + e), 16)));
            else
                r[i] = _mm256_loadu_ps((const float*)((const unsigned short*)rows[i] + e));
        }
        transpose8(r);
        for (int w = 0; w < 8; w++) _mm256_storeu_ps((float*)(qw + (e / 2 + w) * MR), r[w]);
    }
}

/* CALL(common arguments..., nr) with nr = 1..MR a constant: a row panel's real rows, each count its own
 * body (a task's last panel holds rows % MR of them; its padding rows are never read, and skipping them
 * changes no other row: each row has accumulators of its own) */
#define FOR_ROWS(nr, CALL, ...)                                                                            \
    switch (nr) {                                                                                          \
        case 1: CALL(__VA_ARGS__, 1); break;                                                               \
        case 2: CALL(__VA_ARGS__, 2); break;                                                               \
        case 3: CALL(__VA_ARGS__, 3); break;                                                               \
        case 4: CALL(__VA_ARGS__, 4); break;                                                               \
        case 5: CALL(__VA_ARGS__, 5); break;                                                               \
        default: CALL(__VA_ARGS__, MR); break;                                                             \
    }

/* the rows of row panel p of `panels` whose last holds `last` rows */
static inline int panel_rows(long p, long panels, long last) { return p == panels - 1 ? (int)last : MR; }

/* s[r, 0..16 np) = qscale * sum_i qw[i, r] . panel_j[i, 0..16) over np = 1-4 word panels (kp[j]: where panel j
 * starts, packed or in a pool of panels), r < nr */
AVX512_BF16_TARGET static ALWAYS_INLINE void tile_qk512_bf16(const unsigned* qw, const float* const* kp, long d,
                                                            float* s, long lds, __m512 qscale, const int np,
                                                            const int nr) {
    __m512 c[MR][4];
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < np; j++) c[r][j] = _mm512_setzero_ps();
    for (long i = 0; i < d / 2; i++, qw += MR) {
        __m512bh k[4];
        for (int j = 0; j < np; j++) k[j] = (__m512bh)_mm512_loadu_ps(kp[j] + i * KP);
        for (int r = 0; r < nr; r++) {
            __m512bh a = (__m512bh)_mm512_set1_epi32((int)qw[r]);
            for (int j = 0; j < np; j++) c[r][j] = _mm512_dpbf16_ps(c[r][j], a, k[j]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < np; j++) _mm512_storeu_ps(s + r * lds + j * KP, _mm512_mul_ps(qscale, c[r][j]));
}

/* One tile's scores over the row panels, the last holding `last` rows (1..MR); kp: where the tile's KT / KP
 * key panels start */
AVX512_BF16_TARGET static void scores512_bf16(const unsigned* qw, const float* const* kp, long d, float* s,
                                              const long* vis, long panels, long last, float qscale,
                                              TileRequest* ahead) {
    const __m512 qs = _mm512_set1_ps(qscale);
    for (long kk = 0; kk * KP < KT; kk += 4)
        for (long p = 0; p < panels; p++) {
            if (kk == 0) request_more(ahead);
            float* sp = s + p * MR * KT + kk * KP;
            const unsigned* q = qw + p * MR * (d / 2);
            const float* const* k = kp + kk;
            const int nr = panel_rows(p, panels, last);
            switch (panels_seen(vis[p], kk)) {
                case 4: FOR_ROWS(nr, tile_qk512_bf16, q, k, d, sp, KT, qs, 4); break;
                case 3: FOR_ROWS(nr, tile_qk512_bf16, q, k, d, sp, KT, qs, 3); break;
                case 2: FOR_ROWS(nr, tile_qk512_bf16, q, k, d, sp, KT, qs, 2); break;
                case 1: FOR_ROWS(nr, tile_qk512_bf16, q, k, d, sp, KT, qs, 1); break;
                default: break;
            }
        }
}

/* Where the K rows of keys k0 .. k0 + n (n <= KT) of one KV head start in the pool, through the sequence's
 * block table, for a whole number of 16-key panels: -1 for the keys at or past len. A pool of rows holds
 * the head's row of a slot at element `head` (h * D) of the slot's row (slot_stride = KVH * D elements); a
 * float32 pool of panels holds its V rows that way with head = h * block_size * D, slot_stride = D. */
static inline void tile_rows(const long* table, long block_size, long token_stride, long head, long slot_stride,
                             long k0, long n, long len, long* at) {
    long block = k0 / block_size, slot = k0 % block_size;      /* one division a tile, not one a key */
    for (long j = 0; j < round_up(n, KP); j++) {
        at[j] = k0 + j < len ? table[block] * block_size * token_stride + slot * slot_stride + head : -1;
        if (++slot == block_size) { slot = 0; block++; }
    }
}


/* 16 columns of the V rows of two neighbouring keys (x, y) as word pairs: *cols0 holds columns 0-7, *cols1
 * columns 8-15, word e = (x[e] low half, y[e] high half). The one definition of the pair layout, for the
 * pair rows packed here, the pairs decode's few-row tiles interleave as they read, and a pool of panels. */
static inline void pair_keys_bf16(__m256i x, __m256i y, __m256i* cols0, __m256i* cols1) {
    /* per 128-bit lane: columns 0-3 (lo) and 4-7 (hi) of the lane, each interleaved with the next key */
    const __m256i lo = _mm256_unpacklo_epi16(x, y), hi = _mm256_unpackhi_epi16(x, y);
    *cols0 = _mm256_permute2x128_si256(lo, hi, 0x20);
    *cols1 = _mm256_permute2x128_si256(lo, hi, 0x31);
}

/* The V rows of a panel of 16 keys (at[j]: where key j's K row starts, negative past the sequence) as
 * bfloat16 pairs of neighbouring keys into KP / 2 pair rows of D words from vp on: word (i, e) = V[2i][e]
 * (low half) and V[2i + 1][e] (high half). Half the bytes of widened slabs, and no widening; a panel's
 * pairs have the layout a pool of panels holds them in (kv_layout.py), so the tiles read either. */
static void pack_values_bf16(const void* pool, const long* at, long v_offset, long d, float* vp) {
    const unsigned short* pv = (const unsigned short*)pool;
    for (long jj = 0; jj < KP; jj += 2) {
        const long a = at[jj] >= 0 ? at[jj] + v_offset : -1, b = at[jj + 1] >= 0 ? at[jj + 1] + v_offset : -1;
        for (long c = 0; c < d; c += 16) {
            const __m256i x = a >= 0 ? _mm256_loadu_si256((const __m256i*)(pv + a + c)) : _mm256_setzero_si256();
            const __m256i y = b >= 0 ? _mm256_loadu_si256((const __m256i*)(pv + b + c)) : _mm256_setzero_si256();
            __m256i cols0, cols1;
            pair_keys_bf16(x, y, &cols0, &cols1);
            float* dst = vp + jj / 2 * d + c;
            _mm256_storeu_si256((__m256i*)dst, cols0);
            _mm256_storeu_si256((__m256i*)(dst + 8), cols1);
        }
    }
}

/* The probabilities of `rows` rows of a tile (s, KT apart) rounded to bfloat16 into pw (KT apart), so
 * that word i of a row holds keys 2i and 2i + 1. Columns past a row's keys are never read as products. */
AVX512_BF16_TARGET static void probabilities_bf16(const float* s, long rows, unsigned short* pw) {
    for (long r = 0; r < rows; r++)
        for (long j = 0; j < KT; j += 16)
            _mm256_storeu_si256((__m256i*)(pw + r * KT + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + r * KT + j)));
}

/* acc[r][k] += the probabilities of key pair i in row r (one bfloat16 word pair, broadcast) . x[k], for nr
 * rows and nv vectors of V pairs: one step of the chain every P V output lane runs in the bfloat16 body.
 * Its one definition, taken by the prefill tiles and decode's few-row tiles: a token's bits from the two
 * kernels agree only while the steps do. */
AVX512_BF16_TARGET static ALWAYS_INLINE void pv_pair_bf16(__m512 (*acc)[4], const unsigned short* pw, long ldp,
                                                         long i, const __m512bh* x, const int nr, const int nv) {
    for (int r = 0; r < nr; r++) {
        int w;
        memcpy(&w, pw + r * ldp + 2 * i, sizeof(w));
        const __m512bh p = (__m512bh)_mm512_set1_epi32(w);
        for (int k = 0; k < nv; k++) acc[r][k] = _mm512_dpbf16_ps(acc[r][k], p, x[k]);
    }
}

/* o[r, 0..16 ns) = alpha[r] * o[r, ..] (alpha NULL: o as it is) + sum over key pairs i < pairs of
 * pw[r, 2i..2i+1] . (pair row i)[c..c + 16 ns) for r < nr, ns = 1-4 vectors: pair row i is row i % 8 of the
 * tile's panel i / 8, vp[panel] its first (D words a row) */
AVX512_BF16_TARGET static ALWAYS_INLINE void tile_pv512_bf16(float* o, long ldo, const unsigned short* pw, long ldp,
                                                            const float* const* vp, long d, long c, long pairs,
                                                            const float* alpha, const int ns, const int nr) {
    __m512 acc[MR][4];
    for (int r = 0; r < nr; r++)
        for (int k = 0; k < ns; k++) {
            const __m512 x = _mm512_loadu_ps(o + r * ldo + 16 * k);
            acc[r][k] = alpha ? _mm512_mul_ps(_mm512_set1_ps(alpha[r]), x) : x;
        }
    for (long i0 = 0, pan = 0; i0 < pairs; i0 += KP / 2, pan++) {
        const float* v = vp[pan] + c;
        const long n = pairs - i0 < KP / 2 ? pairs - i0 : KP / 2;
        for (long i = 0; i < n; i++) {
            __m512bh x[4];
            for (int k = 0; k < ns; k++) x[k] = (__m512bh)_mm512_loadu_ps(v + i * d + 16 * k);
            pv_pair_bf16(acc, pw, ldp, i0 + i, x, nr, ns);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int k = 0; k < ns; k++) _mm512_storeu_ps(o + r * ldo + 16 * k, acc[r][k]);
}

/* values512 over bfloat16 probabilities (probabilities_bf16) and the tile's V pair rows (vp[panel]: where
 * each of its KT / KP panels' pair rows start, packed by pack_values_bf16 or in a pool of panels), the last
 * row panel holding `last` rows; D % 16 == 0 */
AVX512_BF16_TARGET static void values512_bf16(float* o, long d, const unsigned short* pw, const float* const* vp,
                                              const long* vis, const float* alpha, long panels, long last,
                                              TileRequest* ahead) {
    for (long c = 0; c < d;) {
        const int ns = d - c >= 64 ? 4 : (int)((d - c) / 16);
        for (long p = 0; p < panels; p++) {
            if (!vis[p]) continue;
            request_more(ahead);
            float* op = o + p * MR * d + c;
            const unsigned short* pp = pw + p * MR * KT;
            const long pairs = (vis[p] + 1) / 2;
            const float* a = alpha + p * MR;
            const int nr = panel_rows(p, panels, last);
            switch (ns) {
                case 4: FOR_ROWS(nr, tile_pv512_bf16, op, d, pp, KT, vp, d, c, pairs, a, 4); break;
                case 3: FOR_ROWS(nr, tile_pv512_bf16, op, d, pp, KT, vp, d, c, pairs, a, 3); break;
                case 2: FOR_ROWS(nr, tile_pv512_bf16, op, d, pp, KT, vp, d, c, pairs, a, 2); break;
                default: FOR_ROWS(nr, tile_pv512_bf16, op, d, pp, KT, vp, d, c, pairs, a, 1); break;
            }
        }
        c += 16 * ns;
    }
}

/* The K rows of a panel of 16 keys out of the pool (at[j]: the element where key j's row starts, negative
 * past the sequence) into the transposed panel kt [D][16] (with key_words, bfloat16 word pairs [D/2][16]). */
static void pack_panel_keys(const void* pool, int bf16, int key_words, const long* at, long d, float* kt) {
    if (key_words)
        pack_keys_bf16(pool, at, d, kt);
    else
        for (long e = 0; e < d; e += 8) {
            gather_transposed_pool(pool, bf16, at, e, kt + e * KP, KP);
            gather_transposed_pool(pool, bf16, at + 8, e, kt + e * KP + 8, KP);
        }
}

/* pack_panel_keys, and the panel's V rows (v_offset elements after its K rows) into the column slabs of
 * vr, the first key being key `first`: slab c holds `keys` rows of w = min(16, D - c) floats from
 * vr + c * keys on (with key_words, the panel's pair rows from vr + first / 2 * D on: pack_values_bf16). */
static void pack_panel(const void* pool, int bf16, int key_words, const long* at, long v_offset, long d, float* kt,
                       float* vr, long keys, long first) {
    pack_panel_keys(pool, bf16, key_words, at, d, kt);
    if (key_words) {
        pack_values_bf16(pool, at, v_offset, d, vr + first / 2 * d);
        return;
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

/* A pool of panels (kv_layout.py; bfloat16 pools read by the bfloat16 body, float32 ones by the AVX-512
 * tiles): block blk holds KV head h's keys at element (blk * KVH + h) * block_size * D of the K pool, as
 * block_size / KP panels, and their values v_offset elements later. bfloat16: panels of [D/2][KP] words
 * (pack_keys_bf16's layout), values as block_size / 2 pair rows of D words (pack_values_bf16's); float32:
 * panels of [D][KP] floats (pack_panel_keys'), values as block_size rows of D floats. A tile reads a whole
 * panel where it lies: no transposes, and one head's keys of a block are one run of memory instead of rows
 * KVH * D apart. Either way a panel's K, and its V, are KP * D elements. */

/* Whether a call reads its pool as a pool of panels: layout 1 (the caller checks the blocks) and tiles that
 * read its dtype's panels, the bfloat16 body's word pairs (key_words) or the AVX-512 float32 tiles; the C
 * side of isa.reads_panels */
static inline int reads_panel_pool(int layout, int key_words, int avx512, int pool_bf16, long d) {
    return layout == 1 && (key_words || (avx512 && !pool_bf16 && d % 16 == 0));
}

/* where the K panel holding keys key .. key + KP (key a multiple of KP) of KV head h lies in a pool of
 * panels; its V (pair) rows lie v_offset elements later ((key % block_size) * D either way) */
static inline long panel_start(const long* table, long block_size, long token_stride, long h, long d, long key) {
    return table[key / block_size] * block_size * token_stride + (h * block_size + key % block_size) * d;
}

AVX512_TARGET static void copy_panel(const void* pool, long k_at, long v_at, long d, long valid, float* kt, float* vp);

/* Where a tile's KT / KP panels (keys k0 .. k0 + n of KV head h, n <= KT) are read in a pool of panels of
 * elt-byte elements: in place, but for a bfloat16 panel the sequence (len keys) does not fill, copied into
 * the tile's buffers kt and vr, the tail zero (the buffers: the packing's places, kp / vp of panels past n).
 * The float32 tiles read such a panel in place: of the keys past len they compute only scores, which the
 * softmax masks, and they multiply no V row past it; a bfloat16 V pair holds a key past len beside one
 * before it. */
static inline void tile_panels(const void* pool, long elt, const long* table, long block_size, long token_stride,
                               long v_offset, long h, long d, long k0, long n, long len, float* kt, float* vr,
                               const float** kp, const float** vp) {
    const long floats = KP * d * elt / 4;       /* a panel's K (and V) in the buffers */
    for (long pan = 0; pan < KT / KP; pan++) {
        kp[pan] = kt + pan * floats;
        vp[pan] = vr + pan * floats;
        const long key = k0 + pan * KP;
        if (pan * KP >= n) continue;
        const long k_at = panel_start(table, block_size, token_stride, h, d, key);
        if (key + KP > len && elt == 2) {
            copy_panel(pool, k_at, v_offset + k_at, d, len - key, kt + pan * floats, vr + pan * floats);
            continue;
        }
        kp[pan] = (const float*)((const char*)pool + elt * k_at);
        vp[pan] = (const float*)((const char*)pool + elt * (v_offset + k_at));
    }
}

/* A panel of a bfloat16 pool of panels (K at element k_at, V pairs at v_at) whose keys from `valid` on lie past
 * the sequence, copied into kt and vp with those keys' words zero: a slot not yet written may hold
 * whatever its block held before, and a probability of 0 times a NaN left there is still NaN. */
AVX512_TARGET static void copy_panel(const void* pool, long k_at, long v_at, long d, long valid, float* kt, float* vp) {
    const __mmask16 keys = valid >= KP ? 0xFFFF : (__mmask16)((1u << valid) - 1);
    const unsigned short* pk = (const unsigned short*)pool;
    for (long i = 0; i < d / 2; i++)
        _mm512_storeu_ps(kt + i * KP, _mm512_maskz_loadu_ps(keys, (const float*)(pk + k_at) + i * KP));
    const __m512i low = _mm512_set1_epi32(0xFFFF);
    for (long p = 0; p < KP / 2; p++)
        for (long c = 0; c < d; c += 16) {
            __m512i w = _mm512_loadu_si512((const float*)(pk + v_at) + p * d + c);
            if (2 * p >= valid) w = _mm512_setzero_si512();
            else if (2 * p + 1 >= valid) w = _mm512_and_si512(w, low);
            _mm512_storeu_si512(vp + p * d + c, w);
        }
}

/* One tile's S = Q K^T: for each 6-row panel p of Q (qp, [D][6] each), the 16-key panels from kt on
 * (K^T panels [D][16], consecutive) that its rows see (vis[p] keys) into s (rows KT apart). */
static void scores(const float* qp, const float* kt, long d, float* s, const long* vis, long panels) {
    for (long kk = 0; kk * KP < KT; kk++)
        for (long p = 0; p < panels; p++)
            if (vis[p] > kk * KP) tile_qk(qp + p * MR * d, kt + kk * KP * d, d, s + p * MR * KT + kk * KP, KT);
}

/* scores over AVX-512 tiles, which skip the padding rows of the last row panel (`last` of its MR rows
 * real, as values512 does): with 2 query heads a KV head, 16 sequences stacked over a shared run fill 32
 * of 36 rows, and skipping the 4 took the float32 decode program's step to 0.964x (Zen 4 EPYC, 2 threads,
 * builds alternating every step) */
AVX512_TARGET static void scores512(const float* qp, const float* const* kp, long d, float* s, const long* vis,
                                    long panels, long last, TileRequest* ahead) {
    for (long kk = 0; kk * KP < KT; kk += 4)
        for (long p = 0; p < panels; p++) {
            if (kk == 0) request_more(ahead);
            float* sp = s + p * MR * KT + kk * KP;
            const float* q = qp + p * MR * d;
            const float* const* k = kp + kk;
            const int nr = panel_rows(p, panels, last);
            switch (panels_seen(vis[p], kk)) {
                case 4: FOR_ROWS(nr, tile_qk512, q, k, d, sp, KT, 4); break;
                case 3: FOR_ROWS(nr, tile_qk512, q, k, d, sp, KT, 3); break;
                case 2: FOR_ROWS(nr, tile_qk512, q, k, d, sp, KT, 2); break;
                case 1: FOR_ROWS(nr, tile_qk512, q, k, d, sp, KT, 1); break;
                default: break;
            }
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

/* How values512 reads the tile's V: in a pool of panels, the rows tile_panels left in vp (slab 16, ldv D);
 * else the column slabs packed for `keys` keys (`values`' vr, keys, k0), vp set here (slab 16 * keys,
 * ldv 16). Returns the 8-column slab of D % 16 == 8 (never in a pool of panels), else NULL. */
static inline const float* value_strides(int panel_pool, const float* vr, long keys, long k0, long d,
                                         const float** vp, long* slab, long* ldv) {
    if (panel_pool) {
        *slab = 16;
        *ldv = d;
        return NULL;
    }
    for (long pan = 0; pan < KT / KP; pan++) vp[pan] = vr + (k0 + pan * KP) * 16;
    *slab = 16 * keys;
    *ldv = 16;
    return d % 16 ? vr + (d - d % 16) * keys + k0 * 8 : NULL;
}

/* values over AVX-512 tiles, 64 columns a tile, the tile's V as tile_pv512 reads it (vp, slab, ldv) and
 * the last 8 columns where D % 16 == 8 in a packed slab (tail: value_strides') */
AVX512_TARGET static void values512(float* o, long d, const float* s, const float* const* vp, long slab, long ldv,
                                    const float* tail, const long* vis, const float* alpha, long panels, long last,
                                    TileRequest* ahead) {
    long c = 0;
    while (c + 16 <= d) {
        /* up to 4 slabs (64 columns) a register tile */
        const int ns = d - c >= 64 ? 4 : (int)((d - c) / 16);
        const float* v[KT / KP];
        for (long pan = 0; pan < KT / KP; pan++) v[pan] = vp[pan] + c / 16 * slab;
        for (long p = 0; p < panels; p++) {
            if (!vis[p]) continue;
            request_more(ahead);
            float* op = o + p * MR * d + c;
            const float* sp = s + p * MR * KT, * a = alpha + p * MR;
            const int nr = panel_rows(p, panels, last);
            switch (ns) {
                case 4: FOR_ROWS(nr, tile_pv512, op, d, sp, KT, v, slab, ldv, vis[p], a, 4); break;
                case 3: FOR_ROWS(nr, tile_pv512, op, d, sp, KT, v, slab, ldv, vis[p], a, 3); break;
                case 2: FOR_ROWS(nr, tile_pv512, op, d, sp, KT, v, slab, ldv, vis[p], a, 2); break;
                default: FOR_ROWS(nr, tile_pv512, op, d, sp, KT, v, slab, ldv, vis[p], a, 1); break;
            }
        }
        c += 16 * ns;
    }
    if (c < d)
        for (long p = 0; p < panels; p++)
            if (vis[p]) tile_pv8(o + p * MR * d + c, d, s + p * MR * KT, KT, tail, 8, vis[p], alpha + p * MR);
}

#endif
