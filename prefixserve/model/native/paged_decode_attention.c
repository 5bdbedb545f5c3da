/* Decode attention read straight from the paged KV pool, float32 math, AVX2 + FMA (an AVX-512 body below).
 *
 * For each (sequence b, KV head h): the R query rows of q[b, h] (the G query heads of a
 * grouped-query KV head, or several sequences' heads stacked over a shared run) attend to
 * the first lens[b] slots of the blocks tables[b, :], with an online softmax block by
 * block. Returns the outputs and the log-sum-exps of the scaled scores, or (finalize = 0) leaves
 * the unnormalised outputs with the running max and denominator in state_m / state_l, for a
 * later call (carry_in = 1) over the following blocks to carry on from: one pass over a shared
 * run for several sequences, then each sequence's own blocks, gives the bits of one pass over
 * the whole context.
 *
 * The torch path gathers the blocks into a dense copy, then reads the copy: three passes
 * over K/V, which at decode time outweighs the arithmetic. Here every K/V row is read
 * once, from where it lives.
 *
 * The pool holds float32 or bfloat16 (pool_bf16): bfloat16 K/V are widened to float32 lanes by a
 * shift as they are read (exact), so at the bandwidth bound a bfloat16 pool is read twice as fast
 * and the results are those of float32 attention over the same values.
 *
 * pool: [2, num_blocks, block_size, KVH, D] (K then V); q, out: [B, KVH, R, D] float32; lse: [B, KVH, R].
 * Requires D % 8 == 0.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "simd.h"

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

static inline __m256 load_f32(const float* p) { return _mm256_loadu_ps(p); }

static inline __m256 load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* A task's rows begin from nothing (m = -inf, l = 0, acc = 0) or, carried in, from the state an earlier
 * call left for the blocks before these: the unnormalised accumulator in acc, m and l in state_m/l. */
static void start_rows(float* acc, float* m, float* l, const float* state_m, const float* state_l, long rows,
                       long head_dim, int carry_in) {
    for (long r = 0; r < rows; r++) {
        if (carry_in) {
            m[r] = state_m[r];
            l[r] = state_l[r];
        } else {
            m[r] = -INFINITY;
            l[r] = 0.0f;
            for (long e = 0; e < head_dim; e++) acc[r * head_dim + e] = 0.0f;
        }
    }
}

/* Finalised: acc divided by l, and the log-sum-exp of the scaled scores. Otherwise the state is left for
 * a later call to carry on from: acc unnormalised, m and l in state_m/l. */
static void end_rows(float* acc, const float* m, const float* l, float* lse, float* state_m, float* state_l,
                     long rows, long head_dim, int finalize) {
    for (long r = 0; r < rows; r++) {
        if (finalize) {
            float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            for (long e = 0; e < head_dim; e++) acc[r * head_dim + e] *= inv;
            lse[r] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;
        } else {
            state_m[r] = m[r];
            state_l[r] = l[r];
        }
    }
}

/* One body for both pool types: T is the pool's element type, LOAD widens 8 of them to float32 lanes.
 * Defines dot4##S (scores of one query row against 4 keys spaced `stride` apart: four independent FMA
 * chains), dot##S, scale_accumulate##S (acc = acc * alpha + sum_t p[t] * v[t] over n rows of v spaced
 * `stride` apart, 64 columns at a time in 8 registers so the FMAs form 8 independent chains) and
 * decode##S, the loop over (sequence, KV head) tasks. */
#define PAGED_DECODE(S, T, LOAD)                                                                         \
static inline void dot4##S(const float* q, const T* k, long stride, long d, float* out) {                \
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),                 \
           a3 = _mm256_setzero_ps();                                                                     \
    for (long p = 0; p < d; p += 8) {                                                                    \
        __m256 x = _mm256_loadu_ps(q + p);                                                               \
        a0 = _mm256_fmadd_ps(x, LOAD(k + p), a0);                                                        \
        a1 = _mm256_fmadd_ps(x, LOAD(k + stride + p), a1);                                               \
        a2 = _mm256_fmadd_ps(x, LOAD(k + 2 * stride + p), a2);                                           \
        a3 = _mm256_fmadd_ps(x, LOAD(k + 3 * stride + p), a3);                                           \
    }                                                                                                    \
    out[0] = hsum(a0); out[1] = hsum(a1); out[2] = hsum(a2); out[3] = hsum(a3);                          \
}                                                                                                        \
                                                                                                         \
