/* Decode attention read straight from the paged KV pool, float32 math, AVX2 + FMA.
 *
 * For each (sequence b, KV head h): the R query rows of q[b, h] (the G query heads of a
 * grouped-query KV head, or several sequences' heads stacked over a shared run) attend to
 * the first lens[b] slots of the blocks tables[b, :], with an online softmax block by
 * block. Returns the outputs and the log-sum-exps of the scaled scores, so partial results
 * over disjoint parts of a context merge exactly.
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
                      long table_width, float scale, float* out, float* lse, int threads) {              \
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
            for (long r = 0; r < rows; r++) {                                                            \
                m[r] = -INFINITY;                                                                        \
                l[r] = 0.0f;                                                                             \
                for (long e = 0; e < head_dim; e++) acc[r * head_dim + e] = 0.0f;                        \
            }                                                                                            \
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
            for (long r = 0; r < rows; r++) {                                                            \
                float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;                                            \
                for (long e = 0; e < head_dim; e++) acc[r * head_dim + e] *= inv;                        \
                lse[task * rows + r] = l[r] > 0.0f ? m[r] + logf(l[r]) : -INFINITY;                      \
            }                                                                                            \
        }                                                                                                \
        free(m);                                                                                         \
    }                                                                                                    \
}

PAGED_DECODE(_f32, float, load_f32)
PAGED_DECODE(_bf16, uint16_t, load_bf16)

void paged_decode_attention(const float* q, const void* pool, int pool_bf16, const long* tables, const long* lens,
                            long batch, long kv_heads, long rows, long head_dim, long num_blocks,
                            long block_size, long table_width, float scale, float* out, float* lse,
                            int threads) {
    if (pool_bf16)
        decode_bf16(q, pool, tables, lens, batch, kv_heads, rows, head_dim, num_blocks, block_size, table_width,
                    scale, out, lse, threads);
    else
        decode_f32(q, pool, tables, lens, batch, kv_heads, rows, head_dim, num_blocks, block_size, table_width,
                   scale, out, lse, threads);
}
