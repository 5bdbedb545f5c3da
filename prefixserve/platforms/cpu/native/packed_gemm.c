/* y[m, n] = x[m, k] @ W^T (+ bias) for every row count over a packed weight: bfloat16 (vdpbf16ps, needs
 * avx512_bf16) or float32 (FMA, needs AVX-512F); x, W and y in the one dtype, the sums in float32.
 *
 * Layout (platforms/cpu/packed_weight.py packs it once, at load): W[n, k] in panels of PANEL = 64 output columns,
 * each panel contiguous, and within a panel steps of STEP elements of k (2 in bfloat16, 1 in float32):
 * wp[panel][k / STEP][64][STEP] = W[64 * panel + c][STEP * p + e]. One 64-byte vector holds 16 columns x one
 * step, so one multiply-add against the step's x broadcast to every lane adds its products to each of 16
 * outputs: the outputs sit in lanes, every sum runs in its own lane over k in order, and nothing is
 * reduced across lanes at the end.
 *
 * What this buys over a dot product along k (the row-major layout, small_m_gemm.c):
 * - at prefill sizes, 1.3x the rate (0.6B model's shapes, 512 rows: 700 -> 880-890 GFLOP/s on a Zen 5
 *   EPYC, 2 threads, where oneDNN's bfloat16 matmul reads 790-840): no horizontal sums, no partial sums
 *   saved between k chunks, and x is read as 4-byte broadcasts;
 * - at decode sizes, a panel is one sequential stream for the hardware prefetcher instead of several
 *   rows a whole row apart (1.06-1.10x at 1 row, 1.0x at 4, 1.1x at 8-16, 1.4-1.5x at 32-64).
 * In float32 (the 0.6B model's projections and LM head, weights streamed from memory, same machine): 16 rows
 * 1.86x the row-major AVX-512 kernel (small_m_gemm.c: 211 -> 392 GFLOP/s, 26 -> 49 GB/s of a measured 51),
 * 64 rows 1.55x, 512 rows 1.08x oneDNN's sgemm (463 -> 499 GFLOP/s); one row 0.92x.
 * A row's result is the same whatever the rows beside it, whatever the row group it falls in and whether k
 * is taken whole or in chunks: each output is one float32 sum stepped through k in the same order by the same
 * instruction. That is what keeps prefix caching exact: the rows of a prompt are computed in batches of other
 * sizes with caching on than off.
 *
 * Where the CPU has AMX and Linux grants the tile state, bfloat16 weights whose k is a multiple of TILE_K
 * take the tile body at the end of this file instead (the same layout, read as tile operands).
 *
 * Requires avx512_bf16 (bfloat16) or AVX-512F (float32), the caller checks the CPU, and k a whole number
 * of steps.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <omp.h>

#include "simd.h"

#define PANEL 64
#define VECS (PANEL / 16)          /* 16 float32 lanes per vector */
/* Rows per register tile: MR x VECS = 24 accumulators, plus VECS weight vectors and one broadcast x. */
#define MR 6

/* The two dtypes' steps: the broadcast of row j's step p of x, one multiply-add of it into 16 outputs,
 * and the store of 16 float32 sums as results (bfloat16: one rounding to nearest even, vcvtneps2bf16, as
 * torch rounds; subnormals flush to zero). */
AVX512_BF16_TARGET static ALWAYS_INLINE __m512i broadcast_bf16(const uint16_t* x) {
    return _mm512_set1_epi32(*(const int32_t*)x);
}
AVX512_BF16_TARGET static ALWAYS_INLINE __m512 muladd_bf16(__m512 acc, __m512i w, __m512i x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
}
AVX512_BF16_TARGET static ALWAYS_INLINE void store_bf16x16(uint16_t* y, __mmask16 mask, __m512 s) {
    _mm256_mask_storeu_epi16(y, mask, (__m256i)_mm512_cvtneps_pbh(s));
}
/* the same rounding, stored widened to float32 (exact): what torch's .float() of the bfloat16 result
 * holds, without the second pass over it (an LM head's logits: 16 rows x 151936 columns, ~0.7 ms a
 * decode step on a 2-core Zen 4 EPYC) */
