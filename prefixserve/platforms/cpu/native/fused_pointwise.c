/* The pointwise work of a decoder layer, fused into one pass over memory each, float32, AVX2 + FMA.
 *
 * Between its GEMMs a layer normalises, rotates and gates activations of a few MB. In
 * torch each of those is several elementwise operators, each reading and writing the
 * whole tensor into a fresh allocation: rotary embedding alone is seven passes over q.
 * Here each is one read and one write.
 *
 *   add_rms_norm:  residual += delta (when delta is given); out = residual / rms(residual) * weight
 *   qk_norm_rope:  q and k heads read out of the fused qkv projection, each optionally
 *                  RMS-normed over the head and rotated (HF "rotate_half" layout), written contiguous
 *   silu_and_mul:  out = silu(gate) * up, gate and up the two halves of each row of the fused projection
 *
 * Rows are split among `threads` OpenMP threads; a call too small to pay for waking them runs on one.
 *
 * Each function has an AVX-512 body too (suffix _512; the caller picks it where the CPU runs it): the
 * same operations on each lane in 16 lanes, and sums over a row in the same order (blocks of 8
 * alternating between two 8-lane sums, one 16-lane sum's halves), so both bodies give the same bits.
 * The exponential and the division make these kernels compute-bound: 16 lanes take half the time
 * (prefill of 1560 tokens of a 0.6B model, bfloat16, per layer: SiLU 1.29 -> 0.67 ms; Zen 5 EPYC,
 * 2 threads).
 *
 * The *_bf16 variants take and return bfloat16 (as uint16_t bits) and compute in float32. The norms round
 * where the torch path and HF do (the normalised value, then its product with the weight); rotation
 * and gating round once, at the end. A row's result never depends on the other rows of the call, so
 * a token computes the same bits in any batch (prefix caching on and off agree exactly).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define PARALLEL_MIN_FLOATS 16384

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    return _mm_cvtss_f32(s);
}

/* e^x for x in [-87.3, 88.3] (clamped outside): 2^n * e^r with |r| <= ln2 / 2 and a degree-6 Taylor
 * polynomial for e^r, relative error ~1.2e-7. Defined once over the vector width (W: the intrinsics'
 * prefix, BITS: the register width, ROUND: the round-to-integer intrinsic), so exp256 and exp512 run the
 * same operations on each lane. */
#define DEFINE_EXP(NAME, W, BITS, ROUND, ...)                                                              \
__VA_ARGS__ static ALWAYS_INLINE __m##BITS NAME(__m##BITS x) {                                            \
    x = W##_min_ps(W##_max_ps(x, W##_set1_ps(-87.3f)), W##_set1_ps(88.3f));                                \
    __m##BITS n = ROUND(W##_mul_ps(x, W##_set1_ps(1.44269504088896341f)),                                  \
                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                    \
    /* ln 2 split in two so r keeps its low bits */                                                        \
    __m##BITS r = W##_fnmadd_ps(n, W##_set1_ps(0.693359375f), x);                                          \
    r = W##_fnmadd_ps(n, W##_set1_ps(-2.12194440e-4f), r);                                                 \
    __m##BITS p = W##_set1_ps(1.0f / 720.0f);                                                              \
    p = W##_fmadd_ps(p, r, W##_set1_ps(1.0f / 120.0f));                                                    \
    p = W##_fmadd_ps(p, r, W##_set1_ps(1.0f / 24.0f));                                                     \
    p = W##_fmadd_ps(p, r, W##_set1_ps(1.0f / 6.0f));                                                      \
    p = W##_fmadd_ps(p, r, W##_set1_ps(0.5f));                                                             \
    p = W##_fmadd_ps(p, r, W##_set1_ps(1.0f));                                                             \
    p = W##_fmadd_ps(p, r, W##_set1_ps(1.0f));                                                             \
    __m##BITS##i scale = W##_slli_epi32(W##_add_epi32(W##_cvtps_epi32(n), W##_set1_epi32(127)), 23);       \
    return W##_mul_ps(p, W##_castsi##BITS##_ps(scale));                                                    \
}
DEFINE_EXP(exp256, _mm256, 256, _mm256_round_ps)
DEFINE_EXP(exp512, _mm512, 512, _mm512_roundscale_ps, AVX512_TARGET)

/* 1 / rms of n floats (n % 8 == 0) */
static inline float inv_rms(const float* x, long n, float eps) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 u = _mm256_loadu_ps(x + i), w = _mm256_loadu_ps(x + i + 8);
        a0 = _mm256_fmadd_ps(u, u, a0);
        a1 = _mm256_fmadd_ps(w, w, a1);
    }
    for (; i < n; i += 8) {
        __m256 u = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(u, u, a0);
    }
    return 1.0f / sqrtf(hsum(_mm256_add_ps(a0, a1)) / (float)n + eps);
}

