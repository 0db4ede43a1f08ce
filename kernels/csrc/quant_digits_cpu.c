/* GGUF weights whose values come in blocks of 32 with one scale (and offset) each, times block-integer inputs, on
 * CPUs with AMX: y = x w^T (+ bias) for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and, in 256-value super-blocks of 8
 * such blocks, Q4_K, Q5_K, Q6_K and IQ4_XS, by integer tile products (Q6_K's blocks have a scale per 16 values:
 * each half of a block is summed and scaled as a block of its own).
 *
 * Weights: each block of 32 values is w = a c + off, c integer codes in [-128, 127] (Q8_0 q, Q4_0 q - 8, Q5_0
 * q - 16, Q4_1 / Q5_1 / Q4_K / Q5_K q, Q6_K q - 32, IQ4_NL / IQ4_XS their levels), a the block's scale (d; d sc
 * for Q4_K, Q5_K and Q6_K; d (sc - 32) for IQ4_XS) and off its offset (Q4_1 and Q5_1 m; Q4_K and Q5_K -dmin m; 0 for the others),
 * a and off exact in float32, in ggml's row layout (batchgen_quant_linear's).
 * Inputs: each row's blocks of 32 values (the weights' blocks) as 24-bit block integers: e the exponent of the
 * block's largest magnitude (2^e <= max |x| < 2^(e + 1); at least -103), s = 2^(e - 22), X = round-half-even(x / s)
 * clamped to [-2^23, 2^23 - 1], in three digits X = 65536 D2 + 256 D1 + D0 (D2 in [-128, 127], D1 and D0 in
 * [0, 255]), and the block's sum of X (exact, then rounded to float). An all-zero block has s = 1, a block holding
 * an infinity or NaN s = NaN (its row's outputs NaN).
 * Each output: over the blocks in order, C_j = sum_k D_j c over the block (exact in int32: |C_j| < 32 * 255 *
 * 128), v = fmaf((float)C2, 65536, (float)(C0 + 256 C1)), acc = fmaf(a s, v, acc) and, for formats with offsets,
 * acc = fmaf(off s, sum X, acc) (a s and off s exact: powers of two times exact values), from acc = 0; y = bias +
 * acc (or acc).
 *
 * So each input is kept to 24 bits under its block's largest (an error of at most 2^-23 of that magnitude, where
 * float32 keeps 24 bits of each value), the 32 products of a block are summed exactly, and the float rounding is a
 * few operations per block instead of one per product (formats with offsets sum a c and off apart, as llama.cpp
 * does: their roundings are of those terms, not of w). The integer sums do not depend on their order: the AMX
 * tiles (tdpbsud / tdpbssd, 16 rows x 16 outputs x 32 values a block, for whole tiles of 16 rows), the
 * AVX512-VNNI vectors (vpdpbusd, 16 outputs a vector, for up to VECTOR_ROWS rows) and the plain-C loops
 * (BATCHGEN_GENERIC) give the same bits, and a row's result depends only on that row, never on M, the batch or
 * the thread count.
 *
 * The path is taken wherever the CPU the build targets has AMX-INT8 and Linux grants the tile state (the plain-C
 * build included, so both builds agree on one machine), unless BATCHGEN_QUANT_AMX=0; elsewhere the formats go
 * through quant_linear_cpu.c's float32 loops. */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "half.h"


#if defined(BATCHGEN_HAS_AMX) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && !defined(BATCHGEN_GENERIC)
#include <immintrin.h>
#define DIGITS_TILES 1
#define VECTOR_ROWS 12 /* up to this many rows: AVX512-VNNI (an AMX tile's work is the same for 1 row as for 16) */
#endif

static inline float load_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef DIGITS_TILES
    return _cvtsh_ss(h); /* F16C: exact, as half_bits_to_float */
#else
    return half_bits_to_float(h);
#endif
}

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23 };

extern const int8_t batchgen_iq4_levels[16]; /* quant_linear_cpu.c */

#define DIGIT_BYTES 96 /* a row's block: D0, D1, D2, 32 bytes each */

/* Whether a format is taken here, and whether its weights carry an offset per block (w = a c + off). */
static int digits_format(int qtype) {
    return qtype == Q4_0 || qtype == Q4_1 || qtype == Q5_0 || qtype == Q5_1 || qtype == Q8_0 || qtype == Q4_K ||
           qtype == Q5_K || qtype == Q6_K || qtype == IQ4_NL || qtype == IQ4_XS;
}
static int has_offsets(int qtype) { return qtype == Q4_1 || qtype == Q5_1 || qtype == Q4_K || qtype == Q5_K; }
static int super_blocks(int qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K || qtype == IQ4_XS; }
/* Q6_K: a scale per 16 values, so each block of 32 has two (a for its first 16 values, `off` for the others) */
static int halves(int qtype) { return qtype == Q6_K; }

/* Q4_K's and Q5_K's 6-bit scale and min of sub-block j (ggml's get_scale_min_k4). */
static inline void k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) *sc = s[j] & 63, *m = s[j + 4] & 63;
    else *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4), *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
}

/* The 32 codes of 16 nibbles at q (low nibbles first, then high), `minus` off each (through the IQ4 levels with
 * `levels`). */
static inline void nibble_codes(const uint8_t *q, int minus, int levels, int8_t *c) {
    for (int i = 0; i < 16; i++) {
        const int lo = q[i] & 0x0f, hi = q[i] >> 4;
        c[i] = levels ? batchgen_iq4_levels[lo] : (int8_t)(lo - minus);
        c[i + 16] = levels ? batchgen_iq4_levels[hi] : (int8_t)(hi - minus);
    }
}

/* Block b (values 32 b .. 32 b + 31) of a weight row (`unit` bytes per block, or per 256-value super-block): its
 * scale a (returned) and offset: w = a c + off, a and off exact (ggml's d, d sc, dmin m); for Q6_K, `off` is the
 * scale of the block's second 16 values. */