AVX512_BF16_TARGET static ALWAYS_INLINE void store_bf16_widenedx16(float* y, __mmask16 mask, __m512 s) {
    const __m512i rounded = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(s));
    _mm512_mask_storeu_ps(y, mask, _mm512_castsi512_ps(_mm512_slli_epi32(rounded, 16)));
}
AVX512_TARGET static ALWAYS_INLINE __m512i broadcast_f32(const float* x) {
    return _mm512_castps_si512(_mm512_set1_ps(*x));
}
AVX512_TARGET static ALWAYS_INLINE __m512 muladd_f32(__m512 acc, __m512i w, __m512i x) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(w), _mm512_castsi512_ps(x), acc);
}
AVX512_TARGET static ALWAYS_INLINE void store_f32x16(float* y, __mmask16 mask, __m512 s) {
    _mm512_mask_storeu_ps(y, mask, s);
}

/* 7 to 24 rows (a decode step's) take the panel CHUNK steps of k at a time, every row group over one chunk
 * before the next, their sums kept in a buffer between chunks: the chunk (16 KB in either dtype) is read from
 * memory by the first group and from L1 by the others, and the next chunk is requested while they run, so
 * weights stream at an even pace instead of stopping while the later groups re-read a whole panel from L2
 * (over the 0.6B model's projections + LM head, streamed, 2-core Zen 5 EPYC: bfloat16 16 rows 1.08-1.14x,
 * 8 rows 1.25x; float32 16 rows 1.16x; 32-64 rows no faster, so more rows keep whole panels).
 * On a CPU whose L1 data cache is under BIG_L1, with at most L2_GROUPS row groups (up to 18 rows) the
 * next chunk is requested into L2, not L1, and the chunks are L2_CHUNK steps (8 KB): into L1 (32 KB on
 * Zen 4) the requests pushed out the chunk the later groups still read and queued behind L1's few miss
 * buffers. With four groups each chunk takes long enough that L1 requests arrive in time and the later
 * groups find the chunk in L1, which the compute-bound passes need (Zen 4 EPYC, 2 cores, bfloat16,
 * streamed, in one run: 16 rows 1.10-1.15x, 12 rows 1.35x, 8 rows 1.3-1.5x; 24 rows 0.91-0.93x with the
 * L2 requests, so four groups keep L1's). An L1 of 48 KB holds the chunk being read and the one requested
 * with room to spare, and there L1 requests win at every row count (Zen 5 EPYC, 2 cores, the 0.6B model's
 * four projections over 28 layers streamed, against L2 requests, alternating runs: bfloat16 16 rows 0.91x
 * the time when memory streamed at ~90 GB/s, 0.95x at ~52, 9-13 rows 0.88-0.93x, 7 rows 0.95x, 8 rows
 * 1.00x; float32 16 rows 0.90x, 9-13 rows 0.88-0.95x, 8 rows 1.02x).
 * A few rows split into groups of even size (8 rows: 4 + 4, not 6 + 2): each group asks for an even share of
 * the next chunk's lines, and a short last group asked for its share in a burst while the others left memory
 * idle (bfloat16 decode steps of 8 sequences over a 1056-token context, 2-core Zen 4 EPYC, builds alternating
 * in the engine: 0.956 and 0.983 against null builds' 0.997 and 1.014; 13 and 16 sequences within noise).
 * Up to MR rows (one group) take whole panels: chunks only serve later groups, and cost one group the sums'
 * round trips (same machine and A/B: bfloat16 1 sequence 0.964, 4 sequences 0.964; float32 1 sequence 0.958). */
#define CHUNK 64
#define CHUNKED_ROWS 24
#define L2_CHUNK 32
#define L2_GROUPS 3
#define BIG_L1 (48 * 1024)

/* What the library reads of the machine once, when it loads (constructor below): the L1 data cache's
 * bytes (0 where the system does not say), and whether bfloat16 products take the tile body */
static long l1_data_bytes;
static int tiles_usable;