/* residual, out: [rows, n] (row strides n); delta may be NULL. n % 8 == 0. */
void add_rms_norm(float* residual, const float* delta, const float* weight, float eps, float* out,
                  long rows, long n, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN_FLOATS)
    for (long t = 0; t < rows; t++) {
        float* x = residual + t * n;
        if (delta != 0) {
            const float* d = delta + t * n;
            for (long i = 0; i < n; i += 8)
                _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(d + i)));
        }
        __m256 r = _mm256_set1_ps(inv_rms(x, n, eps));
        float* y = out + t * n;
        for (long i = 0; i < n; i += 8)
            _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), r),
                                                  _mm256_loadu_ps(weight + i)));
    }
}

/* One head: dst = rotate(src * (weight / rms(src)) or src), cos/sin: [d / 2]. d % 16 == 0. */
static inline void norm_rotate(const float* src, float* dst, const float* weight, float eps,
                               const float* cos, const float* sin, long d) {
    const long half = d / 2;
    __m256 r = _mm256_set1_ps(weight != 0 ? inv_rms(src, d, eps) : 1.0f);
    for (long i = 0; i < half; i += 8) {
        __m256 x1 = _mm256_mul_ps(_mm256_loadu_ps(src + i), r);
        __m256 x2 = _mm256_mul_ps(_mm256_loadu_ps(src + half + i), r);
        if (weight != 0) {
            x1 = _mm256_mul_ps(x1, _mm256_loadu_ps(weight + i));
            x2 = _mm256_mul_ps(x2, _mm256_loadu_ps(weight + half + i));
        }
        __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
        _mm256_storeu_ps(dst + i, _mm256_fmsub_ps(x1, c, _mm256_mul_ps(x2, s)));
        _mm256_storeu_ps(dst + half + i, _mm256_fmadd_ps(x2, c, _mm256_mul_ps(x1, s)));
    }
}

/* ------------------------------------------------------------------ bfloat16 */

static inline __m256 load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

static inline float inv_rms_bf16(const uint16_t* x, long n, float eps) {
    __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (long i = 0; i < n; i += 8) {
        __m256 u = load_bf16(x + i);
        a[(i / 8) & 1] = _mm256_fmadd_ps(u, u, a[(i / 8) & 1]);
    }
    return 1.0f / sqrtf(hsum(_mm256_add_ps(a[0], a[1])) / (float)n + eps);
}

void add_rms_norm_bf16(uint16_t* residual, const uint16_t* delta, const uint16_t* weight, float eps,
                       uint16_t* out, long rows, long n, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN_FLOATS)
    for (long t = 0; t < rows; t++) {
        uint16_t* x = residual + t * n;
        if (delta != 0) {
            const uint16_t* d = delta + t * n;
            for (long i = 0; i < n; i += 8)
                store_bf16(x + i, _mm256_add_ps(load_bf16(x + i), load_bf16(d + i)));
        }
        __m256 r = _mm256_set1_ps(inv_rms_bf16(x, n, eps));
        uint16_t* y = out + t * n;
        for (long i = 0; i < n; i += 8)
            store_bf16(y + i, _mm256_mul_ps(round_bf16(_mm256_mul_ps(load_bf16(x + i), r)), load_bf16(weight + i)));
    }
}

static inline void norm_rotate_bf16(const uint16_t* src, uint16_t* dst, const uint16_t* weight, float eps,
                                    const uint16_t* cos, const uint16_t* sin, long d) {
    const long half = d / 2;
    __m256 r = _mm256_set1_ps(weight != 0 ? inv_rms_bf16(src, d, eps) : 1.0f);
    for (long i = 0; i < half; i += 8) {
        __m256 x1 = load_bf16(src + i), x2 = load_bf16(src + half + i);
        if (weight != 0) {
            x1 = round_bf16(_mm256_mul_ps(round_bf16(_mm256_mul_ps(x1, r)), load_bf16(weight + i)));
            x2 = round_bf16(_mm256_mul_ps(round_bf16(_mm256_mul_ps(x2, r)), load_bf16(weight + half + i)));
        }
        __m256 c = load_bf16(cos + i), s = load_bf16(sin + i);
        store_bf16(dst + i, _mm256_fmsub_ps(x1, c, _mm256_mul_ps(x2, s)));
        store_bf16(dst + half + i, _mm256_fmadd_ps(x2, c, _mm256_mul_ps(x1, s)));
    }
}

