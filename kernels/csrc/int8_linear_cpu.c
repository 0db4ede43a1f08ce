/* Integer-activation linear layer for the CPU: y = x w^T (+ bias) for int8 weights whose inputs are quantized to
 * int8 per token or by a static scale (compressed-tensors' W8A8 checkpoints), by integer dot products.
 *
 * Inputs, quantized by batchgen_quantize_rows_s8 exactly as compressed-tensors' symmetric int8 quantizer does
 * (s = max |x| / 127.5 over the row, FLT_EPSILON where that is 0, or the static scale; q = round-half-even of
 * clamp(x / s, -128, 127)): q [M, K] int8 (rows ldq bytes apart), xs [M] float32 scales, qsum [M, G] int32 the
 * sum of each group's q.
 * Weights: u [N, K] uint8 rows ldu bytes apart, u = w + 128 (GroupQuantLinear's 8-bit layout, int32 words of
 * four values, lowest byte first), scales ws [N, G] float32, G = K / group.
 *
 * Each output: D_g = sum_{k in g} u[n,k] q[m,k] - 128 qsum[m,g] = sum_{k in g} w[n,k] q[m,k], exact in int32
 * (|D_g| <= group * 255 * 128 < 2^31 for group <= 65536: larger groups are refused); S = sum over g in order of
 * ws[n,g] * (float)D_g; y[m,n] = xs[m] * S (+ bias[n]). The product of the dequantized values, xs q times
 * ws w, is thus computed exactly up to these few float roundings (transformers' emulation rounds each of its K
 * products and sums). Integer sums do not depend on their order, so the SIMD build (AVX512-VNNI's vpdpbusd, 64
 * products per instruction) and the plain-C loops (BATCHGEN_GENERIC, or a CPU without it) give the same bits,
 * and a row's result never depends on M, the batch or the thread count.
 *
 * Blocking: threads take outputs in groups of NR (dynamic chunks); a group's NR weight rows stay in L1 while
 * every tile of MR input rows passes over them. With AMX (Sapphire Rapids and later; the kernel asks Linux for the
 * tile state once), from AMX_MIN_ROWS rows on, whole blocks of 16 outputs are multiplied by tdpbusd instead: the
 * weights as they lie are the left tiles (16 outputs x 64 k), the quantized rows, laid out once per call in
 * blocks of 16 rows as the right tiles want them (4 consecutive k of a row side by side), the right ones; each
 * tile's int32 sums are the same exact sums, so the results are the same bits. */

#pragma GCC optimize("fp-contract=off")
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(BATCHGEN_GENERIC)
#include <immintrin.h>
#define INT8_VNNI 1
#endif
#include "amx.h"
#if defined(INT8_VNNI) && defined(BATCHGEN_HAS_AMX)
#define INT8_AMX 1
#define AMX_MIN_ROWS 16 /* fewer rows: the vpdpbusd tiles (an AMX tile holds 16) */
#endif

#define MR 4         /* input rows per tile */
#define NR 4         /* outputs per tile */
#define VK 64        /* k per vpdpbusd */
#define MAX_GROUP 65536

