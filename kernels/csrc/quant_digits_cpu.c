/* GGUF's 32-value block formats times block-integer inputs, on CPUs with AMX: y = x w^T (+ bias) for Q8_0, Q4_0,
 * Q5_0 and IQ4_NL weights by integer tile products.
 *
 * Weights: each block of 32 values is d c, c integer codes in [-128, 127] (Q8_0 q, Q4_0 q - 8, Q5_0 q - 16,
 * IQ4_NL's levels) and d one fp16 scale, in ggml's row layout (batchgen_quant_linear's).
 * Inputs: each row's blocks of 32 values (the weights' blocks) as 24-bit block integers: e the exponent of the
 * block's largest magnitude (2^e <= max |x| < 2^(e + 1); at least -103), s = 2^(e - 22), X = round-half-even(x / s)
 * clamped to [-2^23, 2^23 - 1], in three digits X = 65536 D2 + 256 D1 + D0 (D2 in [-128, 127], D1 and D0 in
 * [0, 255]). An all-zero block has s = 1, a block holding an infinity or NaN s = NaN (its row's outputs NaN).
 * Each output: over the blocks b in order, C_j = sum_k D_j c over the block (exact in int32: |C_j| < 32 * 255 *
 * 128), v = fmaf((float)C2, 65536, (float)(C0 + 256 C1)) and acc = fmaf(d s, v, acc) (d s exact: a power of two
 * times an fp16), from acc = 0; y = bias + acc (or acc).
 *
 * So each input is kept to 24 bits under its block's largest (an error of at most 2^-23 of that magnitude, where
 * float32 keeps 24 bits of each value), the 32 products of a block are summed exactly, and the float rounding is a
 * few operations per block instead of one per product. The integer sums do not depend on their order: the AMX
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

enum { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, IQ4_NL = 20 };

extern const int8_t batchgen_iq4_levels[16]; /* quant_linear_cpu.c */

#define DIGIT_BYTES 96 /* a row's block: D0, D1, D2, 32 bytes each */

/* The block's fp16 scale d and its 32 codes. */
static float block_codes(int qtype, const uint8_t *b, int8_t *c) {
    uint16_t h;
    memcpy(&h, b, 2);
    const uint8_t *q = b + 2 + (qtype == Q5_0 ? 4 : 0);
    if (qtype == Q8_0) {
        memcpy(c, q, 32);
    } else if (qtype == Q5_0) {
        uint32_t qh;
        memcpy(&qh, b + 2, 4);
        for (int i = 0; i < 16; i++) {
            c[i] = (int8_t)(((q[i] & 0x0f) | (int)((qh >> i) & 1) << 4) - 16);
            c[i + 16] = (int8_t)(((q[i] >> 4) | (int)((qh >> (i + 16)) & 1) << 4) - 16);
        }
    } else {
        for (int i = 0; i < 16; i++) {
            c[i] = qtype == Q4_0 ? (int8_t)((q[i] & 0x0f) - 8) : batchgen_iq4_levels[q[i] & 0x0f];
            c[i + 16] = qtype == Q4_0 ? (int8_t)((q[i] >> 4) - 8) : batchgen_iq4_levels[q[i] >> 4];
        }
    }
    return half_bits_to_float(h);
}

static inline float float_of_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* x[0..31] as digits d[0..95] (D0, D1, D2); returns s. */
static float digitize_block(const float *x, uint8_t *d) {
    float amax = 0.0f;
    int finite = 1;
    for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(x[k])), finite &= fabsf(x[k]) <= 3.4028235e38f;
    if (!finite || amax == 0.0f) { /* a NaN or an infinity; or all zeros */
        memset(d, 0, DIGIT_BYTES);
        return finite ? 1.0f : NAN;
    }
    uint32_t bits;
    memcpy(&bits, &amax, 4);
    int e = (int)(bits >> 23) - 127;
    if (e < -103) e = -103; /* s stays a normal float, and so does d s */
    const float inv = float_of_bits((uint32_t)(22 - e + 127) << 23);
    for (int k = 0; k < 32; k++) {
        int32_t v = (int32_t)nearbyintf(x[k] * inv); /* |x inv| < 2^23: exact product, then half-even */
        if (v > 8388607) v = 8388607;
        d[k] = (uint8_t)(v & 255), d[32 + k] = (uint8_t)((v >> 8) & 255), d[64 + k] = (uint8_t)(v >> 16);
    }
    return float_of_bits((uint32_t)(e - 22 + 127) << 23);
}