static inline __attribute__((always_inline)) float block_scale(int qtype, const uint8_t *row, int64_t unit, int b,
                                                                float *off) {
    *off = 0.0f;
    if (super_blocks(qtype)) {
        const uint8_t *sb = row + (int64_t)(b / 8) * unit;
        const int j = b % 8;
        if (qtype == Q6_K) { /* block j: quarter j % 4 of half j / 4, a scale per 16 values */
            const int8_t *sc = (const int8_t *)(sb + 192 + 8 * (j / 4));
            const float d = load_half(sb + 208);
            *off = d * (float)sc[2 * (j % 4) + 1];
            return d * (float)sc[2 * (j % 4)];
        }
        if (qtype == IQ4_XS) {
            uint16_t high;
            memcpy(&high, sb + 2, 2);
            const int sc = ((sb[4 + j / 2] >> (4 * (j % 2))) & 0x0f) | (((high >> (2 * j)) & 3) << 4);
            return load_half(sb) * (float)(sc - 32);
        }
        int sc, m;
        k_scale_min(sb + 4, j, &sc, &m);
        *off = -(load_half(sb + 2) * (float)m);
        return load_half(sb) * (float)sc;
    }
    const uint8_t *blk = row + (int64_t)b * unit;
    if (qtype == Q4_1 || qtype == Q5_1) *off = load_half(blk + 2);
    return load_half(blk);
}

/* Block b's 32 codes c (see block_scale), in plain C. */
static void block_codes(int qtype, const uint8_t *row, int64_t unit, int b, int8_t *c) {
    if (super_blocks(qtype)) {
        const uint8_t *sb = row + (int64_t)(b / 8) * unit;
        const int j = b % 8;
        if (qtype == Q6_K) { /* ggml's q1 .. q4 of dequantize_row_q6_K: quarter j % 4 of half j / 4 */
            const int h = j / 4, qd = j % 4;
            const uint8_t *ql = sb + 64 * h + 32 * (qd % 2), *qh = sb + 128 + 32 * h;
            for (int l = 0; l < 32; l++)
                c[l] = (int8_t)(((qd / 2 ? ql[l] >> 4 : ql[l] & 0x0f) | (((qh[l] >> (2 * qd)) & 3) << 4)) - 32);
        } else if (qtype == IQ4_XS) {
            nibble_codes(sb + 8 + 16 * j, 0, 1, c);
        } else {
            const int five = qtype == Q5_K;
            const uint8_t *qh = sb + 16, *q = sb + 16 + 32 * five + 32 * (j / 2);
            for (int l = 0; l < 32; l++)
                c[l] = (int8_t)(((q[l] >> (4 * (j % 2))) & 0x0f) | (five ? ((qh[l] >> j) & 1) << 4 : 0));
        }
        return;
    }
    const uint8_t *blk = row + (int64_t)b * unit;
    if (qtype == Q8_0) {
        memcpy(c, blk + 2, 32);
    } else if (qtype == Q5_0 || qtype == Q5_1) {
        const int one = qtype == Q5_1;
        uint32_t qh;
        memcpy(&qh, blk + 2 + 2 * one, 4);
        const uint8_t *q = blk + 6 + 2 * one;
        for (int i = 0; i < 16; i++) {
            c[i] = (int8_t)(((q[i] & 0x0f) | (int)((qh >> i) & 1) << 4) - (one ? 0 : 16));
            c[i + 16] = (int8_t)(((q[i] >> 4) | (int)((qh >> (i + 16)) & 1) << 4) - (one ? 0 : 16));
        }
    } else {
        nibble_codes(blk + 2 + 2 * (qtype == Q4_1), qtype == Q4_0 ? 8 : 0, qtype == IQ4_NL, c);
    }
}

static inline float float_of_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* x[0..31] as digits d[0..95] (D0, D1, D2); returns s, and the block's sum of X in *sum (exact: |sum| < 2^28). */
static float digitize_block(const float *x, uint8_t *d, float *sum) {
    float amax = 0.0f;
    int finite = 1;
    for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(x[k])), finite &= fabsf(x[k]) <= 3.4028235e38f;
    *sum = 0.0f;
    if (!finite || amax == 0.0f) { /* a NaN or an infinity; or all zeros */
        memset(d, 0, DIGIT_BYTES);
        return finite ? 1.0f : NAN;
    }
    uint32_t bits;
    memcpy(&bits, &amax, 4);
    int e = (int)(bits >> 23) - 127;
    if (e < -103) e = -103; /* s stays a normal float, and so do a s and off s */
    const float inv = float_of_bits((uint32_t)(22 - e + 127) << 23);
    int32_t total = 0;
    for (int k = 0; k < 32; k++) {
        int32_t v = (int32_t)nearbyintf(x[k] * inv); /* |x inv| < 2^23: exact product, then half-even */
        if (v > 8388607) v = 8388607;
        total += v;
        d[k] = (uint8_t)(v & 255), d[32 + k] = (uint8_t)((v >> 8) & 255), d[64 + k] = (uint8_t)(v >> 16);
    }
    *sum = (float)total;
    return float_of_bits((uint32_t)(e - 22 + 127) << 23);
}

/* One product's inputs as digitized and its weights: what every path below reads. */
typedef struct {
    const uint8_t *dig; /* digits: [M, blocks, 96], or right tiles (see digitize) */
    const float *sx;    /* each row's blocks' s: [M, blocks], or [M / 16, blocks, 16] */
    const float *sum;   /* each row's blocks' sum of X, laid out as sx (the offsets' term) */
    const uint8_t *w;   /* the weight rows */
    int64_t row_bytes, unit; /* bytes per row; per block (per 256-value super-block for K-quants and IQ4_XS) */
    int qtype, offsets, halves, blocks;
    const float *bias;
    float *y;
    int64_t ldy;
} Product;