/* ------------------------------------------------------------------ row drivers, both dtypes */

static inline __m256 load_f32(const float* p) { return _mm256_loadu_ps(p); }
static inline void store_f32(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

/* One head's K row (d elements of elt = 2 or 4 bytes) into its column of the panel holding slot `at` of the
 * head's region (its 32-bit words, bfloat16 pairs or floats, down the column), and its V row into the halves
 * of its pair row (bfloat16) or its row (float32) (kv_layout.py) */
static inline void put_panel_k(void* region, long at, long d, long elt, const void* row) {
    const long words = d * elt / 4;
    uint32_t* panel = (uint32_t*)region + at / 16 * 16 * words + at % 16;
    const uint32_t* w = (const uint32_t*)row;
    for (long i = 0; i < words; i++) panel[i * 16] = w[i];
}

static inline void put_panel_v(void* region, long at, long d, long elt, const void* row) {
    if (elt == 4) {
        memcpy((float*)region + at * d, row, sizeof(float) * d);
        return;
    }
    uint16_t* pair = (uint16_t*)region + at / 2 * 2 * d + at % 2;
    const uint16_t* x = (const uint16_t*)row;
    for (long e = 0; e < d; e++) pair[2 * e] = x[e];
}

/* Tokens' K and V rows ([T, k_heads, d] at row strides k_stride and v_stride elements of elt bytes, heads
 * contiguous) into slots[t] of a pool of panels (K region of block b, head h at (b * k_heads + h) *
 * block_size * d of k_pool; V the same in v_pool): a prefill's writes. 1200 tokens of 8 heads of 128 over
 * whole blocks, bfloat16: 1.0 ms, against 9.1 ms for torch's indexed copy through the panels' strides and
 * 0.94 ms for its index_copy_ into a pool of rows (2-core Zen 4 EPYC). The caller checks the slots. */
void write_panels(const void* k, long k_stride, const void* v, long v_stride, void* k_pool, void* v_pool,
                  const long* slots, long tokens, long k_heads, long d, long block_size, long elt, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (tokens * k_heads * d >= PARALLEL_MIN_FLOATS)
    for (long t = 0; t < tokens; t++) {
        const long block = slots[t] / block_size, at = slots[t] % block_size;
        for (long h = 0; h < k_heads; h++) {
            const long region = elt * (block * k_heads + h) * block_size * d;
            put_panel_k((char*)k_pool + region, at, d, elt, (const char*)k + elt * (t * k_stride + h * d));
            put_panel_v((char*)v_pool + region, at, d, elt, (const char*)v + elt * (t * v_stride + h * d));
        }
    }
}

/* qkv: [rows, row_stride], q heads at column 0, k heads right after them, then (with v_out) as many v heads;
 * q_out: [rows, q_heads, d]; cos, sin: [rows, d / 2]; q_weight, k_weight: [d] or both NULL (no per-head
 * norm). d % 16 == 0. k_out: [rows, k_heads, d], or with `slots` a paged pool whose slot slots[t] takes
 * token t's k, and v_out (NULL: no v) the same for its v heads, copied as they are: a decode step writes its
 * new K/V into the cache here instead of in two indexed copies after (0.5 ms of a 16-sequence bfloat16 step
 * of the 0.6B model, in torch's index_copy_; 2-core Zen 5 EPYC). The caller checks the slots. The pools hold
 * rows (layout 0: slot s at row s of [S, k_heads, d]) or panels (layout 1, kv_layout.py: the normed, rotated
 * k row is made in place and its 32-bit words go to their panel's column, the v row's elements to the halves
 * of their pair rows; blocks of block_size slots).
 * The row driver of every body: qk_norm_rope##S over one head's NORM_ROTATE, with TARGET's attribute. */
#define QK_NORM_ROPE(S, TARGET, T, NORM_ROTATE)                                                            \
TARGET void qk_norm_rope##S(const T* qkv, long row_stride, long q_heads, long k_heads, long d,             \
                            const T* q_weight, const T* k_weight, float eps, const T* cos, const T* sin,   \
                            T* q_out, T* k_out, T* v_out, const long* slots, long rows, long block_size,   \
                            int layout, int threads) {                                                     \
    const long heads = q_heads + k_heads;                                                                  \
    const int panels = slots && layout == 1;                                                               \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows * heads * d >= PARALLEL_MIN_FLOATS)") \
    for (long t = 0; t < rows; t++) {                                                                      \
        const T* src = qkv + t * row_stride;                                                               \
        const T* c = cos + t * (d / 2);                                                                    \
        const T* s = sin + t * (d / 2);                                                                    \
        for (long h = 0; h < q_heads; h++)                                                                 \
            NORM_ROTATE(src + h * d, q_out + (t * q_heads + h) * d, q_weight, eps, c, s, d);               \
        if (!panels) {                                                                                     \
            const long row = (slots ? slots[t] : t) * k_heads * d;                                         \
            for (long h = 0; h < k_heads; h++)                                                             \
                NORM_ROTATE(src + (q_heads + h) * d, k_out + row + h * d, k_weight, eps, c, s, d);         \
            if (v_out) memcpy(v_out + row, src + heads * d, sizeof(T) * k_heads * d);                      \
            continue;                                                                                      \
        }                                                                                                  \
        const long block = slots[t] / block_size, at = slots[t] % block_size;                              \
        T k_row[d];                                                                                        \
        for (long h = 0; h < k_heads; h++) {                                                               \
            const long region = (block * k_heads + h) * block_size * d;                                    \
            NORM_ROTATE(src + (q_heads + h) * d, k_row, k_weight, eps, c, s, d);                           \
            put_panel_k(k_out + region, at, d, sizeof(T), k_row);                                          \
            if (v_out) put_panel_v(v_out + region, at, d, sizeof(T), src + (heads + h) * d);               \
        }                                                                                                  \
    }                                                                                                      \
}