/* Defines chunk##NAME, finish##NAME and the vector body vector_gemm##NAME for operands of element type T,
 * STEP elements of k a step, taking the steps of suffix S (broadcast##S, muladd##S), the results of type Y
 * stored by store##ST##x16.
 *
 * chunk##NAME: rows x[0..rows) against steps [p0, p1) of one panel: acc[j][v] (row j, columns 16v..16v+15)
 * starts at zero (p0 == 0) or from sums[j][v], and is left there. `ahead`: this pass's share of the next
 * chunk, `lines` cache lines, requested spread evenly over the steps. With more than one row group, the
 * groups after the first read the chunk from L1 (or L2), and without these requests memory would sit idle
 * while they run (bfloat16, 16 rows, whole panels: 0.92x the row-major kernel without, 1.10x with).
 * Storing and reloading a float32 sum is exact: a row's bits do not depend on where its k is cut.
 *
 * finish##NAME: sums + bias (float32), stored; the last panel writes only its `cols` real columns.
 *
 * vector_gemm##NAME: bias float32 or NULL. Threads split the panels, so each weight byte is read from memory
 * once; each thread runs every row group against a chunk while it sits in cache (x comes from L2 or L3: at
 * 512 rows, blocking the rows to keep x in L2 measured no faster). */
#define PACKED_GEMM(NAME, S, TARGET, T, STEP, Y, ST)                                                      \
TARGET static ALWAYS_INLINE void chunk##NAME(const T* x, size_t k, const T* panel, long p0, long p1,        \
                                             __m512* sums, const int rows, const char* ahead, long lines,  \
                                             const int to_l2) {                                            \
    __m512 acc[MR][VECS];                                                                                   \
    for (int j = 0; j < rows; j++)                                                                          \
        for (int v = 0; v < VECS; v++) acc[j][v] = p0 ? sums[j * VECS + v] : _mm512_setzero_ps();          \
    long line = 0, owed = 0;                                                                                \
    for (long p = p0; p < p1; p++) {                                                                        \
        if (ahead) request_share(ahead, lines, p1 - p0, &line, &owed, to_l2);                               \
        const T* wq = panel + (size_t)p * STEP * PANEL;                                                     \
        __m512i w[VECS];                                                                                    \
        for (int v = 0; v < VECS; v++) w[v] = _mm512_loadu_si512(wq + 16 * STEP * v);                      \
        for (int j = 0; j < rows; j++) {                                                                    \
            const __m512i xb = broadcast##S(x + j * k + STEP * (size_t)p);                                  \
            for (int v = 0; v < VECS; v++) acc[j][v] = muladd##S(acc[j][v], w[v], xb);                      \
        }                                                                                                   \
    }                                                                                                       \
    for (int j = 0; j < rows; j++)                                                                          \
        for (int v = 0; v < VECS; v++) sums[j * VECS + v] = acc[j][v];                                      \
}                                                                                                           \
                                                                                                            \
TARGET static ALWAYS_INLINE void finish##NAME(const __m512* sums, const float* bias, Y* y, size_t n, int cols, \
                                              int rows) {                                                   \
    for (int j = 0; j < rows; j++)                                                                          \
        for (int v = 0; v < VECS && 16 * v < cols; v++) {                                                   \
            const int c = 16 * v;                                                                           \
            const __mmask16 mask = cols - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (cols - c)) - 1); \
            __m512 s = sums[j * VECS + v];                                                                  \
            if (bias) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(mask, bias + c));                         \
            store##ST##x16(y + j * n + c, mask, s);                                                         \
        }                                                                                                   \
}                                                                                                           \
                                                                                                            \