/* Where row m's digits of block b go: [M, blocks, 96], scales [M, blocks]; or, `tiled`, as right tiles of 16
 * rows: tile t = m / 16, block b and digit j hold 512 bytes whose row r is the 16 rows' values 4r .. 4r + 3 side
 * by side (rows past M zeros), scales and sums [M / 16, blocks, 16]. */
static void digitize(const float *x, int64_t lda, int M, int blocks, int tiled, uint8_t *dig, float *sx, float *sum,
                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int m = 0; m < M; m++)
        for (int b = 0; b < blocks; b++) {
            if (!tiled) {
                const int64_t at = (int64_t)m * blocks + b;
                sx[at] = digitize_block(x + m * lda + b * 32, dig + at * DIGIT_BYTES, sum + at);
                continue;
            }
            uint8_t d[DIGIT_BYTES];
            const int64_t at = (int64_t)(m / 16) * blocks + b;
            sx[at * 16 + m % 16] = digitize_block(x + m * lda + b * 32, d, sum + at * 16 + m % 16);
            for (int j = 0; j < 3; j++)
                for (int r = 0; r < 8; r++) memcpy(dig + (at * 3 + j) * 512 + r * 64 + (m % 16) * 4, d + j * 32 + 4 * r, 4);
        }
}

/* acc + a s v + off s sum, v the block's integer sum of X c (C0 + 256 C1 + 65536 C2) in float. */
static inline float combine(int32_t c0, int32_t c1, int32_t c2, float as, float offs, float sum, int offsets,
                            float acc) {
    acc = fmaf(as, fmaf((float)c2, 65536.0f, (float)(c0 + 256 * c1)), acc);
    return offsets ? fmaf(offs, sum, acc) : acc;
}

#ifndef DIGITS_TILES
/* The three digits' sums with codes c over values k0 .. k1 - 1 of a block (dm: its digits). */
static void digit_sums(const uint8_t *dm, const int8_t *c, int k0, int k1, int32_t *sums) {
    const int8_t *top = (const int8_t *)(dm + 64);
    int32_t c0 = 0, c1 = 0, c2 = 0;
    /* one loop per digit: GCC 12 vectorized a fused loop's signed digit as unsigned */
    for (int k = k0; k < k1; k++) c0 += dm[k] * c[k];
    for (int k = k0; k < k1; k++) c1 += dm[32 + k] * c[k];
    for (int k = k0; k < k1; k++) c2 += top[k] * c[k];
    sums[0] = c0, sums[1] = c1, sums[2] = c2;
}

/* The plain-C loops: one output at a time, its codes decoded once for all rows. */
static int loops(const Product *p, int M, int N, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int8_t *codes = malloc((size_t)p->blocks * 32);
        float *a = malloc((size_t)p->blocks * 2 * sizeof(float)), *off = a ? a + p->blocks : NULL;
        if (!codes || !a) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int n = 0; n < N; n++) {
            if (!codes || !a) continue;
            for (int b = 0; b < p->blocks; b++) {
                const uint8_t *row = p->w + n * p->row_bytes;
                a[b] = block_scale(p->qtype, row, p->unit, b, off + b);
                block_codes(p->qtype, row, p->unit, b, codes + b * 32);
            }
            for (int m = 0; m < M; m++) {
                float acc = 0.0f;
                for (int b = 0; b < p->blocks; b++) {
                    const int64_t at = (int64_t)m * p->blocks + b;
                    const uint8_t *dm = p->dig + at * DIGIT_BYTES;
                    int32_t v[3];
                    if (p->halves) { /* Q6_K: each half of the block under its own scale */
                        digit_sums(dm, codes + b * 32, 0, 16, v);
                        acc = combine(v[0], v[1], v[2], a[b] * p->sx[at], 0.0f, 0.0f, 0, acc);
                        digit_sums(dm, codes + b * 32, 16, 32, v);
                        acc = combine(v[0], v[1], v[2], off[b] * p->sx[at], 0.0f, 0.0f, 0, acc);
                        continue;
                    }
                    digit_sums(dm, codes + b * 32, 0, 32, v);
                    acc = combine(v[0], v[1], v[2], a[b] * p->sx[at], off[b] * p->sx[at], p->sum[at], p->offsets, acc);
                }
                p->y[m * p->ldy + n] = p->bias ? p->bias[n] + acc : acc;
            }
        }
        free(codes);
        free(a);
    }
    return failed ? -1 : 0;
}
#else
/* Block j of a Q4_K or Q5_K super-block at sb: its 32 codes (AVX2). */
static inline __attribute__((always_inline)) void k_codes(int qtype, const uint8_t *sb, int j, int8_t *c) {
    const int five = qtype == Q5_K;
    __m256i q = _mm256_loadu_si256((const __m256i *)(sb + 16 + 32 * five + 32 * (j / 2)));
    q = _mm256_and_si256(_mm256_srli_epi16(q, 4 * (j % 2)), _mm256_set1_epi8(0x0f));
    if (five) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 16));
        q = _mm256_or_si256(q, _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(qh, j), 4), _mm256_set1_epi8(0x10)));
    }
    _mm256_storeu_si256((__m256i *)c, q);
}

/* block_codes with the codes widened by SSE/AVX2 for the 4- and 6-bit formats; Q8_0, Q5_0 and Q5_1 by
 * block_codes itself. */
