/* Weight-only quantized linear layer for the CPU: y = x w^T (+ bias) in float32, w held as GGUF (ggml) blocks.
 *
 * Layout: w [N, K] is N rows of row_bytes bytes each; a row is K / QK blocks of the format, in order along K
 * (ggml's own layout, as a GGUF file stores it: rows can be sliced, permuted or concatenated as byte rows).
 * Formats (qtype: ggml's type ids): Q4_0 (2; 32 values in 18 bytes: fp16 d, 16 bytes of 4-bit q; w = d (q - 8)),
 * Q8_0 (8; 32 values in 34 bytes: fp16 d, 32 int8 q; w = d q), Q4_K (12; 256 values in 144 bytes: fp16 d and
 * dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks, 128 bytes of 4-bit q; w = (d sc) q - (dmin m)) and
 * Q6_K (14; 256 values in 210 bytes: 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, fp16 d;
 * w = (d sc) (q - 32)); and, through the plain-C loops only, Q4_1 (3; fp16 d and m, 4-bit q; w = d q + m), Q5_0
 * (6; fp16 d, 32 high bits, 4-bit low q; w = d (q - 16)) and Q5_1 (7; w = d q + m), the types llama.cpp's
 * quantizer falls back to for rows a K-quant cannot split, and the other K-quants of llama.cpp's Q2_K, Q3_K_*
 * and Q5_K_* files: Q2_K (10; 256 values in 84 bytes: 16 bytes of 4-bit scales and mins for 16 sub-blocks, 64
 * bytes of 2-bit q, fp16 d and dmin; w = (d sc) q - (dmin m)), Q3_K (11; 110 bytes: 32 bytes of high bits, 64
 * bytes of 2-bit low q, 12 bytes of 6-bit scales, fp16 d; w = (d (sc - 32)) (q - 4 unless the high bit)) and
 * Q5_K (13; 176 bytes: Q4_K's fields plus 32 bytes of fifth bits; w = (d sc) q - (dmin m)), and the non-linear
 * IQ4_NL (20; 32 values in 18 bytes: fp16 d, 16 bytes of 4-bit indices into 16 int8 levels; w = d level) and
 * IQ4_XS (23; 256 values in 136 bytes: fp16 d, 6-bit scales of 8 sub-blocks, 128 bytes of indices; w = (d (sc -
 * 32)) level). Dequantization is ggml's (and gguf-py's) arithmetic, operation for operation, in
 * float32 without contraction: the widened weights are bit for bit gguf.quants.dequantize's.
 *
 * Each output y[m, n] = bias[n] (or 0) + its eight lane sums over k in order, reduced in a fixed order: a
 * row's result depends only on that row, never on M, the batch or the thread count. Two implementations of
 * that one order: the SIMD kernels (AVX2 + FMA + F16C, and table lookups for 4-bit codes with AVX-512VL: the
 * build's -march=native picks them, and the CPU's flags are in the build key; see "The SIMD path" below) and
 * the plain-C loops (gemm below, the portable build and BATCHGEN_GENERIC), bit for bit equal. Plain-C blocking:
 * threads split the output rows in groups of NR; a group's weights are dequantized one chunk (a block) at a
 * time into an L1 buffer and multiplied with up to MB input rows, each x value loaded once for the NR rows, so
 * the packed weights are read once per MB rows and never widened in memory.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>
#include <string.h>

#include "half.h"

#define MB 64 /* input rows per pass over a weight row */

enum {
    Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14,
    IQ4_NL = 20, IQ4_XS = 23
};

/* IQ4_NL's and IQ4_XS's 16 non-linear levels (ggml's kvalues_iq4nl; quant_digits_cpu.c reads them too). */
#define IQ4_LEVELS batchgen_iq4_levels
const int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline float load_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_bits_to_float(h);
}

/* The 2-bit field of value v (0..255) in Q2_K's and Q3_K's 64 bytes of low bits: v = 128 h + 32 s + l lies in
 * bits 2s of q[32 h + l]. */
static inline int crumb_at(const uint8_t *q, int v) {
    return (q[32 * (v / 128) + v % 32] >> (2 * ((v / 32) % 4))) & 3;
}

