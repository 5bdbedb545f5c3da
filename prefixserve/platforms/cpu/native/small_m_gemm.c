/* y[m, n] = x[m, k] @ w[n, k]^T (+ bias[n]) for the few rows of a decode step, over row-major weights:
 * float32, or bfloat16 weights widened (a model's projections are packed for packed_gemm.c instead where
 * the CPU runs that kernel in their dtype: float32 with AVX-512, bfloat16 with avx512_bf16).
 *
 * Library GEMMs (MKL, oneDNN) pack and block for large m; with 1-64 rows they stream the weight at a
 * third to a half of the memory bandwidth on AMD EPYC. Here each weight row is read from memory once
 * and reused from L1 for every row of x. Threads split the weight rows, so the parallel loop runs on
 * the OpenMP runtime torch already loaded (same soname), sharing its thread pool.
 *
 * Three bodies; the caller picks the widest the CPU runs:
 * - small_m_gemm / small_m_gemm_bf16: AVX2 + FMA. A tile of 6 weight rows against each pair of x rows
 *   in 12 accumulators of 8 lanes, the next tile prefetched while the pairs after the first reuse this
 *   one from cache. The bfloat16 variant reads a bfloat16 weight and float32 x, bias
 *   and y: each weight lane is widened by a shift and multiplied in float32.
 * - small_m_gemm_avx512 (below): float32 on AVX-512, 4 x 6 register tiles.
 *
 * The AVX2 bodies require k % 8 == 0, all of them contiguous row-major operands; the Python side checks.
 */
#include <immintrin.h>
#include <stddef.h>
#include <omp.h>
#include <stdint.h>

#include "simd.h"

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

/* The next weight tile's cache lines, requested a few at a time while the current tile is reused.
 * A tile's first pair of x rows reads it from memory, the other pairs from cache; left to the hardware
 * prefetcher, a core runs those cached passes with no memory traffic in flight and then stalls on the
 * next tile, whose rows (a whole row apart) it cannot predict. One line every `every` steps, from the
 * second pass on, spreads the next tile over the cached passes so the two overlap: 1.14x at 16 rows of
 * the 0.6B model's shapes, weights on huge pages, while the memory was quiet; within noise while the
 * machine's neighbours loaded it (Zen 3 EPYC, 2 threads). */
typedef struct {
    const char* next;       /* the next tile's first row; NULL: nothing to prefetch */
    size_t row_bytes;
    long first, last;       /* its lines [first, last) in row-major order, this pass */
    long every;             /* steps between two of them */
} ahead_t;

/* This pass's share, for pass `pass` of `passes` over a tile of k-element rows: none in the first,
 * the next tile's lines spread evenly over the rest. */
static inline ahead_t ahead_of(const void* next, size_t row_bytes, long pass, long passes, size_t k) {
    ahead_t a = {NULL, row_bytes, 0, 0, 1};
    long lines = TILE_N * (long)((row_bytes + 63) / 64), steps = (long)(k / 8);
    if (!next || pass == 0) return a;
    a.next = (const char*)next;
    a.every = (passes - 1) * steps / lines;
    if (a.every < 1) a.every = 1;
    long per_pass = (steps + a.every - 1) / a.every;
    a.first = (pass - 1) * per_pass < lines ? (pass - 1) * per_pass : lines;
    a.last = a.first + per_pass < lines ? a.first + per_pass : lines;
    return a;
}

/* One kernel body for both weight types: W is the weight element type, LOAD widens 8 of them to
 * float32 lanes. Defines tile_6x2##S (rows x0, x1 against weight rows w[0..6): writes y0[0..6),
 * y1[0..6), prefetching ahead's lines), tile_6x1##S, dot##S and the exported small_m_gemm##S. */
