/* y[m, n] = x[m, k] @ W^T (+ bias) in bfloat16, for every row count, over a weight packed for vdpbf16ps.
 *
 * Layout (model/packed_weight.py packs it once, at load): W[n, k] in panels of PANEL = 64 output columns,
 * each panel contiguous, and within a panel pairs of k: wp[panel][k / 2][64][2] = W[64 * panel + c][2p + e].
 * One 64-byte vector holds 16 columns x one pair of k, so vdpbf16ps against a pair of x broadcast to every
 * lane adds two products to each of 16 outputs: the outputs sit in lanes, every sum runs in its own lane
 * over k in order, and nothing is reduced across lanes at the end.
 *
 * What this buys over a dot product along k (the row-major layout, small_m_gemm.c):
 * - at prefill sizes, 1.3x the rate (0.6B model's shapes, 512 rows: 700 -> 880-890 GFLOP/s on a Zen 5
 *   EPYC, 2 threads, where oneDNN's bfloat16 matmul reads 790-840): no horizontal sums, no partial sums
 *   saved between k chunks, and x is read as 4-byte broadcasts;
 * - at decode sizes, a panel is one sequential stream for the hardware prefetcher instead of several
 *   rows a whole row apart (1.06-1.10x at 1 row, 1.0x at 4, 1.1x at 8-16, 1.4-1.5x at 32-64).
 * A row's result is the same whatever the rows beside it, whatever the tile it falls in: each output is
 * one accumulator stepped through k in the same order by the same instruction. That is what keeps prefix
 * caching exact in bfloat16: the rows of a prompt are computed in batches of other sizes with caching
 * on than off.
 *
 * Requires avx512_bf16 (the caller checks the CPU) and even k.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <omp.h>

#include "simd.h"

#define PANEL 64
#define VECS (PANEL / 16)          /* 16 float32 lanes per vector */
/* Rows per register tile: MR x VECS = 24 accumulators, plus VECS weight vectors and one broadcast x. */
#define MR 6

/* Rows x[0..rows) against one panel over the whole of k: acc[j][v] covers row j, columns 16v..16v+15.
 * `ahead`: this pass's share of the next panel, `lines` cache lines from line `first`, requested spread
 * evenly over the steps. With more than one row group, the groups after the first read the panel from L2,
 * and without these requests memory would sit idle while they run (16 rows: 0.92x the row-major kernel
 * without, 1.10x with; Zen 5 EPYC, 2 threads). */
AVX512_BF16_TARGET static ALWAYS_INLINE void tile(const uint16_t* x, size_t k, const uint16_t* panel,
                                                  const float* bias, uint16_t* y, size_t n, int cols,
                                                  const int rows, const char* ahead, long first, long lines) {
    __m512 acc[MR][VECS];
    for (int j = 0; j < rows; j++)
        for (int v = 0; v < VECS; v++) acc[j][v] = _mm512_setzero_ps();
    const long steps = (long)(k / 2);
    long line = first, owed = 0;
    for (long p = 0; p < steps; p++) {
        if (ahead) request_share(ahead, lines, steps, &line, &owed);
        const uint16_t* wq = panel + (size_t)p * 2 * PANEL;
        __m512i w[VECS];
        for (int v = 0; v < VECS; v++) w[v] = _mm512_loadu_si512(wq + 32 * v);
        for (int j = 0; j < rows; j++) {
            __m512i xb = _mm512_set1_epi32(*(const int32_t*)(x + j * k + 2 * (size_t)p));
            for (int v = 0; v < VECS; v++) acc[j][v] = _mm512_dpbf16_ps(acc[j][v], (__m512bh)w[v], (__m512bh)xb);
        }
    }
    /* bias in float32, then one rounding to nearest even (vcvtneps2bf16, as torch rounds; subnormals
     * flush to zero); the last panel writes only its `cols` real columns */
    for (int j = 0; j < rows; j++)
        for (int v = 0; v < VECS && 16 * v < cols; v++) {
            const int c = 16 * v;
            const __mmask16 mask = cols - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (cols - c)) - 1);
            __m512 s = acc[j][v];
            if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, bias + c));
            _mm256_mask_storeu_epi16(y + j * n + c, mask, (__m256i)_mm512_cvtneps_pbh(s));
        }
}

/* bias: float32 or NULL. Threads split the panels, so each weight byte is read from memory once; each
 * thread runs every row group against a panel while it sits in L2 (x comes from L2 or L3: at 512 rows,
 * blocking the rows to keep x in L2 measured no faster). */
AVX512_BF16_TARGET void packed_gemm_bf16(const uint16_t* x, const uint16_t* wp, const float* bias, uint16_t* y,
                                         long m, long n, long k, int threads) {
    const long panels = (n + PANEL - 1) / PANEL, groups = (m + MR - 1) / MR;
    const size_t panel_elems = (size_t)k * PANEL;
    const long panel_lines = (long)(panel_elems * sizeof(uint16_t) / 64);
    _Pragma("omp parallel num_threads(threads)")
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        long b_begin = panels * id / nt, b_end = panels * (id + 1) / nt;
        for (long b = b_begin; b < b_end; b++) {
            const uint16_t* panel = wp + (size_t)b * panel_elems;
            const int cols = n - b * PANEL < PANEL ? (int)(n - b * PANEL) : PANEL;
            const float* pb = bias ? bias + b * PANEL : NULL;
            const char* next = groups > 1 && b + 1 < b_end ? (const char*)(panel + panel_elems) : NULL;
            for (long g = 0; g < groups; g++) {
                const long r = g * MR;
                const long first = g * panel_lines / groups, lines = (g + 1) * panel_lines / groups - first;
                const uint16_t* xr = x + r * k;
                uint16_t* yr = y + r * n + b * PANEL;
                switch (m - r < MR ? m - r : MR) {
                    case 6: tile(xr, (size_t)k, panel, pb, yr, (size_t)n, cols, 6, next, first, lines); break;
                    case 5: tile(xr, (size_t)k, panel, pb, yr, (size_t)n, cols, 5, next, first, lines); break;
                    case 4: tile(xr, (size_t)k, panel, pb, yr, (size_t)n, cols, 4, next, first, lines); break;
                    case 3: tile(xr, (size_t)k, panel, pb, yr, (size_t)n, cols, 3, next, first, lines); break;
                    case 2: tile(xr, (size_t)k, panel, pb, yr, (size_t)n, cols, 2, next, first, lines); break;
                    default: tile(xr, (size_t)k, panel, pb, yr, (size_t)n, cols, 1, next, first, lines); break;
                }
            }
        }
    }
}