/* (values per block, bytes per block) of a format; 0 values: unknown. */
static void format_of(int qtype, int *qk, int *bytes) {
    switch (qtype) {
    case Q4_0: *qk = 32, *bytes = 18; break;
    case Q4_1: *qk = 32, *bytes = 20; break;
    case Q5_0: *qk = 32, *bytes = 22; break;
    case Q5_1: *qk = 32, *bytes = 24; break;
    case Q8_0: *qk = 32, *bytes = 34; break;
    case Q2_K: *qk = 256, *bytes = 84; break;
    case Q3_K: *qk = 256, *bytes = 110; break;
    case Q4_K: *qk = 256, *bytes = 144; break;
    case Q5_K: *qk = 256, *bytes = 176; break;
    case Q6_K: *qk = 256, *bytes = 210; break;
    case IQ4_NL: *qk = 32, *bytes = 18; break;
    case IQ4_XS: *qk = 256, *bytes = 136; break;
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
    } else if (qtype == IQ4_NL) { /* fp16 d, 16 bytes of 4-bit indices into the levels: w = d level */
        const float d = load_half(b);
        const uint8_t *q = b + 2;
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)IQ4_LEVELS[q[i] & 0x0f];
            out[i + 16] = d * (float)IQ4_LEVELS[q[i] >> 4];
        }
    } else if (qtype == IQ4_XS) { /* fp16 d, 6-bit scales (2 high bits in a uint16, 4 low in 4 bytes), indices */
        const float d = load_half(b);
        uint16_t high;
        memcpy(&high, b + 2, 2);
        const uint8_t *low = b + 4, *q = b + 8;
        for (int j = 0; j < 8; j++) { /* sub-block j: 32 values, scale d (sc - 32), its indices in q[16 j ..] */
            const int sc = ((low[j / 2] >> (4 * (j % 2))) & 0x0f) | (((high >> (2 * j)) & 3) << 4);
            const float dl = d * (float)(sc - 32);
            for (int i = 0; i < 16; i++) {
                out[32 * j + i] = dl * (float)IQ4_LEVELS[q[16 * j + i] & 0x0f];
                out[32 * j + i + 16] = dl * (float)IQ4_LEVELS[q[16 * j + i] >> 4];
            }
        }
    } else if (qtype == Q4_1) { /* fp16 d and m, 16 bytes of 4-bit q: w = d q + m */
        const float d = load_half(b), m = load_half(b + 2);
        const uint8_t *q = b + 4;
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)(q[i] & 0x0f) + m;
            out[i + 16] = d * (float)(q[i] >> 4) + m;
        }
    } else if (qtype == Q5_0 || qtype == Q5_1) { /* fp16 d (and m), 32 high bits, 16 bytes of low nibbles */
        const int one = qtype == Q5_1;
        const float d = load_half(b), m = one ? load_half(b + 2) : 0.0f;
        uint32_t qh;
        memcpy(&qh, b + 2 + 2 * one, 4);
        const uint8_t *q = b + 6 + 2 * one;
        for (int i = 0; i < 16; i++) {
            const int lo = (q[i] & 0x0f) | (int)((qh >> i) & 1) << 4, hi = (q[i] >> 4) | (int)((qh >> (i + 16)) & 1) << 4;
            if (one) {
                out[i] = d * (float)lo + m;
                out[i + 16] = d * (float)hi + m;
            } else { /* w = d (q - 16) */
                out[i] = d * (float)(lo - 16);
                out[i + 16] = d * (float)(hi - 16);
            }
        }
    } else if (qtype == Q4_K || qtype == Q5_K) {
        const int five = qtype == Q5_K;
        const float d = load_half(b), dmin = load_half(b + 2);
        const uint8_t *s = b + 4, *qh = b + 16, *q = b + 16 + 32 * five;
        for (int j = 0; j < 8; j++) { /* sub-block j: 32 values, scale sc and min m (6 bits each) */
            int sc, m;
            if (j < 4) sc = s[j] & 63, m = s[j + 4] & 63;
            else sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
            const float ds = d * (float)sc, dm = dmin * (float)m;
            const uint8_t *qq = q + (j / 2) * 32;
            const int shift = (j % 2) * 4;
            for (int l = 0; l < 32; l++) {
                const int v = ((qq[l] >> shift) & 0x0f) | (five ? ((qh[l] >> j) & 1) << 4 : 0); /* Q5_K: bit j */
                const float p = ds * (float)v;
                out[j * 32 + l] = p - dm;
            }
        }
    } else if (qtype == Q2_K) { /* sub-block i (16 values): scale d (sc & 15), min dmin (sc >> 4) */
        const uint8_t *sc = b, *q = b + 16;
        const float d = load_half(b + 80), dmin = load_half(b + 82);
        float dl[16], ml[16];
        for (int i = 0; i < 16; i++) dl[i] = d * (float)(sc[i] & 0x0f), ml[i] = dmin * (float)(sc[i] >> 4);
        for (int v = 0; v < 256; v++) {
            const float p = dl[v / 16] * (float)crumb_at(q, v);
            out[v] = p - ml[v / 16];
        }
    } else if (qtype == Q3_K) { /* sub-block i (16 values): scale d (sc - 32), sc 6 bits in two places */
        const uint8_t *hm = b, *q = b + 32, *s = b + 96;
        const float d = load_half(b + 108);
        float dl[16];
        for (int i = 0; i < 16; i++) {
            const int lo = i < 8 ? s[i] & 0x0f : s[i - 8] >> 4, hi = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
            dl[i] = d * (float)((lo | hi << 4) - 32); /* 6 bits, offset 32 */
        }
        for (int v = 0; v < 256; v++) { /* low 2 bits as Q2_K's; value v's high bit: bit v / 32 of hm[v % 32] */
            const int high = (hm[v % 32] >> (v / 32)) & 1;
            out[v] = dl[v / 16] * (float)(crumb_at(q, v) - (high ? 0 : 4));
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
#pragma omp for schedule(dynamic, 32) /* see simd_gemm */
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

/* ---------------------------------------------------------------------------------------------------------
 * fp8 weights (float8_e4m3fn: sign, 4 exponent bits of bias 7, 3 mantissa bits; subnormals at exponent 0;
 * S.1111.111 is NaN, no infinities), one byte per weight, row n its K bytes, with float32 scales [N, K / group]:
 * w[n, j] = value(q) * scale[n, j / group], the value exact in float32 and one rounding in the product (what
 * torch's fp8 -> float32 cast times the scale computes; a NaN byte, which no checkpoint holds, reads as 480).
 * Same gemm, chunks within a group. */
static inline float fp8_value(uint8_t q) {
    const int e = (q >> 3) & 15, m = q & 7;
    float v;
    if (e == 0) {
        v = (float)m * 0x1p-9f; /* subnormal: m / 8 * 2^-6 */
    } else {
        const uint32_t bits = (uint32_t)(e + 120) << 23 | (uint32_t)m << 20;
        memcpy(&v, &bits, sizeof v);
    }
    return q & 0x80 ? -v : v;
}

static void fill_fp8(const void *ctx, int n, int k0, int len, float *out) {
    const IntSource *s = (const IntSource *)ctx;
    const uint8_t *row = s->w + (int64_t)n * s->row_bytes;
    const float scale = s->scales[(int64_t)n * s->groups + k0 / s->group];
    for (int i = 0; i < len; i++) out[i] = fp8_value(row[k0 + i]) * scale;
}

/* ---------------------------------------------------------------------------------------------------------
 * The SIMD path (AVX2 + FMA + F16C; BATCHGEN_GENERIC undefined): the same products in the same order as gemm()
 * above (per output: eight lane sums, lane l over k = l mod 8 in order, reduced the same way), so both builds
 * give the same bits. Every format is read 32 values (a span) at a time: a span has one scale (two for Q6_K,
 * a scale and a min for Q4_K) and is widened 8 values at a time in registers (bytes to int32 lanes with
 * vpmovzx/vpmovsx, nibbles with shifts and masks, then cvtdq2ps and ggml's multiplies; Q6_K's 6-bit codes are
 * assembled as 32 int8 values by byte operations once per span), never through memory.
 *
 * Small batches (M <= FUSED_MAX, the memory-bound decode of a few sequences): threads split the outputs in
 * groups of GC (with 16 vector registers and 3 to FUSED_MAX rows: GC3); a group's weights are widened in
 * registers and multiplied at once with up to FR input rows held as vector accumulators over all of K, so each
 * packed byte is read once per FR rows (once per step for up to FR sequences). With at most XREG rows and 4-bit codes, the span's GC tables are built first and each 8 x
 * values are loaded once for the GC outputs (the products and their order unchanged). Larger batches: a group's weights are widened one chunk (KC values) at a time into an L1
 * buffer shared by MB input rows, multiplied in register tiles of BR x GC whose sums are kept in memory between
 * chunks (the order per output is unchanged). */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(BATCHGEN_GENERIC)
#include <immintrin.h>
#define QUANT_SIMD 1

enum { INT4 = 1004, INT8 = 1008, FP8 = 1108 }; /* compressed-tensors' packed integers, fp8 bytes (not ggml ids) */

#define GC 4 /* outputs per group */
#ifdef __AVX512VL__ /* 32 vector registers: FR x GC accumulators + GC weights + one input vector fit */
#define FR 6
#define BR 6
#define FUSED_MAX (2 * FR)
#else /* 16 vector registers: 12 accumulators, as 3 rows x GC outputs, or 4 rows x GC3 outputs (below) */
#define FR 4
#define BR 3
#define FUSED_MAX 6
#endif
#if defined(__AVX512VL__) && defined(__AVX512F__)
#define LUT4 1 /* 4-bit codes widened by a 16-entry table lookup (vpermt2ps ignores the index's high bits) */
#endif
#define GC3 3 /* outputs per group of the fused path on 16 registers for 3 to FUSED_MAX rows: a tile of 4 rows (the
               * drain's few sequences) widens each weight once where 3-row tiles would widen it twice */
#ifndef XREG
#define XREG 2 /* tiles of up to XREG rows (4-bit codes): x vectors loaded once per 8 values for the GC outputs */
#endif
#ifndef KC
#define KC 256 /* values per buffered chunk */
#endif

typedef struct {
    const uint8_t *w;
    int64_t row_bytes;
    const float *scales; /* INT4 / INT8: [N, groups] */
    int64_t groups;
    int group, round_bf16;
    int span_shift; /* INT4 / INT8 / FP8: log2(group / 32) when that is a power of two (a span's scale index is
                     * then a shift, not a division in the inner loop), else -1 */
} Src;

static int span_shift_of(int group) {
    const int spans = group / 32;
    return group > 0 && group % 32 == 0 && (spans & (spans - 1)) == 0 ? __builtin_ctz(spans) : -1;
}

typedef struct {
    float a, b; /* a span's scale (Q6_K: its first 16 values'), and Q4_K's min / Q6_K's second scale */
#ifdef LUT4
    __m256 t0, t1; /* 4-bit kinds: the span's 16 possible weights (code 0..7, 8..15), looked up by vpermt2ps */
#endif
    __m256i q6; /* Q6_K: the span's 32 codes q - 32 as int8, assembled with byte operations once per span */
} Span;

static inline __attribute__((always_inline)) float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h); /* exact, subnormals included */
}

