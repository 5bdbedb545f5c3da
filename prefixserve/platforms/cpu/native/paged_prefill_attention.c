/* Causal prefill attention read from the paged KV pool, blocked like a GEMM, float32, AVX2 + FMA
 * (AVX-512 tiles where the CPU runs them: the same bits, see tile_qk512).
 * The pool may hold float32 or bfloat16: keys and values are widened to float32 as they are packed,
 * so the products and the softmax run in float32 in both cases; where the CPU has avx512_bf16, a
 * bfloat16 pool's keys and values stay bfloat16 and both Q K^T and P V run on vdpbf16ps (exact
 * products, float32 sums; the probabilities rounded to bfloat16 for P V: see the bfloat16 body in
 * attention_tiles.h).
 *
 * Sequence b owns the query rows q[starts[b] : starts[b + 1]] of the flat batch; query i of
 * its n rows sits at position seq_lens[b] - n + i and sees keys 0..that position, whose K/V
 * (the chunk's own included) are already in the pool at the slots of tables[b, :]. Sequences
 * with fewer than min_qlen queries are skipped (decode has its own kernel).
 *
 * Phase 1 copies each (sequence, KV head)'s keys out of the pool once into `work`: K transposed
 * into panels of 16 keys ([D][16] each), V into slabs of 16 columns ([keys][16] each). Read in
 * place, one head's rows of the pool lie KVH*D floats apart (4 KB for 8 heads of 128), so every
 * key of a tile maps to the same few L1 sets and the products below would be served from L2.
 * Sequences starting on the same blocks (a cached document under several questions) pack those
 * keys once (find_shared_keys): 16 chunks of 34 tokens over one 1024-token document, bfloat16,
 * 21.2 -> 13.3 ms a layer, the copies no longer spilling out of the caches.
 *
 * A pool of panels (layout 1, kv_layout.py; a bfloat16 pool in the bfloat16 body, a float32 one in the
 * AVX-512 tiles) already holds each head's keys of a block as packed panels in one run of memory, and its
 * values as the tiles read them: phase 1 copies nothing and every tile reads its panels where they lie,
 * but for a bfloat16 sequence's last, partly written panel, copied with the keys past its end zero.
 *
 * A sequence whose queries make a single work item per KV head and that shares no keys with another
 * (a new turn of tens of tokens over a cached history of thousands) skips phase 1: its item packs each
 * 64-key tile into L1 where it uses it, as the decode kernel does, while the next tile's rows are
 * requested from memory, so reading the pool overlaps the products instead of all preceding them
 * (bfloat16 pool, 2-core Zen 5 EPYC: 32 tokens over 1024 cached 1.06-1.35x, over 2048 1.24-1.40x,
 * 16 over 1024 1.12-1.46x, 48 over 5000 1.19x; 16 fresh 32-token prompts 1.07x).
 *
 * Phase 2 splits (sequence, KV head, block of query tokens) into work items. An item's rows are
 * its tokens x the G query heads of the KV head (token-major), so each packed K panel and V tile
 * serves G heads. Per tile of 64 keys: S = Q K^T with a 6 x 16 register tile (Q pre-scaled by
 * scale * log2(e)), an online softmax in base 2 with a polynomial exp2, then O = alpha O + P V
 * with a 6 x 16 register tile over a V slab. Panels of 6 rows skip the 16-key panels above their
 * diagonal, so the causal square costs about half. Items run largest first, dynamically scheduled.
 *
 * 2-core AMD EPYC (Zen 3), 2 threads, 16 query / 8 KV heads of 128: 512 fresh causal tokens take
 * 9-11 ms a layer (100-120 GFLOP/s, near the matmul peak) against 22-24 ms for torch's CPU flash
 * kernel; a 512-token chunk over 1024 cached tokens 41-48 ms against 60-72 ms for gather + masked SDPA.
 * The AVX-512 tiles on a 2-core Zen 5 EPYC: 512 fresh tokens 5.6 -> 3.4 ms a layer (bfloat16 pool),
 * 32 tokens over 1024 cached 1.8 -> 1.1 ms. The bfloat16 keys on a 2-core Zen 4 EPYC against those
 * tiles: 32 tokens over 1024 cached 2.5 -> 1.9 ms, 512 fresh 10.1 -> 7.7 ms, 512 over 1024 36 -> 29 ms.
 *
 * q: token t, head j at q[t * q_stride + j * D]; out: [T, H, D] contiguous, only the rows of the
 * sequences served are written; both in the pool's dtype (a bfloat16 pool's queries are read as they
 * are and its outputs rounded to nearest even as they are stored: widening the queries and rounding
 * the output with torch took 7.5 ms a layer of a 1560-token long-doc-qa step whose attention takes 16,
 * two fresh float32 tensors of its size faulted in each call); work: the floats paged_prefill_workspace()
 * asks for, which also checks the arguments.
 * Requires D % 8 == 0.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attention_tiles.h"

#define ROWS 96         /* about this many rows (tokens x group) per work item: 48-128 measured within a few %,
                           96-128 a little ahead over a long cached context (more rows per packed key) */