static inline __attribute__((always_inline)) void wide_codes(int qtype, const uint8_t *row, int64_t unit, int b,
                                                             int8_t *c) {
    if (qtype == Q6_K) { /* block_codes' arithmetic, 32 bytes at a time */
        const uint8_t *sb = row + (int64_t)(b / 8) * unit;
        const int h = (b % 8) / 4, qd = b % 4;
        __m256i q = _mm256_loadu_si256((const __m256i *)(sb + 64 * h + 32 * (qd % 2)));
        q = _mm256_and_si256(_mm256_srli_epi16(q, 4 * (qd / 2)), _mm256_set1_epi8(0x0f));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h));
        q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * qd), _mm256_set1_epi8(3)), 4));
        _mm256_storeu_si256((__m256i *)c, _mm256_sub_epi8(q, _mm256_set1_epi8(32)));
        return;
    }
    if (qtype == Q4_K || qtype == Q5_K) {
        k_codes(qtype, row + (int64_t)(b / 8) * unit, b % 8, c);
        return;
    }
    const uint8_t *q;
    if (qtype == IQ4_XS) q = row + (int64_t)(b / 8) * unit + 8 + 16 * (b % 8);
    else if (qtype == Q4_0 || qtype == Q4_1 || qtype == IQ4_NL) q = row + (int64_t)b * unit + 2 + 2 * (qtype == Q4_1);
    else {
        block_codes(qtype, row, unit, b, c);
        return;
    }
    const __m128i low = _mm_set1_epi8(0x0f), v = _mm_loadu_si128((const __m128i *)q);
    __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
    if (qtype == IQ4_XS || qtype == IQ4_NL) {
        const __m128i table = _mm_loadu_si128((const __m128i *)batchgen_iq4_levels);
        lo = _mm_shuffle_epi8(table, lo), hi = _mm_shuffle_epi8(table, hi);
    } else if (qtype == Q4_0) {
        lo = _mm_sub_epi8(lo, _mm_set1_epi8(8)), hi = _mm_sub_epi8(hi, _mm_set1_epi8(8));
    }
    _mm_storeu_si128((__m128i *)c, lo);
    _mm_storeu_si128((__m128i *)(c + 16), hi);
}

/* Block b of outputs n0 .. n0 + 15 (past N: the last again): codes c[16][32], scales a[16], offsets off[16]. */
static void group_block(const Product *p, int n0, int nc, int b, int8_t *c, float *a, float *off) {
    for (int i = 0; i < 16; i++) {
        const uint8_t *row = p->w + (int64_t)(n0 + (i < nc ? i : nc - 1)) * p->row_bytes;
        a[i] = block_scale(p->qtype, row, p->unit, b, off + i);
        wide_codes(p->qtype, row, p->unit, b, c + i * 32);
    }
}

/* The 32 codes of 16 rows (row n at base + n * stride) as 8 vectors: cv[r]'s 32-bit lane n holds row n's codes
 * 4r .. 4r + 3. Two 8 x 8 transposes of 32-bit words side by side (rows n and n + 8 share a vector). */
static inline __attribute__((always_inline)) void transpose_codes(const uint8_t *base, int64_t stride, __m512i cv[8]) {
    __m512 a[8], t[8];
    for (int n = 0; n < 8; n++)
        a[n] = _mm512_castsi512_ps(_mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(base + n * stride))),
            _mm256_loadu_si256((const __m256i *)(base + (n + 8) * stride)), 1));
    for (int n = 0; n < 8; n += 2) t[n] = _mm512_unpacklo_ps(a[n], a[n + 1]), t[n + 1] = _mm512_unpackhi_ps(a[n], a[n + 1]);
    for (int q = 0; q < 8; q += 4) {
        a[q] = _mm512_shuffle_ps(t[q], t[q + 2], 0x44), a[q + 1] = _mm512_shuffle_ps(t[q], t[q + 2], 0xee);
        a[q + 2] = _mm512_shuffle_ps(t[q + 1], t[q + 3], 0x44), a[q + 3] = _mm512_shuffle_ps(t[q + 1], t[q + 3], 0xee);
    }
    const __m512i first = _mm512_set_epi64(13, 12, 5, 4, 9, 8, 1, 0), second = _mm512_set_epi64(15, 14, 7, 6, 11, 10, 3, 2);
    for (int r = 0; r < 4; r++) {
        const __m512i lo = _mm512_castps_si512(a[r]), hi = _mm512_castps_si512(a[r + 4]);
        cv[r] = _mm512_permutex2var_epi64(lo, first, hi), cv[r + 4] = _mm512_permutex2var_epi64(lo, second, hi);
    }
}

/* 16 outputs' 16 bytes of 4-bit codes (output n's at q0 + n * stride) as 4 vectors: word[r]'s 32-bit lane n holds
 * output n's bytes 4r .. 4r + 3 (a 4 x 4 transpose of 32-bit words in each 128-bit lane). */
static inline __attribute__((always_inline)) void nibble_words(const uint8_t *q0, int64_t stride, __m512i word[4]) {
    __m512i z[4]; /* z[i]'s 128-bit lane j: output i + 4j */
    for (int i = 0; i < 4; i++) {
        z[i] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(q0 + i * stride)));
        for (int j = 1; j < 4; j++)
            z[i] = _mm512_inserti32x4(z[i], _mm_loadu_si128((const __m128i *)(q0 + (i + 4 * j) * stride)), j);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    word[0] = _mm512_unpacklo_epi64(t0, t2), word[1] = _mm512_unpackhi_epi64(t0, t2);
    word[2] = _mm512_unpacklo_epi64(t1, t3), word[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* The byte offsets of 16 rows `stride` bytes apart, for gathers. */
static inline __attribute__((always_inline)) __m512i rows_apart(int64_t stride) {
    return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                              _mm512_set1_epi32((int)stride));
}

/* The fp16 values at base + n * stride (n < 16) as float32: a block's scale d for 16 outputs. */
static inline __attribute__((always_inline)) __m512 halves_of_rows(const uint8_t *base, int64_t stride) {
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(rows_apart(stride), (const int *)base, 1)));
}

