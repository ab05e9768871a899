/* A few rows times a row-major weight, streamed once across OpenMP threads.
 *
 * y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for m < M (a handful of rows, as in
 * decoding), float32, every array contiguous. Each thread takes one contiguous run of
 * 4-row tiles of w; a tile (4 x K floats) is read from memory once and stays in L1 for
 * the M rows of x. Built and loaded by headlab/kernels.py, which links the OpenMP
 * runtime torch has already loaded, so both share one pool of threads.
 */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_hadd_ps(a, a);
    a = _mm_hadd_ps(a, a);
    return _mm_cvtss_f32(a);
}

/* out[r] = w[r, :] . x for r < 4 */
static void dot4(const float *x, const float *w, long K, float *out) {
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    long k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv = _mm256_loadu_ps(x + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), xv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), xv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), xv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), xv, a3);
    }
    float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
    for (; k < K; ++k) {
        s0 += w0[k] * x[k];
        s1 += w1[k] * x[k];
        s2 += w2[k] * x[k];
        s3 += w3[k] * x[k];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}
#else
/* portable: 8 independent partial sums per row, which compilers vectorise */
static void dot4(const float *x, const float *w, long K, float *out) {
    float acc[4][8] = {{0}};
    long k = 0;
    for (; k + 8 <= K; k += 8)
        for (int r = 0; r < 4; ++r)
            for (int j = 0; j < 8; ++j) acc[r][j] += w[r * K + k + j] * x[k + j];
    for (int r = 0; r < 4; ++r) {
        float s = 0.f;
        for (int j = 0; j < 8; ++j) s += acc[r][j];
        for (long kk = k; kk < K; ++kk) s += w[r * K + kk] * x[kk];
        out[r] = s;
    }
}
#endif

static float dot1(const float *x, const float *w, long K) {
    float s = 0.f;
    for (long k = 0; k < K; ++k) s += w[k] * x[k];
    return s;
}

/* x (M, K), w (N, K), bias (N,) or NULL, y (M, N); threads: torch.get_num_threads(),
 * passed in because a thread other than the one torch configured has its own default */
void headlab_linear_rows(const float *x, const float *w, const float *bias, float *y,
                         long M, long N, long K, int threads) {
    const long tiles = N / 4;
    /* a small product is not worth waking the other threads */
    #pragma omp parallel for schedule(static) num_threads(threads) if (N * K >= 32768)
    for (long t = 0; t < tiles; ++t) {
        const long n = 4 * t;
        float out[4];
        for (long m = 0; m < M; ++m) {
            dot4(x + m * K, w + n * K, K, out);
            for (int r = 0; r < 4; ++r) y[m * N + n + r] = out[r] + (bias ? bias[n + r] : 0.f);
        }
    }
    for (long n = 4 * tiles; n < N; ++n) /* the last N % 4 rows */
        for (long m = 0; m < M; ++m)
            y[m * N + n] = dot1(x + m * K, w + n * K, K) + (bias ? bias[n] : 0.f);
}