typedef struct {
    long b, h, t0, nt;  /* sequence, KV head, first query token of the block and its count */
    long cost;          /* query-key pairs visible, for ordering */
} Item;

static int by_cost_desc(const void* x, const void* y) {
    long a = ((const Item*)x)->cost, c = ((const Item*)y)->cost;
    return (a < c) - (a > c);
}

/* sequence b has queries and at least min_qlen of them */
static int served(const long* starts, long b, long min_qlen) {
    long n = starts[b + 1] - starts[b];
    return n > 0 && n >= min_qlen;
}

/* Floats of `work` a call needs (per served sequence and KV head: its keys rounded up to 16, K and V; none
 * over a pool of panels, layout 1, which is read where it lies), or, for arguments the kernel must not run
 * on: -1 starts that fall or leave the `tokens` rows of q, -2 a sequence with more queries than positions,
 * -3 a length past the `capacity` of its block table. */
long paged_prefill_workspace(const long* seq_lens, const long* starts, long batch, long kv_heads, long head_dim,
                             long min_qlen, long tokens, long capacity, int layout) {
    long total = 0;
    if (batch > 0 && (starts[0] < 0 || starts[batch] > tokens)) return -1;
    for (long b = 0; b < batch; b++) {
        if (starts[b + 1] < starts[b]) return -1;
        if (starts[b + 1] - starts[b] > seq_lens[b]) return -2;
        if (seq_lens[b] > capacity) return -3;
        if (served(starts, b, min_qlen)) total += 2 * kv_heads * round_up(seq_lens[b], KP) * head_dim;
    }
    return layout == 1 ? 0 : total;
}

/* Sequences whose block tables begin with the same blocks (a shared prefix, the documents and system
 * prompts prefix caching exists for) read the same keys: each such key is packed once. leader[b] is the
 * first served sequence starting on b's first block (-1 when that is b itself, or b is not served), and
 * shared[b] how many of b's leading keys it reads from the leader's packing: the positions both hold
 * in the same blocks, rounded down to whole softmax tiles so that no tile mixes the two packings. */
static void find_shared_keys(const long* tables, const long* seq_lens, const long* starts, long batch,
                             long block_size, long table_width, long min_qlen, long* leader, long* shared) {
    for (long b = 0; b < batch; b++) {
        leader[b] = -1;
        shared[b] = 0;
        if (!served(starts, b, min_qlen) || seq_lens[b] <= 0) continue;
        for (long a = 0; a < b; a++) {
            if (leader[a] != -1 || !served(starts, a, min_qlen) || seq_lens[a] <= 0
                || tables[a * table_width] != tables[b * table_width])
                continue;
            long len = seq_lens[a] < seq_lens[b] ? seq_lens[a] : seq_lens[b];
            long blocks = (len + block_size - 1) / block_size, same = 0;
            while (same < blocks && tables[a * table_width + same] == tables[b * table_width + same]) same++;
            long keys = same * block_size < len ? same * block_size : len;
            keys = keys / KT * KT;
            if (keys > 0) { leader[b] = a; shared[b] = keys; }
            break;
        }
    }
}