/* Where row m's digits of block b go: [M, blocks, 96], scales [M, blocks]; or, `tiled`, as right tiles of 16
 * rows: tile t = m / 16, block b and digit j hold 512 bytes whose row r is the 16 rows' values 4r .. 4r + 3 side
 * by side (rows past M zeros), scales [M / 16, blocks, 16]. */
static void digitize(const float *x, int64_t lda, int M, int blocks, int tiled, uint8_t *dig, float *sx,
                     int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int m = 0; m < M; m++)
        for (int b = 0; b < blocks; b++) {
            if (!tiled) {
                sx[(int64_t)m * blocks + b] =
                    digitize_block(x + m * lda + b * 32, dig + ((int64_t)m * blocks + b) * DIGIT_BYTES);
                continue;
            }
            uint8_t d[DIGIT_BYTES];
            const int64_t at = (int64_t)(m / 16) * blocks + b;
            sx[at * 16 + m % 16] = digitize_block(x + m * lda + b * 32, d);
            for (int j = 0; j < 3; j++)
                for (int r = 0; r < 8; r++) memcpy(dig + (at * 3 + j) * 512 + r * 64 + (m % 16) * 4, d + j * 32 + 4 * r, 4);
        }
}

static inline float combine(int32_t c0, int32_t c1, int32_t c2, float ds, float acc) {
    return fmaf(ds, fmaf((float)c2, 65536.0f, (float)(c0 + 256 * c1)), acc);
}

#ifndef DIGITS_TILES
/* The plain-C loops: one output at a time, its codes decoded once for all rows. */
static int loops(const uint8_t *dig, const float *sx, const uint8_t *w, int64_t row_bytes, int bb, int qtype,
                 const float *bias, float *y, int64_t ldy, int M, int blocks, int N, int num_threads) {
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        int8_t *codes = malloc((size_t)blocks * 32);
        float *d = malloc((size_t)blocks * sizeof(float));
        if (!codes || !d) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int n = 0; n < N; n++) {
            if (!codes || !d) continue;
            for (int b = 0; b < blocks; b++) d[b] = block_codes(qtype, w + n * row_bytes + b * bb, codes + b * 32);
            for (int m = 0; m < M; m++) {
                float acc = 0.0f;
                for (int b = 0; b < blocks; b++) {
                    const uint8_t *dm = dig + ((int64_t)m * blocks + b) * DIGIT_BYTES;
                    const int8_t *c = codes + b * 32, *top = (const int8_t *)(dm + 64);
                    int32_t c0 = 0, c1 = 0, c2 = 0;
                    /* one loop per digit: GCC 12 vectorized a fused loop's signed digit as unsigned */
                    for (int k = 0; k < 32; k++) c0 += dm[k] * c[k];
                    for (int k = 0; k < 32; k++) c1 += dm[32 + k] * c[k];
                    for (int k = 0; k < 32; k++) c2 += top[k] * c[k];
                    acc = combine(c0, c1, c2, d[b] * sx[(int64_t)m * blocks + b], acc);
                }
                y[m * ldy + n] = bias ? bias[n] + acc : acc;
            }
        }
        free(codes);
        free(d);
    }
    return failed ? -1 : 0;
}
#else
/* Block b of outputs n0 .. n0 + 15 (past N: the last again): their fp16 scales into h, and, with `decode`, their
 * codes into c[16][32]. */
static void group_block(const uint8_t *w, int64_t row_bytes, int bb, int qtype, int n0, int nc, int b, int decode,
                        int8_t *c, uint16_t *h) {
    const __m128i low = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    const __m128i levels = _mm_loadu_si128((const __m128i *)batchgen_iq4_levels);
    for (int i = 0; i < 16; i++) {
        const uint8_t *blk = w + (int64_t)(n0 + (i < nc ? i : nc - 1)) * row_bytes + (int64_t)b * bb;
        memcpy(&h[i], blk, 2);
        if (!decode) continue;
        if (qtype == Q8_0) {
            memcpy(c + i * 32, blk + 2, 32);
        } else if (qtype == Q4_0 || qtype == IQ4_NL) {
            const __m128i q = _mm_loadu_si128((const __m128i *)(blk + 2));
            __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
            if (qtype == Q4_0) lo = _mm_sub_epi8(lo, eight), hi = _mm_sub_epi8(hi, eight);
            else lo = _mm_shuffle_epi8(levels, lo), hi = _mm_shuffle_epi8(levels, hi);
            _mm_storeu_si128((__m128i *)(c + i * 32), lo);
            _mm_storeu_si128((__m128i *)(c + i * 32 + 16), hi);
        } else {
            block_codes(qtype, blk, c + i * 32);
        }
    }
}