/* gate_up: [rows, 2 n] (gate then up), out: [rows, n]. n % 8 == 0. */
#define SILU_AND_MUL(S, T, LOAD, STORE)                                                                    \
void silu_and_mul##S(const T* gate_up, T* out, long rows, long n, int threads) {                          \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN_FLOATS)") \
    for (long t = 0; t < rows; t++) {                                                                      \
        const T* g = gate_up + t * 2 * n;                                                                  \
        const T* u = g + n;                                                                                \
        T* y = out + t * n;                                                                                \
        const __m256 one = _mm256_set1_ps(1.0f);                                                           \
        for (long i = 0; i < n; i += 8) {                                                                  \
            __m256 x = LOAD(g + i);                                                                        \
            __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), x)))); \
            STORE(y + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), LOAD(u + i)));                               \
        }                                                                                                  \
    }                                                                                                      \
}

QK_NORM_ROPE(, , float, norm_rotate)
QK_NORM_ROPE(_bf16, , uint16_t, norm_rotate_bf16)
SILU_AND_MUL(, float, load_f32, store_f32)
SILU_AND_MUL(_bf16, uint16_t, load_bf16, store_bf16)

/* ------------------------------------------------------------------ AVX-512 bodies */

/* The first `n` (<= 16) lanes, the rest zero */
#define LANES(n) ((__mmask16)((n) >= 16 ? 0xFFFF : (1u << (n)) - 1))
/* BODY for i = 0, 16, ... < n with k the lanes of [i, n): whole vectors under a constant mask (masked loads
 * and stores under a computed one took 1.5x the time), then the rest */
#define EACH16(i, n, k, ...)                                                                               \
    do {                                                                                                   \
        long i = 0;                                                                                        \
        for (; i + 16 <= (n); i += 16) { const __mmask16 k = 0xFFFF; __VA_ARGS__ }                         \
        if (i < (n)) { const __mmask16 k = LANES((n) - i); __VA_ARGS__ }                                   \
    } while (0)

AVX512_TARGET static ALWAYS_INLINE __m512 load16_f32(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
AVX512_TARGET static ALWAYS_INLINE void store16_f32(float* p, __m512 v, __mmask16 k) { _mm512_mask_storeu_ps(p, k, v); }

AVX512_TARGET static ALWAYS_INLINE __m512 load16_bf16(const uint16_t* p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}

/* round_bf16 in 16 lanes */
AVX512_TARGET static ALWAYS_INLINE __m512 round16_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xFFFF0000u)));
}

AVX512_TARGET static ALWAYS_INLINE void store16_bf16(uint16_t* p, __m512 v, __mmask16 k) {
    _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round16_bf16(v)), 16)));
}

/* The sum of squares in inv_rms's order: lanes 0-7 of `a` are its a0, lanes 8-15 its a1 (n % 8 == 0) */
#define INV_RMS_512(S, T)                                                                                   \
AVX512_TARGET static ALWAYS_INLINE float inv_rms##S##_512(const T* x, long n, float eps) {                \
    __m512 a = _mm512_setzero_ps();                                                                        \
    EACH16(i, n, k, __m512 u = load16##S(x + i, k); a = _mm512_fmadd_ps(u, u, a););                       \
    return 1.0f / sqrtf(hsum(_mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1))) / (float)n + eps); \
}
INV_RMS_512(_f32, float)
INV_RMS_512(_bf16, uint16_t)