/* work items of at most nt query tokens the served sequences make */
static long count_items(const long* starts, long batch, long min_qlen, long kv_heads, long nt) {
    long n = 0;
    for (long b = 0; b < batch; b++)
        if (served(starts, b, min_qlen)) n += kv_heads * ((starts[b + 1] - starts[b] + nt - 1) / nt);
    return n;
}

/* query tokens per work item: about ROWS rows, a whole number of 6-row panels where the group allows,
 * and small enough to give every thread several items. The items are counted as the sequences make
 * them: counting tokens as if they split evenly cut a 32-token chunk of one sequence into items of 24
 * and 8 tokens on 2 threads, where 8 items of 32 already give each thread 4 (and stream, below). */
static long block_tokens(long group, const long* starts, long batch, long min_qlen, long kv_heads, int threads) {
    long rows = ROWS;
    for (long r = ROWS; r <= ROWS + 48; r++)
        if (r % MR == 0 && r % group == 0) { rows = r; break; }
    long nt = rows / group > 0 ? rows / group : 1;
    /* at least ~4 items per thread where the work allows, down to 2 panels' worth of rows */
    while (nt > 1 && nt * group > 2 * MR && count_items(starts, batch, min_qlen, kv_heads, nt) < 4L * threads)
        nt = (nt + 1) / 2;
    return nt;
}

/* a query row's D elements widened to float into dst (bfloat16 rows: their bits are a float's upper half) */
static void widen_row(const void* row, int bf16, long d, float* dst) {
    for (long e = 0; e < d; e += 8) _mm256_storeu_ps(dst + e, pool_load8(row, bf16, e));
}

/* dst[0..D) = o[0..D) * inv, in float32 or rounded to the nearest even bfloat16 (store_bf16, as torch rounds) */
static void store_row(void* dst, int bf16, const float* o, float inv, long d) {
    const __m256 s = _mm256_set1_ps(inv);
    for (long e = 0; e < d; e += 8) {
        const __m256 x = _mm256_mul_ps(s, _mm256_loadu_ps(o + e));
        if (bf16)
            store_bf16((uint16_t*)dst + e, x);
        else
            _mm256_storeu_ps((float*)dst + e, x);
    }
}

