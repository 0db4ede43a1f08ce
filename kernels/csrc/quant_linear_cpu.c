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
 * Each output y[m, n] = bias[n] (or 0) + sum over blocks in order of the block's dot product with x (8 lane
 * partial sums reduced in a fixed order): a row's result depends only on that row, never on M, the batch or the
 * thread count. Blocking: threads split the output rows n; for each n the weight row is dequantized one block
 * at a time into a 256-float buffer (L1) and dotted with up to MB input rows (their partial sums in a
 * per-thread array), so the weights are read once per MB rows and never widened in memory.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <string.h>

#define MB 64 /* input rows per pass over a weight row */

enum { Q4_0 = 2, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };

static float half_bits(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (mant << 13);
    else if (exp != 0) bits = sign | ((exp + 112) << 23) | (mant << 13);
    else if (mant == 0) bits = sign;
    else {
        int e = -1;
        uint32_t m = mant;
        do { m <<= 1, e++; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float load_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_bits(h);
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

/* sum_i a[i] b[i] over n (a multiple of 8) values: eight lane sums, reduced in a fixed order. */
static inline float dot8(const float *a, const float *b, int n) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < n; i += 8)
        for (int l = 0; l < 8; l++) s[l] = __builtin_fmaf(a[i + l], b[i + l], s[l]);
    return ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
}

/* y = x w^T + bias (bias may be NULL). Returns 0, or -1 on a bad argument (unknown format, K not a whole
 * number of blocks, row_bytes not K's blocks). */
int batchgen_quant_linear(const float *x, int64_t lda, const uint8_t *w, int64_t row_bytes, int qtype,
                          const float *bias, float *y, int64_t ldy, int M, int K, int N, int num_threads) {
    int qk, bb;
    format_of(qtype, &qk, &bb);
    if (qk == 0 || M < 0 || K <= 0 || N <= 0 || K % qk != 0 || row_bytes != (int64_t)(K / qk) * bb || lda < K)
        return -1;
    const int blocks = K / qk;
#pragma omp parallel num_threads(num_threads)
    {
        float wb[256], acc[MB];
#pragma omp for schedule(static)
        for (int n = 0; n < N; n++) {
            const uint8_t *row = w + (int64_t)n * row_bytes;
            for (int m0 = 0; m0 < M; m0 += MB) {
                const int rows = M - m0 < MB ? M - m0 : MB;
                for (int r = 0; r < rows; r++) acc[r] = 0.0f;
                for (int j = 0; j < blocks; j++) {
                    dequant_block(qtype, row + (int64_t)j * bb, wb);
                    for (int r = 0; r < rows; r++) acc[r] += dot8(x + (int64_t)(m0 + r) * lda + (int64_t)j * qk, wb, qk);
                }
                const float b = bias ? bias[n] : 0.0f;
                for (int r = 0; r < rows; r++) y[(int64_t)(m0 + r) * ldy + n] = b + acc[r];
            }
        }
    }
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
