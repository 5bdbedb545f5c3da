/* What several kernels of this folder share: the AVX-512 target attribute, forced inlining, the
 * 4-way lane sum, the coefficients of the polynomial 2^x and the float32 -> bfloat16 rounding torch does.
 * Included by the .c files, whose build cache key covers every header here (build.py). */
#ifndef PREFIXSERVE_SIMD_H
#define PREFIXSERVE_SIMD_H

#include <immintrin.h>
#include <stdint.h>

/* AVX-512 bodies carry their own target attribute (the build flags stay AVX2); callers run them only
 * where torch reports the features (CPU and OS). */
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define AVX512_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))
#define ALWAYS_INLINE inline __attribute__((always_inline))
/* Pins a loaded vector in a register: without it GCC folds a load used by several multiply-adds into
 * each of them, re-reading it once per use (the AVX2 6x2 tile then issued 14 loads per 12 FMAs, bound
 * by the two 256-bit loads a Zen 3 core issues per cycle, instead of 8). */
#define IN_REGISTER(v) __asm__("" : "+x"(v))

/* Requests the cache line at p into L2 (to_l2) or L1: the hint must be a constant, so one branch here
 * instead of one at every caller that decides at run time. */
static ALWAYS_INLINE void request_line(const char* p, int to_l2) {
    if (to_l2) _mm_prefetch(p, _MM_HINT_T1);
    else _mm_prefetch(p, _MM_HINT_T0);
}

/* One step's share of `lines` cache lines (from `ahead`) spread evenly over `steps` steps: requests the
 * lines owed by this step (into L2 or L1, request_line), counted exactly in integers (`owed` starts at 0,
 * `line` at the first line), so `steps` calls request all of them. Lets a GEMM pass stream the next weight
 * tile while it computes on this one from cache, instead of leaving memory idle and then stalling on the
 * next tile. */
static ALWAYS_INLINE void request_share(const char* ahead, long lines, long steps, long* line, long* owed,
                                        int to_l2) {
    for (*owed += lines; *owed >= steps; *owed -= steps) request_line(ahead + 64 * (*line)++, to_l2);
}

/* [sum a0, sum a1, sum a2, sum a3]: interleaving pairs and adding halves costs a third of four
 * separate reductions. Every add combines lanes of one accumulator only, in a fixed order, so each
 * sum is the same whatever the other three hold (what keeps a row's result independent of the rows
 * computed beside it). */
AVX512_TARGET static ALWAYS_INLINE __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
    __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
    __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* 2^f for f in [-0.5, 0.5], relative error ~2e-7 (least-squares fit weighted toward equal relative
 * error), evaluated by Horner's rule from EXP2_C5 down to EXP2_C0. */
#define EXP2_C5 1.3276425e-3f
#define EXP2_C4 9.6755317e-3f
#define EXP2_C3 5.5507135e-2f
#define EXP2_C2 2.4022120e-1f
#define EXP2_C1 6.9314694e-1f
#define EXP2_C0 1.0000001f

/* round to nearest even, as torch's float -> bfloat16 conversion (finite values) */
static inline __m256 round_bf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline void store_bf16(uint16_t* p, __m256 v) {
    __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(round_bf16(v)), 16);
    /* packus works within 128-bit lanes: [a0..a3 a0..a3 | a4..a7 a4..a7] -> a0..a7 in the low half */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0xD8);
    _mm_storeu_si128((__m128i*)p, _mm256_castsi256_si128(packed));
}

#endif