void paged_prefill_attention(const void* q, long q_stride, const void* pool, int pool_bf16, const long* tables,
                             const long* seq_lens, const long* starts, long batch, long heads,
                             long kv_heads, long head_dim, long num_blocks, long block_size, long table_width,
                             long min_qlen, float scale, void* out, float* work, int body, int layout,
                             int threads) {
    const long d = head_dim, group = heads / kv_heads;
    /* body: 0 the AVX2 tiles, 1 the AVX-512 tiles, 2 those with a bfloat16 pool's keys in word pairs */
    /* a bfloat16 pool's keys in word pairs (head dims of whole 16-element rows: every model's) */
    const int avx512 = body >= 1, key_words = body == 2 && pool_bf16 && d % 16 == 0;
    /* a pool of panels (layout 1: a bfloat16 pool in the bfloat16 body, a float32 one in the AVX-512 tiles;
     * the caller checks): every tile reads its panels where they lie, nothing is packed in phase 1 or per
     * tile but a bfloat16 sequence's last, partly filled panel */
    const int panel_pool = reads_panel_pool(layout, key_words, avx512, pool_bf16, d);
    const long kstride = key_words ? KP * d / 2 : KP * d;     /* floats from one K panel to the next */
    const long token_stride = kv_heads * d;
    const long block_stride = block_size * token_stride;
    const long elt = pool_bf16 ? 2 : 4;
    const long v_offset = num_blocks * block_stride;    /* the V pool follows the K pool */

    /* where each served sequence's packed keys start in `work` */
    long* offset = malloc(sizeof(long) * (5 * batch + 1));
    long* qlens = offset + batch + 1;
    long* leader = qlens + batch;
    long* shared = leader + batch;
    long* streamed = shared + batch;
    for (long b = 0; b < batch; b++) qlens[b] = starts[b + 1] - starts[b];
    find_shared_keys(tables, seq_lens, starts, batch, block_size, table_width, min_qlen, leader, shared);
    long panels_total = 0;
    offset[0] = 0;
    for (long b = 0; b < batch; b++) {
        long keys = served(starts, b, min_qlen) ? round_up(seq_lens[b], KP) : 0;
        offset[b + 1] = offset[b] + 2 * kv_heads * keys * d;
        panels_total += kv_heads * keys / KP;
    }
    const long nt_max = block_tokens(group, starts, batch, min_qlen, kv_heads, threads);
    /* Streamed: a sequence whose queries make one item per KV head and that shares no keys packs each
     * tile of keys into L1 where its item uses it, while the next tile's rows are requested, instead of
     * in phase 1 */
    for (long b = 0; b < batch; b++) streamed[b] = served(starts, b, min_qlen) && qlens[b] <= nt_max && leader[b] < 0;
    for (long b = 0; b < batch; b++)
        if (leader[b] >= 0) streamed[leader[b]] = 0;
    long items_total = 0;
    for (long b = 0; b < batch; b++)
        if (served(starts, b, min_qlen)) items_total += kv_heads * ((qlens[b] + nt_max - 1) / nt_max);
    Item* items = malloc(sizeof(Item) * (items_total > 0 ? items_total : 1));
    long n_items = 0;
    for (long b = 0; b < batch; b++) {
        if (!served(starts, b, min_qlen)) continue;
        long ctx = seq_lens[b] - qlens[b];
        for (long t0 = 0; t0 < qlens[b]; t0 += nt_max) {
            long nt = qlens[b] - t0 < nt_max ? qlens[b] - t0 : nt_max;
            for (long h = 0; h < kv_heads; h++)
                items[n_items++] = (Item){b, h, t0, nt, nt * (ctx + t0 + nt)};
        }
    }
    qsort(items, n_items, sizeof(Item), by_cost_desc);
    const float qscale = scale * 1.44269504088896341f;     /* scores in base 2 */
    const __m256 qs = _mm256_set1_ps(qscale);

    #pragma omp parallel num_threads(threads)
    {
        /* phase 1: (sequence, panel of 16 keys, head) -> K^T panel and 16 V rows; the heads of a panel are
         * neighbours in the pool, so a thread's run of tasks reads whole token rows (2x faster than by head) */
        #pragma omp for schedule(dynamic, 64)
        for (long task = 0; task < panels_total; task++) {
            /* a sequence's tasks are its share of `work`, 2 * D * 16 floats each: find the one holding this */
            long at = task * 2 * d * KP, b = 0, hi = batch;      /* offset[b] <= at < offset[hi] */
            while (hi - b > 1) {
                long mid = (b + hi) / 2;
                if (offset[mid] <= at) b = mid; else hi = mid;
            }
            long rest = (at - offset[b]) / (2 * d * KP);
            long npan = round_up(seq_lens[b], KP) / KP, pan = rest / kv_heads, h = rest % kv_heads;
            if (panel_pool || pan * KP < shared[b] || streamed[b]) continue;  /* read in place, or packed by its
                                                                                leader or its item */
            float* kt = work + offset[b] + h * 2 * npan * KP * d;
            long rows[KP];                /* where the panel's K rows start in the pool, -1 past the sequence */
            for (long jj = 0; jj < KP; jj++) {
                long j = pan * KP + jj;
                long slot = j < seq_lens[b] ? tables[b * table_width + j / block_size] * block_size + j % block_size : 0;
                rows[jj] = j < seq_lens[b] ? slot * token_stride + h * d : -1;
            }
            pack_panel(pool, pool_bf16, key_words, rows, v_offset, d, kt + pan * kstride, kt + npan * KP * d,
                       npan * KP, pan * KP);
        }
        /* the barrier closing the loop above: every panel is packed before any item reads one */

        const long rows_max = round_up(nt_max * group, MR);
        /* Q panels (+ 2 floats the last 8-wide store of a 6-row panel spills), O, S, running max and sum,
         * a streamed tile's K panels and V slabs */
        float* qp = malloc(sizeof(float) * (rows_max * d * 2 + 8 + rows_max * KT + rows_max * 3 + 2 * KT * d
                                            + rows_max * KT / 2));
        float* o = qp + rows_max * d + 8;
        float* s = o + rows_max * d;
        float* m = s + rows_max * KT;
        float* l = m + rows_max;
        float* alpha = l + rows_max;
        float* tile_k = alpha + rows_max;
        float* tile_v = tile_k + KT * d;
        unsigned short* pw = (unsigned short*)(tile_v + KT * d);      /* a tile's bfloat16 probabilities */
        memset(tile_k, 0, sizeof(float) * KT * d);  /* the slot beside a lone last panel is read, never used */
        long at[KT];
        long* pos = malloc(sizeof(long) * rows_max * 3);
        /* Q panels in word pairs */
        unsigned* qw = key_words ? malloc(sizeof(unsigned) * (rows_max * d / 2 + QW_SPILL)) : NULL;
        float* qrows = pool_bf16 && !key_words ? malloc(sizeof(float) * MR * d) : NULL;  /* a panel's rows widened */
        long* vis = pos + rows_max;
        long* valid = pos + 2 * rows_max;     /* a tile row's keys at or before its position */

        /* phase 2: work items */
        #pragma omp for schedule(dynamic, 1)
        for (long it = 0; it < n_items; it++) {
            const Item w = items[it];
            const long len = seq_lens[w.b], ctx = len - qlens[w.b];
            const long npan = round_up(len, KP) / KP;
            /* where phase 1 packed the item's keys (a pool of panels: nowhere, and `work` holds nothing) */
            const float* kt = panel_pool ? NULL : work + offset[w.b] + w.h * 2 * npan * KP * d;
            const float* vr = panel_pool ? NULL : kt + npan * KP * d;
            /* the keys before shared[b] are read where the sequence's leader packed them */
            const long lead = leader[w.b], lead_pan = lead >= 0 ? round_up(seq_lens[lead], KP) / KP : 0;
            const float* lead_kt = lead >= 0 && !panel_pool ? work + offset[lead] + w.h * 2 * lead_pan * KP * d : kt;
            const float* lead_vr = panel_pool ? NULL : lead_kt + lead_pan * KP * d;
            const long rows = w.nt * group, panels = (rows + MR - 1) / MR, last_rows = rows - (panels - 1) * MR;
            const long first = starts[w.b] + w.t0;
            const long last = ctx + w.t0 + w.nt - 1;             /* the block's furthest position */
            const int stream = (int)streamed[w.b];
            const long* table = tables + w.b * table_width;
            if (stream && avx512) {
                TileRequest first_tile = tile_request(pool, panel_pool, elt, table, block_size, token_stride, v_offset,
                                                      w.h * d, d, 0,
                                                      last + 1 < KT ? last + 1 : KT, 1, 0);
                request_more(&first_tile);
            }

            /* Q panels [D][6], scaled; rows past the item's are zeros at its last token's position */
            for (long p = 0; p < panels; p++) {
                const char* src[MR];
                for (long r = p * MR; r < p * MR + MR; r++) {
                    long t = r < rows ? r / group : w.nt - 1;
                    src[r - p * MR] = r < rows ? (const char*)q + elt * ((first + t) * q_stride + (w.h * group + r % group) * d)
                                               : NULL;
                    pos[r] = ctx + w.t0 + t;
                    m[r] = -INFINITY;
                    l[r] = 0.0f;
                }
                if (key_words) {
                    pack_query_words((const void* const*)src, 0, d, qw + p * MR * (d / 2));
                    continue;
                }
                const float* rows_f[MR];
                for (int r = 0; r < MR; r++) {
                    rows_f[r] = (const float*)src[r];
                    if (qrows && src[r]) {
                        widen_row(src[r], 1, d, qrows + r * d);
                        rows_f[r] = qrows + r * d;
                    }
                }
                for (long e = 0; e < d; e += 8) gather_transposed(rows_f, MR, e, qs, qp + p * MR * d + e * MR, MR);
            }
            memset(o, 0, sizeof(float) * panels * MR * d);

            for (long k0 = 0; k0 <= last; k0 += KT) {
                /* keys of the tile each panel sees: its last row's (rows are token-major) */
                for (long p = 0; p < panels; p++) {
                    long n = pos[p * MR + MR - 1] - k0 + 1;
                    vis[p] = n <= 0 ? 0 : n > KT ? KT : n;
                }
                /* a streamed item's next tile, requested over this one's row panels (AVX-512 CPUs, as in decode) */
                TileRequest ahead = tile_request(pool, panel_pool, elt, table, block_size, token_stride, v_offset,
                                                 w.h * d, d, k0 + KT,
                                                 stream && avx512 ? (last + 1 < k0 + 2 * KT ? last + 1 : k0 + 2 * KT) : 0,
                                                 request_points(panels, d), 0);
                const float* kp[KT / KP];
                const float* vp[KT / KP];
                if (panel_pool) {
                    const long n = last + 1 - k0 < KT ? last + 1 - k0 : KT;
                    tile_panels(pool, elt, table, block_size, token_stride, v_offset, w.h, d, k0, n, len, tile_k,
                                tile_v, kp, vp);
                } else if (stream) {
                    const long n = last + 1 - k0 < KT ? last + 1 - k0 : KT;
                    tile_rows(table, block_size, token_stride, w.h * d, token_stride, k0, n, len, at);
                    for (long pan = 0; pan * KP < n; pan++)
                        pack_panel(pool, pool_bf16, key_words, at + pan * KP, v_offset, d, tile_k + pan * kstride, tile_v,
                                   KT, pan * KP);
                }
                /* S = Q K^T, only the 16-key panels at or below each row panel's diagonal */
                const int led = k0 < shared[w.b];
                const float* kpan = stream ? tile_k : panel_pool ? NULL : (led ? lead_kt : kt) + (k0 / KP) * kstride;
                for (long pan = 0; !panel_pool && pan < KT / KP; pan++) kp[pan] = kpan + pan * kstride;
                if (key_words)
                    scores512_bf16(qw, kp, d, s, vis, panels, last_rows, qscale, &ahead);
                else if (avx512)
                    scores512(qp, kp, d, s, vis, panels, last_rows, &ahead);
                else
                    scores(qp, kpan, d, s, vis, panels);
                /* the softmax over runs of row panels whose tiles have the same columns */
                for (long p = 0, p1; p < panels; p = p1) {
                    p1 = p + 1;
                    if (!vis[p]) continue;
                    const long cols = round_up(vis[p], 8);
                    while (p1 < panels && vis[p1] && round_up(vis[p1], 8) == cols) p1++;
                    /* the AVX-512 tiles skip the padding rows of the last panel */
                    const long r1 = avx512 && p1 * MR > rows ? rows : p1 * MR;
                    for (long r = p * MR; r < r1; r++) {
                        const long v = pos[r] - k0 + 1;
                        valid[r] = v <= 0 ? 0 : v > KT ? KT : v;
                    }
                    softmax_rows_in(avx512, s, p * MR, r1, valid, 1, cols, m, l, alpha);
                }
                /* O = alpha O + P V, a slab of V at a time across the row panels */
                const float* vslab = stream ? tile_v : led ? lead_vr : vr;
                const long vkeys = stream ? KT : (led ? lead_pan : npan) * KP, vk0 = stream ? 0 : k0;
                if (key_words) {
                    for (long pan = 0; !panel_pool && pan < KT / KP; pan++)
                        vp[pan] = vslab + (vk0 / KP + pan) * (KP / 2) * d;
                    probabilities_bf16(s, rows, pw);
                    values512_bf16(o, d, pw, vp, vis, alpha, panels, last_rows, &ahead);
                }
                else if (avx512) {
                    long slab, ldv;
                    const float* tail = value_strides(panel_pool, vslab, vkeys, vk0, d, vp, &slab, &ldv);
                    values512(o, d, s, vp, slab, ldv, tail, vis, alpha, panels, last_rows, &ahead);
                }
                else
                    values(o, d, s, vslab, vkeys, vk0, vis, alpha, panels);
                request_rest(&ahead);
            }

            for (long r = 0; r < rows; r++) {
                long t = r / group, g = r % group;
                store_row((char*)out + elt * ((first + t) * heads + w.h * group + g) * d, pool_bf16, o + r * d,
                          1.0f / l[r], d);
            }
        }
        free(qrows);
        free(qw);
        free(pos);
        free(qp);
    }
    free(items);
    free(offset);
}
