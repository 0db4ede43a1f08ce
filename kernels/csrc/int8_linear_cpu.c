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
 * every tile of MR input rows passes over them. */

#pragma GCC optimize("fp-contract=off")
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(BATCHGEN_GENERIC)
#include <immintrin.h>
#define INT8_VNNI 1
#endif

#define MR 4         /* input rows per tile */
#define NR 4         /* outputs per tile */
#define VK 64        /* k per vpdpbusd */
#define MAX_GROUP 65536

/* Quantize rows of x: returns 0, or -1 on a bad argument. given: NULL (each row's scale from its own values), or
 * the scale of row m at given[m * given_stride] (stride 0: one static scale for every row). */
int batchgen_quantize_rows_s8(const float *x, int64_t ldx, int M, int K, const float *given, int given_stride,
                              int group, int8_t *q, float *xs, int32_t *qsum) {
    if (M < 0 || K <= 0 || group <= 0 || K % group != 0 || ldx < K || given_stride < 0) return -1;
    const int G = K / group;
    for (int m = 0; m < M; m++) {
        const float *row = x + (int64_t)m * ldx;
        float s;
        if (given) {
            s = given[(int64_t)m * given_stride];
        } else {
            float amax = 0.0f;
            for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(row[k]));
            s = amax / 127.5f;
            if (s == 0.0f) s = FLT_EPSILON;
        }
        xs[m] = s;
        int8_t *qr = q + (int64_t)m * K;
        for (int k = 0; k < K; k++) {
            float v = row[k] / s;
            v = v < -128.0f ? -128.0f : v;
            v = v > 127.0f ? 127.0f : v;
            qr[k] = (int8_t)rintf(v);
        }
        for (int g = 0; g < G; g++) {
            int32_t t = 0;
            for (int k = g * group; k < (g + 1) * group; k++) t += qr[k];
            qsum[(int64_t)m * G + g] = t;
        }
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

/* y = x w^T + bias (bias may be NULL) from quantized rows. Returns 0, or -1 on a bad argument. */
int batchgen_int8_linear(const int8_t *q, int64_t ldq, const float *xs, const int32_t *qsum, const uint8_t *u,
                         int64_t ldu, const float *ws, int group, const float *bias, float *y, int64_t ldy, int M,
                         int K, int N, int num_threads) {
    if (M < 0 || K <= 0 || N <= 0 || group <= 0 || group > MAX_GROUP || K % group != 0 || ldq < K || ldu < K ||
        ldy < N)
        return -1;
    const int groups = (N + NR - 1) / NR;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 8)
    for (int t = 0; t < groups; t++) {
        const int n0 = t * NR, nr = N - n0 < NR ? N - n0 : NR;
        output_group(q, ldq, xs, qsum, u, ldu, ws, group, bias, y, ldy, M, K, n0, nr);
    }
    return 0;
}
