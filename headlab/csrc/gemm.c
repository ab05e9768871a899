/* c (M, N) = a (M, K) @ b + bias, float32, in the summation order of torch's CPU
 * products (MKL's sgemm), with AVX-512.
 *
 * Every output element is
 *     bias[n] + block_0 + block_1 + ...        (added left to right)
 * where block_q = sum over k in the q-th block of a[m, k] * b[k, n], accumulated by one
 * fused multiply-add per k in increasing k from 0, and the blocks of K are: K itself
 * when K <= 192; two halves when 192 < K < 384 (K even: MKL's split of an odd K is not
 * known, and kernels.py leaves those to torch); 192 each, the remainder last, when
 * K >= 384. That is the order MKL keeps on AMD CPUs, where it runs its AVX2 code (found
 * by matching bits, not documented); there it reaches about 200 GFLOP/s on 2 Zen 5
 * cores, and this code about 400 on the same sums. headlab/kernels.py checks bit for
 * bit that a built library agrees with torch on this machine before it uses it, and
 * uses it only for the shapes it checked (more than 16 rows, at least 16 outputs).
 *
 * b is given as (N, K) row-major when b_kn is 0 (an nn.Linear weight) or as (K, N)
 * row-major when b_kn is 1 (a weight stored input-major, or the weight in the
 * product that gives the input's gradient). Blocks of b are packed into 64-column
 * panels (zero padded) that stay in L2 while the rows of a stream past them; each
 * 6 x 64 tile of c is held in 24 registers for one block of K, then added to c. OpenMP
 * threads share the packed panels and split the (rows of 48, panel) pairs.
 */
#include <stdlib.h>

#if defined(__AVX512F__)
#include <immintrin.h>

#define MR 6               /* rows of a per tile */
#define NV 4               /* 16-float vectors per tile row */
#define NR (16 * NV)       /* columns per tile and per packed panel */
#define MC_MAX 48          /* rows of a per unit of work */
#define L2_BYTES (384 * 1024) /* for the packed panels of one column block */

static long block_of(long K) { return K <= 192 ? K : K < 384 ? K / 2 : 192; }

static inline __mmask16 mask_of(long cols) {
    return cols >= 16 ? 0xffff : cols <= 0 ? 0 : (__mmask16)((1u << cols) - 1);
}

/* c[i, :w] = (first ? bias or 0 : c[i, :w]) + sum_k a[i, k] * bp[k, :w] for i < mr,
 * k < kc; bp is one packed panel (kc x NR), w <= NR the columns that exist */
static inline __attribute__((always_inline)) void tile(
    int mr, long kc, const float *a, long lda, const float *bp, float *c, long ldc,
    const float *bias, int first, long w)
{
    __m512 acc[MR][NV];
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
    for (long k = 0; k < kc; ++k) {
        __m512 b[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; ++v) b[v] = _mm512_load_ps(bp + k * NR + 16 * v);
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
            if (i < mr) {
                __m512 ai = _mm512_set1_ps(a[i * lda + k]);
#pragma GCC unroll 4
                for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_fmadd_ps(ai, b[v], acc[i][v]);
            }
        }
    }
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
        if (i < mr) {
#pragma GCC unroll 4
            for (int v = 0; v < NV; ++v) {
                __mmask16 m = mask_of(w - 16 * v);
                float *out = c + i * ldc + 16 * v;
                if (first && !bias) {
                    _mm512_mask_storeu_ps(out, m, acc[i][v]);
                } else {
                    __m512 base = _mm512_maskz_loadu_ps(m, first ? bias + 16 * v : out);
                    _mm512_mask_storeu_ps(out, m, _mm512_add_ps(base, acc[i][v]));
                }
            }
        }
    }
}