#define SMALL_M_GEMM(S, W, LOAD)                                                                         \
static ALWAYS_INLINE void tile_6x2##S(const float* x0, const float* x1, const W* w, size_t k,            \
                                      const float* bias, float* y0, float* y1, ahead_t ahead) {          \
    __m256 a[TILE_N][2];                                                                                 \
    for (int i = 0; i < TILE_N; i++) a[i][0] = a[i][1] = _mm256_setzero_ps();                           \
    const long per_row = (long)((ahead.row_bytes + 63) / 64);                                            \
    long line = ahead.first, count = 0;                                                                  \
    for (size_t p = 0; p < k; p += 8) {                                                                  \
        if (line < ahead.last && ++count == ahead.every) {                                               \
            _mm_prefetch(ahead.next + line / per_row * ahead.row_bytes + line % per_row * 64,             \
                         _MM_HINT_T0);                                                                   \
            count = 0;                                                                                   \
            line++;                                                                                      \
        }                                                                                                \
        __m256 u = _mm256_loadu_ps(x0 + p), v = _mm256_loadu_ps(x1 + p);                                \
        for (int i = 0; i < TILE_N; i++) {                                                               \
            __m256 t = LOAD(w + i * k + p);                                                              \
            IN_REGISTER(t);                                                                              \
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
        const W* next = t + 1 < tiles ? wt + TILE_N * (size_t)k : NULL;                                  \
        long r = 0;                                                                                      \
        for (; r + 2 <= m; r += 2)                                                                       \
            tile_6x2##S(x + r * k, x + (r + 1) * k, wt, (size_t)k, bt, y + r * n + i, y + (r + 1) * n + i, \
                        ahead_of(next, (size_t)k * sizeof(W), r / 2, m / 2, (size_t)k));                 \
        if (r < m) tile_6x1##S(x + r * k, wt, (size_t)k, bt, y + r * n + i);                             \
    }                                                                                                    \
    for (long i = tiles * TILE_N; i < n; i++)                                                            \
        for (long r = 0; r < m; r++)                                                                     \
            y[r * n + i] = dot##S(x + r * k, w + i * k, (size_t)k) + bias_at(bias, (size_t)i);           \
}

SMALL_M_GEMM(, float, load_f32)
SMALL_M_GEMM(_bf16, uint16_t, load_bf16)

/* The AVX-512 float32 body, register-blocked for 2-64 rows: a tile of TN4 weight rows against up to TM6 x rows
 * holds 24 accumulators of 16 lanes, so every weight load feeds up to six multiply-adds and every x load
 * four, and the loop runs at the FMA rate instead of the load rate. Rows are
 * taken six at a time while the weight tile stays in L1; each output's sum runs over the same lanes in
 * the same order whatever the rows beside it, so a row's result does not depend on the batch. These
 * functions carry their own target attribute; the caller runs them only where torch reports AVX-512. */
#define TN4 4
#define TM6 6
/* From this many rows on, a tile's passes prefetch the next tile's weights, spread over all of them
 * (rows512): the next tile is then in L1 when its passes start (1.4x at 16 rows on a Zen 5 EPYC when
 * the first pass alone requested it; spreading it, 1.26x more). With one or two rows the tile is a
 * single pass and the hardware prefetcher alone streams it faster. */
#define PREFETCH_MIN_ROWS 4
/* Up to this many rows in a tile, its weight rows are read one after another rather than interleaved:
 * 4 interleaved streams of one tile read at 20-23 GB/s where one row at a time reads at 29-44 GB/s
 * (bfloat16, one or two x rows, a Zen 4 EPYC, 2 threads; torch's sum over 1 GiB at 30-55 GB/s). */
#define ROW_ORDER_MAX_ROWS 2
/* With many rows: rows of x are taken ROW_BLOCK at a time (they stay in L2) against CHUNK_BYTES of
 * weight tiles at a time (in L2 too), every row block against one chunk before the next chunk, so
 * each weight is read from memory once and x from L3. */
#define ROW_BLOCK 48
#define CHUNK_BYTES (512 * 1024)
/* k per pass over a row group: 2 KB of each row, so six rows of x and four of the weight (20 KB) stay
 * in L1 (with k = 3072 in bfloat16 they did not, and the loads came from L2 at 0.7x the rate). */
#define K_CHUNK_BYTES 2048

/* Loading 16 elements as one vector: unmasked, or the first k % 16 under a mask (the tail). */
AVX512_TARGET static ALWAYS_INLINE __m512 vec_f32(const float* p, __mmask16 m, int full) {
    return full ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(m, p);
}

/* acc[i][j] over the whole of k for weight rows w[i] (i < TN) and x rows x[j] (j < TM): the TM x
 * vectors of a step are loaded once, then each weight vector once and multiplied into its TM
 * accumulators (24 + 6 + 1 of the 32 registers). TN and TM are constants at every call site, so the
 * loops unroll and the accumulators stay in registers. */