/* round_to_bf16 on 8 lanes: to nearest even by the same integer steps, infinities and NaNs kept. */
static inline __attribute__((always_inline)) __m256 round_bf16_8(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v), e = _mm256_set1_epi32(0x7f800000);
    const __m256i special = _mm256_cmpeq_epi32(_mm256_and_si256(bits, e), e);
    __m256i add = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(_mm256_srli_epi32(bits, 16),
                                                                              _mm256_set1_epi32(1)));
    add = _mm256_andnot_si256(special, add);
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(bits, add), _mm256_set1_epi32((int)0xffff0000u));
    return _mm256_castsi256_ps(r);
}

#ifdef LUT4
/* The 16 weights a 4-bit code of the span can stand for, by the format's own arithmetic on each code. */
static inline __attribute__((always_inline)) void span_table(const Src *s, const int kind, Span *o) {
    const __m256 lo = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), hi = _mm256_setr_ps(8, 9, 10, 11, 12, 13, 14, 15);
    if (kind == Q4_K) { /* (d sc) q - (dmin m) */
        o->t0 = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(o->a), lo), _mm256_set1_ps(o->b));
        o->t1 = _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(o->a), hi), _mm256_set1_ps(o->b));
        return;
    }
    const __m256 eight = _mm256_set1_ps(8); /* q - 8, exact */
    o->t0 = _mm256_mul_ps(_mm256_set1_ps(o->a), _mm256_sub_ps(lo, eight));
    o->t1 = _mm256_mul_ps(_mm256_set1_ps(o->a), _mm256_sub_ps(hi, eight));
    if (kind == INT4 && s->round_bf16) o->t0 = round_bf16_8(o->t0), o->t1 = round_bf16_8(o->t1);
}
#endif