/* max |row[k]| (the order of a maximum does not change it). */
static float largest_magnitude(const float *row, int K) {
    int k = 0;
    float amax = 0.0f;
#ifdef INT8_VNNI
    __m512 acc = _mm512_setzero_ps();
    for (; k + 16 <= K; k += 16) acc = _mm512_max_ps(acc, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
    amax = _mm512_reduce_max_ps(acc);
#endif
    for (; k < K; k++) amax = fmaxf(amax, fabsf(row[k]));
    return amax;
}

/* One row: q = round_half_even(clamp(x / s, -128, 127)); each group's sum of q into sums. */
static void quantize_row(const float *row, int K, float s, int group, int8_t *qr, int32_t *sums) {
    int k = 0;
#ifdef INT8_VNNI
    if (group % 16 == 0) {
        const __m512 vs = _mm512_set1_ps(s), lo = _mm512_set1_ps(-128.0f), hi = _mm512_set1_ps(127.0f);
        for (int g = 0; g < K / group; g++) {
            __m512i acc = _mm512_setzero_si512();
            for (; k < (g + 1) * group; k += 16) {
                __m512 v = _mm512_div_ps(_mm512_loadu_ps(row + k), vs);
                v = _mm512_min_ps(_mm512_max_ps(v, lo), hi); /* x < -128 ? -128 : x, then > 127 ? 127 : x */
                const __m512i i = _mm512_cvtps_epi32(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                _mm_storeu_si128((__m128i *)(qr + k), _mm512_cvtepi32_epi8(i));
                acc = _mm512_add_epi32(acc, i);
            }
            sums[g] = _mm512_reduce_add_epi32(acc);
        }
        return;
    }
#endif
    for (; k < K; k++) {
        float v = row[k] / s;
        v = v < -128.0f ? -128.0f : v;
        v = v > 127.0f ? 127.0f : v;
        qr[k] = (int8_t)rintf(v);
    }
    for (int g = 0; g < K / group; g++) {
        int32_t t = 0;
        for (int j = g * group; j < (g + 1) * group; j++) t += qr[j];
        sums[g] = t;
    }
}

/* Quantize rows of x: returns 0, or -1 on a bad argument. given: NULL (each row's scale from its own values), or
 * the scale of row m at given[m * given_stride] (stride 0: one static scale for every row). */
int batchgen_quantize_rows_s8(const float *x, int64_t ldx, int M, int K, const float *given, int given_stride,
                              int group, int8_t *q, float *xs, int32_t *qsum, int num_threads) {
    if (M < 0 || K <= 0 || group <= 0 || K % group != 0 || ldx < K || given_stride < 0) return -1;
    const int G = K / group;
#pragma omp parallel for num_threads((int64_t)M * K >= 65536 ? num_threads : 1) schedule(static)
    for (int m = 0; m < M; m++) {
        const float *row = x + (int64_t)m * ldx;
        float s;
        if (given) {
            s = given[(int64_t)m * given_stride];
        } else {
            float amax = largest_magnitude(row, K);
            s = amax / 127.5f;
            if (s == 0.0f) s = FLT_EPSILON;
        }
        xs[m] = s;
        quantize_row(row, K, s, group, q + (int64_t)m * K, qsum + (int64_t)m * G);
    }
    return 0;
}

/* d[i][j] = sum over k in [k0, k1) of u_j[k] q_i[k], for MR rows and NR weight rows (pointers may repeat: the
 * tile's edges compute duplicates, never read). */
static inline void dot_tile(const int8_t *const *qr, const uint8_t *const *ur, int k0, int k1, int32_t d[MR][NR]) {
    int k = k0;
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) d[i][j] = 0;
#ifdef INT8_VNNI
    if (k1 - k0 >= VK) {
        __m512i acc[MR][NR];
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_si512();
        for (; k + VK <= k1; k += VK) {
            __m512i w[NR];
            for (int j = 0; j < NR; j++) w[j] = _mm512_loadu_si512((const void *)(ur[j] + k));
            for (int i = 0; i < MR; i++) {
                const __m512i a = _mm512_loadu_si512((const void *)(qr[i] + k));
                for (int j = 0; j < NR; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], w[j], a);
            }
        }
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) d[i][j] = _mm512_reduce_add_epi32(acc[i][j]);
    }
#endif
    for (int i = 0; i < MR; i++)
        for (int j = 0; j < NR; j++) {
            int32_t t = 0;
            for (int kk = k; kk < k1; kk++) t += (int32_t)ur[j][kk] * (int32_t)qr[i][kk];
            d[i][j] += t;
        }
}

