/* Float32 linear layer for the CPU: y = x w^T (+ bias) over a weight packed once into 16-column panels.
 *
 * Layout: the packed weight of an [N, K] matrix w is [ceil(N / 16), K, 16] contiguous: panel p holds the
 * columns p * 16 .. p * 16 + 15 of w^T, row k of the panel being w[p * 16 + c, k] for c = 0..15 (zero past N);
 * the bias, when given, is padded the same way to ceil(N / 16) * 16 floats. x [M, K] has rows lda floats
 * apart (unit stride within a row); y [M, N] has rows ldy floats apart.
 *
 * Each output y[m, n] is bias[n] (or 0) followed by one chain of fused multiply-adds over k = 0 .. K - 1 in
 * order: the result of a row depends on nothing but that row, its weights and K -- not on M, the other rows,
 * the thread count or where the row falls in a tile. So results are bit-identical run to run and for any
 * batch composition.
 *
 * Blocking (GotoBLAS's order, no packing of x): rows in blocks of MC, within a block the weight's k range in
 * chunks of KC (a panel's chunk, 32 KiB, stays in L1 while the block's rows pass over it; the rows' chunk,
 * MC x KC floats, stays in L2), and register tiles of 6 rows x 16 columns: 12 vector accumulators, two panel
 * loads and six broadcasts of x per k. Threads split the panels (OpenMP, static): each thread writes its own
 * columns, so no two threads touch the same output.
 *
 * SIMD: AVX2 and FMA (and BATCHGEN_GENERIC undefined) run the tile with intrinsics, and with AVX-512 tiles of 12
 * rows take one 512-bit accumulator per row (tile16: the same chains, twice the products per instruction);
 * otherwise the same loops
 * in plain C (with the compiler's own vectorisation), same packed layout, same order of operations per
 * output (fmaf), so both builds give the same results.
 *
 * Narrow weights: the same panels may hold bfloat16 or float16 values (2 bytes each, same [ceil(N / 16), K, 16]
 * layout; a bfloat16 panel row interleaves its columns as 0, 8, 1, 9, ..., 7, 15, so that the 32-bit lanes'
 * low halves are columns 0..7 and their high halves columns 8..15). They are widened to float32 in registers as
 * each panel row is loaded (bfloat16: a shift left by 16 and a mask of the high halves, one instruction each;
 * float16: F16C's vcvtph2ps, or an exact bit conversion in the plain-C build) and the arithmetic is the float32
 * kernel's, in the same order: the result is bit for bit the float32 kernel's on the widened weights. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "half.h"

#define PANEL 16 /* columns per panel */
#define TILE_ROWS 6
#if defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(BATCHGEN_GENERIC)
#define WIDE_ROWS 12 /* rows per 512-bit tile (tile16) */
#define WIDE_TILE(W) tile16(a, lda, b, kc, bias, c, ldc, first, W)
#else
#define WIDE_ROWS TILE_ROWS
#define WIDE_TILE(W)
#endif
#define KC 512 /* k per chunk */
#define MC 144 /* rows per block: a multiple of TILE_ROWS */

enum { W_F32 = 0, W_BF16 = 1, W_F16 = 2 }; /* weight element kinds */

static inline int64_t weight_bytes(const int W) { return W == W_F32 ? 4 : 2; }

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(BATCHGEN_GENERIC)
#include <immintrin.h>

/* Row k of a panel chunk as two vectors of 8 float32 (columns 0..7 and 8..15). */
static inline __attribute__((always_inline)) void load_panel_row(const void *b, int k, const int W, __m256 *b0,
                                                                  __m256 *b1) {
    if (W == W_F32) {
        const float *f = (const float *)b + (int64_t)k * PANEL;
        *b0 = _mm256_loadu_ps(f), *b1 = _mm256_loadu_ps(f + 8);
        return;
    }
    const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)b + (int64_t)k * PANEL));
    if (W == W_BF16) { /* interleaved panel (columns 0, 8, 1, 9, ...): a shift and a mask widen each half */
        *b0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *b1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        *b0 = _mm256_cvtph_ps(_mm256_castsi256_si128(v)), *b1 = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
    }
}

/* c[r, 0..15] (r < R; rows ldc apart) = (first ? bias or 0 : c) + sum_k a[r, k] b[k, 0..15] over kc values of
 * k; b is a panel's chunk (16 floats per k, aligned). R is a constant once inlined. */
