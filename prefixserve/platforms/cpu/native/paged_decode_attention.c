/* Decode attention read straight from the paged KV pool, float32 sums, in the prefill kernel's tiles.
 *
 * For each (sequence b, KV head h): the R query rows of q[b, h] (the G query heads of a
 * grouped-query KV head, or several sequences' heads stacked over a shared run) attend to
 * the first lens[b] slots of the blocks tables[b, :]. Returns the outputs and the log-sum-exps of
 * the scaled scores, or (finalize = 0) leaves the unnormalised outputs with the running max and
 * denominator (base 2) in state_m / state_l, for a later call (carry_in = 1) over the following
 * keys to carry on from: one pass over a shared run for several sequences, then each sequence's own
 * blocks, gives the bits of one pass over the whole context when the run is a whole number of
 * softmax tiles (KT keys; paged_attention_tile_keys()).
 *
 * Every row goes through the tiles of paged_prefill_attention.c (attention_tiles.h) over softmax
 * tiles starting at the same keys, so a token's output has the same bits as when the prefill kernel
 * computes it as a row of a chunk: what keeps prefix caching exact when a prompt's last uncached token
 * runs alone, or a later turn reuses K/V that decode steps wrote, or a preempted sequence recomputes
 * in a prefill what it decoded. Per tile of 64 keys, the keys are packed out of the pool into 16-key
 * panels (transposed, as bfloat16 pairs for a bfloat16 pool where they can be) and, for tasks of
 * more than 3 rows, the values into 16-column slabs (pair rows in the bfloat16 body): a few KB that
 * stay in L1 while every row of the task reads them, so each K/V row is read from the pool once per
 * task and the rows stacked over a shared run make the products a small GEMM. Tasks of up to 3 rows
 * (one sequence's G heads) read each V row in place instead, through tiles of their own that run each
 * lane's multiply-adds as the shared ones do (in the bfloat16 body, pairs of V rows interleaved as they
 * are read).
 *
 * Against the previous kernel (its own summation order, one block per softmax step), 2-core AMD EPYC
 * Zen 3 (AVX2), 8 KV heads of 128, K/V from memory, per layer: 16 sequences stacked over a 1024-token
 * run 0.47x the time (bfloat16 pool), 0.53x (float32); one sequence over 256-1024 tokens 0.79-0.85x
 * (bfloat16), 1.05-1.15x (float32: the transposes the shared tiles need cost a few-row task more than
 * the lane sums they replace); 16 unshared sequences over 1024 0.76x (bfloat16), 1.02-1.11x (float32).
 *
 * A pool of panels (layout 1, kv_layout.py; a bfloat16 pool in the bfloat16 body, a float32 one in the
 * AVX-512 tiles) holds each head's keys of a block as those panels and its values as those pairs (bfloat16)
 * or as rows a tile reads where they lie (float32): nothing is packed, but a bfloat16 sequence's last,
 * partly written panel is copied (its tail zero). 16 sequences x 8 KV heads over a shared 1024-token run
 * with 48 keys of their own each, 2-core Zen 4 EPYC, against the same calls packing rows: bfloat16, the
 * run's call 0.81x the time (K/V in cache), 0.83x (from memory), the own blocks' 0.77x, 0.84x, the decode
 * program's whole step 0.96x; float32, the run's 0.79x, 0.79x, the own blocks' 0.64x, 0.95x, the step
 * 0.96x.
 *
 * pool: [2, num_blocks, block_size, KVH, D] (K then V; panels: [2, num_blocks, KVH, block_size, D]);
 * q, out: [B, KVH, R, D] float32 (with a bfloat16 pool holding bfloat16 values: the model's queries,
 * widened); lse: [B, KVH, R]. Where the keys are read as word pairs (body 2), q may be the bfloat16
 * queries themselves (q_bf16 = 1: the tiles take their word pairs as they are), and a finishing call
 * writes its output rounded to bfloat16 into out_bf16 (not NULL; `out` then only carries a state in):
 * a bfloat16 decode step's queries come from, and its output goes to, bfloat16 projections, and the
 * serial copies between them and float32 cost 0.6-0.7 ms of a 34 ms 16-sequence step of the 0.6B
 * model (2-core Zen 5 EPYC; the rows each copy wrote were held in the other core's cache).
 * With `members` (a shared run: B = 1, R = count x group), row r of KV head h is row r % group of
 * sequence members[r / group] in q, out and the states laid out [N, KVH, group, ...]: the run reads
 * its members' queries and leaves its state where their own blocks' call carries on from it, with
 * no stacking copies in between.
 * body: 0 the AVX2 tiles, 1 the AVX-512 tiles, 2 with a bfloat16 pool's keys in word pairs (the
 * prefill kernel's codes). Requires D % 8 == 0.
 */
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention_tiles.h"