static inline float dot##S(const float* q, const T* k, long d) {                                         \
    __m256 a = _mm256_setzero_ps();                                                                      \
    for (long p = 0; p < d; p += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + p), LOAD(k + p), a);         \
    return hsum(a);                                                                                      \
}                                                                                                        \
                                                                                                         \
static inline void scale_accumulate##S(float* acc, float alpha, const float* p, const T* v, long n,      \
                                       long stride, long d) {                                            \
    __m256 a = _mm256_set1_ps(alpha);                                                                    \
    long e = 0;                                                                                          \
    for (; e + 64 <= d; e += 64) {                                                                       \
        __m256 s[8];                                                                                     \
        for (int i = 0; i < 8; i++) s[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + e + 8 * i), a);          \
        for (long t = 0; t < n; t++) {                                                                   \
            __m256 w = _mm256_set1_ps(p[t]);                                                             \
            const T* vt = v + t * stride + e;                                                            \
            for (int i = 0; i < 8; i++) s[i] = _mm256_fmadd_ps(w, LOAD(vt + 8 * i), s[i]);              \
        }                                                                                                \
        for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + e + 8 * i, s[i]);                             \
    }                                                                                                    \
    for (; e < d; e += 8) {                                                                              \
        __m256 s = _mm256_mul_ps(_mm256_loadu_ps(acc + e), a);                                           \
        for (long t = 0; t < n; t++) s = _mm256_fmadd_ps(_mm256_set1_ps(p[t]), LOAD(v + t * stride + e), s); \
        _mm256_storeu_ps(acc + e, s);                                                                    \
    }                                                                                                    \
}                                                                                                        \
                                                                                                         \
static void decode##S(const float* q, const T* pool, const long* tables, const long* lens, long batch,    \
                      long kv_heads, long rows, long head_dim, long num_blocks, long block_size,         \
                      long table_width, float scale, float* out, float* lse, float* state_m,             \
                      float* state_l, int carry_in, int finalize, int threads) {                         \
    const long token_stride = kv_heads * head_dim;      /* elements between slots of one head */         \
    const long block_stride = block_size * token_stride;                                                 \
    const T* v_pool = pool + num_blocks * block_stride;                                                  \
    _Pragma("omp parallel num_threads(threads)")                                                         \
    {                                                                                                    \
        /* per thread: running max, denominator and R x block_size scores */                            \
        float* m = malloc(sizeof(float) * rows * (2 + block_size));                                      \
        float* l = m + rows;                                                                             \
        float* s = l + rows;                                                                             \
        _Pragma("omp for schedule(static)")                                                              \
        for (long task = 0; task < batch * kv_heads; task++) {                                           \
            long b = task / kv_heads, h = task % kv_heads;                                               \
            const float* qb = q + task * rows * head_dim;                                                \
            float* acc = out + task * rows * head_dim;                                                   \
            start_rows(acc, m, l, state_m + task * rows, state_l + task * rows, rows, head_dim, carry_in); \
            long len = lens[b];                                                                          \
            for (long j = 0; j * block_size < len; j++) {                                                \
                long n = len - j * block_size < block_size ? len - j * block_size : block_size;          \
                long blk = tables[b * table_width + j];                                                  \
                const T* kb = pool + blk * block_stride + h * head_dim;                                  \
                const T* vb = v_pool + blk * block_stride + h * head_dim;                                \
                for (long r = 0; r < rows; r++) {                                                        \
                    float* sr = s + r * block_size;                                                      \
                    float top = m[r];                                                                    \
                    long t = 0;                                                                          \
                    for (; t + 4 <= n; t += 4)                                                           \
                        dot4##S(qb + r * head_dim, kb + t * token_stride, token_stride, head_dim, sr + t); \
                    for (; t < n; t++) sr[t] = dot##S(qb + r * head_dim, kb + t * token_stride, head_dim); \
                    for (t = 0; t < n; t++) {                                                            \
                        sr[t] *= scale;                                                                  \
                        if (sr[t] > top) top = sr[t];                                                    \
                    }                                                                                    \
                    float alpha = expf(m[r] - top);   /* 0 on the first block: m = -inf */               \
                    float sum = 0.0f;                                                                    \
                    for (long t = 0; t < n; t++) {                                                       \
                        sr[t] = expf(sr[t] - top);                                                       \
                        sum += sr[t];                                                                    \
                    }                                                                                    \
                    l[r] = l[r] * alpha + sum;                                                           \
                    m[r] = top;                                                                          \
                    scale_accumulate##S(acc + r * head_dim, alpha, sr, vb, n, token_stride, head_dim);   \
                }                                                                                        \
            }                                                                                            \
            end_rows(acc, m, l, lse + task * rows, state_m + task * rows, state_l + task * rows, rows,      \
                     head_dim, finalize);                                                                \
        }                                                                                                \
        free(m);                                                                                         \
    }                                                                                                    \
}