/* 16 outputs' codes of each block as left tiles (16 x 32 bytes) into tiles[blocks][512], their scales d into
 * d[blocks][16]. Returns the left tiles' row stride: Q8_0's whole groups are read where they lie (their codes are
 * the rows' bytes; tiles is left unwritten). */
static int64_t left_tiles(const uint8_t *w, int64_t row_bytes, int bb, int qtype, int n0, int nc, int blocks,
                          int8_t *tiles, float *d) {
    const int direct = qtype == Q8_0 && nc == 16;
    for (int b = 0; b < blocks; b++) {
        uint16_t h[16];
        group_block(w, row_bytes, bb, qtype, n0, nc, b, !direct, tiles + (int64_t)b * 512, h);
        _mm512_store_ps(d + b * 16, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)h)));
    }
    return direct ? row_bytes : 32;
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

/* Rows 0 .. M - 1 (M <= VECTOR_ROWS; digits [M, blocks, 96]) times outputs n0 .. n0 + nc - 1 by AVX512-VNNI:
 * lanes are the 16 outputs, each 32-bit lane 4 consecutive values of its block (gathered from the rows); the
 * signed top digit goes in offset by 128 (vpdpbusd multiplies unsigned by signed) and comes out less 128 times
 * the codes' sum: the same integers as the tiles'. */
/* Block b of 16 outputs, row n's block at base + n * stride (its first byte): the codes as cv (see
 * transpose_codes) and the scales d. */
static inline __attribute__((always_inline)) void vector_block(const uint8_t *base, int64_t stride, int qtype,
                                                                __m512i cv[8], __m512 *d) {
    const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          _mm512_set1_epi32((int)stride));
    *d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(at, (const int *)base, 1)));
    if (qtype == Q8_0) {
        transpose_codes(base + 2, stride, cv);
    } else if (qtype == Q4_0 || qtype == IQ4_NL) { /* q's 4 words: words r of 16 outputs, then their nibbles */
        __m512i z[4];
        for (int i = 0; i < 4; i++) { /* z[i]'s 128-bit lane j: output i + 4j */
            z[i] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(base + i * stride + 2)));
            for (int j = 1; j < 4; j++)
                z[i] = _mm512_inserti32x4(z[i], _mm_loadu_si128((const __m128i *)(base + (i + 4 * j) * stride + 2)), j);
        }
        const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
        const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
        const __m512i word[4] = {_mm512_unpacklo_epi64(t0, t2), _mm512_unpackhi_epi64(t0, t2),
                                 _mm512_unpacklo_epi64(t1, t3), _mm512_unpackhi_epi64(t1, t3)};
        const __m512i low = _mm512_set1_epi8(0x0f), eight = _mm512_set1_epi8(8);
        const __m512i levels = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)batchgen_iq4_levels));
        for (int r = 0; r < 4; r++) {
            const __m512i lo = _mm512_and_si512(word[r], low), hi = _mm512_and_si512(_mm512_srli_epi16(word[r], 4), low);
            cv[r] = qtype == Q4_0 ? _mm512_sub_epi8(lo, eight) : _mm512_shuffle_epi8(levels, lo);
            cv[r + 4] = qtype == Q4_0 ? _mm512_sub_epi8(hi, eight) : _mm512_shuffle_epi8(levels, hi);
        }
    } else {
        int8_t codes[16 * 32] __attribute__((aligned(64)));
        for (int n = 0; n < 16; n++) block_codes(qtype, base + n * stride, codes + n * 32);
        transpose_codes((const uint8_t *)codes, 32, cv);
    }
}