static inline __attribute__((always_inline)) void tile(const float *a, int64_t lda, const void *b, int kc,
                                                        const float *bias, float *c, int64_t ldc, const int R,
                                                        int first, const int W) {
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
    const __m256 z0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
    const __m256 z1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
    c00 = c10 = c20 = c30 = c40 = c50 = z0;
    c01 = c11 = c21 = c31 = c41 = c51 = z1;
    if (!first) {
#define LOAD(r)                                                                                               \
    if (R > r) c##r##0 = _mm256_loadu_ps(c + r * ldc), c##r##1 = _mm256_loadu_ps(c + r * ldc + 8);
        LOAD(0) LOAD(1) LOAD(2) LOAD(3) LOAD(4) LOAD(5)
#undef LOAD
    }
    for (int k = 0; k < kc; k++) {
        __m256 b0, b1;
        load_panel_row(b, k, W, &b0, &b1);
#define FMA(r)                                                                                                \
    if (R > r) {                                                                                              \
        const __m256 ar = _mm256_broadcast_ss(a + r * lda + k);                                               \
        c##r##0 = _mm256_fmadd_ps(ar, b0, c##r##0);                                                           \
        c##r##1 = _mm256_fmadd_ps(ar, b1, c##r##1);                                                           \
    }
        FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5)
#undef FMA
    }
#define STORE(r)                                                                                              \
    if (R > r) _mm256_storeu_ps(c + r * ldc, c##r##0), _mm256_storeu_ps(c + r * ldc + 8, c##r##1);
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
}

#ifdef __AVX512F__
/* Row k of a panel chunk as one vector of 16 float32 (columns 0..15 in order). */
static inline __attribute__((always_inline)) __m512 load_panel_row16(const void *b, int k, const int W) {
    if (W == W_F32) return _mm512_loadu_ps((const float *)b + (int64_t)k * PANEL);
    const __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)b + (int64_t)k * PANEL));
    if (W == W_F16) return _mm512_cvtph_ps(v);
    const __m256i lo = _mm256_slli_epi32(v, 16), hi = _mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u));
    return _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
}

/* tile() for WIDE_ROWS rows with 512-bit vectors: one accumulator per row holds its 16 columns, each the same
 * chain of fused multiply-adds as tile()'s (so the same bits), twice the products per instruction. */
static inline __attribute__((always_inline)) void tile16(const float *a, int64_t lda, const void *b, int kc,
                                                          const float *bias, float *c, int64_t ldc, int first,
                                                          const int W) {
    __m512 acc[WIDE_ROWS];
    const __m512 z = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    for (int r = 0; r < WIDE_ROWS; r++) acc[r] = first ? z : _mm512_loadu_ps(c + r * ldc);
    for (int k = 0; k < kc; k++) {
        const __m512 w = load_panel_row16(b, k, W);
        for (int r = 0; r < WIDE_ROWS; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r * lda + k]), w, acc[r]);
    }
    for (int r = 0; r < WIDE_ROWS; r++) _mm512_storeu_ps(c + r * ldc, acc[r]);
}
#endif

#define TILE_ROWS_FOR(W)                                                                                      \
    static void tile_rows_##W(const float *a, int64_t lda, const void *b, int kc, const float *bias, float *c, \
                              int64_t ldc, int rows, int first) {                                             \
        if (WIDE_ROWS > TILE_ROWS && rows == WIDE_ROWS) {                                                     \
            WIDE_TILE(W);                                                                                     \
            return;                                                                                           \
        }                                                                                                     \
        for (; rows > TILE_ROWS; rows -= TILE_ROWS, a += TILE_ROWS * lda, c += TILE_ROWS * ldc)              \
            tile(a, lda, b, kc, bias, c, ldc, TILE_ROWS, first, W);                                           \
        switch (rows) {                                                                                       \
        case 6: tile(a, lda, b, kc, bias, c, ldc, 6, first, W); break;                                        \
        case 5: tile(a, lda, b, kc, bias, c, ldc, 5, first, W); break;                                        \
        case 4: tile(a, lda, b, kc, bias, c, ldc, 4, first, W); break;                                        \
        case 3: tile(a, lda, b, kc, bias, c, ldc, 3, first, W); break;                                        \
        case 2: tile(a, lda, b, kc, bias, c, ldc, 2, first, W); break;                                        \
        default: tile(a, lda, b, kc, bias, c, ldc, 1, first, W); break;                                       \
        }                                                                                                     \
    }
TILE_ROWS_FOR(W_F32)
TILE_ROWS_FOR(W_BF16)
TILE_ROWS_FOR(W_F16)
#undef TILE_ROWS_FOR