PAGED_DECODE(_f32, float, load_f32)
PAGED_DECODE(_bf16, uint16_t, load_bf16)

/* The AVX-512 body, for head_dim % 16 == 0: the same online softmax, with the rows of a task blocked
 * like a GEMM so that each K and V row serves several query rows. A task's rows are the G heads of a
 * KV head, or many sequences' heads stacked over a shared run: the more rows, the more a key is
 * reused. Per block: K and V widened once into float32 scratch (a bfloat16 pool; a float32 pool is
 * read in place), scores 6 rows x 4 keys in 24 accumulators of 16 lanes summed by reduce4, the
 * softmax 16 scores at a time with a polynomial exp, values 3 rows x 128 columns in 24 accumulators.
 * Each score and each output element goes through the same operations in the same order whatever
 * the number of rows in the task, so a row's result does not depend on the rows beside it. */
#define QK_ROWS 6
#define PV_ROWS 3
#define PV_VECS 8       /* 128 columns */

/* e^x for x <= 0 through the shared 2^x polynomial; below ~-87 gives ~2^-125. */
AVX512_TARGET static ALWAYS_INLINE __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _mm512_set1_ps(-125.0f));
    __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(EXP2_C5);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C4));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C3));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C2));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C1));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(EXP2_C0));
    return _mm512_scalef_ps(p, n);
}

/* Scores of NR query rows (d apart) against the 4 keys k[0..4) (float32): s[r * sstride + 0..4). */
AVX512_TARGET static ALWAYS_INLINE void qk512(const float* q, long d, const float* const* k, float* s, long sstride,
                                             const int NR) {
    __m512 a[QK_ROWS][4];
    for (int r = 0; r < NR; r++)
        for (int j = 0; j < 4; j++) a[r][j] = _mm512_setzero_ps();
    for (long p = 0; p < d; p += 16) {
        __m512 k0 = _mm512_loadu_ps(k[0] + p), k1 = _mm512_loadu_ps(k[1] + p), k2 = _mm512_loadu_ps(k[2] + p),
               k3 = _mm512_loadu_ps(k[3] + p);
        for (int r = 0; r < NR; r++) {
            __m512 x = _mm512_loadu_ps(q + r * d + p);
            a[r][0] = _mm512_fmadd_ps(x, k0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(x, k1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(x, k2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(x, k3, a[r][3]);
        }
    }
    for (int r = 0; r < NR; r++) _mm_storeu_ps(s + r * sstride, reduce4(a[r][0], a[r][1], a[r][2], a[r][3]));
}

/* acc[r] = acc[r] * alpha[r] + sum_t p[r][t] v[t] for NR rows (d apart), columns [e, e + 16 NV);
 * v rows (float32) vstride apart. */
AVX512_TARGET static ALWAYS_INLINE void pv512(float* acc, long d, long e, const float* alpha, const float* p,
                                             long pstride, const float* v, long vstride, long n, const int NR,
                                             const int NV) {
    __m512 c[PV_ROWS][PV_VECS];
    for (int r = 0; r < NR; r++) {
        __m512 al = _mm512_set1_ps(alpha[r]);
        for (int i = 0; i < NV; i++) c[r][i] = _mm512_mul_ps(_mm512_loadu_ps(acc + r * d + e + 16 * i), al);
    }
    for (long t = 0; t < n; t++) {
        __m512 w[PV_ROWS];
        for (int r = 0; r < NR; r++) w[r] = _mm512_set1_ps(p[r * pstride + t]);
        const float* vt = v + t * vstride + e;
        for (int i = 0; i < NV; i++) {
            __m512 x = _mm512_loadu_ps(vt + 16 * i);
            for (int r = 0; r < NR; r++) c[r][i] = _mm512_fmadd_ps(w[r], x, c[r][i]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int i = 0; i < NV; i++) _mm512_storeu_ps(acc + r * d + e + 16 * i, c[r][i]);
}

AVX512_TARGET static void pv_rows512(float* acc, long d, const float* alpha, const float* p, long pstride,
                                     const float* v, long vstride, long n, const int NR) {
    long e = 0;
    for (; e + 16 * PV_VECS <= d; e += 16 * PV_VECS) pv512(acc, d, e, alpha, p, pstride, v, vstride, n, NR, PV_VECS);
    for (; e < d; e += 16) pv512(acc, d, e, alpha, p, pstride, v, vstride, n, NR, 1);
}

/* Row r's scores s[0..n) (scaled here) update its running max m and sum l; they become e^(s - max),
 * and alpha the factor the earlier accumulator is scaled by. 16 scores at a time. */
AVX512_TARGET static void softmax_row512(float* sr, long n, float scale, float* m, float* l, float* alpha) {
    __m512 top = _mm512_set1_ps(*m);
    for (long t = 0; t < n; t += 16) {
        __mmask16 valid = (__mmask16)(n - t >= 16 ? 0xFFFF : (1u << (n - t)) - 1);
        __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(valid, sr + t), _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(sr + t, valid, x);
        top = _mm512_mask_max_ps(top, valid, top, x);
    }
    float new_max = _mm512_reduce_max_ps(top);
    __m512 sum = _mm512_setzero_ps(), mx = _mm512_set1_ps(new_max);
    for (long t = 0; t < n; t += 16) {
        __mmask16 valid = (__mmask16)(n - t >= 16 ? 0xFFFF : (1u << (n - t)) - 1);
        __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(valid, sr + t), mx)));
        _mm512_mask_storeu_ps(sr + t, valid, e);
        sum = _mm512_add_ps(sum, e);
    }
    *alpha = expf(*m - new_max);   /* 0 on the first block: m = -inf */
    *l = *l * *alpha + _mm512_reduce_add_ps(sum);
    *m = new_max;
}

/* n rows of a pool block (stride apart) as float32 rows d apart: widened from bfloat16 into dst, or,
 * for a float32 pool, read in place (*stride_out says which). */
AVX512_TARGET static const float* rows_f32_bf16(const uint16_t* src, long stride, long n, long d, float* dst,
                                                long* stride_out) {
    for (long t = 0; t < n; t++)
        for (long e = 0; e < d; e += 16)
            _mm512_storeu_ps(dst + t * d + e, _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(src + t * stride + e))), 16)));
    *stride_out = d;
    return dst;
}