static void vector_group(const uint8_t *dig, const float *sx, const uint8_t *w, int64_t row_bytes, int bb,
                         int qtype, const float *bias, float *y, int64_t ldy, int M, int blocks, int n0, int nc) {
    uint8_t tail[16 * 34]; /* a last group of fewer than 16 outputs: the block's rows copied, the last repeated */
    __m512 acc[VECTOR_ROWS];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    const __m512i ones = _mm512_set1_epi8(1), flip = _mm512_set1_epi8((char)0x80);
    const __m512 high = _mm512_set1_ps(65536.0f);
    for (int b = 0; b < blocks; b++) {
        const uint8_t *base = w + (int64_t)n0 * row_bytes + (int64_t)b * bb;
        int64_t stride = row_bytes;
        if (nc < 16) {
            for (int n = 0; n < 16; n++) memcpy(tail + n * bb, base + (n < nc ? n : nc - 1) * row_bytes, bb);
            base = tail, stride = bb;
        }
        __m512i cv[8], sum = _mm512_setzero_si512();
        __m512 dv;
        vector_block(base, stride, qtype, cv, &dv);
        for (int r = 0; r < 8; r++) sum = _mm512_dpbusd_epi32(sum, ones, cv[r]);
        const __m512i offset = _mm512_slli_epi32(sum, 7);
        for (int m = 0; m < M; m++) {
            const uint8_t *dm = dig + ((int64_t)m * blocks + b) * DIGIT_BYTES;
            __m512i c0 = _mm512_setzero_si512(), c1 = c0, c2 = c0;
            for (int r = 0; r < 8; r++) {
                int32_t d0, d1, d2;
                memcpy(&d0, dm + 4 * r, 4), memcpy(&d1, dm + 32 + 4 * r, 4), memcpy(&d2, dm + 64 + 4 * r, 4);
                c0 = _mm512_dpbusd_epi32(c0, _mm512_set1_epi32(d0), cv[r]);
                c1 = _mm512_dpbusd_epi32(c1, _mm512_set1_epi32(d1), cv[r]);
                c2 = _mm512_dpbusd_epi32(c2, _mm512_xor_si512(_mm512_set1_epi32(d2), flip), cv[r]);
            }
            c2 = _mm512_sub_epi32(c2, offset);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_add_epi32(c0, _mm512_slli_epi32(c1, 8)));
            const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c2), high, lo);
            acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(dv, _mm512_set1_ps(sx[(int64_t)m * blocks + b])), v, acc[m]);
        }
    }
    const __mmask16 mask = (__mmask16)((1u << nc) - 1);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int m = 0; m < M; m++)
        _mm512_mask_storeu_ps(y + (int64_t)m * ldy + n0, mask, bias ? _mm512_add_ps(bv, acc[m]) : acc[m]);
}

static void vector_product(const uint8_t *dig, const float *sx, const uint8_t *w, int64_t row_bytes, int bb,
                           int qtype, const float *bias, float *y, int64_t ldy, int M, int blocks, int N,
                           int num_threads) {
    const int groups = (N + 15) / 16;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 4)
    for (int g = 0; g < groups; g++)
        vector_group(dig, sx, w, row_bytes, bb, qtype, bias, y, ldy, M, blocks, g * 16, N - g * 16 < 16 ? N - g * 16 : 16);
}

/* Rows m0 .. m0 + mr - 1 (tile t = m0 / 16) times one group of 16 outputs: the left tiles at `left` (block b at
 * left + b * left_step, rows `stride` apart). */
static void row_tile(const uint8_t *dig, const float *sx, const int8_t *left, int64_t left_step, int64_t stride,
                     const float *d, int blocks, const float *bias, float *y, int64_t ldy, int m0, int mr, int n0,
                     int nc) {
    int32_t c[3][16][16] __attribute__((aligned(64)));
    __m512 acc[16]; /* lanes: the tile's rows */
    for (int o = 0; o < 16; o++) acc[o] = _mm512_setzero_ps();
    const int64_t t = m0 / 16;
    const __m512 high = _mm512_set1_ps(65536.0f);
    for (int b = 0; b < blocks; b++) {
        const uint8_t *right = dig + (t * blocks + b) * 3 * 512;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_loadd(3, left + b * left_step, stride);
        _tile_loadd(4, right, 64);
        _tile_loadd(5, right + 512, 64);
        _tile_loadd(6, right + 1024, 64);
        _tile_dpbsud(0, 3, 4);
        _tile_dpbsud(1, 3, 5);
        _tile_dpbssd(2, 3, 6);
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64);
        const __m512 sv = _mm512_loadu_ps(sx + (t * blocks + b) * 16);
        for (int o = 0; o < 16; o++) {
            const __m512i c0 = _mm512_load_si512(c[0][o]), c1 = _mm512_load_si512(c[1][o]);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_add_epi32(c0, _mm512_slli_epi32(c1, 8)));
            const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c[2][o])), high, lo);
            acc[o] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(d[b * 16 + o]), sv), v, acc[o]);
        }
    }
    float out[16][16];
    for (int o = 0; o < 16; o++) _mm512_storeu_ps(out[o], acc[o]);
    for (int i = 0; i < mr; i++)
        for (int o = 0; o < nc; o++)
            y[(int64_t)(m0 + i) * ldy + n0 + o] = bias ? bias[n0 + o] + out[o][i] : out[o][i];
}