TARGET static void vector_gemm##NAME(const T* x, const T* wp, const float* bias, Y* y, long m, long n, long k, \
                                     int threads) {                                                         \
    const long panels = (n + PANEL - 1) / PANEL, groups = (m + MR - 1) / MR;                                \
    const size_t panel_elems = (size_t)k * PANEL;                                                           \
    const int to_l2 = groups <= L2_GROUPS && l1_data_bytes < BIG_L1;                                        \
    const int few = m <= CHUNKED_ROWS;                                                                      \
    const long steps = (long)(k / STEP), chunk = few && groups > 1 ? to_l2 ? L2_CHUNK : CHUNK : steps;      \
    const long step_lines = (long)(STEP * PANEL * sizeof(T) / 64);                                          \
    _Pragma("omp parallel num_threads(threads)")                                                            \
    {                                                                                                       \
        int nt = omp_get_num_threads(), id = omp_get_thread_num();                                          \
        long b_begin = panels * id / nt, b_end = panels * (id + 1) / nt;                                    \
        /* a group's sums between chunks (whole panels: one group at a time, finished as it ends) */       \
        __m512 sums[CHUNKED_ROWS / MR * MR * VECS];                                                         \
        for (long b = b_begin; b < b_end; b++) {                                                            \
            const T* panel = wp + (size_t)b * panel_elems;                                                  \
            const int cols = n - b * PANEL < PANEL ? (int)(n - b * PANEL) : PANEL;                          \
            for (long p0 = 0; p0 < steps; p0 += chunk) {                                                    \
                const long p1 = p0 + chunk < steps ? p0 + chunk : steps;                                    \
                /* the next chunk: this panel's, or the next panel's first */                               \
                const char* next = NULL;                                                                    \
                long next_lines = 0;                                                                        \
                if (groups > 1 && p1 < steps) {                                                             \
                    next = (const char*)(panel + (size_t)p1 * STEP * PANEL);                                \
                    next_lines = ((p1 + chunk < steps ? p1 + chunk : steps) - p1) * step_lines;             \
                } else if (groups > 1 && b + 1 < b_end) {                                                   \
                    next = (const char*)(panel + panel_elems);                                              \
                    next_lines = (chunk < steps ? chunk : steps) * step_lines;                              \
                }                                                                                           \
                for (long g = 0; g < groups; g++) {                                                         \
                    const long r = few ? g * m / groups : g * MR;                                           \
                    const int rows = few ? (int)((g + 1) * m / groups - r) : m - r < MR ? (int)(m - r) : MR; \
                    const long first = g * next_lines / groups, lines = (g + 1) * next_lines / groups - first; \
                    const T* xr = x + r * k;                                                                \
                    const char* ahead = next ? next + 64 * first : NULL;                                    \
                    __m512* gs = sums + (chunk < steps ? g : 0) * MR * VECS;                                \
                    switch (rows) {                                                                         \
                        case 6: chunk##NAME(xr, (size_t)k, panel, p0, p1, gs, 6, ahead, lines, to_l2); break; \
                        case 5: chunk##NAME(xr, (size_t)k, panel, p0, p1, gs, 5, ahead, lines, to_l2); break; \
                        case 4: chunk##NAME(xr, (size_t)k, panel, p0, p1, gs, 4, ahead, lines, to_l2); break; \
                        case 3: chunk##NAME(xr, (size_t)k, panel, p0, p1, gs, 3, ahead, lines, to_l2); break; \
                        case 2: chunk##NAME(xr, (size_t)k, panel, p0, p1, gs, 2, ahead, lines, to_l2); break; \
                        default: chunk##NAME(xr, (size_t)k, panel, p0, p1, gs, 1, ahead, lines, to_l2); break; \
                    }                                                                                       \
                    if (p1 == steps)                                                                        \
                        finish##NAME(gs, bias ? bias + b * PANEL : NULL, y + r * n + b * PANEL, (size_t)n, cols, rows); \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
}

PACKED_GEMM(_bf16, _bf16, AVX512_BF16_TARGET, uint16_t, 2, uint16_t, _bf16)
PACKED_GEMM(_f32, _f32, AVX512_TARGET, float, 1, float, _f32)
/* bfloat16 operands, the bfloat16 results stored widened to float32 */
PACKED_GEMM(_bf16_widened, _bf16, AVX512_BF16_TARGET, uint16_t, 2, float, _bf16_widened)

/* ---- The tile body: bfloat16 products on AMX (Sapphire Rapids and later Xeons) ----
 *
 * oneDNN multiplies bfloat16 about 6x faster than float32 on AMX (1.2-2.1 against 0.26-0.34 TFLOP/s on a
 * 2-vCPU Xeon of this project), several times what vdpbf16ps gives, so where the CPU and the OS grant the
 * tiles, every bfloat16 weight whose k is a whole number of TILE_K takes this body at every row count.
 * That choice depends on the machine and the weight's shape, never on m, so a row's bits still do not depend
 * on the batch: each output is one float32 tile element accumulated by TDPBF16PS over k in chunks of
 * TILE_K, in order, whatever the rows beside it (the instruction computes each row of its destination from
 * that row of its first source alone).
 *
 * The packed layout is already the tiles' operand layout: a panel's step p holds 64 columns x one bfloat16
 * pair of k, so TILE_PAIRS consecutive steps, 64 bytes in from the start of each 256-byte step per group of
 * 16 columns, are one B tile (16 pairs of k x 16 columns, read with a stride of 256 bytes), and TILE_K
 * consecutive elements of TILE_ROWS rows of x are one A tile. Per panel and group of up to 16 rows, four
 * accumulator tiles (0-3) hold the group's 16 x 64 sums; each step of TILE_K loads the group's A tile (4)
 * once and the four column groups' B tiles alternately into 5 and 6, so each load can overlap the product
 * reading the other B tile. The sums are stored to memory once per group and finished there as the
 * vector body finishes its own (bias, one rounding, masked columns).
 * Threads split the panels as in the vector body. With up to 16 rows (decode) each panel streams once, in
 * order, 4 KB a step; more rows re-read the panel from L2 once per group of 16.
 * Written and checked against emulated tiles on a CPU without AMX
 * (tests/platforms/cpu/test_model_packed_gemm_tiles.py); its speed on AMX is not yet measured. */
#define TILE_ROWS 16
#define TILE_PAIRS 16                  /* pairs of k a step takes: 64 bytes of a row of x, 16 steps of a panel */
#define TILE_K (2 * TILE_PAIRS)
#define ARCH_REQ_XCOMP_PERM 0x1023     /* arch_prctl: ask Linux for permission to use an extended state */
#define XFEATURE_XTILEDATA 18

/* The 64-byte operand of LDTILECFG (palette 1) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Compilers before GCC 11 and clang 12 know no AMX intrinsics: built there, the library has no tile body */
#if defined(PACKED_GEMM_EMULATE_TILES) || (defined(__clang__) && __clang_major__ >= 12) \
    || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define TILE_BODY 1
#else
#define TILE_BODY 0
#endif

#ifdef PACKED_GEMM_EMULATE_TILES
/* Tiles emulated in C, for checking the body on CPUs without AMX: the thread's eight tile registers, each
 * up to 16 rows of 64 bytes, and TDPBF16PS as the SDM describes it (per row, per column: the even and the
 * odd products of the instruction's pairs summed in two float32 chains of fused multiply-adds, their sum
 * then added to the destination; denormals are not flushed here). Hardware may round differently; the
 * tests use this only to check the body's tiling against a brute-force product of the same definition. */
#include <math.h>
static __thread struct {
    tile_config config;
    uint8_t data[8][TILE_ROWS][64];
} emulated;

static void emulated_config(const tile_config* c) {
    emulated.config = *c;
    memset(emulated.data, 0, sizeof emulated.data);
}
static void emulated_zero(int t) { memset(emulated.data[t], 0, sizeof emulated.data[t]); }
static void emulated_load(int t, const void* base, long stride) {
    emulated_zero(t);
    for (int r = 0; r < emulated.config.rows[t]; r++)
        memcpy(emulated.data[t][r], (const char*)base + r * stride, emulated.config.colsb[t]);
}
static void emulated_store(int t, void* base, long stride) {
    for (int r = 0; r < emulated.config.rows[t]; r++)
        memcpy((char*)base + r * stride, emulated.data[t][r], emulated.config.colsb[t]);
}
static float widen_bf16(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static void emulated_dot(int c, int a, int b) {
    const int rows = emulated.config.rows[c], cols = emulated.config.colsb[c] / 4;
    const int pairs = emulated.config.colsb[a] / 4;
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            float even = 0.0f, odd = 0.0f, sum;
            for (int p = 0; p < pairs; p++) {
                uint16_t av[2], bv[2];
                memcpy(av, emulated.data[a][i] + 4 * p, sizeof av);
                memcpy(bv, emulated.data[b][p] + 4 * j, sizeof bv);
                even = fmaf(widen_bf16(av[0]), widen_bf16(bv[0]), even);
                odd = fmaf(widen_bf16(av[1]), widen_bf16(bv[1]), odd);
            }
            memcpy(&sum, emulated.data[c][i] + 4 * j, sizeof sum);
            sum += even + odd;
            memcpy(emulated.data[c][i] + 4 * j, &sum, sizeof sum);
        }
}
#define TILE_TARGET AVX512_BF16_TARGET
#define tile_configure(c) emulated_config(c)
#define tile_zero(t) emulated_zero(t)
#define tile_load(t, base, stride) emulated_load(t, base, stride)
#define tile_store(t, base, stride) emulated_store(t, base, stride)
#define tile_dot(c, a, b) emulated_dot(c, a, b)
#define tile_release()
#elif TILE_BODY
#include <cpuid.h>
#include <sys/syscall.h>
/* the finish's rounding (vcvtneps2bf16) is AVX-512 too */
#define TILE_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))
#define tile_configure(c) _tile_loadconfig(c)
#define tile_zero(t) _tile_zero(t)
#define tile_load(t, base, stride) _tile_loadd(t, base, stride)
#define tile_store(t, base, stride) _tile_stored(t, base, stride)
#define tile_dot(c, a, b) _tile_dpbf16ps(c, a, b)
#define tile_release() _tile_release()
#endif

/* The CPU has AMX-TILE, AMX-BF16 and avx512_bf16, and Linux lets this process use the tile state (a
 * kernel before 5.16 or a hypervisor that hides AMX says no). */
static int detect_tiles(void) {
#ifdef PACKED_GEMM_EMULATE_TILES
    return 1;
#elif TILE_BODY
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22)))
        return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d) || !(a & (1u << 5)))
        return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