static void tile_rows(const float *a, int64_t lda, const void *b, int kc, const float *bias, float *c,
                      int64_t ldc, int rows, int first, int W) {
    if (W == W_BF16) tile_rows_W_BF16(a, lda, b, kc, bias, c, ldc, rows, first);
    else if (W == W_F16) tile_rows_W_F16(a, lda, b, kc, bias, c, ldc, rows, first);
    else tile_rows_W_F32(a, lda, b, kc, bias, c, ldc, rows, first);
}
#else
static inline float weight_at(const void *b, int64_t i, int W) {
    if (W == W_F32) return ((const float *)b)[i];
    if (W == W_F16) return half_bits_to_float(((const uint16_t *)b)[i]);
    const int64_t j = i % PANEL; /* bfloat16 panels interleave columns j and j + 8 */
    const uint32_t bits = (uint32_t)((const uint16_t *)b)[i - j + (j < 8 ? 2 * j : 2 * (j - 8) + 1)] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void tile_rows(const float *a, int64_t lda, const void *b, int kc, const float *bias, float *c,
                      int64_t ldc, int rows, int first, int W) {
    for (int r = 0; r < rows; r++) {
        float acc[PANEL];
        for (int j = 0; j < PANEL; j++) acc[j] = first ? (bias ? bias[j] : 0.0f) : c[r * ldc + j];
        for (int k = 0; k < kc; k++) {
            const float ar = a[r * lda + k];
            for (int j = 0; j < PANEL; j++) acc[j] = fmaf(ar, weight_at(b, (int64_t)k * PANEL + j, W), acc[j]);
        }
        memcpy(c + r * ldc, acc, sizeof acc);
    }
}
#endif

/* Rows m0 .. m1 - 1 of panel p into y (cols valid columns of the panel; a partial panel goes through a
 * 16-column scratch so nothing past column N is written). */
static void panel_rows(const float *x, int64_t lda, int K, const char *panel, const float *bias, float *y,
                       int64_t ldy, int m0, int m1, int cols, int W) {
    float scratch[MC * PANEL];
    float *c = cols == PANEL ? y + m0 * ldy : scratch;
    const int64_t ldc = cols == PANEL ? ldy : PANEL;
    for (int k0 = 0; k0 < K; k0 += KC) {
        const int kc = K - k0 < KC ? K - k0 : KC;
        for (int m = m0; m < m1; m += WIDE_ROWS) {
            const int rows = m1 - m < WIDE_ROWS ? m1 - m : WIDE_ROWS;
            tile_rows(x + m * lda + k0, lda, panel + (int64_t)k0 * PANEL * weight_bytes(W), kc, bias,
                      c + (m - m0) * ldc, ldc, rows, k0 == 0, W);
        }
    }
    if (c == scratch)
        for (int m = m0; m < m1; m++) memcpy(y + m * ldy, scratch + (m - m0) * PANEL, sizeof(float) * cols);
}

static int linear(const float *x, int64_t lda, const void *packed, const float *bias, float *y, int64_t ldy,
                  int M, int K, int N, int num_threads, int W) {
    if (M < 0 || K <= 0 || N <= 0 || lda < K || ldy < N) return -1;
    const int panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel num_threads(num_threads)
    for (int m0 = 0; m0 < M; m0 += MC) {
        const int m1 = M - m0 < MC ? M : m0 + MC;
#pragma omp for schedule(static) nowait
        for (int p = 0; p < panels; p++) {
            const int cols = N - p * PANEL < PANEL ? N - p * PANEL : PANEL;
            panel_rows(x, lda, K, (const char *)packed + (int64_t)p * K * PANEL * weight_bytes(W),
                       bias ? bias + p * PANEL : NULL, y + p * PANEL, ldy, m0, m1, cols, W);
        }
    }
    return 0;
}

/* y = x w^T + bias (bias may be NULL), w in float32 / bfloat16 / float16 panels. Returns 0, or -1 on a bad
 * argument. */
int batchgen_linear_f32(const float *x, int64_t lda, const float *packed, const float *bias, float *y,
                        int64_t ldy, int M, int K, int N, int num_threads) {
    return linear(x, lda, packed, bias, y, ldy, M, K, N, num_threads, W_F32);
}

int batchgen_linear_bf16w(const float *x, int64_t lda, const uint16_t *packed, const float *bias, float *y,
                          int64_t ldy, int M, int K, int N, int num_threads) {
    return linear(x, lda, packed, bias, y, ldy, M, K, N, num_threads, W_BF16);
}

int batchgen_linear_f16w(const float *x, int64_t lda, const uint16_t *packed, const float *bias, float *y,
                         int64_t ldy, int M, int K, int N, int num_threads) {
    return linear(x, lda, packed, bias, y, ldy, M, K, N, num_threads, W_F16);
}