long paged_attention_tile_keys(void) { return KT; }

/* Per row of a task: the online softmax's state on entry, fresh (m = -inf, l = 0, o = 0) or carried in
 * from the unnormalised accumulator acc and state_m / state_l. Rows past R (padding of the last 6-row
 * panel) start fresh and are never written out. */
static void start_rows(float* o, float* m, float* l, const float* acc, const float* state_m, const float* state_l,
                       const long* at, long rows, long padded, long d, int carry_in) {
    for (long r = 0; r < padded; r++) {
        if (carry_in && r < rows) {
            m[r] = state_m[at[r]];
            l[r] = state_l[at[r]];
            memcpy(o + r * d, acc + at[r] * d, sizeof(float) * d);
        } else {
            m[r] = -INFINITY;
            l[r] = 0.0f;
            memset(o + r * d, 0, sizeof(float) * d);
        }
    }
}

/* Finalised: o scaled by 1 / l as the prefill kernel does, into acc, or (out16 not NULL) rounded to
 * bfloat16 into out16 to nearest even as torch rounds (a NaN stays one: its low half, which the rounding
 * adds into the high one, is zero, as it comes from a bfloat16 V value or is the default NaN), and the
 * natural log-sum-exp of the scaled scores. Otherwise o, m and l are left for a later call. */
static void end_rows(const float* o, const float* m, const float* l, float* acc, uint16_t* out16, float* lse,
                     float* state_m, float* state_l, const long* at, long rows, long d, int finalize) {
    for (long r = 0; r < rows; r++) {
        float* a = acc + at[r] * d;
        if (!finalize) {
            memcpy(a, o + r * d, sizeof(float) * d);
            state_m[at[r]] = m[r];
            state_l[at[r]] = l[r];
            continue;
        }
        const __m256 inv = _mm256_set1_ps(l[r] > 0.0f ? 1.0f / l[r] : 0.0f);
        for (long e = 0; e < d; e += 8) {
            const __m256 v = _mm256_mul_ps(inv, _mm256_loadu_ps(o + r * d + e));
            if (out16) store_bf16(out16 + at[r] * d + e, v);
            else _mm256_storeu_ps(a + e, v);
        }
        lse[at[r]] = l[r] > 0.0f ? (m[r] + log2f(l[r])) * 0.69314718055994531f : -INFINITY;
    }
}

/* Tiles for tasks of a few rows (a KV head's G query heads, one sequence): the 6-row tiles would spend
 * most of their multiply-adds on zero rows. The same chain per lane as tile_qk / tile_pv16 (so the same
 * bits), over 32 keys or 32 columns a tile: nr <= 3 rows x 4 vectors of accumulators. */
#define FEW_ROWS 3
/* calls of request_more a few-row tile makes: its scores per 32 keys, its values per 16 (the bfloat16
 * body's scores run on the 6-row tiles, one call; request_rest asks for what is left) */
#define FEW_REQUEST_POINTS (KT / (2 * KP) + KT / KP)