static int tiles_product(const uint8_t *dig, const float *sx, const uint8_t *w, int64_t row_bytes, int bb,
                         int qtype, const float *bias, float *y, int64_t ldy, int M, int blocks, int N,
                         int num_threads) {
    const int groups = (N + 15) / 16;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        TileConfig cfg = {0};
        cfg.palette_id = 1;
        for (int t = 0; t < 3; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64; /* sums: 16 outputs x 16 rows */
        cfg.rows[3] = 16, cfg.colsb[3] = 32;                               /* codes: 16 outputs x 32 values */
        for (int t = 4; t < 7; t++) cfg.rows[t] = 8, cfg.colsb[t] = 64;  /* digits: 8 x (16 rows x 4 values) */
        _tile_loadconfig(&cfg);
        int8_t *tiles = aligned_alloc(64, (size_t)blocks * 512);
        float *d = aligned_alloc(64, (size_t)blocks * 64);
        if (!tiles || !d) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int g = 0; g < groups; g++) {
            if (!tiles || !d) continue;
            const int n0 = g * 16, nc = N - n0 < 16 ? N - n0 : 16;
            const int64_t stride = left_tiles(w, row_bytes, bb, qtype, n0, nc, blocks, tiles, d);
            const int8_t *left = stride == 32 ? tiles : (const int8_t *)(w + (int64_t)n0 * row_bytes + 2);
            const int64_t step = stride == 32 ? 512 : bb;
            for (int m0 = 0; m0 < M; m0 += 16)
                row_tile(dig, sx, left, step, stride, d, blocks, bias, y, ldy, m0, M - m0 < 16 ? M - m0 : 16, n0, nc);
        }
        _tile_release();
        free(tiles);
        free(d);
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
    const int blocks = K / 32, bb = (int)(row_bytes / blocks), rows = tiled ? (M + 15) / 16 * 16 : M;
    const size_t digit_bytes = (size_t)rows * blocks * DIGIT_BYTES;
    uint8_t *mem = scratch(digit_bytes + (size_t)rows * blocks * sizeof(float));
    if (!mem) return -1;
    uint8_t *dig = mem;
    float *sx = (float *)(mem + digit_bytes);
    if (rows > M) { /* the last tile's rows past M: zeros */
        const size_t tile = (size_t)(rows / 16 - 1) * blocks;
        memset(dig + tile * 3 * 512, 0, (size_t)blocks * 3 * 512);
        memset(sx + tile * 16, 0, (size_t)blocks * 16 * sizeof(float));
    }
    digitize(x, lda, M, blocks, tiled, dig, sx, num_threads);
    int rc;
#ifdef DIGITS_TILES
    if (tiled) rc = tiles_product(dig, sx, w, row_bytes, bb, qtype, bias, y, ldy, M, blocks, N, num_threads);
    else vector_product(dig, sx, w, row_bytes, bb, qtype, bias, y, ldy, M, blocks, N, num_threads), rc = 0;
#else
    rc = loops(dig, sx, w, row_bytes, bb, qtype, bias, y, ldy, M, blocks, N, num_threads);
#endif
    scratch_done(mem, digit_bytes + (size_t)rows * blocks * sizeof(float));
    return rc;
}

/* y = x w^T + bias for the formats above, K a multiple of 32 and row_bytes K's blocks (checked by the caller).
 * Returns 1 when done here, 0 when the caller's float32 loops are to run (another format, no AMX, or no memory).
 * The SIMD build takes whole tiles of 16 rows by AMX and a remainder of up to VECTOR_ROWS rows by the vectors. */
int batchgen_quant_digits_linear(const float *x, int64_t lda, const uint8_t *w, int64_t row_bytes, int qtype,
                                 const float *bias, float *y, int64_t ldy, int M, int K, int N, int num_threads) {
    if ((qtype != Q8_0 && qtype != Q4_0 && qtype != Q5_0 && qtype != IQ4_NL) || !digits_on()) return 0;
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