/* Outputs n0 .. n0 + nr - 1 for every input row. */
static void output_group(const int8_t *q, int64_t ldq, const float *xs, const int32_t *qsum, const uint8_t *u,
                         int64_t ldu, const float *ws, int group, const float *bias, float *y, int64_t ldy, int M,
                         int K, int n0, int nr) {
    const int G = K / group;
    const uint8_t *ur[NR];
    for (int j = 0; j < NR; j++) ur[j] = u + (int64_t)(n0 + (j < nr ? j : 0)) * ldu;
    for (int m0 = 0; m0 < M; m0 += MR) {
        const int mr = M - m0 < MR ? M - m0 : MR;
        const int8_t *qr[MR];
        for (int i = 0; i < MR; i++) qr[i] = q + (int64_t)(m0 + (i < mr ? i : 0)) * ldq;
        float s[MR][NR] = {{0}};
        for (int g = 0; g < G; g++) {
            int32_t d[MR][NR];
            dot_tile(qr, ur, g * group, (g + 1) * group, d);
            for (int i = 0; i < mr; i++)
                for (int j = 0; j < nr; j++) {
                    const int32_t exact = d[i][j] - 128 * qsum[(int64_t)(m0 + i) * G + g];
                    s[i][j] += ws[(int64_t)(n0 + j) * G + g] * (float)exact;
                }
        }
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++) {
                const float v = xs[m0 + i] * s[i][j];
                y[(int64_t)(m0 + i) * ldy + n0 + j] = bias ? v + bias[n0 + j] : v;
            }
    }
}

#ifdef INT8_AMX
/* AMX unless BATCHGEN_INT8_AMX=0. */
static int amx_ready(void) { return amx_permitted("BATCHGEN_INT8_AMX"); }

/* q [M, K] -> qv: for each block of 16 rows (zeros past M) and each 64 k, a 16 x 64-byte right tile whose row t
 * holds q[row][k + 4t .. k + 4t + 3] for the block's 16 rows side by side. */
static void lay_out_rows(const int8_t *q, int64_t ldq, int M, int K, int blocks, int8_t *qv, int num_threads) {
    const int chunks = K / VK;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int b = 0; b < blocks; b++)
        for (int c = 0; c < chunks; c++) {
            int8_t *tile = qv + ((int64_t)b * chunks + c) * 1024;
            for (int r = 0; r < 16; r++) {
                const int m = b * 16 + r;
                for (int t = 0; t < 16; t++) {
                    if (m < M)
                        memcpy(tile + t * 64 + r * 4, q + (int64_t)m * ldq + c * VK + 4 * t, 4);
                    else
                        memset(tile + t * 64 + r * 4, 0, 4);
                }
            }
        }
}

/* Outputs n0 .. n0 + 16 * nt - 1 (nt: 1 or 2 tiles) for every row, two blocks of 16 rows at a time. */
static void amx_output_block(const int8_t *qv, int chunks, int row_blocks, const float *xs, const int32_t *qsum,
                             const uint8_t *u, int64_t ldu, const float *ws, int group, const float *bias, float *y,
                             int64_t ldy, int M, int K, int n0, int nt) {
    const int G = K / group;
    int32_t c[4][16][16];
    for (int mb = 0; mb < row_blocks; mb += 2) {
        const int rb = row_blocks - mb < 2 ? 1 : 2;
        float s[32][32] = {{0}}; /* [output][row] */
        for (int g = 0; g < G; g++) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int k = g * group; k < (g + 1) * group; k += VK) {
                const int8_t *right = qv + ((int64_t)mb * chunks + k / VK) * 1024;
                _tile_loadd(4, u + (int64_t)n0 * ldu + k, ldu);
                _tile_loadd(6, right, 64);
                _tile_dpbusd(0, 4, 6);
                if (rb == 2) {
                    _tile_loadd(7, right + (int64_t)chunks * 1024, 64);
                    _tile_dpbusd(1, 4, 7);
                }
                if (nt == 2) {
                    _tile_loadd(5, u + (int64_t)(n0 + 16) * ldu + k, ldu);
                    _tile_dpbusd(2, 5, 6);
                    if (rb == 2) _tile_dpbusd(3, 5, 7);
                }
            }
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
            int32_t offset[32]; /* 128 times each row's sum of q over the group (0 past M: those rows are zeros) */
            for (int r = 0; r < 32; r++) {
                const int m = mb * 16 + r;
                offset[r] = m < M ? 128 * qsum[(int64_t)m * G + g] : 0;
            }
            for (int ot = 0; ot < nt; ot++)
                for (int rt = 0; rt < rb; rt++)
                    for (int o = 0; o < 16; o++) {
                        const float scale = ws[(int64_t)(n0 + ot * 16 + o) * G + g];
                        float *srow = s[ot * 16 + o] + rt * 16;
                        const int32_t *crow = c[ot * 2 + rt][o], *orow = offset + rt * 16;
                        for (int r = 0; r < 16; r++) srow[r] += scale * (float)(crow[r] - orow[r]);
                    }
        }
        for (int r = 0; r < rb * 16; r++) {
            const int m = mb * 16 + r;
            if (m >= M) break;
            for (int o = 0; o < nt * 16; o++) {
                const float v = xs[m] * s[o][r];
                y[(int64_t)m * ldy + n0 + o] = bias ? v + bias[n0 + o] : v;
            }
        }
    }
}