/* PREFIXSERVE_AMX=0 keeps bfloat16 on the vector body: to compare the two bodies on one machine, or to
 * step around a hypervisor that advertises AMX but runs it badly */
__attribute__((constructor)) static void read_machine(void) {
    const long bytes = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    l1_data_bytes = bytes > 0 ? bytes : 0;
    const char* amx = getenv("PREFIXSERVE_AMX");
    tiles_usable = !(amx && strcmp(amx, "0") == 0) && detect_tiles();
}

#if TILE_BODY
/* Accumulators 0-3 and the A tile 4 as `rows` rows, the B tiles 5 and 6 as 16 pairs of k; per thread,
 * and again for a last group of fewer rows (which zeroes every tile, between groups) */
TILE_TARGET static void configure_tiles(int rows) {
    tile_config config = {0};
    config.palette = 1;
    for (int t = 0; t < 7; t++) {
        config.colsb[t] = 64;
        config.rows[t] = t < 5 ? (uint8_t)rows : TILE_PAIRS;
    }
    tile_configure(&config);
}

/* rows (as configured) of x against one whole panel: sums[row][64] float32 */
TILE_TARGET static ALWAYS_INLINE void tile_panel(const uint16_t* x, long k, const uint16_t* panel, float* sums) {
    const long x_stride = k * (long)sizeof(uint16_t), step_bytes = 2 * PANEL * (long)sizeof(uint16_t);
    tile_zero(0);
    tile_zero(1);
    tile_zero(2);
    tile_zero(3);
    for (long p = 0; p < k / 2; p += TILE_PAIRS) {
        const uint16_t* steps = panel + p * 2 * PANEL;
        tile_load(4, x + 2 * p, x_stride);
        tile_load(5, steps, step_bytes);
        tile_dot(0, 4, 5);
        tile_load(6, steps + 32, step_bytes);
        tile_dot(1, 4, 6);
        tile_load(5, steps + 64, step_bytes);
        tile_dot(2, 4, 5);
        tile_load(6, steps + 96, step_bytes);
        tile_dot(3, 4, 6);
    }
    const long sums_stride = PANEL * (long)sizeof(float);
    tile_store(0, sums, sums_stride);
    tile_store(1, sums + 16, sums_stride);
    tile_store(2, sums + 32, sums_stride);
    tile_store(3, sums + 48, sums_stride);
}