/* The (a, b) of the 8 spans of K-quant block `blk` of a row (what span_setup decodes span by span). */
static inline __attribute__((always_inline)) void kblock_scales(const uint8_t *row, int blk, const int kind,
                                                                float ab[16]) {
    if (kind == Q4_K) {
        const uint8_t *b = row + (int64_t)blk * 144, *s6 = b + 4;
        const float d = half_at(b), dmin = half_at(b + 2);
        for (int j = 0; j < 8; j++) {
            int sc, m;
            if (j < 4) sc = s6[j] & 63, m = s6[j + 4] & 63;
            else sc = (s6[j + 4] & 0x0f) | ((s6[j - 4] >> 6) << 4), m = (s6[j + 4] >> 4) | ((s6[j] >> 6) << 4);
            ab[2 * j] = d * (float)sc, ab[2 * j + 1] = dmin * (float)m;
        }
    } else {
        const uint8_t *b = row + (int64_t)blk * 210;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = half_at(b + 208);
        for (int i = 0; i < 16; i++) ab[i] = d * (float)sc[i];
    }
}

/* A span's constants; ab: its K-quant block's kblock_scales, or NULL to decode them here. */
static inline __attribute__((always_inline)) void span_setup(const Src *s, const uint8_t *row, int64_t n, int sp,
                                                             const int kind, Span *o, const float *ab) {
#ifdef LUT4
    o->t0 = o->t1 = _mm256_setzero_ps(); /* (set below for the 4-bit kinds) */
#endif
    if (kind == Q8_0) {
        o->a = half_at(row + (int64_t)sp * 34), o->b = 0.0f;
    } else if (kind == Q4_0) {
        o->a = half_at(row + (int64_t)sp * 18), o->b = 0.0f;
    } else if ((kind == Q4_K || kind == Q6_K) && ab) {
        o->a = ab[2 * (sp & 7)], o->b = ab[2 * (sp & 7) + 1];
    } else if (kind == Q4_K) {
        const uint8_t *b = row + (int64_t)(sp >> 3) * 144, *s6 = b + 4;
        const int j = sp & 7;
        int sc, m;
        if (j < 4) sc = s6[j] & 63, m = s6[j + 4] & 63;
        else sc = (s6[j + 4] & 0x0f) | ((s6[j - 4] >> 6) << 4), m = (s6[j + 4] >> 4) | ((s6[j] >> 6) << 4);
        o->a = half_at(b) * (float)sc, o->b = half_at(b + 2) * (float)m;
    } else if (kind == Q6_K) {
        const uint8_t *b = row + (int64_t)(sp >> 3) * 210;
        const int j = sp & 7;
        const int8_t *sc = (const int8_t *)(b + 192 + (j >> 2) * 8) + 2 * (j & 3);
        const float d = half_at(b + 208);
        o->a = d * (float)sc[0], o->b = d * (float)sc[1];
    } else {
        const int64_t g = s->span_shift >= 0 ? sp >> s->span_shift : (int64_t)sp * 32 / s->group;
        o->a = s->scales[n * s->groups + g], o->b = 0.0f;
    }
#ifdef LUT4
    if (kind == Q4_0 || kind == Q4_K || kind == INT4) span_table(s, kind, o);
#endif
    if (kind == Q6_K) { /* span j of the block: low 4 bits from ql's low (j & 3 < 2) or high nibbles, high 2
                         * bits from qh at bit 2 (j & 3); 16-bit shifts, then byte masks drop what crossed over */
        const uint8_t *b = row + (int64_t)(sp >> 3) * 210;
        const int j = sp & 7, h = j >> 2, t = j & 3;
        const __m256i f = _mm256_set1_epi8(0x0f), three = _mm256_set1_epi8(3);
        __m256i lo = _mm256_loadu_si256((const __m256i *)(b + h * 64 + (t & 1) * 32));
        lo = _mm256_and_si256(t < 2 ? lo : _mm256_srli_epi16(lo, 4), f);
        __m256i hi = _mm256_loadu_si256((const __m256i *)(b + 128 + h * 32));
        hi = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * t)), three);
        o->q6 = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    } else {
        o->q6 = _mm256_setzero_si256();
    }
}

