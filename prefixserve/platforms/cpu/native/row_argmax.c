/* The index of each row's largest value, float32, AVX2: greedy sampling's argmax over the vocabulary.
 *
 * torch's argmax along the last dimension runs scalar, a row per thread: 0.8-0.9 ms a decode step for
 * 16 rows of a 152k vocabulary on a 2-core Zen 5 EPYC, against 0.07 ms for the vectorised amax. Here a
 * chunk of a row is scanned twice while it sits in cache: its maximum, then the first index holding it.
 * The answer is torch's: the first index of the maximum, or of the first NaN where a row holds one.
 * A row is split into `threads` chunks when there are fewer rows than threads; chunks combine in row
 * order, so ties keep the lowest index.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>

typedef struct {
    long index;      /* first NaN, or first maximum */
    float value;
    int nan;
} Best;

static Best scan(const float* x, long begin, long end) {
    Best best = {begin, -INFINITY, 0};
    if (begin >= end) return best;
    __m256 mx = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    long i = begin;
    for (; i + 8 <= end; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        mx = _mm256_max_ps(mx, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float m[8];
    _mm256_storeu_ps(m, mx);
    float top = m[0];
    for (int e = 1; e < 8; e++) top = m[e] > top ? m[e] : top;
    int nan = _mm256_movemask_ps(unordered) != 0;
    for (long j = i; j < end; j++) {
        nan |= isnan(x[j]);
        top = x[j] > top ? x[j] : top;
    }
    if (nan) {
        for (long j = begin; j < end; j++)
            if (isnan(x[j])) return (Best){j, x[j], 1};
    }
    const __m256 t = _mm256_set1_ps(top);
    for (i = begin; i + 8 <= end; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), t, _CMP_EQ_OQ));
        if (hit) return (Best){i + __builtin_ctz(hit), top, 0};
    }
    for (; i < end; i++)
        if (x[i] == top) return (Best){i, top, 0};
    return best;   /* every value -inf: the first index, as torch gives */
}

/* out[r] = argmax(x[r, 0..n)) for x [rows, n] contiguous */
void row_argmax(const float* x, long rows, long n, long* out, int threads) {
    const long chunks = rows >= threads ? 1 : threads;
    const long tasks = rows * chunks;
    Best part[tasks];
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 16384)
    for (long task = 0; task < tasks; task++) {
        const long r = task / chunks, c = task % chunks;
        part[task] = scan(x + r * n, n * c / chunks, n * (c + 1) / chunks);
    }
    for (long r = 0; r < rows; r++) {
        Best best = part[r * chunks];
        for (long c = 1; c < chunks && !best.nan; c++) {
            const Best b = part[r * chunks + c];
            if (b.nan || b.value > best.value) best = b;
        }
        out[r] = best.index;
    }
}