/* tile_gemm##NAME: the tile body for k a whole number of TILE_K, results stored by finish##NAME */
#define TILE_GEMM(NAME, Y)                                                                                  \
TILE_TARGET static void tile_gemm##NAME(const uint16_t* x, const uint16_t* wp, const float* bias, Y* y,    \
                                         long m, long n, long k, int threads) {                             \
    const long panels = (n + PANEL - 1) / PANEL;                                                            \
    const size_t panel_elems = (size_t)k * PANEL;                                                           \
    _Pragma("omp parallel num_threads(threads)")                                                            \
    {                                                                                                       \
        const int nt = omp_get_num_threads(), id = omp_get_thread_num();                                    \
        const long b_begin = panels * id / nt, b_end = panels * (id + 1) / nt;                              \
        float sums[TILE_ROWS * PANEL] __attribute__((aligned(64)));                                         \
        int configured = 0;                                                                                 \
        for (long b = b_begin; b < b_end; b++) {                                                            \
            const int cols = n - b * PANEL < PANEL ? (int)(n - b * PANEL) : PANEL;                          \
            for (long r = 0; r < m; r += TILE_ROWS) {                                                       \
                const int rows = m - r < TILE_ROWS ? (int)(m - r) : TILE_ROWS;                              \
                if (rows != configured) {                                                                   \
                    configure_tiles(rows);                                                                  \
                    configured = rows;                                                                      \
                }                                                                                           \
                tile_panel(x + r * k, k, wp + (size_t)b * panel_elems, sums);                               \
                finish##NAME((const __m512*)sums, bias ? bias + b * PANEL : NULL, y + r * n + b * PANEL,    \
                             (size_t)n, cols, rows);                                                        \
            }                                                                                               \
        }                                                                                                   \
        if (configured) tile_release();                                                                     \
    }                                                                                                       \
}