static inline __attribute__((always_inline)) __m256i bytes8(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* Values 8c .. 8c + 7 of span sp of a row, widened (ggml's / compressed-tensors' arithmetic, unfused). */
static inline __attribute__((always_inline)) __m256 deq8(const Src *s, const uint8_t *row, int sp, const int c,
                                                         const int kind, const Span *o) {
    const __m256i f = _mm256_set1_epi32(0x0f);
    if (kind == Q8_0) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(row + (int64_t)sp * 34 + 2 + c * 8));
        return _mm256_mul_ps(_mm256_set1_ps(o->a), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)));
    }
#ifdef LUT4
    if (kind == Q4_0) { /* low nibbles for values 0..15 of the block, high for 16..31 */
        __m256i q = bytes8(row + (int64_t)sp * 18 + 2 + (c & 1) * 8);
        if (c >= 2) q = _mm256_srli_epi32(q, 4);
        return _mm256_permutex2var_ps(o->t0, q, o->t1);
    }
    if (kind == Q4_K) {
        __m256i q = bytes8(row + (int64_t)(sp >> 3) * 144 + 16 + ((sp & 7) >> 1) * 32 + c * 8);
        if (sp & 1) q = _mm256_srli_epi32(q, 4);
        return _mm256_permutex2var_ps(o->t0, q, o->t1);
    }
    if (kind == INT4) {
        uint32_t word;
        memcpy(&word, row + (int64_t)sp * 16 + c * 4, 4);
        const __m256i q =
            _mm256_srlv_epi32(_mm256_set1_epi32((int)word), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        return _mm256_permutex2var_ps(o->t0, q, o->t1);
    }
#endif
    if (kind == Q4_0) {
        __m256i q = bytes8(row + (int64_t)sp * 18 + 2 + (c & 1) * 8);
        q = c < 2 ? _mm256_and_si256(q, f) : _mm256_srli_epi32(q, 4);
        q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));
        return _mm256_mul_ps(_mm256_set1_ps(o->a), _mm256_cvtepi32_ps(q));
    }
    if (kind == Q4_K) {
        __m256i q = bytes8(row + (int64_t)(sp >> 3) * 144 + 16 + ((sp & 7) >> 1) * 32 + c * 8);
        q = _mm256_and_si256(_mm256_srl_epi32(q, _mm_cvtsi32_si128((sp & 1) * 4)), f);
        const __m256 p = _mm256_mul_ps(_mm256_set1_ps(o->a), _mm256_cvtepi32_ps(q));
        return _mm256_sub_ps(p, _mm256_set1_ps(o->b));
    }
    if (kind == Q6_K) { /* the span's codes 8c .. 8c + 7, sign-extended */
        const __m128i half = c < 2 ? _mm256_castsi256_si128(o->q6) : _mm256_extracti128_si256(o->q6, 1);
        const __m256i q = _mm256_cvtepi8_epi32(c & 1 ? _mm_unpackhi_epi64(half, half) : half);
        return _mm256_mul_ps(_mm256_set1_ps(c < 2 ? o->a : o->b), _mm256_cvtepi32_ps(q));
    }
    if (kind == FP8) { /* the e4m3 byte as the fp16 (b & 0x7f) << 7 with its sign at bit 15: 2^-8 times its value,
                        * normals and subnormals alike, widened exactly by vcvtph2ps; the scale carries the 2^8 */
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(row + (int64_t)sp * 32 + c * 8)));
        const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(0x3f80)),
                                       _mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16((short)0x8000)));
        return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(o->a * 256.0f));
    }
    __m256i q;
    if (kind == INT4) {
        uint32_t word;
        memcpy(&word, row + (int64_t)sp * 16 + c * 4, 4);
        q = _mm256_srlv_epi32(_mm256_set1_epi32((int)word), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        q = _mm256_sub_epi32(_mm256_and_si256(q, f), _mm256_set1_epi32(8));
    } else {
        q = _mm256_sub_epi32(bytes8(row + (int64_t)sp * 32 + c * 8), _mm256_set1_epi32(128));
    }
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(o->a));
    return s->round_bf16 ? round_bf16_8(v) : v;
}

/* ((s0 + s4) + (s2 + s6)) + ((s1 + s5) + (s3 + s7)), gemm()'s reduction. */
static inline float reduce8(__m256 v) {
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}

/* Bytes of packed weights per span of 32 values (K-quants: on average). */
#define SPAN_BYTES(kind)                                                                                      \
    ((kind) == Q8_0 ? 34 : (kind) == Q6_K ? 26 : (kind) == INT4 ? 16 : (kind) == INT8 || (kind) == FP8 ? 32 : 18)