/* The first N16 = N - N % 16 outputs by AMX tiles. Returns 0, or -1 when the rows' layout cannot be allocated. */
static int amx_gemm(const int8_t *q, int64_t ldq, const float *xs, const int32_t *qsum, const uint8_t *u,
                    int64_t ldu, const float *ws, int group, const float *bias, float *y, int64_t ldy, int M, int K,
                    int N16, int num_threads) {
    const int chunks = K / VK, row_blocks = (M + 15) / 16;
    int8_t *qv = malloc((size_t)row_blocks * chunks * 1024);
    if (!qv) return -1;
    lay_out_rows(q, ldq, M, K, row_blocks, qv, num_threads);
    const int pairs = (N16 / 16 + 1) / 2;
#pragma omp parallel num_threads(num_threads)
    {
        TileConfig cfg = {0};
        cfg.palette_id = 1;
        for (int t = 0; t < 8; t++) {
            cfg.rows[t] = 16;
            cfg.colsb[t] = 64;
        }
        _tile_loadconfig(&cfg);
#pragma omp for schedule(dynamic, 2)
        for (int p = 0; p < pairs; p++) {
            const int n0 = p * 32, nt = N16 - n0 >= 32 ? 2 : 1;
            amx_output_block(qv, chunks, row_blocks, xs, qsum, u, ldu, ws, group, bias, y, ldy, M, K, n0, nt);
        }
        _tile_release();
    }
    free(qv);
    return 0;
}
#endif

/* y = x w^T + bias (bias may be NULL) from quantized rows. Returns 0, or -1 on a bad argument. */
int batchgen_int8_linear(const int8_t *q, int64_t ldq, const float *xs, const int32_t *qsum, const uint8_t *u,
                         int64_t ldu, const float *ws, int group, const float *bias, float *y, int64_t ldy, int M,
                         int K, int N, int num_threads) {
    if (M < 0 || K <= 0 || N <= 0 || group <= 0 || group > MAX_GROUP || K % group != 0 || ldq < K || ldu < K ||
        ldy < N)
        return -1;
    int first = 0; /* the first output the vpdpbusd tiles compute */
#ifdef INT8_AMX
    if (M >= AMX_MIN_ROWS && group % VK == 0 && N >= 16 && amx_ready() &&
        amx_gemm(q, ldq, xs, qsum, u, ldu, ws, group, bias, y, ldy, M, K, N - N % 16, num_threads) == 0)
        first = N - N % 16;
#endif
    const int groups = (N - first + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 8)
    for (int t = 0; t < groups; t++) {
        const int n0 = first + t * NR, nr = N - n0 < NR ? N - n0 : NR;
        output_group(q, ldq, xs, qsum, u, ldu, ws, group, bias, y, ldy, M, K, n0, nr);
    }
    return 0;
}