/* A super-block's scales and offsets for its 8 blocks, 16 outputs a vector (Q4_K and Q5_K: d sc and -dmin m;
 * IQ4_XS: d (sc - 32)), and Q5_K's fifth bits as transpose_codes lays out codes. */
typedef struct {
    __m512 a[8], off[8];
    __m512i high[8];
} SuperScales;

static inline __attribute__((always_inline)) void super_scales(int qtype, const uint8_t *sb0, int64_t stride,
                                                                SuperScales *o) {
    const __m512i at = rows_apart(stride);
    const __m512i head = _mm512_i32gather_epi32(at, (const int *)sb0, 1), six = _mm512_set1_epi32(63);
    const __m512i four = _mm512_set1_epi32(15), two = _mm512_set1_epi32(3);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
    const __m512i s0 = _mm512_i32gather_epi32(at, (const int *)(sb0 + 4), 1);
    if (qtype == IQ4_XS) { /* head's high half: the scales' 2 high bits; s0: their 4 low bits, two a byte */
        const __m512i high = _mm512_srli_epi32(head, 16);
        for (int j = 0; j < 8; j++) {
            const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(s0, 8 * (j / 2) + 4 * (j % 2)), four);
            const __m512i hi = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(high, 2 * j), two), 4);
            const __m512i sc = _mm512_sub_epi32(_mm512_or_si512(lo, hi), _mm512_set1_epi32(32));
            o->a[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)), o->off[j] = _mm512_setzero_ps();
        }
        return;
    }
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
    const __m512i s1 = _mm512_i32gather_epi32(at, (const int *)(sb0 + 8), 1);
    const __m512i s2 = _mm512_i32gather_epi32(at, (const int *)(sb0 + 12), 1);
    for (int j = 0; j < 8; j++) { /* k_scale_min, 16 outputs at once */
        __m512i sc, m;
        if (j < 4) {
            sc = _mm512_and_si512(_mm512_srli_epi32(s0, 8 * j), six), m = _mm512_and_si512(_mm512_srli_epi32(s1, 8 * j), six);
        } else {
            const int i = 8 * (j - 4);
            const __m512i b2 = _mm512_srli_epi32(s2, i);
            sc = _mm512_or_si512(_mm512_and_si512(b2, four),
                                 _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s0, i + 6), two), 4));
            m = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(b2, 4), four),
                                _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s1, i + 6), two), 4));
        }
        o->a[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
        o->off[j] = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m)));
    }
    if (qtype == Q5_K) transpose_codes(sb0 + 16, stride, o->high);
}

/* Block b (of the super-block at sb0, 16 outputs stride bytes apart) of Q4_K, Q5_K or IQ4_XS as cv. */
static inline __attribute__((always_inline)) void super_codes(int qtype, const uint8_t *sb0, int64_t stride, int j,
                                                               const SuperScales *o, __m512i cv[8]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    if (qtype == IQ4_XS) {
        __m512i word[4];
        nibble_words(sb0 + 8 + 16 * j, stride, word);
        const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)batchgen_iq4_levels));
        for (int r = 0; r < 4; r++) {
            cv[r] = _mm512_shuffle_epi8(levels, _mm512_and_si512(word[r], low));
            cv[r + 4] = _mm512_shuffle_epi8(levels, _mm512_and_si512(_mm512_srli_epi16(word[r], 4), low));
        }
        return;
    }
    const int five = qtype == Q5_K;
    transpose_codes(sb0 + 16 + 32 * five + 32 * (j / 2), stride, cv);
    for (int r = 0; r < 8; r++) {
        cv[r] = _mm512_and_si512(_mm512_srli_epi16(cv[r], 4 * (j % 2)), low);
        if (five)
            cv[r] = _mm512_or_si512(cv[r], _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(o->high[r], j),
                                                                              _mm512_set1_epi8(1)), 4));
    }
}

/* Block j of 16 outputs' Q6_K super-blocks (at sb0, stride bytes apart) as cv, its halves' scales as a and off:
 * block_scale's and block_codes' arithmetic on transposed words. */
static inline __attribute__((always_inline)) void q6_block(const uint8_t *sb0, int64_t stride, int j, __m512i cv[8],
                                                            __m512 *a, __m512 *off) {
    const int h = j / 4, qd = j % 4;
    __m512i high[8];
    transpose_codes(sb0 + 64 * h + 32 * (qd % 2), stride, cv);
    transpose_codes(sb0 + 128 + 32 * h, stride, high);
    for (int r = 0; r < 8; r++) {
        const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(cv[r], 4 * (qd / 2)), _mm512_set1_epi8(0x0f));
        const __m512i hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(high[r], 2 * qd), _mm512_set1_epi8(3)), 4);
        cv[r] = _mm512_sub_epi8(_mm512_or_si512(lo, hi), _mm512_set1_epi8(32));
    }
    const __m512i at = rows_apart(stride);
    const __m512i sc = _mm512_i32gather_epi32(at, (const int *)(sb0 + 192 + 8 * h + 2 * qd), 1);
    /* d: the high half of the word at 206 (the word at 208 would read past the super-block) */
    const __m512i dw = _mm512_i32gather_epi32(at, (const int *)(sb0 + 206), 1);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dw, 16)));
    *a = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(sc, 24), 24)));
    *off = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(sc, 16), 24)));
}

/* Block b of 16 outputs, output n's row at row0 + n * stride: the codes as cv (see transpose_codes), the scales
 * and offsets as vectors. */