/* Rows m0 .. m0 + R - 1 times the G (<= GC) outputs of `rows` over all of K (spans sp < spans), the weights
 * widened in registers; writes the nc valid outputs from column n0. */
static inline __attribute__((always_inline)) void fused_tile(const Src *s, const uint8_t *const *rows,
                                                             const int64_t *ns, int nc, const float *x, int64_t lda,
                                                             int spans, const float *bias, float *y, int64_t ldy,
                                                             int64_t n0, const int R, const int G, const int kind) {
    __m256 acc[FR][GC];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < G; c++) acc[r][c] = _mm256_setzero_ps();
    float ab[GC][16]; /* K-quants: the current block's span scales, per output */
    for (int sp = 0; sp < spans; sp++) {
        const float *xs = x + (int64_t)sp * 32;
        if ((kind == Q4_K || kind == Q6_K) && (sp & 7) == 0)
            for (int c = 0; c < G; c++) kblock_scales(rows[c], sp >> 3, kind, ab[c]);
        /* the next group's rows (G rows on: rows are row_bytes apart) at this span, read a group from now: each
         * row is a short stream (a few cache lines) that the hardware prefetcher barely learns */
#pragma GCC unroll 4
        for (int c = 0; c < G; c++) __builtin_prefetch(rows[c] + G * s->row_bytes + (int64_t)sp * SPAN_BYTES(kind), 0, 1);
#ifdef LUT4
        if ((kind == Q4_0 || kind == INT4) && R <= XREG) { /* x loaded once per 8 values for the G outputs */
            __m256 t0[GC], t1[GC];
#pragma GCC unroll 4
            for (int c = 0; c < G; c++) {
                Span o;
                span_setup(s, rows[c], ns[c], sp, kind, &o, NULL);
                t0[c] = o.t0, t1[c] = o.t1;
            }
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) {
                __m256 xv[FR];
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(xs + r * lda + q * 8);
#pragma GCC unroll 4
                for (int c = 0; c < G; c++) {
                    __m256i code;
                    if (kind == Q4_0) {
                        code = bytes8(rows[c] + (int64_t)sp * 18 + 2 + (q & 1) * 8);
                        if (q >= 2) code = _mm256_srli_epi32(code, 4);
                    } else {
                        uint32_t word;
                        memcpy(&word, rows[c] + (int64_t)sp * 16 + q * 4, 4);
                        code = _mm256_srlv_epi32(_mm256_set1_epi32((int)word),
                                                 _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
                    }
                    const __m256 w = _mm256_permutex2var_ps(t0[c], code, t1[c]);
#pragma GCC unroll 8
                    for (int r = 0; r < R; r++) acc[r][c] = _mm256_fmadd_ps(xv[r], w, acc[r][c]);
                }
            }
            continue;
        }
#endif
#pragma GCC unroll 4
        for (int c = 0; c < G; c++) { /* one output's span at a time: its table and weights live briefly */
            Span o;
            span_setup(s, rows[c], ns[c], sp, kind, &o, kind == Q4_K || kind == Q6_K ? ab[c] : NULL);
#pragma GCC unroll 4
            for (int q = 0; q < 4; q++) {
                const __m256 w = deq8(s, rows[c], sp, q, kind, &o);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++)
                    acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(xs + r * lda + q * 8), w, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc; c++) y[r * ldy + n0 + c] = (bias ? bias[n0 + c] : 0.0f) + reduce8(acc[r][c]);
}

/* Rows of a buffered chunk: sums[r][c] (row r at sums + r * ss, kept in memory between chunks) += x[r, k0 ..
 * k0 + kc) wb[c] for GC buffered outputs (KC floats apart). */
static inline __attribute__((always_inline)) void buffered_tile(const float *x, int64_t lda, const float *wb,
                                                                int kc, float *sums, int64_t ss, int first,
                                                                const int R) {
    __m256 acc[BR][GC];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < GC; c++) acc[r][c] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + r * ss + c * 8);
    for (int i = 0; i < kc; i += 8) {
        __m256 w[GC];
#pragma GCC unroll 4
        for (int c = 0; c < GC; c++) w[c] = _mm256_load_ps(wb + c * KC + i);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_loadu_ps(x + r * lda + i);
#pragma GCC unroll 4
            for (int c = 0; c < GC; c++) acc[r][c] = _mm256_fmadd_ps(xv, w[c], acc[r][c]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int c = 0; c < GC; c++) _mm256_storeu_ps(sums + r * ss + c * 8, acc[r][c]);
}

#ifndef BG
#define BG 16 /* outputs per group of the buffered path: each tile of input rows, in L1, serves BG / GC tiles */
#endif

/* Rows r0 .. r0 + R - 1 of a buffered chunk against all BG buffered outputs. */
static inline __attribute__((always_inline)) void buffered_rows_tile(const float *x, int64_t lda, const float *wb,
                                                                     int kc, float *sums, int first, const int R) {
    for (int g = 0; g < BG / GC; g++)
        buffered_tile(x, lda, wb + g * GC * KC, kc, sums + g * GC * 8, BG * 8, first, R);
}