/* s[r, 0..32) = sum_d qp[d, r] * (K panels kt, kt1)[d, 0..32) for r < nr; qp a [D][6] panel */
static ALWAYS_INLINE void qk_few(const float* qp, const float* kt, const float* kt1, long d, float* s, long lds,
                                 const int nr) {
    __m256 c[FEW_ROWS][4];
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm256_setzero_ps();
    for (long i = 0; i < d; i++) {
        const __m256 k0 = _mm256_loadu_ps(kt + i * KP), k1 = _mm256_loadu_ps(kt + i * KP + 8);
        const __m256 k2 = _mm256_loadu_ps(kt1 + i * KP), k3 = _mm256_loadu_ps(kt1 + i * KP + 8);
        for (int r = 0; r < nr; r++) {
            const __m256 a = _mm256_broadcast_ss(qp + i * MR + r);
            c[r][0] = _mm256_fmadd_ps(a, k0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(a, k1, c[r][1]);
            c[r][2] = _mm256_fmadd_ps(a, k2, c[r][2]);
            c[r][3] = _mm256_fmadd_ps(a, k3, c[r][3]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(s + r * lds + 8 * j, c[r][j]);
}

/* qk_few over a bfloat16 pool's keys packed as word pairs (pack_keys_bf16: [D/2][16] words a panel),
 * widened here: half the transposing of widened keys, much of a few-row task's work. Each lane
 * still multiplies dimension 2i before 2i + 1, the same chain as qk_few. */
static ALWAYS_INLINE void qk_few_pairs(const float* qp, const float* kt, const float* kt1, long d, float* s,
                                       long lds, const int nr) {
    __m256 c[FEW_ROWS][4];
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (long i = 0; i < d / 2; i++) {
        const __m256i w[4] = {_mm256_loadu_si256((const __m256i*)(kt + i * KP)),
                              _mm256_loadu_si256((const __m256i*)(kt + i * KP + 8)),
                              _mm256_loadu_si256((const __m256i*)(kt1 + i * KP)),
                              _mm256_loadu_si256((const __m256i*)(kt1 + i * KP + 8))};
        __m256 k[4];
        for (int j = 0; j < 4; j++) k[j] = _mm256_castsi256_ps(_mm256_slli_epi32(w[j], 16));
        for (int r = 0; r < nr; r++) {
            const __m256 a = _mm256_broadcast_ss(qp + 2 * i * MR + r);
            for (int j = 0; j < 4; j++) c[r][j] = _mm256_fmadd_ps(a, k[j], c[r][j]);
        }
        for (int j = 0; j < 4; j++) k[j] = _mm256_castsi256_ps(_mm256_and_si256(w[j], high));
        for (int r = 0; r < nr; r++) {
            const __m256 a = _mm256_broadcast_ss(qp + (2 * i + 1) * MR + r);
            for (int j = 0; j < 4; j++) c[r][j] = _mm256_fmadd_ps(a, k[j], c[r][j]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(s + r * lds + 8 * j, c[r][j]);
}

/* o[r, c..c+8 nv) = alpha[r] * o[r, ..] (alpha NULL: o as it is) + sum_{j<n} p[r, j] * V_j[c..c+8 nv) for
 * r < nr, nv <= 4, each V row read where it lies in the pool (v[j]: its element c; widened from bfloat16
 * as it is read) */
static ALWAYS_INLINE void pv_few(float* o, long ldo, const float* p, long ldp, const void* pool, int bf16,
                                 const long* v, long c, long n, const float* alpha, const int nr, const int nv) {
    __m256 acc[FEW_ROWS][4];
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++) {
            const __m256 x = _mm256_loadu_ps(o + r * ldo + c + 8 * i);
            acc[r][i] = alpha ? _mm256_mul_ps(_mm256_broadcast_ss(alpha + r), x) : x;
        }
    for (long j = 0; j < n; j++) {
        __m256 x[4];
        for (int i = 0; i < nv; i++) x[i] = pool_load8(pool, bf16, v[j] + c + 8 * i);
        for (int r = 0; r < nr; r++) {
            const __m256 a = _mm256_broadcast_ss(p + r * ldp + j);
            for (int i = 0; i < nv; i++) acc[r][i] = _mm256_fmadd_ps(a, x[i], acc[r][i]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int i = 0; i < nv; i++) _mm256_storeu_ps(o + r * ldo + c + 8 * i, acc[r][i]);
}

/* pv_few in the bfloat16 body: o[r, c..c+16 nv) = alpha[r] * o[r, ..] (alpha NULL: o as it is) + the sum over
 * key pairs i of pw[r, 2i..2i+1] . (V_2i, V_2i+1)[c..c+16 nv), the pairs interleaved from the pool rows as
 * they are read (v[j]: where key j's V row starts; the missing partner of an odd n's last key reads as
 * zeros, as past-the-end keys are packed): per lane the vdpbf16ps chain of tile_pv512_bf16, without
 * packing slabs that only a few rows would read */
AVX512_BF16_TARGET static ALWAYS_INLINE void pv_few_bf16(float* o, long ldo, const unsigned short* pw, long ldp,
                                                        const void* pool, const long* v, long c, long n,
                                                        const float* alpha, const int nr, const int nv) {
    const unsigned short* pv = (const unsigned short*)pool;
    __m512 acc[FEW_ROWS][4];
    for (int r = 0; r < nr; r++)
        for (int k = 0; k < nv; k++) {
            const __m512 x = _mm512_loadu_ps(o + r * ldo + c + 16 * k);
            acc[r][k] = alpha ? _mm512_mul_ps(_mm512_set1_ps(alpha[r]), x) : x;
        }
    for (long i = 0; 2 * i < n; i++) {
        const long a = v[2 * i] + c, b = 2 * i + 1 < n ? v[2 * i + 1] + c : -1;
        __m512bh x[4];
        for (int k = 0; k < nv; k++) {
            const __m256i first = _mm256_loadu_si256((const __m256i*)(pv + a + 16 * k));
            const __m256i second = b >= 0 ? _mm256_loadu_si256((const __m256i*)(pv + b + 16 * k)) : _mm256_setzero_si256();
            __m256i cols0, cols1;
            pair_keys_bf16(first, second, &cols0, &cols1);
            x[k] = (__m512bh)_mm512_inserti64x4(_mm512_castsi256_si512(cols0), cols1, 1);
        }
        pv_pair_bf16(acc, pw, ldp, i, x, nr, nv);
    }
    for (int r = 0; r < nr; r++)
        for (int k = 0; k < nv; k++) _mm512_storeu_ps(o + r * ldo + c + 16 * k, acc[r][k]);
}

/* values_few in the bfloat16 body for nr = 1-3 rows, over a tile's bfloat16 probabilities (probabilities_bf16);
 * D % 16 == 0 */
AVX512_BF16_TARGET static ALWAYS_INLINE void values_few_bf16_rows(float* o, long d, const unsigned short* pw,
                                                                 const void* pool, const long* v, long n,
                                                                 const float* alpha, TileRequest* ahead, const int nr) {
    for (long j0 = 0; j0 < n; j0 += KP) {
        request_more(ahead);
        const long nj = n - j0 < KP ? n - j0 : KP;
        const float* a = j0 ? NULL : alpha;
        long c = 0;
        for (; c + 64 <= d; c += 64) pv_few_bf16(o, d, pw + j0, KT, pool, v + j0, c, nj, a, nr, 4);
        for (; c < d; c += 16) pv_few_bf16(o, d, pw + j0, KT, pool, v + j0, c, nj, a, nr, 1);
    }
}

AVX512_BF16_TARGET static void values_few_bf16(float* o, long d, const unsigned short* pw, const void* pool,
                                               const long* v, long n, const float* alpha, TileRequest* ahead,
                                               long rows) {
    if (rows == 1) values_few_bf16_rows(o, d, pw, pool, v, n, alpha, ahead, 1);
    else if (rows == 2) values_few_bf16_rows(o, d, pw, pool, v, n, alpha, ahead, 2);
    else values_few_bf16_rows(o, d, pw, pool, v, n, alpha, ahead, 3);
}

/* One tile's scores for nr rows: the key panels (kp[panel]) two at a time (a lone last one beside the next
 * panel's slot, whose scores land in columns never read) */
static ALWAYS_INLINE void scores_few(const float* qp, const float* const* kp, long d, float* s, long n, int pairs,
                                     TileRequest* ahead, const int nr) {
    for (long pan = 0; pan * KP < n; pan += 2) {
        request_more(ahead);
        if (pairs) qk_few_pairs(qp, kp[pan], kp[pan + 1], d, s + pan * KP, KT, nr);
        else qk_few(qp, kp[pan], kp[pan + 1], d, s + pan * KP, KT, nr);
    }
}

/* One tile's O = alpha O + P V for nr rows, 32 columns at a time over 16 keys at a time: the 16 rows
 * stay in L1 across the column passes (over all 64 keys at once a float32 tile's rows, 4 KB apart, came
 * back from L2 on every pass: 2.5x the time). Each output lane still runs alpha, then the keys in order;
 * o holds it exactly between groups. (v: where each key's V row starts) */
static ALWAYS_INLINE void values_few(float* o, long d, const float* s, const void* pool, int bf16, const long* v,
                                     long n, const float* alpha, TileRequest* ahead, const int nr) {
    for (long j0 = 0; j0 < n; j0 += KP) {
        request_more(ahead);
        const long nj = n - j0 < KP ? n - j0 : KP;
        const float* a = j0 ? NULL : alpha;
        long c = 0;
        for (; c + 32 <= d; c += 32) pv_few(o, d, s + j0, KT, pool, bf16, v + j0, c, nj, a, nr, 4);
        for (; c < d; c += 8) pv_few(o, d, s + j0, KT, pool, bf16, v + j0, c, nj, a, nr, 1);
    }
}

/* values_few_bf16 over a pool of panels' V pair rows (vp[panel], 16 keys a panel), read where they lie:
 * the same chain per lane */
AVX512_BF16_TARGET static void values_few_pairs(float* o, long d, const unsigned short* pw, const float* const* vp,
                                                long n, const float* alpha, TileRequest* ahead, long rows) {
    for (long j0 = 0, pan = 0; j0 < n; j0 += KP, pan++) {
        request_more(ahead);
        const long pairs = ((n - j0 < KP ? n - j0 : KP) + 1) / 2;
        const float* a = j0 ? NULL : alpha;
        for (long c = 0; c < d; c += 64) {
            const int ns = d - c >= 64 ? 4 : (int)((d - c) / 16);
            switch (ns * 4 + (int)rows) {
#define PAIRS_CASE(NS, NR) \
                case NS * 4 + NR: tile_pv512_bf16(o + c, d, pw + j0, KT, vp + pan, d, c, pairs, a, NS, NR); break;
                PAIRS_CASE(4, 1) PAIRS_CASE(4, 2) PAIRS_CASE(4, 3) PAIRS_CASE(3, 1) PAIRS_CASE(3, 2) PAIRS_CASE(3, 3)
                PAIRS_CASE(2, 1) PAIRS_CASE(2, 2) PAIRS_CASE(2, 3) PAIRS_CASE(1, 1) PAIRS_CASE(1, 2) PAIRS_CASE(1, 3)
#undef PAIRS_CASE
                default: break;
            }
        }
    }
}

void paged_decode_attention(const void* q, const void* pool, int pool_bf16, const long* tables, const long* lens,
                            long batch, long kv_heads, long rows, long head_dim, long num_blocks,
                            long block_size, long table_width, float scale, float* out, float* lse,
                            float* state_m, float* state_l, int carry_in, int finalize, const long* members,
                            long group, int body, int layout, int q_bf16, uint16_t* out_bf16, int threads) {
    const long d = head_dim;
    const int avx512 = body >= 1, key_words = body == 2 && pool_bf16 && d % 16 == 0;
    const int panel_pool = reads_panel_pool(layout, key_words, avx512, pool_bf16, d);
    const long token_stride = kv_heads * d;
    const long block_stride = block_size * token_stride;
    const long v_offset = num_blocks * block_stride;          /* the V pool follows the K pool */
    const long elt = pool_bf16 ? 2 : 4;
    const long panels = (rows + MR - 1) / MR, padded = panels * MR, last = rows - (panels - 1) * MR;
    const float qscale = scale * 1.44269504088896341f;       /* scores in base 2, as in prefill */
    const __m256 qs = _mm256_set1_ps(qscale);
    /* a few rows (one sequence's G heads) read each V row in place, once: no V slabs to fill */
    const int few = rows <= FEW_ROWS;
    /* and keep a bfloat16 pool's keys as word pairs (the float32 queries and products unchanged) */
    const int few_pairs = few && !key_words && pool_bf16 && d % 16 == 0;
    const long pstride = key_words || few_pairs ? KP * d / 2 : KP * d;     /* floats between K panels */
    const long q_elt = q_bf16 ? 2 : 4;

    #pragma omp parallel num_threads(threads)
    {
        /* Q panels (+ 8 floats the last 8-wide store of a 6-row panel spills), O, S, max, sum, alpha,
         * a tile's K panels and V slabs, its bfloat16 probabilities */
        float* qp = malloc(sizeof(float) * (padded * d + 8 + padded * d + padded * KT + 3 * padded + 2 * KT * d
                                            + padded * KT / 2));
        float* o = qp + padded * d + 8;
        float* s = o + padded * d;
        float* m = s + padded * KT;
        float* l = m + padded;
        float* alpha = l + padded;
        float* kt = alpha + padded;
        float* vr = kt + KT * d;
        unsigned short* pw = (unsigned short*)(vr + KT * d);
        unsigned* qw = key_words ? malloc(sizeof(unsigned) * (padded * d / 2 + QW_SPILL)) : NULL;
        memset(kt, 0, sizeof(float) * KT * d);     /* the slot beside a lone last panel is read, never used */
        long vis[(padded + MR - 1) / MR], at[KT], vrow[KT], row_at[rows > 0 ? rows : 1];

        #pragma omp for schedule(static)
        for (long task = 0; task < batch * kv_heads; task++) {
            const long b = task / kv_heads, h = task % kv_heads, len = lens[b];
            const long* table = tables + b * table_width;
            for (long r = 0; r < rows; r++)
                row_at[r] = members ? (members[r / group] * kv_heads + h) * group + r % group : task * rows + r;
            for (long p = 0; p < panels; p++) {
                const void* src[MR];
                for (long r = 0; r < MR; r++)
                    src[r] = p * MR + r < rows ? (const char*)q + q_elt * row_at[p * MR + r] * d : NULL;
                if (key_words)
                    pack_query_words(src, !q_bf16, d, qw + p * MR * (d / 2));
                else
                    for (long e = 0; e < d; e += 8)
                        gather_transposed((const float* const*)src, MR, e, qs, qp + p * MR * d + e * MR, MR);
            }
            start_rows(o, m, l, out, state_m, state_l, row_at, rows, padded, d, carry_in);

            for (long k0 = 0; k0 < len; k0 += KT) {
                const long n = len - k0 < KT ? len - k0 : KT;
                /* where the tile's K panels and V pair rows are read: packed here, or in a pool of panels
                 * where they lie (a last panel the sequence does not fill: copied, its tail zero) */
                const float* kp[KT / KP];
                const float* vp[KT / KP];
                for (long pan = 0; pan < KT / KP; pan++) {
                    kp[pan] = kt + pan * pstride;
                    vp[pan] = vr + pan * (KP / 2) * d;
                }
                if (panel_pool) {
                    tile_panels(pool, elt, table, block_size, token_stride, v_offset, h, d, k0, n, len, kt, vr, kp, vp);
                    /* a few rows read a float32 pool's V rows in place, as in a pool of rows */
                    if (few && !key_words) tile_rows(table, block_size, token_stride, h * block_size * d, d, k0, n, len, at);
                } else {
                    tile_rows(table, block_size, token_stride, h * d, token_stride, k0, n, len, at);
                    for (long pan = 0; pan * KP < n; pan++) {
                        if (few)
                            pack_panel_keys(pool, pool_bf16, key_words || few_pairs, at + pan * KP, d,
                                            kt + pan * pstride);
                        else
                            pack_panel(pool, pool_bf16, key_words, at + pan * KP, v_offset, d, kt + pan * pstride, vr,
                                       KT, pan * KP);
                    }
                }
                /* the next tile's K and V rows (this task's, or the next task's first), requested while
                 * this one is computed, spread over its row panels or, for a few rows, its key groups;
                 * on AVX-512 CPUs only: on a Zen 3 EPYC (AVX2) the same requests left stacked runs
                 * 1.00-1.07x and made tasks of a few float32 rows 1.2x slower */
                const long next = k0 + KT < len ? task : task + 1, nb = next < batch * kv_heads ? next / kv_heads : 0;
                const long j0 = next == task ? k0 + KT : 0;
                const long j1 = !avx512 || next == batch * kv_heads ? j0 : lens[nb] < j0 + KT ? lens[nb] : j0 + KT;
                TileRequest ahead = tile_request(pool, panel_pool, elt, tables + nb * table_width, block_size,
                                                 token_stride, v_offset, next % kv_heads * d, d, j0, j1,
                                                 few ? FEW_REQUEST_POINTS : request_points(panels, d), 1);
                /* every row of a decode task sits after all of the tile's keys */
                for (long p = 0; p < panels; p++) vis[p] = n;
                if (key_words) scores512_bf16(qw, kp, d, s, vis, panels, last, qscale, &ahead);
                else if (rows == 1) scores_few(qp, kp, d, s, n, few_pairs, &ahead, 1);
                else if (rows == 2) scores_few(qp, kp, d, s, n, few_pairs, &ahead, 2);
                else if (rows == 3) scores_few(qp, kp, d, s, n, few_pairs, &ahead, 3);
                else if (avx512) scores512(qp, kp, d, s, vis, panels, last, &ahead);
                else scores(qp, kt, d, s, vis, panels);
                /* padding rows are never read where the tiles skip them (the AVX-512 ones, a few rows') */
                softmax_rows_in(avx512, s, 0, few || avx512 ? rows : padded, &n, 0, round_up(n, 8), m, l, alpha);
                for (long j = 0; few && !(panel_pool && key_words) && j < n; j++) vrow[j] = at[j] + v_offset;
                if (panel_pool && key_words && few) {
                    probabilities_bf16(s, rows, pw);
                    values_few_pairs(o, d, pw, vp, n, alpha, &ahead, rows);
                }
                else if (key_words && few) {
                    probabilities_bf16(s, rows, pw);
                    values_few_bf16(o, d, pw, pool, vrow, n, alpha, &ahead, rows);
                }
                else if (key_words) {
                    probabilities_bf16(s, rows, pw);
                    values512_bf16(o, d, pw, vp, vis, alpha, panels, last, &ahead);
                }
                else if (rows == 1) values_few(o, d, s, pool, pool_bf16, vrow, n, alpha, &ahead, 1);
                else if (rows == 2) values_few(o, d, s, pool, pool_bf16, vrow, n, alpha, &ahead, 2);
                else if (rows == 3) values_few(o, d, s, pool, pool_bf16, vrow, n, alpha, &ahead, 3);
                else if (avx512) {
                    long slab, ldv;
                    const float* tail = value_strides(panel_pool, vr, KT, 0, d, vp, &slab, &ldv);
                    values512(o, d, s, vp, slab, ldv, tail, vis, alpha, panels, last, &ahead);
                }
                else values(o, d, s, vr, KT, 0, vis, alpha, panels);
                request_rest(&ahead);
            }
            end_rows(o, m, l, out, out_bf16, lse, state_m, state_l, row_at, rows, d, finalize);
        }
        free(qw);
        free(qp);
    }
}