static inline __attribute__((always_inline)) void vector_block(const Product *p, const uint8_t *row0,
                                                                int64_t stride, int b, __m512i cv[8], __m512 *a,
                                                                __m512 *off) {
    const int qtype = p->qtype;
    *off = _mm512_setzero_ps();
    if (qtype != Q8_0 && qtype != Q4_0 && qtype != IQ4_NL) {
        int8_t codes[16 * 32] __attribute__((aligned(64)));
        float as[16], offs[16];
        for (int n = 0; n < 16; n++) {
            as[n] = block_scale(qtype, row0 + n * stride, p->unit, b, offs + n);
            wide_codes(qtype, row0 + n * stride, p->unit, b, codes + n * 32);
        }
        transpose_codes((const uint8_t *)codes, 32, cv);
        *a = _mm512_loadu_ps(as), *off = _mm512_loadu_ps(offs);
        return;
    }
    const uint8_t *base = row0 + (int64_t)b * p->unit;
    *a = halves_of_rows(base, stride);
    if (qtype == Q8_0) {
        transpose_codes(base + 2, stride, cv);
        return;
    }
    __m512i word[4];
    nibble_words(base + 2, stride, word);
    const __m512i low = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
    const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)batchgen_iq4_levels));
    for (int r = 0; r < 4; r++) {
        const __m512i lo = _mm512_and_si512(word[r], low), hi = _mm512_and_si512(_mm512_srli_epi16(word[r], 4), low);
        cv[r] = qtype == Q4_0 ? _mm512_sub_epi8(lo, eight) : _mm512_shuffle_epi8(levels, lo);
        cv[r + 4] = qtype == Q4_0 ? _mm512_sub_epi8(hi, eight) : _mm512_shuffle_epi8(levels, hi);
    }
}

/* Rows 0 .. M - 1 (M <= VECTOR_ROWS; digits [M, blocks, 96]) times outputs n0 .. n0 + nc - 1 by AVX512-VNNI:
 * lanes are the 16 outputs, each 32-bit lane 4 consecutive values of its block; the signed top digit goes in
 * offset by 128 (vpdpbusd multiplies unsigned by signed) and comes out less 128 times the codes' sum: the same
 * integers as the tiles'. */
static void vector_group(const Product *p, int M, int n0, int nc) {
    uint8_t tail[16 * 210]; /* a last group of fewer than 16 outputs: the rows' unit copied, the last repeated */
    __m512 acc[VECTOR_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi8((char)0x80);
    const __m512 high = _mm512_set1_ps(65536.0f);
    const int per_unit = super_blocks(p->qtype) ? 8 : 1;
    SuperScales ss;
    memset(&ss, 0, sizeof ss);
    for (int b = 0; b < p->blocks; b++) {
        const uint8_t *row0 = p->w + (int64_t)n0 * p->row_bytes;
        int64_t stride = p->row_bytes;
        int bu = b; /* b within row0's rows */
        if (nc < 16) {
            const int64_t at = (int64_t)(b / per_unit) * p->unit;
            for (int n = 0; n < 16; n++) memcpy(tail + n * p->unit, row0 + (n < nc ? n : nc - 1) * p->row_bytes + at, p->unit);
            row0 = tail, stride = p->unit, bu = b % per_unit;
        }
        __m512i cv[8];
        __m512 av, offv;
        if (p->halves) {
            q6_block(row0 + (int64_t)(bu / 8) * p->unit, stride, bu % 8, cv, &av, &offv);
        } else if (per_unit == 8) { /* K-quants and IQ4_XS: the super-block's scales once for its 8 blocks */
            const uint8_t *sb0 = row0 + (int64_t)(bu / 8) * p->unit;
            if (bu % 8 == 0 || nc < 16) super_scales(p->qtype, sb0, stride, &ss);
            super_codes(p->qtype, sb0, stride, bu % 8, &ss, cv);
            av = ss.a[bu % 8], offv = ss.off[bu % 8];
        } else {
            vector_block(p, row0, stride, bu, cv, &av, &offv);
        }
        /* Q6_K: the block's halves (cv[0..3], cv[4..7]) under their own scales, av and offv */
        const int parts = p->halves ? 2 : 1, per_part = 8 / parts;
        for (int part = 0; part < parts; part++) {
            __m512i codes_sum = _mm512_setzero_si512();
            for (int r = part * per_part; r < (part + 1) * per_part; r++)
                codes_sum = _mm512_dpbusd_epi32(codes_sum, ones, cv[r]);
            const __m512i offset = _mm512_slli_epi32(codes_sum, 7);
            const __m512 scale = part ? offv : av;
            for (int m = 0; m < M; m++) {
                const int64_t at = (int64_t)m * p->blocks + b;
                const uint8_t *dm = p->dig + at * DIGIT_BYTES;
                __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0;
                for (int r = part * per_part; r < (part + 1) * per_part; r++) {
                    int32_t d0, d1, d2;
                    memcpy(&d0, dm + 4 * r, 4), memcpy(&d1, dm + 32 + 4 * r, 4), memcpy(&d2, dm + 64 + 4 * r, 4);
                    c0 = _mm512_dpbusd_epi32(c0, _mm512_set1_epi32(d0), cv[r]);
                    c1 = _mm512_dpbusd_epi32(c1, _mm512_set1_epi32(d1), cv[r]);
                    c2 = _mm512_dpbusd_epi32(c2, _mm512_xor_si512(_mm512_set1_epi32(d2), flip), cv[r]);
                }
                c2 = _mm512_sub_epi32(c2, offset);
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_add_epi32(c0, _mm512_slli_epi32(c1, 8)));
                const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c2), high, lo), s = _mm512_set1_ps(p->sx[at]);
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(scale, s), v, acc[m]);
                if (p->offsets) acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(offv, s), _mm512_set1_ps(p->sum[at]), acc[m]);
            }
        }
    }
    const __mmask16 mask = (__mmask16)((1u << nc) - 1);
    const __m512 bv = p->bias ? _mm512_maskz_loadu_ps(mask, p->bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < M; m++)
        _mm512_mask_storeu_ps(p->y + (int64_t)m * p->ldy + n0, mask, p->bias ? _mm512_add_ps(bv, acc[m]) : acc[m]);
}