AVX512_TARGET static ALWAYS_INLINE void step512(__m512 a[TN4][TM6], const float* x, const float* w, size_t k,
                                                size_t p, __mmask16 mask, int full, const int TN, const int TM) {
    __m512 xv[TM6];
    for (int j = 0; j < TM; j++) xv[j] = vec_f32(x + j * k + p, mask, full);
    for (int i = 0; i < TN; i++) {
        __m512 wv = vec_f32(w + i * k + p, mask, full);
        for (int j = 0; j < TM; j++) a[i][j] = _mm512_fmadd_ps(wv, xv[j], a[i][j]);
    }
}

/* The tile's sums over k in [p0, p1): started from zero (p0 == 0) or from the vectors saved in `save`,
 * and finished (p1 == k: reduced, bias added, stored) or saved again. Saving and reloading a vector is
 * exact, so a chunked k gives the same bits as one pass. */
AVX512_TARGET static ALWAYS_INLINE void tile512(const float* x, const float* w, size_t k, size_t p0, size_t p1,
                                                __m512* save, const float* bias, float* y, size_t n,
                                                const int TN, const int TM, const char* ahead,
                                                long line0, long lines) {
    __m512 a[TN4][TM6];
    for (int i = 0; i < TN; i++)
        for (int j = 0; j < TM; j++) a[i][j] = p0 ? save[i * TM6 + j] : _mm512_setzero_ps();
    size_t p = p0;
    if (TM <= ROW_ORDER_MAX_ROWS) {
        /* few x rows: each weight row read start to end in turn, one stream at a time; the same
         * multiply-adds in the same order as the interleaved loop below, so the same bits */
        const __mmask16 tail = (__mmask16)(((uint64_t)1 << ((p1 - p0) % 16)) - 1);
        for (int i = 0; i < TN; i++) {
            size_t q = p0;
            for (; q + 16 <= p1; q += 16) {
                __m512 wv = vec_f32(w + i * k + q, 0, 1);
                for (int j = 0; j < TM; j++) a[i][j] = _mm512_fmadd_ps(wv, vec_f32(x + j * k + q, 0, 1), a[i][j]);
            }
            if (q < p1) {
                __m512 wv = vec_f32(w + i * k + q, tail, 0);
                for (int j = 0; j < TM; j++) a[i][j] = _mm512_fmadd_ps(wv, vec_f32(x + j * k + q, tail, 0), a[i][j]);
            }
        }
        p = p1;
    }
    if (ahead) {
        /* this pass's share of the next tile, `lines` lines spread evenly over its steps */
        const long steps = (long)((p1 - p) / 16);
        long line = line0, owed = 0;
        for (; p + 16 <= p1; p += 16) {
            request_share(ahead, lines, steps, &line, &owed, 0);
            step512(a, x, w, k, p, 0, 1, TN, TM);
        }
        for (; line < line0 + lines; line++) _mm_prefetch(ahead + 64 * line, _MM_HINT_T0);
    }
    for (; p + 16 <= p1; p += 16) step512(a, x, w, k, p, 0, 1, TN, TM);
    if (p < p1) step512(a, x, w, k, p, (__mmask16)(((uint64_t)1 << (p1 - p)) - 1), 0, TN, TM);
    if (p1 < k) {
        for (int i = 0; i < TN; i++)
            for (int j = 0; j < TM; j++) save[i * TM6 + j] = a[i][j];
        return;
    }
    for (int j = 0; j < TM; j++) {
        if (TN == TN4) {
            __m128 sums = reduce4(a[0][j], a[1][j], a[2][j], a[3][j]);
            if (bias) sums = _mm_add_ps(sums, _mm_loadu_ps(bias));
            _mm_storeu_ps(y + j * n, sums);
        } else {
            for (int i = 0; i < TN; i++) y[j * n + i] = _mm512_reduce_add_ps(a[i][j]) + bias_at(bias, i);
        }
    }
}

/* All m rows (at most ROW_BLOCK: the saved sums are sized for it) against TN weight rows, six rows at a
 * time, k in chunks of K_CHUNK_BYTES per row so that a row group and the weight tile stay in L1 together.
 * `ahead`: the next tile (TN4 contiguous rows), or NULL; its lines are requested spread evenly over every
 * interleaved pass (chunk x row group) of this tile, so memory keeps busy while the groups after the first
 * reuse this tile from L1: requested all in the first group, they queued behind one another there, and the
 * later groups then ran with no memory traffic in flight. */
