/* Weight-only quantized linear layer for the CPU: y = x w^T (+ bias) in float32, w held as GGUF (ggml) blocks.
 *
 * Layout: w [N, K] is N rows of row_bytes bytes each; a row is K / QK blocks of the format, in order along K
 * (ggml's own layout, as a GGUF file stores it: rows can be sliced, permuted or concatenated as byte rows).
 * Formats (qtype: ggml's type ids): Q4_0 (2; 32 values in 18 bytes: fp16 d, 16 bytes of 4-bit q; w = d (q - 8)),
 * Q8_0 (8; 32 values in 34 bytes: fp16 d, 32 int8 q; w = d q), Q4_K (12; 256 values in 144 bytes: fp16 d and
 * dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks, 128 bytes of 4-bit q; w = (d sc) q - (dmin m)) and
 * Q6_K (14; 256 values in 210 bytes: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, fp16 d;
 * w = (d sc) (q - 32)). Dequantization is ggml's (and gguf-py's) arithmetic, operation for operation, in
 * float32 without contraction: the widened weights are bit for bit gguf.quants.dequantize's.
 *
 * Each output y[m, n] = bias[n] (or 0) + its eight lane sums over k in order, reduced in a fixed order: a
 * row's result depends only on that row, never on M, the batch or the thread count. Blocking (gemm below):
 * threads split the output rows in groups of NR; a group's weights are dequantized one chunk (a block) at a
 * time into an L1 buffer and multiplied with up to MB input rows, each x value loaded once for the NR rows, so
 * the packed weights are read once per MB rows and never widened in memory.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <string.h>

#include "half.h"

#define MB 64 /* input rows per pass over a weight row */

enum { Q4_0 = 2, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

static inline float load_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_bits_to_float(h);
}

/* (values per block, bytes per block) of a format; 0 values: unknown. */
static void format_of(int qtype, int *qk, int *bytes) {
    switch (qtype) {
    case Q4_0: *qk = 32, *bytes = 18; break;
    case Q8_0: *qk = 32, *bytes = 34; break;
    case Q4_K: *qk = 256, *bytes = 144; break;
    case Q6_K: *qk = 256, *bytes = 210; break;
    default: *qk = 0, *bytes = 0;
    }
}