static void vector_product(const Product *p, int M, int N, int num_threads) {
    const int groups = (N + 15) / 16;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4)
    for (int g = 0; g < groups; g++) vector_group(p, M, g * 16, N - g * 16 < 16 ? N - g * 16 : 16);
}

/* 16 outputs' codes of each block as left tiles (16 x 32 bytes) into tiles[blocks][512], their scales and offsets
 * into a[blocks][16] and off[blocks][16]. Returns the left tiles' row stride: Q8_0's whole groups are read where
 * they lie (their codes are the rows' bytes; tiles is left unwritten). */
static int64_t left_tiles(const Product *p, int n0, int nc, int8_t *tiles, float *a, float *off) {
    const int direct = p->qtype == Q8_0 && nc == 16;
    if ((p->qtype == Q4_K || p->qtype == Q5_K) && nc == 16) { /* a super-block's scales once for its 8 blocks */
        SuperScales ss;
        for (int b = 0; b < p->blocks; b++) {
            const uint8_t *sb0 = p->w + (int64_t)n0 * p->row_bytes + (int64_t)(b / 8) * p->unit;
            if (b % 8 == 0) super_scales(p->qtype, sb0, p->row_bytes, &ss);
            _mm512_store_ps(a + b * 16, ss.a[b % 8]), _mm512_store_ps(off + b * 16, ss.off[b % 8]);
            for (int i = 0; i < 16; i++) k_codes(p->qtype, sb0 + i * p->row_bytes, b % 8, tiles + (int64_t)b * 512 + i * 32);
        }
        return 32;
    }
    for (int b = 0; b < p->blocks; b++) {
        if (!direct) {
            group_block(p, n0, nc, b, tiles + (int64_t)b * 512, a + b * 16, off + b * 16);
            continue;
        }
        _mm512_store_ps(a + b * 16, halves_of_rows(p->w + (int64_t)n0 * p->row_bytes + (int64_t)b * p->unit, p->row_bytes));
        _mm512_store_ps(off + b * 16, _mm512_setzero_ps());
    }
    return direct ? p->row_bytes : 32;
}

/* Rows m0 .. m0 + mr - 1 (tile t = m0 / 16) times one group of 16 outputs: the left tiles at `left` (block b at
 * left + b * left_step, rows `stride` apart). */
static void row_tile(const Product *p, const int8_t *left, int64_t left_step, int64_t stride, const float *a,
                     const float *off, int m0, int mr, int n0, int nc) {
    int32_t c[3][16][16] __attribute__((aligned(64)));
    __m512 acc[16]; /* lanes: the tile's rows */
    for (int o = 0; o < 16; o++) acc[o] = _mm512_setzero_ps();
    const int64_t t = m0 / 16;
    const __m512 high = _mm512_set1_ps(65536.0f);
    const int parts = p->halves ? 2 : 1; /* Q6_K: the block's halves (K = 16 tiles) under their own scales */
    for (int b = 0; b < p->blocks; b++)
        for (int part = 0; part < parts; part++) {
            const uint8_t *right = p->dig + (t * p->blocks + b) * 3 * 512 + part * 256;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_loadd(3, left + b * left_step + part * 16, stride);
            _tile_loadd(4, right, 64);
            _tile_loadd(5, right + 512, 64);
            _tile_loadd(6, right + 1024, 64);
            _tile_dpbsud(0, 3, 4);
            _tile_dpbsud(1, 3, 5);
            _tile_dpbssd(2, 3, 6);
            _tile_stored(0, c[0], 64);
            _tile_stored(1, c[1], 64);
            _tile_stored(2, c[2], 64);
            const __m512 sv = _mm512_loadu_ps(p->sx + (t * p->blocks + b) * 16);
            const __m512 sum = _mm512_loadu_ps(p->sum + (t * p->blocks + b) * 16);
            const float *scale = part ? off : a;
            for (int o = 0; o < 16; o++) {
                const __m512i c0 = _mm512_load_si512(c[0][o]), c1 = _mm512_load_si512(c[1][o]);
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_add_epi32(c0, _mm512_slli_epi32(c1, 8)));
                const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[2][o])), high, lo);
                acc[o] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(scale[b * 16 + o]), sv), v, acc[o]);
                if (p->offsets)
                    acc[o] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(off[b * 16 + o]), sv), sum, acc[o]);
            }
        }
    float out[16][16];
    for (int o = 0; o < 16; o++) _mm512_storeu_ps(out[o], acc[o]);
    for (int i = 0; i < mr; i++)
        for (int o = 0; o < nc; o++)
            p->y[(int64_t)(m0 + i) * p->ldy + n0 + o] = p->bias ? p->bias[n0 + o] + out[o][i] : out[o][i];
}

static int tiles_product(const Product *p, int M, int N, int num_threads) {
    const int groups = (N + 15) / 16, blocks = p->blocks;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        TileConfig cfg = {0};
        cfg.palette_id = 1;
        for (int t = 0; t < 3; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64; /* sums: 16 outputs x 16 rows */
        const int k = p->halves ? 16 : 32;                                /* values a product takes */
        cfg.rows[3] = 16, cfg.colsb[3] = (uint16_t)k;                      /* codes: 16 outputs x k values */
        for (int t = 4; t < 7; t++) cfg.rows[t] = (uint8_t)(k / 4), cfg.colsb[t] = 64; /* digits: k / 4 x (16 rows x 4) */
        _tile_loadconfig(&cfg);
        int8_t *tiles = aligned_alloc(64, (size_t)blocks * 512);
        float *a = aligned_alloc(64, (size_t)blocks * 128), *off = a ? a + blocks * 16 : NULL;
        if (!tiles || !a) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int g = 0; g < groups; g++) {
            if (!tiles || !a) continue;
            const int n0 = g * 16, nc = N - n0 < 16 ? N - n0 : 16;
            const int64_t stride = left_tiles(p, n0, nc, tiles, a, off);
            const int8_t *left = stride == 32 ? tiles : (const int8_t *)(p->w + (int64_t)n0 * p->row_bytes + 2);
            const int64_t step = stride == 32 ? 512 : p->unit;
            for (int m0 = 0; m0 < M; m0 += 16) row_tile(p, left, step, stride, a, off, m0, M - m0 < 16 ? M - m0 : 16, n0, nc);
        }
        _tile_release();
        free(tiles);
        free(a);
    }
    return failed ? -1 : 0;
}
#endif