/* add_rms_norm and add_rms_norm_bf16 in 16 lanes: ROUND where the bfloat16 one rounds (the normalised value,
 * before the weight, as HF's RMSNorm does) */
#define ADD_RMS_NORM_512(N, S, T, ROUND)                                                                   \
AVX512_TARGET void add_rms_norm##N##_512(T* residual, const T* delta, const T* weight, float eps, T* out,  \
                                          long rows, long n, int threads) {                                 \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN_FLOATS)") \
    for (long t = 0; t < rows; t++) {                                                                      \
        T* x = residual + t * n;                                                                           \
        if (delta != 0)                                                                                    \
            EACH16(i, n, k, store16##S(x + i, _mm512_add_ps(load16##S(x + i, k), load16##S(delta + t * n + i, k)), k);); \
        __m512 r = _mm512_set1_ps(inv_rms##S##_512(x, n, eps));                                           \
        EACH16(i, n, k, store16##S(out + t * n + i, _mm512_mul_ps(ROUND(_mm512_mul_ps(load16##S(x + i, k), r)), \
                                                                  load16##S(weight + i, k)), k););          \
    }                                                                                                      \
}

/* float32 stores its products unrounded */
#define NO_ROUND(v) (v)
ADD_RMS_NORM_512(, _f32, float, NO_ROUND)
ADD_RMS_NORM_512(_bf16, _bf16, uint16_t, round16_bf16)

/* norm_rotate and norm_rotate_bf16 in 16 lanes: ROUND where the bfloat16 one rounds (d % 16 == 0) */
#define NORM_ROTATE_512(S, T, ROUND)                                                                       \
AVX512_TARGET static ALWAYS_INLINE void norm_rotate##S##_512(const T* src, T* dst, const T* weight, float eps, \
                                                            const T* cos, const T* sin, long d) {          \
    const long half = d / 2;                                                                               \
    __m512 r = _mm512_set1_ps(weight != 0 ? inv_rms##S##_512(src, d, eps) : 1.0f);                        \
    EACH16(i, half, k,                                                                                     \
        __m512 x1 = load16##S(src + i, k), x2 = load16##S(src + half + i, k);                             \
        if (weight != 0) {                                                                                 \
            x1 = ROUND(_mm512_mul_ps(ROUND(_mm512_mul_ps(x1, r)), load16##S(weight + i, k)));             \
            x2 = ROUND(_mm512_mul_ps(ROUND(_mm512_mul_ps(x2, r)), load16##S(weight + half + i, k)));      \
        } else {                                                                                           \
            x1 = _mm512_mul_ps(x1, r);                                                                     \
            x2 = _mm512_mul_ps(x2, r);                                                                     \
        }                                                                                                  \
        __m512 c = load16##S(cos + i, k), s = load16##S(sin + i, k);                                      \
        store16##S(dst + i, _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s)), k);                             \
        store16##S(dst + half + i, _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s)), k););                    \
}

/* without weights r is 1, and x * 1 is x: the bfloat16 body's skipped multiply */
NORM_ROTATE_512(_f32, float, NO_ROUND)
NORM_ROTATE_512(_bf16, uint16_t, round16_bf16)

#define SILU_AND_MUL_512(N, S, T)                                                                          \
AVX512_TARGET void silu_and_mul##N##_512(const T* gate_up, T* out, long rows, long n, int threads) {      \
    _Pragma("omp parallel for num_threads(threads) schedule(static) if (rows * n >= PARALLEL_MIN_FLOATS)") \
    for (long t = 0; t < rows; t++) {                                                                      \
        const T* g = gate_up + t * 2 * n;                                                                  \
        const T* u = g + n;                                                                                \
        T* y = out + t * n;                                                                                \
        const __m512 one = _mm512_set1_ps(1.0f);                                                           \
        EACH16(i, n, k,                                                                                    \
            __m512 x = load16##S(g + i, k);                                                                \
            __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp512(_mm512_sub_ps(_mm512_setzero_ps(), x)))); \
            store16##S(y + i, _mm512_mul_ps(_mm512_mul_ps(x, sig), load16##S(u + i, k)), k););             \
    }                                                                                                      \
}

SILU_AND_MUL_512(, _f32, float)
SILU_AND_MUL_512(_bf16, _bf16, uint16_t)
QK_NORM_ROPE(_512, AVX512_TARGET, float, norm_rotate_f32_512)
QK_NORM_ROPE(_bf16_512, AVX512_TARGET, uint16_t, norm_rotate_bf16_512)