AVX512_TARGET static const float* rows_f32_f32(const float* src, long stride, long n, long d, float* dst,
                                               long* stride_out) {
    (void)n; (void)d; (void)dst;
    *stride_out = stride;
    return src;
}

/* The n rows (stride elements apart, row_bytes each) of the next block, asked of the caches while
 * this one is computed: a layer's K/V come from memory (the step's weights passed through the caches
 * since), and a head's rows lie a token row apart, a stride the hardware prefetchers follow late. */
static inline void prefetch_rows(const char* p, long stride_bytes, long n, long row_bytes) {
    for (long t = 0; t < n; t++)
        for (long o = 0; o < row_bytes; o += 64) _mm_prefetch(p + t * stride_bytes + o, _MM_HINT_T0);
}

#define PAGED_DECODE512(S, T)                                                                            \
AVX512_TARGET static void decode512##S(const float* q, const T* pool, const long* tables, const long* lens, \
                                       long batch, long kv_heads, long rows, long head_dim, long num_blocks, \
                                       long block_size, long table_width, float scale, float* out, float* lse, \
                                       float* state_m, float* state_l, int carry_in, int finalize, int threads) { \
    const long token_stride = kv_heads * head_dim;                                                       \
    const long block_stride = block_size * token_stride;                                                 \
    const long sstride = (block_size + 15) / 16 * 16;  /* scores: four keys per store, 16 per softmax step */ \
    const long d = head_dim;                                                                             \
    const T* v_pool = pool + num_blocks * block_stride;                                                  \
    _Pragma("omp parallel num_threads(threads)")                                                         \
    {                                                                                                    \
        float* m = malloc(sizeof(float) * (rows * (3 + sstride) + 2 * block_size * d));                  \
        float* l = m + rows;                                                                             \
        float* alpha = l + rows;                                                                         \
        float* s = alpha + rows;                                                                         \
        float* kbuf = s + rows * sstride;                                                                \
        float* vbuf = kbuf + block_size * d;                                                             \
        _Pragma("omp for schedule(static)")                                                              \
        for (long task = 0; task < batch * kv_heads; task++) {                                           \
            long b = task / kv_heads, h = task % kv_heads;                                               \
            const float* qb = q + task * rows * d;                                                       \
            float* acc = out + task * rows * d;                                                          \
            start_rows(acc, m, l, state_m + task * rows, state_l + task * rows, rows, d, carry_in);      \
            long len = lens[b];                                                                          \
            for (long j = 0; j * block_size < len; j++) {                                                \
                long n = len - j * block_size < block_size ? len - j * block_size : block_size;          \
                long blk = tables[b * table_width + j];                                                  \
                if ((j + 1) * block_size < len) {                                                        \
                    long next = tables[b * table_width + j + 1];                                         \
                    long nn = len - (j + 1) * block_size < block_size ? len - (j + 1) * block_size : block_size; \
                    prefetch_rows((const char*)(pool + next * block_stride + h * d), token_stride * sizeof(T), nn, \
                                  d * sizeof(T));                                                        \
                    prefetch_rows((const char*)(v_pool + next * block_stride + h * d), token_stride * sizeof(T), nn, \
                                  d * sizeof(T));                                                        \
                }                                                                                        \
                long kstride, vstride;                                                                   \
                const float* kb = rows_f32##S(pool + blk * block_stride + h * d, token_stride, n, d, kbuf, &kstride); \
                const float* vb = rows_f32##S(v_pool + blk * block_stride + h * d, token_stride, n, d, vbuf, &vstride); \
                for (long t = 0; t < n; t += 4) {                                                        \
                    const float* k[4];                                                                   \
                    /* past the block's end the last key stands in: its scores land in unread slots */  \
                    for (int i = 0; i < 4; i++) k[i] = kb + (t + i < n ? t + i : n - 1) * kstride;       \
                    long r = 0;                                                                          \
                    for (; r + QK_ROWS <= rows; r += QK_ROWS) qk512(qb + r * d, d, k, s + r * sstride + t, sstride, QK_ROWS); \
                    switch (rows - r) {                                                                  \
                        case 5: qk512(qb + r * d, d, k, s + r * sstride + t, sstride, 5); break;         \
                        case 4: qk512(qb + r * d, d, k, s + r * sstride + t, sstride, 4); break;         \
                        case 3: qk512(qb + r * d, d, k, s + r * sstride + t, sstride, 3); break;         \
                        case 2: qk512(qb + r * d, d, k, s + r * sstride + t, sstride, 2); break;         \
                        case 1: qk512(qb + r * d, d, k, s + r * sstride + t, sstride, 1); break;         \
                        default: break;                                                                  \
                    }                                                                                    \
                }                                                                                        \
                for (long r = 0; r < rows; r++) softmax_row512(s + r * sstride, n, scale, m + r, l + r, alpha + r); \
                long r = 0;                                                                              \
                for (; r + PV_ROWS <= rows; r += PV_ROWS)                                                \
                    pv_rows512(acc + r * d, d, alpha + r, s + r * sstride, sstride, vb, vstride, n, PV_ROWS); \
                if (rows - r == 2) pv_rows512(acc + r * d, d, alpha + r, s + r * sstride, sstride, vb, vstride, n, 2); \
                else if (rows - r == 1) pv_rows512(acc + r * d, d, alpha + r, s + r * sstride, sstride, vb, vstride, n, 1); \
            }                                                                                            \
            end_rows(acc, m, l, lse + task * rows, state_m + task * rows, state_l + task * rows, rows, d, finalize); \
        }                                                                                                \
        free(m);                                                                                         \
    }                                                                                                    \
}

PAGED_DECODE512(_f32, float)
PAGED_DECODE512(_bf16, uint16_t)

/* avx512: the caller has checked that the CPU runs AVX-512 and head_dim % 16 == 0. */
void paged_decode_attention(const float* q, const void* pool, int pool_bf16, const long* tables, const long* lens,
                            long batch, long kv_heads, long rows, long head_dim, long num_blocks,
                            long block_size, long table_width, float scale, float* out, float* lse,
                            float* state_m, float* state_l, int carry_in, int finalize, int avx512,
                            int threads) {
#define DECODE_ARGS tables, lens, batch, kv_heads, rows, head_dim, num_blocks, block_size, table_width, scale, \
                    out, lse, state_m, state_l, carry_in, finalize, threads
    if (avx512 && pool_bf16) decode512_bf16(q, pool, DECODE_ARGS);
    else if (avx512) decode512_f32(q, pool, DECODE_ARGS);
    else if (pool_bf16) decode_bf16(q, pool, DECODE_ARGS);
    else decode_f32(q, pool, DECODE_ARGS);
#undef DECODE_ARGS
}