AVX512_TARGET static ALWAYS_INLINE void rows512(const float* x, const float* w, size_t k, const float* bias,
                                                float* y, size_t n, long m, const int TN, const float* ahead) {
    __m512 save[(ROW_BLOCK + TM6 - 1) / TM6][TN4 * TM6];
    /* one row of x stays in L1 whatever k: no chunks, so each weight row is one sequential read */
    const size_t kc = m == 1 ? k : K_CHUNK_BYTES / sizeof(float);
    /* passes that take a share of the prefetching: the interleaved ones (not a row-order tail group) */
    const long groups = m / TM6 + (m % TM6 > ROW_ORDER_MAX_ROWS);
    const long passes = groups * (long)((k + kc - 1) / kc);
    const long lines = ahead ? (long)((TN4 * k * sizeof(float) + 63) / 64) : 0;
    long pass = 0;
    for (size_t p0 = 0; p0 < k; p0 += kc) {
        size_t p1 = p0 + kc < k ? p0 + kc : k;
        for (long r = 0; r < m; r += TM6) {
            const int tm = m - r < TM6 ? (int)(m - r) : TM6;
            const char* next = tm > ROW_ORDER_MAX_ROWS && lines ? (const char*)ahead : NULL;
            const long first = next ? pass * lines / passes : 0;
            const long count = next ? (pass + 1) * lines / passes - first : 0;
            pass += next != NULL;
            switch (tm) {
                case 6: tile512(x + r * k, w, k, p0, p1, save[r / TM6], bias, y + r * n, n, TN, 6, next, first, count); break;
                case 5: tile512(x + r * k, w, k, p0, p1, save[r / TM6], bias, y + r * n, n, TN, 5, next, first, count); break;
                case 4: tile512(x + r * k, w, k, p0, p1, save[r / TM6], bias, y + r * n, n, TN, 4, next, first, count); break;
                case 3: tile512(x + r * k, w, k, p0, p1, save[r / TM6], bias, y + r * n, n, TN, 3, next, first, count); break;
                case 2: tile512(x + r * k, w, k, p0, p1, save[r / TM6], bias, y + r * n, n, TN, 2, NULL, 0, 0); break;
                default: tile512(x + r * k, w, k, p0, p1, save[r / TM6], bias, y + r * n, n, TN, 1, NULL, 0, 0); break;
            }
        }
    }
}

AVX512_TARGET void small_m_gemm_avx512(const float* x, const float* w, const float* bias, float* y,
                                         long m, long n, long k, int threads) {
    long tiles = n / TN4;
    #pragma omp parallel num_threads(threads)
    {
        /* each thread its share of the weight tiles (as schedule(static) would split them), a chunk
         * at a time: every row block runs over a chunk while it sits in L2 */
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        long t_begin = tiles * id / nt, t_end = tiles * (id + 1) / nt;
        long chunk = CHUNK_BYTES / (TN4 * k * (long)sizeof(float));
        if (chunk < 1) chunk = 1;
        for (long c = t_begin; c < t_end; c += chunk) {
            long c_end = c + chunk < t_end ? c + chunk : t_end;
            for (long r0 = 0; r0 < m; r0 += ROW_BLOCK) {
                long mb = m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK;
                for (long t = c; t < c_end; t++) {
                    size_t i = (size_t)t * TN4;
                    rows512(x + r0 * k, w + i * (size_t)k, (size_t)k, bias ? bias + i : NULL,
                               y + r0 * n + i, (size_t)n, mb, TN4,
                               mb >= PREFETCH_MIN_ROWS && t + 1 < t_end ? w + (i + TN4) * (size_t)k : NULL);
                }
            }
        }
        if (id == nt - 1)
            for (long i = tiles * TN4; i < n; i++)
                for (long r0 = 0; r0 < m; r0 += ROW_BLOCK)
                    rows512(x + r0 * k, w + i * (size_t)k, (size_t)k, bias ? bias + i : NULL, y + r0 * n + i,
                               (size_t)n, m - r0 < ROW_BLOCK ? m - r0 : ROW_BLOCK, 1, NULL);
    }
}