TILE_GEMM(_bf16, uint16_t)
TILE_GEMM(_bf16_widened, float)
#else
#define tile_gemm_bf16 vector_gemm_bf16
#define tile_gemm_bf16_widened vector_gemm_bf16_widened
#endif

/* The exported products: bfloat16 on the tiles where usable and k allows, else the vector body */
/* the one rule: by the machine and the weight's k, never by the rows */
static int takes_tiles(long k) { return tiles_usable && k % TILE_K == 0; }

void packed_gemm_bf16(const uint16_t* x, const uint16_t* wp, const float* bias, uint16_t* y, long m, long n,
                      long k, int threads) {
    if (takes_tiles(k)) tile_gemm_bf16(x, wp, bias, y, m, n, k, threads);
    else vector_gemm_bf16(x, wp, bias, y, m, n, k, threads);
}
void packed_gemm_bf16_widened(const uint16_t* x, const uint16_t* wp, const float* bias, float* y, long m, long n,
                              long k, int threads) {
    if (takes_tiles(k)) tile_gemm_bf16_widened(x, wp, bias, y, m, n, k, threads);
    else vector_gemm_bf16_widened(x, wp, bias, y, m, n, k, threads);
}
void packed_gemm_f32(const float* x, const float* wp, const float* bias, float* y, long m, long n, long k,
                     int threads) {
    vector_gemm_f32(x, wp, bias, y, m, n, k, threads);
}

/* 1 where bfloat16 products whose k is a multiple of packed_gemm_tile_k() take the tile body */
int packed_gemm_tiles(void) { return tiles_usable; }
int packed_gemm_tile_k(void) { return TILE_K; }
