/* y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]) for the few rows of a decode step, float32, AVX2 + FMA.
 *
 * Library GEMMs (MKL, oneDNN) pack and block for large m; with 1-32 rows they stream the weight at a
 * third to a half of the memory bandwidth on AMD EPYC. Here each weight row is read from memory once:
 * a tile of 6 weight rows stays in L1/L2 while every pair of x rows is multiplied into 12 register
 * accumulators (8 lanes of k each), then reduced. Threads split the weight rows, so the parallel loop
 * runs on the OpenMP runtime torch already loaded (same soname), sharing its thread pool.
 *
 * Requires k % 8 == 0 and contiguous row-major operands; the Python side checks both.
 *
 * small_m_gemm_bf16 reads a bfloat16 weight (half the bytes, so twice the rows per second at the
 * bandwidth bound) and float32 x, bias and y: each weight lane is widened by a shift and multiplied
 * in float32, so the only roundings are the caller's, of x before and y after.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define TILE_N 6

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

static inline float bias_at(const float* bias, size_t i) { return bias ? bias[i] : 0.0f; }

static inline __m256 load_f32(const float* p) { return _mm256_loadu_ps(p); }

/* bfloat16 bits widened to float32 by a shift: exact. */
static inline __m256 load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* One kernel body for both weight types: W is the weight element type, LOAD widens 8 of them to
 * float32 lanes. Defines tile_6x2##S (rows x0, x1 against weight rows w[0..6): writes y0[0..6),
 * y1[0..6)), tile_6x1##S, dot##S and the exported small_m_gemm##S. */
#define SMALL_M_GEMM(S, W, LOAD)                                                                         \
static inline void tile_6x2##S(const float* x0, const float* x1, const W* w, size_t k,                   \
                               const float* bias, float* y0, float* y1) {                                \
    __m256 a[TILE_N][2];                                                                                 \
    for (int i = 0; i < TILE_N; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();                           \
    for (size_t p = 0; p < k; p += 8) {                                                                  \
        __m256 u = _mm256_loadu_ps(x0 + p), v = _mm256_loadu_ps(x1 + p);                                \
        for (int i = 0; i < TILE_N; i++) {                                                               \
            __m256 t = LOAD(w + i * k + p);                                                              \
            a[i][0] = _mm256_fmadd_ps(t, u, a[i][0]);                                                    \
            a[i][1] = _mm256_fmadd_ps(t, v, a[i][1]);                                                    \
        }                                                                                                \
    }                                                                                                    \
    for (int i = 0; i < TILE_N; i++) {                                                                   \
        y0[i] = hsum(a[i][0]) + bias_at(bias, i);                                                        \
        y1[i] = hsum(a[i][1]) + bias_at(bias, i);                                                        \
    }                                                                                                    \
}                                                                                                        \
                                                                                                         \
static inline void tile_6x1##S(const float* x0, const W* w, size_t k, const float* bias, float* y0) {    \
    __m256 a[TILE_N];                                                                                    \
    for (int i = 0; i < TILE_N; i++) a[i] = _mm256_setzero_ps();                                         \
    for (size_t p = 0; p < k; p += 8) {                                                                  \
        __m256 u = _mm256_loadu_ps(x0 + p);                                                              \
        for (int i = 0; i < TILE_N; i++) a[i] = _mm256_fmadd_ps(LOAD(w + i * k + p), u, a[i]);          \
    }                                                                                                    \
    for (int i = 0; i < TILE_N; i++) y0[i] = hsum(a[i]) + bias_at(bias, i);                              \
}                                                                                                        \
                                                                                                         \
static inline float dot##S(const float* x, const W* w, size_t k) {                                       \
    __m256 a = _mm256_setzero_ps();                                                                      \
    for (size_t p = 0; p < k; p += 8) a = _mm256_fmadd_ps(LOAD(w + p), _mm256_loadu_ps(x + p), a);       \
    return hsum(a);                                                                                      \
}                                                                                                        \
                                                                                                         \
void small_m_gemm##S(const float* x, const W* w, const float* bias, float* y,                            \
                     long m, long n, long k, int threads) {                                              \
    long tiles = n / TILE_N;                                                                             \
    _Pragma("omp parallel for num_threads(threads) schedule(static)")                                    \
    for (long t = 0; t < tiles; t++) {                                                                   \
        size_t i = (size_t)t * TILE_N;                                                                   \
        const W* wt = w + i * (size_t)k;                                                                 \
        const float* bt = bias ? bias + i : NULL;                                                        \
        long r = 0;                                                                                      \
        for (; r + 2 <= m; r += 2)                                                                       \
            tile_6x2##S(x + r * k, x + (r + 1) * k, wt, (size_t)k, bt, y + r * n + i, y + (r + 1) * n + i); \
        if (r < m) tile_6x1##S(x + r * k, wt, (size_t)k, bt, y + r * n + i);                             \
    }                                                                                                    \
    for (long i = tiles * TILE_N; i < n; i++)                                                            \
        for (long r = 0; r < m; r++)                                                                     \
            y[r * n + i] = dot##S(x + r * k, w + i * k, (size_t)k) + bias_at(bias, (size_t)i);           \
}

SMALL_M_GEMM(, float, load_f32)
SMALL_M_GEMM(_bf16, uint16_t, load_bf16)