static void buffered_rows(const float *x, int64_t lda, const float *wb, int kc, float *sums, int first, int rows) {
    int r = 0;
    for (; r + BR <= rows; r += BR) buffered_rows_tile(x + r * lda, lda, wb, kc, sums + r * BG * 8, first, BR);
    float *sr = sums + r * BG * 8;
    const float *xr = x + r * lda;
    switch (rows - r) {
#if BR > 5
    case 5: buffered_rows_tile(xr, lda, wb, kc, sr, first, 5); break;
#endif
#if BR > 4
    case 4: buffered_rows_tile(xr, lda, wb, kc, sr, first, 4); break;
#endif
#if BR > 3
    case 3: buffered_rows_tile(xr, lda, wb, kc, sr, first, 3); break;
#endif
    case 2: buffered_rows_tile(xr, lda, wb, kc, sr, first, 2); break;
    case 1: buffered_rows_tile(xr, lda, wb, kc, sr, first, 1); break;
    default: break;
    }
}

#ifndef MBUF
#define MBUF 64 /* input rows per pass over a buffered chunk */
#endif

/* The whole product for one format (a constant once inlined). */
/* Output group g (width outputs from g * width) of all M rows, the weights of one kind. Called once per group from
 * the parallel region through a function of its own per kind (group_fn): inlined into the region's outlined
 * body instead, the fused tiles ran up to 3x slower (GCC 12, AVX2: the region's shared variables are read
 * through its data block, and the tiles' registers are allocated across every kind and tile shape at once). */
static inline __attribute__((always_inline)) void gemm_group(const float *x, int64_t lda, const Src *s,
                                                             const float *bias, float *y, int64_t ldy, int M,
                                                             int K, int N, int g, int width, int fg, float *wb,
                                                             float *sums, const int kind) {
    const int spans = K / 32;
    const int64_t n0 = (int64_t)g * width;
    const int nc = N - n0 < width ? (int)(N - n0) : width;
    const uint8_t *rows[BG];
    int64_t ns[BG];
    for (int c = 0; c < width; c++) { /* past N: repeat the last row (computed, never written) */
        ns[c] = n0 + (c < nc ? c : nc - 1);
        rows[c] = s->w + ns[c] * s->row_bytes;
    }
    if (M <= FUSED_MAX) {
#define FUSED(R)                                                                                              \
    (fg == GC3 ? fused_tile(s, rows, ns, nc, x + m * lda, lda, spans, bias, y + m * ldy, ldy, n0, R, GC3, kind) \
               : fused_tile(s, rows, ns, nc, x + m * lda, lda, spans, bias, y + m * ldy, ldy, n0, R, GC, kind))
        int m = 0;
        for (; m + FR <= M; m += FR) FUSED(FR);
        switch (M - m) {
#if FR > 5
        case 5: FUSED(5); break;
        case 4: FUSED(4); break;
#endif
        case 3: FUSED(3); break;
        case 2: FUSED(2); break;
        case 1: FUSED(1); break;
        default: break;
        }
#undef FUSED
        return;
    }
    for (int m0 = 0; m0 < M; m0 += MBUF) {
        const int mr = M - m0 < MBUF ? M - m0 : MBUF;
        for (int k0 = 0; k0 < K; k0 += KC) {
            const int kc = K - k0 < KC ? K - k0 : KC;
            for (int c = 0; c < BG; c++) {
                for (int sp = k0 / 32; sp < (k0 + kc) / 32; sp++) {
                    Span o;
                    span_setup(s, rows[c], ns[c], sp, kind, &o, NULL);
                    float *dst = wb + c * KC + (sp * 32 - k0);
                    _mm256_store_ps(dst, deq8(s, rows[c], sp, 0, kind, &o));
                    _mm256_store_ps(dst + 8, deq8(s, rows[c], sp, 1, kind, &o));
                    _mm256_store_ps(dst + 16, deq8(s, rows[c], sp, 2, kind, &o));
                    _mm256_store_ps(dst + 24, deq8(s, rows[c], sp, 3, kind, &o));
                }
            }
            buffered_rows(x + m0 * lda + k0, lda, wb, kc, sums, k0 == 0, mr);
        }
        for (int m = 0; m < mr; m++)
            for (int c = 0; c < nc; c++)
                y[(m0 + m) * ldy + n0 + c] =
                    (bias ? bias[n0 + c] : 0.0f) + reduce8(_mm256_loadu_ps(sums + (m * BG + c) * 8));
    }
}

typedef void (*group_fn)(const float *x, int64_t lda, const Src *s, const float *bias, float *y, int64_t ldy,
                         int M, int K, int N, int g, int width, int fg, float *wb, float *sums);

#define GROUP_FN(KIND)                                                                                        \
    static __attribute__((noinline)) void group_##KIND(const float *x, int64_t lda, const Src *s,            \
                                                      const float *bias, float *y, int64_t ldy, int M, int K, \
                                                      int N, int g, int width, int fg, float *wb, float *sums) { \
        gemm_group(x, lda, s, bias, y, ldy, M, K, N, g, width, fg, wb, sums, KIND);                          \
    }