/* One block of `qtype` at b into out[qk]. */
static void dequant_block(int qtype, const uint8_t *b, float *out) {
    if (qtype == Q8_0) {
        const float d = load_half(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (int i = 0; i < 32; i++) out[i] = d * (float)q[i];
    } else if (qtype == Q4_0) {
        const float d = load_half(b);
        const uint8_t *q = b + 2;
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)((int)(q[i] & 0x0f) - 8);
            out[i + 16] = d * (float)((int)(q[i] >> 4) - 8);
        }
    } else if (qtype == Q4_K) {
        const float d = load_half(b), dmin = load_half(b + 2);
        const uint8_t *s = b + 4, *q = b + 16;
        for (int j = 0; j < 8; j++) { /* sub-block j: 32 values, scale sc and min m (6 bits each) */
            int sc, m;
            if (j < 4) sc = s[j] & 63, m = s[j + 4] & 63;
            else sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
            const float ds = d * (float)sc, dm = dmin * (float)m;
            const uint8_t *qq = q + (j / 2) * 32;
            const int shift = (j % 2) * 4;
            for (int l = 0; l < 32; l++) {
                const float p = ds * (float)((qq[l] >> shift) & 0x0f);
                out[j * 32 + l] = p - dm;
            }
        }
    } else { /* Q6_K */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = load_half(b + 208);
        for (int half = 0; half < 2; half++) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = (int)((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = (int)((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                out[l] = (d * (float)sc[is + 0]) * (float)q1;
                out[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
                out[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
                out[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
            }
            out += 128, ql += 64, qh += 32, sc += 8;
        }
    }
}

#define NR 8 /* output rows dequantized together: each x value loaded once for all of them */

/* A source of weight values: `fill(ctx, n, k0, len, out)` writes w[n, k0 .. k0 + len) as float32. */
typedef void (*fill_fn)(const void *ctx, int n, int k0, int len, float *out);

/* y[m, n] = bias[n] + sum_k x[m, k] w[n, k], the weights produced chunk by chunk (`chunk` values, a multiple
 * of 8 dividing K) for NR output rows at a time into an L1 buffer; for each input row, eight lane sums per
 * output row accumulate over all of K and are reduced in a fixed order at the end. A row's result depends only
 * on that row: not on M, the batch or the thread count. */
static void gemm(const float *x, int64_t lda, const void *ctx, fill_fn fill, int chunk, const float *bias, float *y,
                 int64_t ldy, int M, int K, int N, int num_threads) {
    const int groups = (N + NR - 1) / NR;
#pragma omp parallel num_threads(num_threads)
    {
        float wb[NR * 256];
        float acc[MB][NR][8];
#pragma omp for schedule(static)
        for (int g = 0; g < groups; g++) {
            const int n0 = g * NR, nr = N - n0 < NR ? N - n0 : NR;
            for (int m0 = 0; m0 < M; m0 += MB) {
                const int rows = M - m0 < MB ? M - m0 : MB;
                memset(acc, 0, sizeof(float) * (size_t)rows * NR * 8);
                for (int k0 = 0; k0 < K; k0 += chunk) {
                    for (int r = 0; r < nr; r++) fill(ctx, n0 + r, k0, chunk, wb + r * chunk);
                    for (int r = nr; r < NR; r++) memset(wb + r * chunk, 0, sizeof(float) * chunk);
                    for (int m = 0; m < rows; m++) { /* the row's NR x 8 sums stay in registers over the chunk */
                        const float *xm = x + (int64_t)(m0 + m) * lda + k0;
                        float a[NR][8];
                        memcpy(a, acc[m], sizeof a);
                        for (int i = 0; i < chunk; i += 8)
                            for (int r = 0; r < NR; r++)
                                for (int l = 0; l < 8; l++)
                                    a[r][l] = __builtin_fmaf(xm[i + l], wb[r * chunk + i + l], a[r][l]);
                        memcpy(acc[m], a, sizeof a);
                    }
                }
                for (int m = 0; m < rows; m++)
                    for (int r = 0; r < nr; r++) {
                        const float *s = acc[m][r];
                        const float dot = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
                        y[(int64_t)(m0 + m) * ldy + n0 + r] = (bias ? bias[n0 + r] : 0.0f) + dot;
                    }
            }
        }
    }
}

typedef struct {
    const uint8_t *w;
    int64_t row_bytes;
    int qtype, qk, bb;
} BlockSource;

static void fill_blocks(const void *ctx, int n, int k0, int len, float *out) {
    const BlockSource *s = (const BlockSource *)ctx;
    for (int k = k0; k < k0 + len; k += s->qk)
        dequant_block(s->qtype, s->w + (int64_t)n * s->row_bytes + (int64_t)(k / s->qk) * s->bb, out + (k - k0));
}

/* y = x w^T + bias (bias may be NULL). Returns 0, or -1 on a bad argument (unknown format, K not a whole
 * number of blocks, row_bytes not K's blocks). */
int batchgen_quant_linear(const float *x, int64_t lda, const uint8_t *w, int64_t row_bytes, int qtype,
                          const float *bias, float *y, int64_t ldy, int M, int K, int N, int num_threads) {
    int qk, bb;
    format_of(qtype, &qk, &bb);
    if (qk == 0 || M < 0 || K <= 0 || N <= 0 || K % qk != 0 || row_bytes != (int64_t)(K / qk) * bb || lda < K)
        return -1;
    const BlockSource src = {w, row_bytes, qtype, qk, bb};
    int chunk = qk; /* whole blocks, up to 256 values, dividing K: fewer passes over each row's sums */
    for (int c = 256; c > qk; c -= qk)
        if (c % qk == 0 && K % c == 0) {
            chunk = c;
            break;
        }
    gemm(x, lda, &src, fill_blocks, chunk, bias, y, ldy, M, K, N, num_threads);
    return 0;
}

/* out [N, K] = the dequantized rows of w (same layout as above). Returns 0, or -1 on a bad argument. */
int batchgen_quant_dequantize(const uint8_t *w, int64_t row_bytes, int qtype, float *out, int K, int N) {
    int qk, bb;
    format_of(qtype, &qk, &bb);
    if (qk == 0 || K <= 0 || N < 0 || K % qk != 0 || row_bytes != (int64_t)(K / qk) * bb) return -1;
    for (int64_t n = 0; n < N; n++)
        for (int j = 0; j < K / qk; j++) dequant_block(qtype, w + n * row_bytes + (int64_t)j * bb, out + n * K + (int64_t)j * qk);
    return 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * Integer weights with group scales (compressed-tensors' pack-quantized W4A16 / W8A16, symmetric):
 * row n holds K values of `bits` bits (4 or 8) packed little-endian (value j at bit bits * j of the row, as
 * compressed-tensors' pack_to_int32 lays int32 words out), each stored with an offset of 2^(bits - 1);
 * scales [N, K / group] float32. w[n, j] = (q - offset) * scale[n, j / group], the product rounded to bfloat16
 * when round_bf16 (compressed-tensors computes it in the scale's dtype: a bfloat16 checkpoint's scales).
 * The same gemm as the GGUF path, over chunks of up to 256 values that never straddle a group. */
static inline float round_to_bf16(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7f800000u) != 0x7f800000u) bits += 0x7fffu + ((bits >> 16) & 1u); /* to nearest even */
    bits &= 0xffff0000u;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static void dequant_int(const uint8_t *row, int bits, int j0, int n, float scale, int round_bf16, float *out) {
    const int offset = 1 << (bits - 1);
    for (int i = 0; i < n; i++) {
        const int j = j0 + i;
        const int q = bits == 8 ? (int)row[j] : (int)((row[j >> 1] >> ((j & 1) * 4)) & 0x0f);
        const float v = (float)(q - offset) * scale;
        out[i] = round_bf16 ? round_to_bf16(v) : v;
    }
}

typedef struct {
    const uint8_t *w;
    const float *scales;
    int64_t row_bytes, groups;
    int bits, group, round_bf16;
} IntSource;

static void fill_int(const void *ctx, int n, int k0, int len, float *out) {
    const IntSource *s = (const IntSource *)ctx;
    dequant_int(s->w + (int64_t)n * s->row_bytes, s->bits, k0, len, s->scales[(int64_t)n * s->groups + k0 / s->group],
                s->round_bf16, out);
}

int batchgen_int_linear(const float *x, int64_t lda, const uint8_t *w, int bits, const float *scales, int group,
                        int round_bf16, const float *bias, float *y, int64_t ldy, int M, int K, int N,
                        int num_threads) {
    if ((bits != 4 && bits != 8) || group <= 0 || group % 8 != 0 || K % group != 0 || M < 0 || N <= 0 || lda < K)
        return -1;
    int chunk = 8; /* the largest multiple of 8 up to 256 dividing the group: chunks never straddle a scale */
    for (int c = 256; c >= 8; c -= 8)
        if (group % c == 0) {
            chunk = c;
            break;
        }
    const IntSource src = {w, scales, (int64_t)K * bits / 8, K / group, bits, group, round_bf16};
    gemm(x, lda, &src, fill_int, chunk, bias, y, ldy, M, K, N, num_threads);
    return 0;
}