/* Whether this process multiplies the block-32 formats here (the same answer in both builds on one machine). */
static int digits_on(void) {
#ifdef BATCHGEN_HAS_AMX
    return amx_permitted("BATCHGEN_QUANT_AMX");
#else
    return 0;
#endif
}

/* Whether batchgen_quant_digits_linear takes its formats in this process (1) or leaves them to the float loops. */
int batchgen_quant_integer_inputs(void) { return digits_on(); }

#define KEEP_BYTES (8 << 20) /* scratch kept by a calling thread between calls */

/* A calling thread's kept scratch memory (freed when the thread exits). */
typedef struct {
    uint8_t *p;
    size_t bytes;
} Kept;

static pthread_key_t kept_key;
static pthread_once_t kept_once = PTHREAD_ONCE_INIT;

static void kept_free(void *k) {
    free(((Kept *)k)->p);
    free(k);
}

static void kept_make_key(void) { pthread_key_create(&kept_key, kept_free); }

/* `bytes` of scratch memory for the calling thread: kept between calls up to KEEP_BYTES (a fresh allocation per
 * call pays its page faults every time); larger blocks are freed by scratch_done. NULL: out of memory. */
static uint8_t *scratch(size_t bytes) {
    if (bytes > KEEP_BYTES) return malloc(bytes);
    pthread_once(&kept_once, kept_make_key);
    Kept *k = pthread_getspecific(kept_key);
    if (!k) {
        if (!(k = calloc(1, sizeof *k))) return NULL;
        pthread_setspecific(kept_key, k);
    }
    if (bytes > k->bytes) {
        free(k->p);
        k->p = malloc(bytes);
        k->bytes = k->p ? bytes : 0;
    }
    return k->p;
}

static void scratch_done(uint8_t *p, size_t bytes) {
    if (bytes > KEEP_BYTES) free(p);
}

/* Rows 0 .. M - 1 digitized and multiplied: by the tiles (`tiled`) or the vectors in the SIMD build. Returns 0, or
 * -1 when memory ran out. */
static int rows_product(const float *x, int64_t lda, const uint8_t *w, int64_t row_bytes, int qtype,
                        const float *bias, float *y, int64_t ldy, int M, int K, int N, int tiled, int num_threads) {
    const int blocks = K / 32, rows = tiled ? (M + 15) / 16 * 16 : M;
    const size_t digit_bytes = (size_t)rows * blocks * DIGIT_BYTES, all = digit_bytes + (size_t)rows * blocks * 8;
    uint8_t *mem = scratch(all);
    if (!mem) return -1;
    const int units = super_blocks(qtype) ? blocks / 8 : blocks;
    Product p = {mem, (float *)(mem + digit_bytes), (float *)(mem + digit_bytes) + (size_t)rows * blocks, w,
                 row_bytes, row_bytes / units, qtype, has_offsets(qtype), halves(qtype), blocks, bias, y, ldy};
    if (rows > M) { /* the last tile's rows past M: zeros */
        const size_t tile = (size_t)(rows / 16 - 1) * blocks;
        memset(mem + tile * 3 * 512, 0, (size_t)blocks * 3 * 512);
        memset((float *)p.sx + tile * 16, 0, (size_t)blocks * 16 * sizeof(float));
        memset((float *)p.sum + tile * 16, 0, (size_t)blocks * 16 * sizeof(float));
    }
    digitize(x, lda, M, blocks, tiled, mem, (float *)p.sx, (float *)p.sum, num_threads);
    int rc;
#ifdef DIGITS_TILES
    if (tiled) rc = tiles_product(&p, M, N, num_threads);
    else vector_product(&p, M, N, num_threads), rc = 0;
#else
    rc = loops(&p, M, N, num_threads);
#endif
    scratch_done(mem, all);
    return rc;
}

/* y = x w^T + bias for the formats above, K a multiple of the format's block (checked by the caller) and row_bytes
 * K's blocks. Returns 1 when done here, 0 when the caller's float32 loops are to run (another format, no AMX, or
 * no memory). The SIMD build takes whole tiles of 16 rows by AMX and a remainder of up to VECTOR_ROWS rows by the
 * vectors. */
int batchgen_quant_digits_linear(const float *x, int64_t lda, const uint8_t *w, int64_t row_bytes, int qtype,
                                 const float *bias, float *y, int64_t ldy, int M, int K, int N, int num_threads) {
    if (!digits_format(qtype) || !digits_on()) return 0;
#ifdef DIGITS_TILES
    const int rest = M % 16 <= VECTOR_ROWS ? M % 16 : 0, tiled = M - rest;
    int rc = tiled ? rows_product(x, lda, w, row_bytes, qtype, bias, y, ldy, tiled, K, N, 1, num_threads) : 0;
    if (rc == 0 && rest)
        rc = rows_product(x + tiled * lda, lda, w, row_bytes, qtype, bias, y + tiled * ldy, ldy, rest, K, N, 0,
                          num_threads);
#else
    const int rc = M ? rows_product(x, lda, w, row_bytes, qtype, bias, y, ldy, M, K, N, 0, num_threads) : 0;
#endif
    return rc == 0;
}