GROUP_FN(Q4_0)
GROUP_FN(Q8_0)
GROUP_FN(Q4_K)
GROUP_FN(Q6_K)
GROUP_FN(INT4)
GROUP_FN(INT8)
GROUP_FN(FP8)
#undef GROUP_FN

/* kind is a ggml type id or INT4 / INT8; K a multiple of 32 (and INT groups of 32). */
static void simd_gemm(const float *x, int64_t lda, const Src *s, int kind, const float *bias, float *y,
                      int64_t ldy, int M, int K, int N, int num_threads) {
    const group_fn fn = kind == Q4_0 ? group_Q4_0
                        : kind == Q8_0 ? group_Q8_0
                        : kind == Q4_K ? group_Q4_K
                        : kind == Q6_K ? group_Q6_K
                        : kind == INT4 ? group_INT4
                        : kind == FP8  ? group_FP8
                                       : group_INT8;
#ifdef __AVX512VL__
    const int fg = GC;
#else
    const int fg = M >= 3 && M <= FUSED_MAX ? GC3 : GC; /* see GC3; with GC, M < 3: no whole FR-row tile */
#endif
    const int width = M <= FUSED_MAX ? fg : BG, groups = (N + width - 1) / width;
#pragma omp parallel num_threads(num_threads)
    {
        float wb[BG * KC] __attribute__((aligned(32)));
        float sums[MBUF * BG * 8];
        /* dynamic: a thread whose core runs slower (a busy sibling, a shared VM) takes fewer chunks instead of
         * holding up the others; each output is computed whole by one thread, so results do not depend on it */
#pragma omp for schedule(dynamic, 32)
        for (int g = 0; g < groups; g++) fn(x, lda, s, bias, y, ldy, M, K, N, g, width, fg, wb, sums);
    }
}
#endif

int batchgen_int_linear(const float *x, int64_t lda, const uint8_t *w, int bits, const float *scales, int group,
                        int round_bf16, const float *bias, float *y, int64_t ldy, int M, int K, int N,
                        int num_threads) {
    if ((bits != 4 && bits != 8) || group <= 0 || group % 8 != 0 || K % group != 0 || M < 0 || N <= 0 || lda < K)
        return -1;
#ifdef QUANT_SIMD
    if (group % 32 == 0) {
        const Src simd_src = {w, (int64_t)K * bits / 8, scales, K / group, group, round_bf16, span_shift_of(group)};
        simd_gemm(x, lda, &simd_src, bits == 4 ? INT4 : INT8, bias, y, ldy, M, K, N, num_threads);
        return 0;
    }
#endif
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

/* y = x w^T + bias for fp8 (e4m3) weights [N, K] bytes with scales [N, K / group]. Returns 0, or -1 on a bad
 * argument (group not a multiple of 8 dividing K). */
int batchgen_fp8_linear(const float *x, int64_t lda, const uint8_t *w, const float *scales, int group,
                        const float *bias, float *y, int64_t ldy, int M, int K, int N, int num_threads) {
    if (group <= 0 || group % 8 != 0 || K % group != 0 || M < 0 || N <= 0 || lda < K) return -1;
#ifdef QUANT_SIMD
    if (group % 32 == 0) {
        const Src simd_src = {w, K, scales, K / group, group, 0, span_shift_of(group)};
        simd_gemm(x, lda, &simd_src, FP8, bias, y, ldy, M, K, N, num_threads);
        return 0;
    }
#endif
    int chunk = 8;
    for (int c = 256; c >= 8; c -= 8)
        if (group % c == 0) {
            chunk = c;
            break;
        }
    const IntSource src = {w, scales, K, K / group, 8, group, 0};
    gemm(x, lda, &src, fill_fp8, chunk, bias, y, ldy, M, K, N, num_threads);
    return 0;
}

int batchgen_quant_digits_linear(const float *x, int64_t lda, const uint8_t *w, int64_t row_bytes, int qtype,
                                 const float *bias, float *y, int64_t ldy, int M, int K, int N, int num_threads);

/* y = x w^T + bias (bias may be NULL). Returns 0, or -1 on a bad argument (unknown format, K not a whole
 * number of blocks, row_bytes not K's blocks). With AMX the 32-value block formats go to quant_digits_cpu.c. */
int batchgen_quant_linear(const float *x, int64_t lda, const uint8_t *w, int64_t row_bytes, int qtype,
                          const float *bias, float *y, int64_t ldy, int M, int K, int N, int num_threads) {
    int qk, bb;
    format_of(qtype, &qk, &bb);
    if (qk == 0 || M < 0 || K <= 0 || N <= 0 || K % qk != 0 || row_bytes != (int64_t)(K / qk) * bb || lda < K)
        return -1;
    if (batchgen_quant_digits_linear(x, lda, w, row_bytes, qtype, bias, y, ldy, M, K, N, num_threads)) return 0;
#ifdef QUANT_SIMD
    if (qtype == Q4_0 || qtype == Q8_0 || qtype == Q4_K || qtype == Q6_K) { /* the others: the plain-C loops */
        const Src simd_src = {w, row_bytes, NULL, 0, 0, 0, -1};
        simd_gemm(x, lda, &simd_src, qtype, bias, y, ldy, M, K, N, num_threads);
        return 0;
    }
#endif
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