/* `tile` with mr a compile-time constant in each branch, so acc lives in registers */
static void tile_rows(int mr, long kc, const float *a, long lda, const float *bp, float *c,
                      long ldc, const float *bias, int first, long w) {
    switch (mr) {
    case 1: tile(1, kc, a, lda, bp, c, ldc, bias, first, w); break;
    case 2: tile(2, kc, a, lda, bp, c, ldc, bias, first, w); break;
    case 3: tile(3, kc, a, lda, bp, c, ldc, bias, first, w); break;
    case 4: tile(4, kc, a, lda, bp, c, ldc, bias, first, w); break;
    case 5: tile(5, kc, a, lda, bp, c, ldc, bias, first, w); break;
    default: tile(MR, kc, a, lda, bp, c, ldc, bias, first, w); break;
    }
}

/* bp (kc x NR) = b[k0 : k0 + kc, j : j + NR] as (k, n), zero beyond column N */
static void pack(const float *b, int b_kn, long N, long K, long j, long k0, long kc,
                 float *bp) {
    long w = N - j < NR ? N - j : NR;
    if (b_kn) { /* (K, N): each k is a run of columns */
        for (long k = 0; k < kc; ++k) {
            const float *src = b + (k0 + k) * N + j;
            for (long t = 0; t < NR; ++t) bp[k * NR + t] = t < w ? src[t] : 0.f;
        }
    } else { /* (N, K): each column is a run of k */
        for (long t = 0; t < w; ++t) {
            const float *src = b + (j + t) * K + k0;
            for (long k = 0; k < kc; ++k) bp[k * NR + t] = src[k];
        }
        for (long t = w; t < NR; ++t)
            for (long k = 0; k < kc; ++k) bp[k * NR + t] = 0.f;
    }
}

/* returns 0 when done, 1 when out of memory */
int headlab_gemm(const float *a, const float *b, int b_kn, const float *bias, float *c,
                 long M, long N, long K, int threads) {
    const long kc_max = block_of(K), blocks = (K + kc_max - 1) / kc_max;
    long nc = (L2_BYTES / (4 * K)) / NR * NR; /* columns per block: K x nc in L2 */
    if (nc < NR) nc = NR;
    if (nc > (N + NR - 1) / NR * NR) nc = (N + NR - 1) / NR * NR;
    long mc = ((M + threads - 1) / threads + MR - 1) / MR * MR; /* all threads busy */
    if (mc > MC_MAX) mc = MC_MAX;
    const long row_units = (M + mc - 1) / mc;
    float *bp = aligned_alloc(64, sizeof(float) * K * nc); /* blocks of K, then panels */
    if (!bp) return 1;
#pragma omp parallel num_threads(threads)
    for (long j0 = 0; j0 < N; j0 += nc) {
        const long panels = ((N - j0 < nc ? N - j0 : nc) + NR - 1) / NR;
#pragma omp for collapse(2) schedule(static)
        for (long q = 0; q < blocks; ++q)
            for (long p = 0; p < panels; ++p) {
                long k0 = q * kc_max, kc = K - k0 < kc_max ? K - k0 : kc_max;
                pack(b, b_kn, N, K, j0 + p * NR, k0, kc, bp + k0 * nc + p * kc * NR);
            }
#pragma omp for collapse(2) schedule(static)
        for (long u = 0; u < row_units; ++u)
            for (long p = 0; p < panels; ++p) {
                const long i0 = u * mc, i1 = i0 + mc < M ? i0 + mc : M, j = j0 + p * NR;
                for (long q = 0; q < blocks; ++q) {
                    long k0 = q * kc_max, kc = K - k0 < kc_max ? K - k0 : kc_max;
                    for (long i = i0; i < i1; i += MR)
                        tile_rows(i1 - i < MR ? (int)(i1 - i) : MR, kc, a + i * K + k0, K,
                                  bp + k0 * nc + p * kc * NR, c + i * N + j, N,
                                  bias ? bias + j : NULL, q == 0, N - j);
                }
            }
    }
    free(bp);
    return 0;
}

int headlab_gemm_available(void) { return 1; }

#else /* without AVX-512 there is nothing to gain over torch's own products */

int headlab_gemm(const float *a, const float *b, int b_kn, const float *bias, float *c,
                 long M, long N, long K, int threads) {
    (void)a, (void)b, (void)b_kn, (void)bias, (void)c, (void)M, (void)N, (void)K,
        (void)threads;
    return 2;
}

int headlab_gemm_available(void) { return 0; }

#endif
