/* Paged decode attention for the CPU, float32, reading K/V blocks in place (no gather).
 *
 * Semantics: batchgen/kernels/reference.py (paged_decode_attention). One query per sequence, the token at
 * position seq_lens[b] - 1; query head h reads kv head h / G (G = Hq / Hkv); logits s = scale * q.k, soft-capped
 * to softcap * tanh(s / softcap) when softcap > 0; keys at positions max(0, len - window) .. len - 1 (window > 0)
 * or 0 .. len - 1; with sinks, one more logit sinks[h] in the softmax denominator (no value).
 *
 * Work item = (sequence, range of KV heads h0..h1-1): each token's K (then V) rows of those heads are one
 * contiguous span, read once for all their query heads (G per KV head), token after token (this row order
 * keeps the hardware prefetchers streaming: orders that walk a block head by head ran slower from memory, even
 * with fewer instructions); the same rows of the next block are prefetched meanwhile. With AVX2, the scores
 * of eight query heads for a token are eight vector dot products whose lanes are summed together. Per item, exact two-pass softmax: scores of every visible key into a per-thread
 * buffer, their maximum, exp and sum, then out = sum_k p_k v_k / sum. Dot products use 16 explicit lane
 * accumulators (the compiler turns them into vector FMAs without -ffast-math) reduced in a fixed order; exp is
 * a polynomial, eight lanes at a time with AVX2 (exp_row). Every query head's result is computed by one thread
 * in a fixed order, whatever the items, so results do not depend on the number of threads and are
 * bit-identical run to run.
 *
 * The step's own K/V (optional, k_new NULL: none): k_new/v_new [B, Hkv, D] with strides (kn_stride_b,
 * kn_stride_h, 1) and (vn_stride_b, vn_stride_h, 1), slots [B] int64 (block * block_size + row; < 0: none):
 * each item writes its heads' rows of token b into slot slots[b] before attending (its own heads only, so no
 * item reads what another writes), the same write as a separate store would make: the lines are fetched
 * once, for the write and the read that follows.
 *
 * Cascade support: `starts` [B] int32 (NULL: all 0) makes sequence b attend only to keys at positions
 * >= starts[b] (its suffix after a prefix attended elsewhere); `lse` [B, Hq] (NULL: not written) receives the
 * natural log-sum-exp of each head's scaled logits, so a caller can merge this partial result with another
 * (-inf, and a zero output, when a sequence has no key to attend to). batchgen_cascade_prefix_f32 (at the end)
 * is the other half: each group's shared prefix, read once for the group, merged into those results.
 *
 * SIMD: with AVX2 and FMA (and BATCHGEN_GENERIC undefined) the dot products, value sums and every exp use
 * explicit 8-lane intrinsics, and the many-row items (prefill chunks, the cascade's prefix half) run register
 * tiles of 6 query rows x 16 keys (scores, against each block's keys transposed once) and 6 rows x 16 dims
 * (value sums) where block size and head dim are multiples of 8; otherwise the same loops run in plain C. All
 * are exact to float32 rounding and deterministic; they may differ from each other in the last bits.
 *
 * Narrow caches (engine.kv_cache_dtype; kv_kind: 0 float32, 1 bfloat16, 2 float16, 3 fp8 e4m3fn, 4 fp8 e5m2): the
 * caches hold 4, 2 or 1 bytes per value, indexed as above in elements. The decode items (AVX2 + F16C, head_dim a
 * multiple of 8) read the cache in place and widen 8 values at a time in registers as the dot products and
 * value sums consume them (decode_scores, decode_values: every cache dtype, float32 included, through one
 * loop; a narrow cache's tokens in chunks of 8 / G for GQA groups G of 1, 2, 4 (and 1 for multiples of 8), so
 * each query or output vector is loaded once per chunk and each cache vector widened once per KV head: see
 * decode_chunks); otherwise what an item reads is widened to float32 as it is read -- each token's span of K/V rows
 * (decode), each block's rows of a head (prefill, the prefix half) -- into a per-thread buffer that stays in
 * L1, and the float32 code runs on it. Either way: exact attention over the rounded values, the memory
 * traffic of the narrow cache. bfloat16 widens by a shift, float16 by F16C (exact
 * bit conversion in plain C), fp8 through a 256-entry table (with F16C, 8 at a time through a half conversion:
 * the same values, NaN payloads aside). The decode kernel writes the step's own K/V only
 * into a float32 cache (the caller stores rounded rows itself first otherwise).
 *
 * Layout: q [B, Hq, D] with strides (q_stride_b, q_stride_h, 1); caches [NB, BS, Hkv, D] with the last three
 * dims contiguous and cache_stride_block elements between blocks; block_tables [B, table_stride] int32;
 * seq_lens [B] int32 (>= 1); out [B, Hq, D] contiguous. Plain C, no torch headers. Block ids and lengths are
 * checked against the table width and num_blocks (a bad one returns -1 instead of reading out of bounds).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "half.h"

#define LANES 16
#define MAX_HEADS 256 /* query heads per item */

/* exp(x) for x <= 0 (arguments are score - max), relative error ~2e-7; x is clamped at -87 (e^-87 ~ 1.6e-38,
 * nothing next to the maximum's e^0 = 1). Vectorisable. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer in the low mantissa bits */
    float t = x * 1.44269504088896341f + shifter;
    float n = t - shifter;
    float r = x - n * 0.693145751953125f;  /* ln2 split in a high part exact in float ... */
    r = r - n * 1.428606765330187e-06f;    /* ... and the rest */
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits;
    memcpy(&bits, &t, sizeof bits);
    int32_t e = (bits - 0x4B400000) + 127; /* n + 127 */
    int32_t sbits = e << 23;
    float s;
    memcpy(&s, &sbits, sizeof s);
    return p * s;
}

static inline float dot(const float *a, const float *b, int d) {
    float acc[LANES] = {0};
    int i = 0;
    for (; i + LANES <= d; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    for (int j = 0; i < d; i++, j++) acc[j] += a[i] * b[i];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

#if defined(__AVX2__) && defined(__FMA__) && !defined(BATCHGEN_GENERIC)
#include <immintrin.h>
#define SIMD 1

/* Lane t of the result: the sum of a<t>'s eight lanes (a fixed order). */
static inline __m256 sum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                            __m256 a7) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float sum8(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}
#else
#define SIMD 0
#endif

/* dst[i] = scale * q . k_i for the m key rows k_i = k + i * row (head_dim d). With AVX2 and d a multiple of 8,
 * eight keys at a time, one vector accumulator per key: 32 of q's floats are held in registers while the eight
 * keys' matching floats stream in as FMA operands, and the eight accumulators are summed into one vector at the
 * end (a fixed order). */
static inline void scores_span(const float *q, const float *k, int64_t row, int m, int d, float scale,
                               float *dst) {
    int i = 0;
#if SIMD
    if (d % 8 == 0) {
        const __m256 vs = _mm256_set1_ps(scale);
        for (; i + 8 <= m; i += 8) {
            const float *k0 = k + (int64_t)i * row;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
#define KEYS8(qx, kc)                                                                                         \
    do {                                                                                                      \
        a0 = _mm256_fmadd_ps(qx, _mm256_loadu_ps(kc), a0);                                                    \
        a1 = _mm256_fmadd_ps(qx, _mm256_loadu_ps((kc) + row), a1);                                            \
        a2 = _mm256_fmadd_ps(qx, _mm256_loadu_ps((kc) + 2 * row), a2);                                        \
        a3 = _mm256_fmadd_ps(qx, _mm256_loadu_ps((kc) + 3 * row), a3);                                        \
        a4 = _mm256_fmadd_ps(qx, _mm256_loadu_ps((kc) + 4 * row), a4);                                        \
        a5 = _mm256_fmadd_ps(qx, _mm256_loadu_ps((kc) + 5 * row), a5);                                        \
        a6 = _mm256_fmadd_ps(qx, _mm256_loadu_ps((kc) + 6 * row), a6);                                        \
        a7 = _mm256_fmadd_ps(qx, _mm256_loadu_ps((kc) + 7 * row), a7);                                        \
    } while (0)
            int c = 0;
            for (; c + 32 <= d; c += 32) { /* four vectors of q in registers, the keys' floats as FMA operands */
                const __m256 q0 = _mm256_loadu_ps(q + c), q1 = _mm256_loadu_ps(q + c + 8);
                const __m256 q2 = _mm256_loadu_ps(q + c + 16), q3 = _mm256_loadu_ps(q + c + 24);
                KEYS8(q0, k0 + c);
                KEYS8(q1, k0 + c + 8);
                KEYS8(q2, k0 + c + 16);
                KEYS8(q3, k0 + c + 24);
            }
            for (; c < d; c += 8) {
                const __m256 qx = _mm256_loadu_ps(q + c);
                KEYS8(qx, k0 + c);
            }
#undef KEYS8
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(sum8x8(a0, a1, a2, a3, a4, a5, a6, a7), vs));
        }
        for (; i < m; i++) {
            const float *ki = k + (int64_t)i * row;
            __m256 a = _mm256_setzero_ps();
            for (int c = 0; c < d; c += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), _mm256_loadu_ps(ki + c), a);
            dst[i] = sum8(a) * scale;
        }
        return;
    }
#endif
    for (; i < m; i++) dst[i] = dot(q, k + (int64_t)i * row, d) * scale;
}

/* o[c] += sum_i p[i] * v_i[c] for the m value rows v_i = v + i * row, keys in order (head_dim d). With AVX2 and
 * d a multiple of 8, o is held in registers 64 floats at a time across the m keys. */
static inline void accumulate_span(const float *p, const float *v, int64_t row, int m, int d, float *o) {
#if SIMD
    if (d % 8 == 0) {
        int c = 0;
        for (; c + 64 <= d; c += 64) {
            __m256 o0 = _mm256_loadu_ps(o + c), o1 = _mm256_loadu_ps(o + c + 8);
            __m256 o2 = _mm256_loadu_ps(o + c + 16), o3 = _mm256_loadu_ps(o + c + 24);
            __m256 o4 = _mm256_loadu_ps(o + c + 32), o5 = _mm256_loadu_ps(o + c + 40);
            __m256 o6 = _mm256_loadu_ps(o + c + 48), o7 = _mm256_loadu_ps(o + c + 56);
            for (int i = 0; i < m; i++) {
                const __m256 pv = _mm256_broadcast_ss(p + i);
                const float *vi = v + (int64_t)i * row + c;
                o0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vi), o0);
                o1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vi + 8), o1);
                o2 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vi + 16), o2);
                o3 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vi + 24), o3);
                o4 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vi + 32), o4);
                o5 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vi + 40), o5);
                o6 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vi + 48), o6);
                o7 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vi + 56), o7);
            }
            _mm256_storeu_ps(o + c, o0), _mm256_storeu_ps(o + c + 8, o1);
            _mm256_storeu_ps(o + c + 16, o2), _mm256_storeu_ps(o + c + 24, o3);
            _mm256_storeu_ps(o + c + 32, o4), _mm256_storeu_ps(o + c + 40, o5);
            _mm256_storeu_ps(o + c + 48, o6), _mm256_storeu_ps(o + c + 56, o7);
        }
        for (; c < d; c += 8) {
            __m256 acc = _mm256_loadu_ps(o + c);
            for (int i = 0; i < m; i++)
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i), _mm256_loadu_ps(v + (int64_t)i * row + c), acc);
            _mm256_storeu_ps(o + c, acc);
        }
        return;
    }
#endif
    for (int i = 0; i < m; i++) {
        const float *vi = v + (int64_t)i * row;
        for (int c = 0; c < d; c++) o[c] += p[i] * vi[c];
    }
}

/* sg[i] = exp(sg[i] - m) for the n scores of a row (all <= m); returns their sum, added in a fixed order. */
static inline float exp_row(float *sg, int n, float m) {
    int i = 0;
    float total = 0.0f;
#if SIMD
    {
        const __m256 vm = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.0f), shifter = _mm256_set1_ps(12582912.0f);
        const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), ln2_hi = _mm256_set1_ps(0.693145751953125f);
        const __m256 ln2_lo = _mm256_set1_ps(1.428606765330187e-06f), one = _mm256_set1_ps(1.0f);
        const __m256 c6 = _mm256_set1_ps(1.0f / 720.0f), c5 = _mm256_set1_ps(1.0f / 120.0f);
        const __m256 c4 = _mm256_set1_ps(1.0f / 24.0f), c3 = _mm256_set1_ps(1.0f / 6.0f), c2 = _mm256_set1_ps(0.5f);
        const __m256i bias = _mm256_set1_epi32(0x4B400000 - 127);
        __m256 acc = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) { /* exp_nonpos, eight lanes at once */
            const __m256 x = _mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(sg + i), vm), lo);
            const __m256 t = _mm256_fmadd_ps(x, log2e, shifter);
            const __m256 k = _mm256_sub_ps(t, shifter);
            __m256 r = _mm256_fnmadd_ps(k, ln2_hi, x);
            r = _mm256_fnmadd_ps(k, ln2_lo, r);
            __m256 poly = _mm256_fmadd_ps(c6, r, c5);
            poly = _mm256_fmadd_ps(poly, r, c4);
            poly = _mm256_fmadd_ps(poly, r, c3);
            poly = _mm256_fmadd_ps(poly, r, c2);
            poly = _mm256_fmadd_ps(poly, r, one);
            poly = _mm256_fmadd_ps(poly, r, one);
            const __m256i e = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_castps_si256(t), bias), 23);
            const __m256 v = _mm256_mul_ps(poly, _mm256_castsi256_ps(e));
            _mm256_storeu_ps(sg + i, v);
            acc = _mm256_add_ps(acc, v);
        }
        total = sum8(acc);
    }
#endif
    float acc[LANES] = {0};
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) {
            const float e = exp_nonpos(sg[i + l] - m);
            sg[i + l] = e;
            acc[l] += e;
        }
    for (int l = 0; i < n; i++, l++) {
        const float e = exp_nonpos(sg[i] - m);
        sg[i] = e;
        acc[l] += e;
    }
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return total + acc[0];
}

/* The largest of x[0 .. n - 1] (n >= 1; finite scores: a NaN makes the result unspecified), eight lanes at a
 * time with AVX2 (a chain of scalar compares would wait on each one's latency). */
static inline float row_max(const float *x, int n) {
    int i = 1;
    float m = x[0];
#if SIMD
    if (n >= 8) {
        __m256 vm = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) vm = _mm256_max_ps(_mm256_loadu_ps(x + i), vm);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        h = _mm_max_ps(_mm_movehl_ps(h, h), h);
        h = _mm_max_ss(_mm_movehdup_ps(h), h);
        m = _mm_cvtss_f32(h);
    }
#endif
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

/* A per-thread buffer of at least `bytes` bytes, grown (contents dropped) when too small; NULL when it cannot be
 * allocated. */
typedef struct {
    void *p;
    size_t cap;
} Buffer;

static void *grow(Buffer *b, size_t bytes) {
    if (bytes > b->cap) {
        free(b->p);
        b->p = malloc(bytes);
        b->cap = b->p ? bytes : 0;
    }
    return b->p;
}

static __thread Buffer tls_floats = {NULL, 0};

static float *scratch(size_t n) { return (float *)grow(&tls_floats, n * sizeof(float)); }

/* ------------------------------------------------------------------ narrow caches: widening on load */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_E4M3 = 3, KV_E5M2 = 4 };

static inline int64_t kv_bytes(int kind) { return kind == KV_F32 ? 4 : (kind <= KV_F16 ? 2 : 1); }

static float fp8_table[2][256]; /* [0]: e4m3fn, [1]: e5m2 (the top byte of a half) */

__attribute__((constructor)) static void init_fp8_tables(void) {
    for (int b = 0; b < 256; b++) {
        const int e = (b >> 3) & 0xf, m = b & 7;
        float v = (e == 15 && m == 7) ? NAN : (e == 0 ? ldexpf((float)m, -9) : ldexpf((float)(8 + m), e - 10));
        fp8_table[0][b] = (b & 0x80) ? -v : v;
        fp8_table[1][b] = half_bits_to_float((uint16_t)(b << 8));
    }
}

/* dst[0..n) = the n values of kind `kind` at src, as float32. */
static void widen_span(const char *src, int kind, int n, float *dst) {
    int i = 0;
    if (kind == KV_BF16) {
        const uint16_t *h = (const uint16_t *)src;
#if SIMD
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(
                                          _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(h + i))), 16)));
#endif
        for (; i < n; i++) {
            const uint32_t bits = (uint32_t)h[i] << 16;
            memcpy(dst + i, &bits, sizeof bits);
        }
    } else if (kind == KV_F16) {
        const uint16_t *h = (const uint16_t *)src;
#if SIMD && defined(__F16C__)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
        for (; i < n; i++) dst[i] = half_bits_to_float(h[i]);
    } else if (kind == KV_E4M3 || kind == KV_E5M2) {
        const float *table = fp8_table[kind - KV_E4M3];
        const uint8_t *b = (const uint8_t *)src;
#if SIMD && defined(__F16C__)
        /* the table's values, 8 at a time: e5m2 is a half's top byte; e4m3fn's seven low bits placed at a half's
         * bit 7 are a half worth its magnitude times 2^-8 (normal and subnormal alike), so a half conversion and
         * an exact scaling by 256 widen it; code 0x7f (NaN) is patched in with its sign */
        for (; i + 8 <= n; i += 8) {
            const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(b + i)));
            if (kind == KV_E5M2) {
                _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_slli_epi16(v, 8)));
                continue;
            }
            const __m128i mag = _mm_and_si128(v, _mm_set1_epi16(0x7f));
            const __m128i sign = _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8);
            const __m256 f =
                _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(mag, 7), sign)), _mm256_set1_ps(256.0f));
            const __m256 nan = _mm256_or_ps(_mm256_and_ps(f, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(NAN));
            const __m256i is_nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)));
            _mm256_storeu_ps(dst + i, _mm256_blendv_ps(f, nan, _mm256_castsi256_ps(is_nan)));
        }
#endif
        for (; i < n; i++) dst[i] = table[b[i]];
    } else {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    }
}

static __thread Buffer tls_wide = {NULL, 0};  /* a decode item's widened token span */
static __thread Buffer tls_block = {NULL, 0}; /* a block's widened rows of one head */

/* Block `id`'s rows of one head (`offset` elements into each token row of `row` elements) as float32: in place
 * for a float32 cache (*stride = row), else widened into a per-thread buffer (*stride = head_dim); NULL when the
 * buffer cannot be allocated. */
static const float *block_head(const char *cache, int kind, int32_t id, int64_t stride_block, int64_t row,
                               int64_t offset, int block_size, int head_dim, int64_t *stride) {
    const int64_t esize = kv_bytes(kind);
    const char *base = cache + ((int64_t)id * stride_block + offset) * esize;
    if (kind == KV_F32) {
        *stride = row;
        return (const float *)base;
    }
    float *out = (float *)grow(&tls_block, sizeof(float) * (size_t)block_size * (size_t)head_dim);
    if (out == NULL) return NULL;
    for (int r = 0; r < block_size; r++) widen_span(base + r * row * esize, kind, head_dim, out + (size_t)r * head_dim);
    *stride = head_dim;
    return out;
}

/* A query row of the prefix and prefill items: its query, and how many keys it attends to (the first `keys`
 * of the item's block table). */
typedef struct {
    const float *q;
    int keys;
} QueryRow;

static __thread Buffer tls_rows = {NULL, 0};

static QueryRow *row_scratch(size_t n) { return (QueryRow *)grow(&tls_rows, n * sizeof(QueryRow)); }

/* The rows x keys core of the prefix and prefill items, one KV head (`offset` floats into each token row of
 * `row` floats): scores s[r * ss + t] (ss >= keys >= every row's own count), each row's softmax (stats[2r]: its
 * maximum, stats[2r + 1]: its sum of exps), and acc[r] = sum_t p_rt v_t, unnormalised. Keys are visited block
 * by block: each block's K (then V) rows of the head stay in L1 across the rows. The plain-C form, and what
 * serves block sizes or head dims that are not multiples of 8. */
static int attend_rows_plain(const QueryRow *qr, int rows, int keys, const int32_t *table, const char *k_cache,
                             const char *v_cache, int kind, int64_t cache_stride_block, int64_t row, int64_t offset,
                             int head_dim, int block_size, float scale, float *s, size_t ss, float *acc,
                             float *stats) {
    int64_t rs;
    for (int j = 0; j * block_size < keys; j++) {
        const float *kb = block_head(k_cache, kind, table[j], cache_stride_block, row, offset, block_size, head_dim, &rs);
        if (kb == NULL) return -1;
        for (int r = 0; r < rows; r++) {
            const int m = qr[r].keys - j * block_size;
            if (m > 0)
                scores_span(qr[r].q, kb, rs, m < block_size ? m : block_size, head_dim, scale,
                            s + (size_t)r * ss + (size_t)j * block_size);
        }
    }
    for (int r = 0; r < rows; r++) {
        float *sr = s + (size_t)r * ss;
        const float m = row_max(sr, qr[r].keys);
        stats[2 * r] = m, stats[2 * r + 1] = exp_row(sr, qr[r].keys, m);
    }
    memset(acc, 0, sizeof(float) * (size_t)rows * head_dim);
    for (int j = 0; j * block_size < keys; j++) {
        const float *vb = block_head(v_cache, kind, table[j], cache_stride_block, row, offset, block_size, head_dim, &rs);
        if (vb == NULL) return -1;
        for (int r = 0; r < rows; r++) {
            const int m = qr[r].keys - j * block_size;
            if (m > 0)
                accumulate_span(s + (size_t)r * ss + (size_t)j * block_size, vb, rs,
                                m < block_size ? m : block_size, head_dim, acc + (size_t)r * head_dim);
        }
    }
    return 0;
}


#if SIMD
#define TILE_ROWS 6 /* query rows of a register tile: 6 x 16 accumulators = 12 of the 16 ymm registers */

/* In place: r[t] <- the t-th column of the 8 x 8 matrix whose rows are r[0..7]. */
static inline void transpose8x8(__m256 *r) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20), r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20), r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31), r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31), r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* kt[c * kp + i] = k_i[c] for the m key rows k_i = k + i * row (head_dim d; kp and d multiples of 8), transposed
 * 8 x 8 at a time; keys m .. kp - 1 are zero. */
static inline void pack_keys_t(const float *k, int64_t row, int m, int kp, int d, float *kt) {
    for (int i0 = 0; i0 < kp; i0 += 8)
        for (int c0 = 0; c0 < d; c0 += 8) {
            __m256 r[8];
            for (int t = 0; t < 8; t++)
                r[t] = i0 + t < m ? _mm256_loadu_ps(k + (int64_t)(i0 + t) * row + c0) : _mm256_setzero_ps();
            transpose8x8(r);
            for (int t = 0; t < 8; t++) _mm256_storeu_ps(kt + (size_t)(c0 + t) * kp + i0, r[t]);
        }
}

/* Scores of R query rows against 8 * NV keys of a transposed block (column stride kp): s_r[i] = scale * q_r . k_i,
 * each a plain FMA chain over the head dim in order (so a row's scores do not depend on the rows tiled with it).
 * R and NV are constants once inlined: the R x NV accumulators stay in registers. */
static inline __attribute__((always_inline)) void scores_tile(const QueryRow *qr, const int R, const int NV,
                                                              const float *kt, int kp, int d, __m256 vs,
                                                              float *s, size_t ss) {
    __m256 a[TILE_ROWS][2];
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (int c = 0; c < d; c++) {
        const __m256 k0 = _mm256_loadu_ps(kt + (size_t)c * kp);
        const __m256 k1 = NV == 2 ? _mm256_loadu_ps(kt + (size_t)c * kp + 8) : k0;
        for (int r = 0; r < R; r++) {
            const __m256 qb = _mm256_broadcast_ss(qr[r].q + c);
            a[r][0] = _mm256_fmadd_ps(qb, k0, a[r][0]);
            if (NV == 2) a[r][1] = _mm256_fmadd_ps(qb, k1, a[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(s + (size_t)r * ss, _mm256_mul_ps(a[r][0], vs));
        if (NV == 2) _mm256_storeu_ps(s + (size_t)r * ss + 8, _mm256_mul_ps(a[r][1], vs));
    }
}

/* acc_r[c .. c + 8 * NV) += sum_i p_r[i] v_i[c ..] over the m value rows v_i = v + i * row, keys in order; p_r =
 * p + r * ss, acc_r = acc + r * d. */
static inline __attribute__((always_inline)) void values_tile(const float *p, size_t ss, const int R, const int NV,
                                                              const float *v, int64_t row, int m, int c,
                                                              float *acc, int d) {
    __m256 o[TILE_ROWS][2];
    for (int r = 0; r < R; r++) {
        o[r][0] = _mm256_loadu_ps(acc + (size_t)r * d + c);
        o[r][1] = NV == 2 ? _mm256_loadu_ps(acc + (size_t)r * d + c + 8) : o[r][0];
    }
    for (int i = 0; i < m; i++) {
        const float *vi = v + (int64_t)i * row + c;
        const __m256 v0 = _mm256_loadu_ps(vi);
        const __m256 v1 = NV == 2 ? _mm256_loadu_ps(vi + 8) : v0;
        for (int r = 0; r < R; r++) {
            const __m256 pb = _mm256_broadcast_ss(p + (size_t)r * ss + i);
            o[r][0] = _mm256_fmadd_ps(pb, v0, o[r][0]);
            if (NV == 2) o[r][1] = _mm256_fmadd_ps(pb, v1, o[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(acc + (size_t)r * d + c, o[r][0]);
        if (NV == 2) _mm256_storeu_ps(acc + (size_t)r * d + c + 8, o[r][1]);
    }
}

/* The tiles of one block for R rows (a constant per case): scores of the first `need` keys (rounded up to 8),
 * or the value sums over `need` keys. */
#define TILE_CASES(CALL)                                                                                      \
    switch (R) {                                                                                              \
    case 6: CALL(6); break;                                                                                   \
    case 5: CALL(5); break;                                                                                   \
    case 4: CALL(4); break;                                                                                   \
    case 3: CALL(3); break;                                                                                   \
    case 2: CALL(2); break;                                                                                   \
    default: CALL(1); break;                                                                                  \
    }

static void scores_block(const QueryRow *qr, int R, const float *kt, int kp, int need, int d, __m256 vs, float *s,
                         size_t ss) {
    int i = 0;
    for (; i + 16 <= need || (i + 8 < need && i + 16 <= kp); i += 16) {
#define SCORES16(n) scores_tile(qr, n, 2, kt + i, kp, d, vs, s + i, ss)
        TILE_CASES(SCORES16)
#undef SCORES16
    }
    for (; i < need; i += 8) {
#define SCORES8(n) scores_tile(qr, n, 1, kt + i, kp, d, vs, s + i, ss)
        TILE_CASES(SCORES8)
#undef SCORES8
    }
}

static void values_block(const float *p, size_t ss, int R, const float *v, int64_t row, int need, float *acc,
                         int d) {
    int c = 0;
    for (; c + 16 <= d; c += 16) {
#define VALUES16(n) values_tile(p, ss, n, 2, v, row, need, c, acc, d)
        TILE_CASES(VALUES16)
#undef VALUES16
    }
    for (; c < d; c += 8) {
#define VALUES8(n) values_tile(p, ss, n, 1, v, row, need, c, acc, d)
        TILE_CASES(VALUES8)
#undef VALUES8
    }
}

static __thread Buffer tls_keys = {NULL, 0};

/* attend_rows_plain's contract with register tiles (block_size and head_dim multiples of 8): each block's K rows
 * of the head are transposed once into a [head_dim, block_size] panel, then TILE_ROWS query rows at a time take
 * 16 keys per step (q broadcast, the panel's two vectors: 12 FMAs for 8 loads), and the value sums likewise
 * (16 dims of TILE_ROWS rows per step). A row's entries past its own keys are computed against real keys or
 * zeros and set to 0 before the value pass, so they add nothing. Returns -1 when scratch cannot be allocated. */
static int attend_rows_tiled(const QueryRow *qr, int rows, int keys, const int32_t *table, const char *k_cache,
                             const char *v_cache, int kind, int64_t cache_stride_block, int64_t row, int64_t offset,
                             int head_dim, int block_size, float scale, float *s, size_t ss, float *acc,
                             float *stats) {
    float *kt = (float *)grow(&tls_keys, sizeof(float) * (size_t)head_dim * (size_t)block_size);
    if (kt == NULL) return -1;
    const __m256 vs = _mm256_set1_ps(scale);
    for (int j = 0; j * block_size < keys; j++) {
        const int base = j * block_size;
        const int mb = keys - base < block_size ? keys - base : block_size;
        int64_t rs;
        const float *kb = block_head(k_cache, kind, table[j], cache_stride_block, row, offset, block_size, head_dim, &rs);
        if (kb == NULL) return -1;
        pack_keys_t(kb, rs, mb, block_size, head_dim, kt);
        for (int r0 = 0; r0 < rows; r0 += TILE_ROWS) {
            const int R = rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS;
            int most = 0;
            for (int r = r0; r < r0 + R; r++) most = qr[r].keys > most ? qr[r].keys : most;
            const int need = most - base < block_size ? most - base : block_size;
            if (need > 0) scores_block(qr + r0, R, kt, block_size, need, head_dim, vs, s + (size_t)r0 * ss + base, ss);
        }
    }
    for (int r = 0; r < rows; r++) {
        float *sr = s + (size_t)r * ss;
        const float m = row_max(sr, qr[r].keys);
        stats[2 * r] = m, stats[2 * r + 1] = exp_row(sr, qr[r].keys, m);
        for (int i = qr[r].keys; i < keys; i++) sr[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)rows * head_dim);
    for (int j = 0; j * block_size < keys; j++) {
        const int base = j * block_size;
        int64_t rs;
        const float *vb = block_head(v_cache, kind, table[j], cache_stride_block, row, offset, block_size, head_dim, &rs);
        if (vb == NULL) return -1;
        for (int r0 = 0; r0 < rows; r0 += TILE_ROWS) {
            const int R = rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS;
            int most = 0;
            for (int r = r0; r < r0 + R; r++) most = qr[r].keys > most ? qr[r].keys : most;
            const int need = most - base < block_size ? most - base : block_size;
            if (need > 0)
                values_block(s + (size_t)r0 * ss + base, ss, R, vb, rs, need, acc + (size_t)r0 * head_dim, head_dim);
        }
    }
    return 0;
}
#endif

/* Columns of the score rows of attend_rows: `keys` rounded up to whole blocks (the tiles write whole groups of 8
 * keys within a block). */
static inline size_t score_stride(int keys, int block_size) {
    return (size_t)((keys + block_size - 1) / block_size) * (size_t)block_size;
}

/* The rows x keys core (see attend_rows_plain), by register tiles where the shapes allow. s: rows x
 * score_stride(keys, block_size) floats. Returns 0, or -1 when scratch memory could not be allocated. */
static int attend_rows(const QueryRow *qr, int rows, int keys, const int32_t *table, const void *k_cache,
                       const void *v_cache, int kind, int64_t cache_stride_block, int64_t row, int64_t offset,
                       int head_dim, int block_size, float scale, float *s, float *acc, float *stats) {
    const size_t ss = score_stride(keys, block_size);
#if SIMD
    if (block_size % 8 == 0 && head_dim % 8 == 0)
        return attend_rows_tiled(qr, rows, keys, table, k_cache, v_cache, kind, cache_stride_block, row, offset,
                                 head_dim, block_size, scale, s, ss, acc, stats);
#endif
    return attend_rows_plain(qr, rows, keys, table, k_cache, v_cache, kind, cache_stride_block, row, offset, head_dim,
                             block_size, scale, s, ss, acc, stats);
}

/* Prefetch the `bytes` bytes at p (one hint per cache line). */
static inline void prefetch_span(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 3);
}

/* Where token t's rows of heads h0.. start in `cache` (offset: h0 * head_dim); the same token row of the next
 * block of the table is prefetched (`span` bytes) while the caller reads this one. */
static inline const char *token_rows(const char *cache, int64_t esize, const int32_t *table, int t, int block_size,
                                     int last_block, int64_t stride_block, int64_t row, int64_t offset,
                                     int64_t span) {
    const int j = t / block_size, r = t % block_size;
    if (j < last_block) prefetch_span(cache + ((int64_t)table[j + 1] * stride_block + r * row + offset) * esize, span);
    return cache + ((int64_t)table[j] * stride_block + r * row + offset) * esize;
}

/* token_rows, as float32: in place, or widened into `wide` (n values) for a narrow cache. */
static inline const float *token_floats(const char *cache, int kind, const int32_t *table, int t, int block_size,
                                        int last_block, int64_t stride_block, int64_t row, int64_t offset,
                                        int64_t span, int n, float *wide) {
    const char *p = token_rows(cache, kv_bytes(kind), table, t, block_size, last_block, stride_block, row, offset, span);
    if (kind == KV_F32) return (const float *)p;
    widen_span(p, kind, n, wide);
    return wide;
}

#if SIMD && defined(__F16C__)
#define WIDE_SIMD 1
enum { KV_E4M3_SCALED = 5 }; /* e4m3fn codes widened to 2^-8 times their value, NaN codes aside (see load8) */

/* Elements i .. i + 7 of kind `kind` at p, as float32 in a register: the values widen_span writes, except for
 * KV_E4M3_SCALED: an e4m3fn code's seven low bits at a half's bit 7 are a half worth 2^-8 times its value
 * (normal and subnormal alike), used as it is by callers that scale by 256 elsewhere, exactly (a power of two);
 * the NaN codes (0x7f, 0xff) read as 1.875 x 2^-8 there, so a span holding one is read as KV_E4M3. */
static inline __attribute__((always_inline)) __m256 load8(const char *p, int64_t i, const int kind) {
    if (kind == KV_F32) return _mm256_loadu_ps((const float *)p + i);
    if (kind == KV_BF16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))), 16));
    if (kind == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    if (kind == KV_E4M3_SCALED) { /* sign-extended code << 7: sign at bit 15 and a copy at bit 14 (cleared) */
        const __m128i v = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)p + i)));
        return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(v, 7), _mm_set1_epi16((short)0xbfff)));
    }
    const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)((const uint8_t *)p + i)));
    if (kind == KV_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(v, 8));
    const __m128i mag = _mm_and_si128(v, _mm_set1_epi16(0x7f));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(v, _mm_set1_epi16(0x80)), 8);
    const __m256 h = _mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(mag, 7), sign));
    const __m256 f = _mm256_mul_ps(h, _mm256_set1_ps(256.0f)); /* e4m3fn, as widen_span */
    const __m256 nan = _mm256_or_ps(_mm256_and_ps(f, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(NAN));
    const __m256i is_nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)));
    return _mm256_blendv_ps(f, nan, _mm256_castsi256_ps(is_nan));
}

/* Whether the `bytes` e4m3fn codes at p hold a NaN code (0x7f or 0xff). */
static inline int e4m3_nan(const char *p, int64_t bytes) {
    int64_t i = 0;
    for (; i + 32 <= bytes; i += 32) {
        const __m256i v = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + i)), _mm256_set1_epi8(0x7f));
        if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(v, _mm256_set1_epi8(0x7f)))) return 1;
    }
    for (; i < bytes; i++)
        if ((p[i] & 0x7f) == 0x7f) return 1;
    return 0;
}

/* One token of pass 1: dst[qh * n] = mul * (q_qh . k) for the item's query heads, k the token's K rows at base;
 * eight query heads' dots summed together (sum8x8). */
static inline __attribute__((always_inline)) void scores_token(const float *q, int64_t q_stride_h, const char *base,
                                                               int heads, int group, int head_dim, float mul,
                                                               float *dst, int n, const int kind) {
    const int64_t es = kv_bytes(kind);
    for (int qh = 0; qh < heads; qh += 8) {
        const int m = heads - qh < 8 ? heads - qh : 8;
        __m256 a[8];
        for (int i = 0; i < 8; i++) {
            a[i] = _mm256_setzero_ps();
            if (i >= m) continue;
            const float *qq = q + (qh + i) * q_stride_h;
            const char *kk = base + (int64_t)((qh + i) / group) * head_dim * es;
            for (int c = 0; c < head_dim; c += 8)
                a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qq + c), load8(kk, c, kind), a[i]);
        }
        float dots[8];
        _mm256_storeu_ps(dots, _mm256_mul_ps(sum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]),
                                             _mm256_set1_ps(mul)));
        for (int i = 0; i < m; i++) dst[(size_t)(qh + i) * n] = dots[i];
    }
}

/* Pass 1 of a decode item (attend_item) with the cache read in place and widened in registers: s[qh * n + t -
 * first] = scale * q_qh . k_t (head_dim % 8 == 0). e4m3fn tokens without NaN codes are read scaled by 2^-8 and
 * their dots multiplied by 256 * scale: the same products and sums scaled by powers of two, the same bits. */
static inline __attribute__((always_inline)) void decode_scores_tokenwise(const float *q, int64_t q_stride_h,
                                                                const char *k_cache, const int32_t *table,
                                                                int first, int len, int block_size,
                                                                int64_t stride_block, int64_t row, int64_t offset,
                                                                int heads, int group, int head_dim, float scale,
                                                                float *s, int n, const int kind) {
    const int64_t es = kv_bytes(kind), span = (int64_t)(heads / group) * head_dim * es;
    const int last_block = (len - 1) / block_size;
    for (int t = first; t < len; t++) {
        const char *base = token_rows(k_cache, es, table, t, block_size, last_block, stride_block, row, offset, span);
        float *dst = s + (t - first);
        if (kind == KV_E4M3 && !e4m3_nan(base, span))
            scores_token(q, q_stride_h, base, heads, group, head_dim, 256.0f * scale, dst, n, KV_E4M3_SCALED);
        else
            scores_token(q, q_stride_h, base, heads, group, head_dim, scale, dst, n, kind);
    }
}

/* One token of pass 2: out[qh] += (mul p[qh * n]) v for the item's query heads, v the token's V rows at base;
 * each 8 values of a KV head's row widened once for its query heads. */
static inline __attribute__((always_inline)) void values_token(const char *base, int kv_heads, int group,
                                                               int head_dim, const float *p, int n, float mul,
                                                               float *out, const int kind) {
    const int64_t es = kv_bytes(kind);
    for (int h = 0; h < kv_heads; h++) {
        const char *vrow = base + (int64_t)h * head_dim * es;
        const float *ph = p + (size_t)h * group * n;
        float *o = out + (size_t)h * group * head_dim;
        for (int c = 0; c < head_dim; c += 8) {
            const __m256 w = load8(vrow, c, kind);
            for (int g = 0; g < group; g++) {
                float *og = o + (size_t)g * head_dim + c;
                const __m256 pg = _mm256_set1_ps(mul * ph[(size_t)g * n]);
                _mm256_storeu_ps(og, _mm256_fmadd_ps(pg, w, _mm256_loadu_ps(og)));
            }
        }
    }
}

/* Pass 2 of a decode item, the cache read in place and widened in registers: out[qh] = sum_t p[qh][t] v_t
 * (unnormalised), token after token (each token's V span of the item's heads read once, as a stream; the same
 * row of the next block prefetched). e4m3fn tokens without NaN codes: read scaled by 2^-8, weights times 256. */
static inline __attribute__((always_inline)) void decode_values_tokenwise(const char *v_cache, const int32_t *table,
                                                                int first, int len, int block_size,
                                                                int64_t stride_block, int64_t row, int64_t offset,
                                                                int kv_heads, int group, int head_dim,
                                                                const float *s, int n, float *out, const int kind) {
    const int64_t es = kv_bytes(kind), span = (int64_t)kv_heads * head_dim * es;
    const int last_block = (len - 1) / block_size;
    memset(out, 0, sizeof(float) * (size_t)kv_heads * group * head_dim);
    for (int t = first; t < len; t++) {
        const char *base = token_rows(v_cache, es, table, t, block_size, last_block, stride_block, row, offset, span);
        const float *p = s + (t - first);
        if (kind == KV_E4M3 && !e4m3_nan(base, span))
            values_token(base, kv_heads, group, head_dim, p, n, 256.0f, out, KV_E4M3_SCALED);
        else
            values_token(base, kv_heads, group, head_dim, p, n, 1.0f, out, kind);
    }
}

/* Chunks of CT tokens (decode_scores, decode_values where the GQA group is 1, 2, 4 or a multiple of 8): the dot
 * products of QB query heads of one KV head with CT tokens (QB x CT = 8 accumulators, one sum8x8), and the value
 * sums of QB query heads over CT tokens at a time, so each query vector (scores) or output vector (values) is
 * loaded once per chunk and each 8 cache values are widened once for the KV head's query heads. The products
 * and the order of every sum are those of one token at a time: a dot's eight lanes over head_dim in order,
 * summed by sum8x8 (the same order in every lane), and out += p_t v_t token after token. */

/* dst[i * n + tt] = mul * q_i . k_tt for QB query heads (q: the first, rows q_stride_h apart) and NT <= CT
 * tokens (k[tt]: a token's K row of their KV head). */
static inline __attribute__((always_inline)) void scores_chunk(const float *q, int64_t q_stride_h,
                                                               const char *const *k, int head_dim, float mul,
                                                               float *dst, int n, const int QB, const int CT,
                                                               const int NT, const int kind) {
    __m256 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
    for (int c = 0; c < head_dim; c += 8) {
        __m256 qv[8];
        for (int i = 0; i < QB; i++) qv[i] = _mm256_loadu_ps(q + i * q_stride_h + c);
        for (int tt = 0; tt < NT; tt++) {
            const __m256 kv = load8(k[tt], c, kind);
            for (int i = 0; i < QB; i++) a[i * CT + tt] = _mm256_fmadd_ps(qv[i], kv, a[i * CT + tt]);
        }
    }
    float dots[8];
    _mm256_storeu_ps(dots, _mm256_mul_ps(sum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]),
                                         _mm256_set1_ps(mul)));
    for (int i = 0; i < QB; i++)
        for (int tt = 0; tt < NT; tt++) dst[(size_t)i * n + tt] = dots[i * CT + tt];
}

/* The scores of NT tokens (base[tt]: the token's K rows of the item's heads) for every query head. */
static inline __attribute__((always_inline)) void scores_tokens(const float *q, int64_t q_stride_h,
                                                                const char *const *base, int kv_heads, int group,
                                                                int head_dim, float mul, float *dst, int n,
                                                                const int QB, const int CT, const int NT,
                                                                const int kind) {
    const int64_t es = kv_bytes(kind);
    for (int h = 0; h < kv_heads; h++) {
        const char *k[8];
        for (int tt = 0; tt < NT; tt++) k[tt] = base[tt] + (int64_t)h * head_dim * es;
        for (int g = 0; g < group; g += QB)
            scores_chunk(q + (int64_t)(h * group + g) * q_stride_h, q_stride_h, k, head_dim, mul,
                         dst + (size_t)(h * group + g) * n, n, QB, CT, NT, kind);
    }
}

/* out[qh] += sum_tt (mul p[qh * n + tt]) v_tt for NT tokens (base[tt]: the token's V rows of the item's heads),
 * tokens in order. */
static inline __attribute__((always_inline)) void values_tokens(const char *const *base, int kv_heads, int group,
                                                                int head_dim, const float *p, int n, float mul,
                                                                float *out, const int QB, const int CT,
                                                                const int NT, const int kind) {
    const int64_t es = kv_bytes(kind);
    for (int h = 0; h < kv_heads; h++) {
        const char *v[8];
        for (int tt = 0; tt < NT; tt++) v[tt] = base[tt] + (int64_t)h * head_dim * es;
        for (int g0 = 0; g0 < group; g0 += QB) {
            const float *ph = p + (size_t)(h * group + g0) * n;
            float *o = out + (size_t)(h * group + g0) * head_dim;
            __m256 pv[8];
            for (int i = 0; i < QB; i++)
                for (int tt = 0; tt < NT; tt++) pv[i * CT + tt] = _mm256_set1_ps(mul * ph[(size_t)i * n + tt]);
            for (int c = 0; c < head_dim; c += 8) {
                __m256 w[8];
                for (int tt = 0; tt < NT; tt++) w[tt] = load8(v[tt], c, kind);
                for (int i = 0; i < QB; i++) {
                    float *oi = o + (size_t)i * head_dim + c;
                    __m256 acc = _mm256_loadu_ps(oi);
                    for (int tt = 0; tt < NT; tt++) acc = _mm256_fmadd_ps(pv[i * CT + tt], w[tt], acc);
                    _mm256_storeu_ps(oi, acc);
                }
            }
        }
    }
}

/* Pass 1 or 2 of a decode item (values: out zeroed first) over tokens first .. len - 1 in chunks of CT; e4m3fn
 * chunks without NaN codes are read scaled by 2^-8 (mul times 256), the others token by token as their codes
 * allow. */
static inline __attribute__((always_inline)) void decode_chunks(const float *q, int64_t q_stride_h,
                                                                const char *cache, const int32_t *table,
                                                                int first, int len, int block_size,
                                                                int64_t stride_block, int64_t row, int64_t offset,
                                                                int kv_heads, int group, int head_dim, float scale,
                                                                float *s, int n, float *out, const int values,
                                                                const int QB, const int CT, const int kind) {
    const int64_t es = kv_bytes(kind), span = (int64_t)kv_heads * head_dim * es;
    const int last_block = (len - 1) / block_size;
    if (values) memset(out, 0, sizeof(float) * (size_t)kv_heads * group * head_dim);
#define CHUNK(B, MUL, NT, K)                                                                                       \
    do {                                                                                                          \
        if (values) values_tokens(B, kv_heads, group, head_dim, s + (t - first) + (B - base), n, MUL, out, QB, CT, \
                                  NT, K);                                                                         \
        else scores_tokens(q, q_stride_h, B, kv_heads, group, head_dim, (MUL) * scale, s + (t - first) + (B - base), \
                           n, QB, CT, NT, K);                                                                     \
    } while (0)
    for (int t = first; t < len; t += CT) {
        const int nt = len - t < CT ? len - t : CT;
        const char *base[8];
        for (int tt = 0; tt < nt; tt++)
            base[tt] = token_rows(cache, es, table, t + tt, block_size, last_block, stride_block, row, offset, span);
        if (kind == KV_E4M3) {
            int clean = nt == CT;
            for (int tt = 0; tt < nt && clean; tt++) clean = !e4m3_nan(base[tt], span);
            if (clean) {
                CHUNK(base, 256.0f, CT, KV_E4M3_SCALED);
                continue;
            }
            for (int tt = 0; tt < nt; tt++) {
                if (!e4m3_nan(base[tt], span)) CHUNK(base + tt, 256.0f, 1, KV_E4M3_SCALED);
                else CHUNK(base + tt, 1.0f, 1, KV_E4M3);
            }
            continue;
        }
        if (nt == CT) CHUNK(base, 1.0f, CT, kind);
        else
            for (int tt = 0; tt < nt; tt++) CHUNK(base + tt, 1.0f, 1, kind);
    }
#undef CHUNK
}

#define CHUNKED(values, QB, CT, kind)                                                                              \
    decode_chunks(q, q_stride_h, cache, table, first, len, block_size, stride_block, row, offset, kv_heads, group,  \
                  head_dim, scale, s, n, out, values, QB, CT, kind)

/* Pass 1 of a decode item (attend_item): s[qh * n + t - first] = scale * q_qh . k_t, the cache read in place and
 * widened in registers (head_dim % 8 == 0). */
static inline __attribute__((always_inline)) void decode_scores(const float *q, int64_t q_stride_h,
                                                                const char *cache, const int32_t *table, int first,
                                                                int len, int block_size, int64_t stride_block,
                                                                int64_t row, int64_t offset, int heads, int group,
                                                                int head_dim, float scale, float *s, int n,
                                                                const int kind) {
    const int kv_heads = heads / group;
    float *out = NULL;
    if (kind == KV_F32) /* one token at a time: chunks ran slower over a float32 cache in shuffled blocks */
        decode_scores_tokenwise(q, q_stride_h, cache, table, first, len, block_size, stride_block, row, offset, heads,
                                group, head_dim, scale, s, n, kind);
    else if (group == 1) CHUNKED(0, 1, 8, kind);
    else if (group == 2) CHUNKED(0, 2, 4, kind);
    else if (group == 4) CHUNKED(0, 4, 2, kind);
    else if (group % 8 == 0) CHUNKED(0, 8, 1, kind);
    else
        decode_scores_tokenwise(q, q_stride_h, cache, table, first, len, block_size, stride_block, row, offset, heads,
                                group, head_dim, scale, s, n, kind);
}

/* Pass 2 of a decode item: out[qh] = sum_t p[qh][t] v_t (unnormalised), as decode_scores reads K. */
static inline __attribute__((always_inline)) void decode_values(const char *cache, const int32_t *table, int first,
                                                                int len, int block_size, int64_t stride_block,
                                                                int64_t row, int64_t offset, int kv_heads, int group,
                                                                int head_dim, const float *s_in, int n, float *out,
                                                                const int kind) {
    const float *q = NULL;
    const int64_t q_stride_h = 0;
    const float scale = 1.0f;
    float *s = (float *)s_in; /* read only (values) */
    if (kind == KV_F32) /* one token at a time: chunks ran slower over a float32 cache in shuffled blocks */
        decode_values_tokenwise(cache, table, first, len, block_size, stride_block, row, offset, kv_heads, group,
                                head_dim, s_in, n, out, kind);
    else if (group == 1) CHUNKED(1, 1, 8, kind);
    else if (group == 2) CHUNKED(1, 2, 4, kind);
    else if (group == 4) CHUNKED(1, 4, 2, kind);
    else if (group % 8 == 0) CHUNKED(1, 8, 1, kind);
    else
        decode_values_tokenwise(cache, table, first, len, block_size, stride_block, row, offset, kv_heads, group,
                                head_dim, s_in, n, out, kind);
}
#undef CHUNKED

#define BY_KIND(call_with_kind)                                                                                    \
    switch (kind) {                                                                                               \
    case KV_F32: call_with_kind(KV_F32); break;                                                                   \
    case KV_BF16: call_with_kind(KV_BF16); break;                                                                 \
    case KV_F16: call_with_kind(KV_F16); break;                                                                   \
    case KV_E4M3: call_with_kind(KV_E4M3); break;                                                                 \
    default: call_with_kind(KV_E5M2); break;                                                                      \
    }
#else
#define WIDE_SIMD 0
#endif

/* One item: sequence `len` tokens long (table: its block table), keys from position `start` on, KV heads
 * h0 .. h1 - 1 and their query heads (q, out, lse: the first of them; lse may be NULL). Returns 0, or -1 when
 * scratch memory could not be allocated. */
static int attend_item(const float *q, int64_t q_stride_h, const char *k_cache, const char *v_cache, int kind,
                       int64_t cache_stride_block, const int32_t *table, int len, int start, int group,
                       int num_kv_heads, int h0, int h1, int head_dim, int block_size, float scale, int window,
                       float softcap, const float *sinks, float *out, float *lse) {
    int first = (window > 0 && len > window) ? len - window : 0;
    first = start > first ? start : first;
    const int n = len - first;
    const int heads = (h1 - h0) * group; /* query heads of this item */
    if (n <= 0) { /* nothing to attend to: a zero output that weighs nothing in a merge */
        memset(out, 0, sizeof(float) * (size_t)heads * head_dim);
        if (lse)
            for (int qh = 0; qh < heads; qh++) lse[qh] = -INFINITY;
        return 0;
    }
    float *s = scratch((size_t)heads * (size_t)n);
    if (s == NULL) return -1;
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    const int64_t span = (int64_t)(h1 - h0) * head_dim * kv_bytes(kind); /* bytes read per token */
    const int width = (h1 - h0) * head_dim;                              /* values read per token */
    const int narrow = kind != KV_F32 && !(WIDE_SIMD && head_dim % 8 == 0);
    float *wide = narrow ? (float *)grow(&tls_wide, sizeof(float) * (size_t)width) : NULL;
    if (narrow && wide == NULL) return -1;
    const int last_block = (len - 1) / block_size;
    const int64_t offset = (int64_t)h0 * head_dim;
    /* Pass 1: scores. Each token's K rows of heads h0..h1 are one contiguous span, read once for all the
     * query heads; the same token's span in the next block is prefetched meanwhile. */
#if WIDE_SIMD
    const int in_registers = head_dim % 8 == 0; /* the cache widened in registers (decode_scores, decode_values) */
    if (in_registers) {
#define SCORES(K)                                                                                                 \
    decode_scores(q, q_stride_h, k_cache, table, first, len, block_size, cache_stride_block, row, offset, heads,    \
                  group, head_dim, scale, s, n, K)
        BY_KIND(SCORES)
#undef SCORES
    }
#else
    const int in_registers = 0;
#endif
    for (int t = in_registers ? len : first; t < len; t++) {
        const float *base = token_floats(k_cache, kind, table, t, block_size, last_block, cache_stride_block, row,
                                         offset, span, width, wide);
#if SIMD
        if (head_dim % 8 == 0) { /* eight query heads at a time: their dots' lanes summed together (sum8x8) */
            for (int qh = 0; qh < heads; qh += 8) {
                const int m = heads - qh < 8 ? heads - qh : 8;
                __m256 a[8];
                for (int i = 0; i < 8; i++) {
                    a[i] = _mm256_setzero_ps();
                    if (i >= m) continue;
                    const float *qq = q + (qh + i) * q_stride_h, *kk = base + ((qh + i) / group) * head_dim;
                    for (int c = 0; c < head_dim; c += 8)
                        a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qq + c), _mm256_loadu_ps(kk + c), a[i]);
                }
                float dots[8];
                _mm256_storeu_ps(dots, _mm256_mul_ps(sum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]),
                                                     _mm256_set1_ps(scale)));
                for (int i = 0; i < m; i++) s[(size_t)(qh + i) * n + (t - first)] = dots[i];
            }
            continue;
        }
#endif
        for (int qh = 0; qh < heads; qh++)
            s[(size_t)qh * n + (t - first)] = dot(q + qh * q_stride_h, base + (qh / group) * head_dim, head_dim) * scale;
    }
    float inv_sum[MAX_HEADS];
    for (int qh = 0; qh < heads; qh++) {
        float *sg = s + (size_t)qh * n;
        if (softcap > 0.0f)
            for (int i = 0; i < n; i++) sg[i] = softcap * tanhf(sg[i] / softcap);
        float m = row_max(sg, n);
        const float sink = sinks ? sinks[h0 * group + qh] : 0.0f;
        if (sinks && sink > m) m = sink;
        float total = exp_row(sg, n, m);
        if (sinks) total += exp_nonpos(sink - m);
        inv_sum[qh] = 1.0f / total;
        if (lse) lse[qh] = m + logf(total);
    }
    /* Pass 2: out_qh = sum_t p_qh[t] v_t, each token's V span read once for all the query heads. */
#if WIDE_SIMD
    if (in_registers) {
#define VALUES(K)                                                                                                 \
    decode_values(v_cache, table, first, len, block_size, cache_stride_block, row, offset, h1 - h0, group, head_dim, \
                  s, n, out, K)
        BY_KIND(VALUES)
#undef VALUES
    } else
#endif
        memset(out, 0, sizeof(float) * (size_t)heads * head_dim);
    for (int t = in_registers ? len : first; t < len; t++) {
        const float *base = token_floats(v_cache, kind, table, t, block_size, last_block, cache_stride_block, row,
                                         offset, span, width, wide);
        for (int h = 0; h < h1 - h0; h++) {
            const float *vrow = base + h * head_dim;
            for (int g = 0; g < group; g++) {
                const int qh = h * group + g;
                const float p = s[(size_t)qh * n + (t - first)];
                float *o = out + (size_t)qh * head_dim;
                for (int d = 0; d < head_dim; d++) o[d] += p * vrow[d];
            }
        }
    }
    for (int qh = 0; qh < heads; qh++) {
        float *o = out + (size_t)qh * head_dim;
        const float w = inv_sum[qh];
        for (int d = 0; d < head_dim; d++) o[d] *= w;
    }
    return 0;
}

/* Whether sequence b can be read safely: len >= 1, its blocks within its table row, and every block id it reads
 * (from the window's first block on) a valid block of the cache. */
static int table_ok(const int32_t *table, int len, int window, int block_size, int64_t table_cols,
                    int64_t num_blocks) {
    if (len < 1 || (int64_t)(len - 1) / block_size >= table_cols) return 0;
    const int first = (window > 0 && len > window) ? len - window : 0;
    for (int j = first / block_size; j <= (len - 1) / block_size; j++)
        if (table[j] < 0 || table[j] >= num_blocks) return 0;
    return 1;
}

/* Returns 0 on success, -1 on a bad argument or allocation failure (out is then unspecified).
 * Items: (sequence, range of `heads_per_item` KV heads); the caller picks heads_per_item (a divisor of
 * num_kv_heads) so that there are enough items for the threads. */
int batchgen_paged_decode_f32(const float *q, int64_t q_stride_b, int64_t q_stride_h, void *k_cache,
                              void *v_cache, int64_t cache_stride_block, const int32_t *block_tables,
                              int64_t table_stride, const int32_t *seq_lens, float *out, int batch,
                              int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                              int window, float softcap, const float *sinks, int num_threads, int heads_per_item,
                              int64_t table_cols, int64_t num_blocks, const int32_t *starts, float *lse,
                              const float *k_new, int64_t kn_stride_b, int64_t kn_stride_h, const float *v_new,
                              int64_t vn_stride_b, int64_t vn_stride_h, const int64_t *slots, int kv_kind) {
    if (batch < 0 || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) return -1;
    if (kv_kind < KV_F32 || kv_kind > KV_E5M2 || (k_new != NULL && kv_kind != KV_F32)) return -1;
    if (heads_per_item <= 0 || num_kv_heads % heads_per_item != 0) return -1;
    const int group = num_q_heads / num_kv_heads;
    if (heads_per_item * group > MAX_HEADS) return -1;
    const int splits = num_kv_heads / heads_per_item;
    const int64_t items = (int64_t)batch * splits;
    int status = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : status)
    for (int64_t it = 0; it < items; it++) {
        const int b = (int)(it / splits), h0 = (int)(it % splits) * heads_per_item;
        const int len = seq_lens[b];
        if (!table_ok(block_tables + b * table_stride, len, window, block_size, table_cols, num_blocks)) {
            status |= 1; /* the caller falls back to the torch path, which reports the bad input */
            continue;
        }
        if (k_new != NULL && slots[b] >= 0) { /* the step's own K/V rows of these heads first (see above) */
            const int64_t slot = slots[b];
            if (slot >= num_blocks * block_size) {
                status |= 1;
                continue;
            }
            const int64_t at = slot / block_size * cache_stride_block + slot % block_size * num_kv_heads * head_dim;
            for (int h = h0; h < h0 + heads_per_item; h++) {
                memcpy((float *)k_cache + at + (int64_t)h * head_dim, k_new + b * kn_stride_b + h * kn_stride_h,
                       sizeof(float) * head_dim);
                memcpy((float *)v_cache + at + (int64_t)h * head_dim, v_new + b * vn_stride_b + h * vn_stride_h,
                       sizeof(float) * head_dim);
            }
        }
        const float *qb = q + b * q_stride_b + (int64_t)h0 * group * q_stride_h;
        float *ob = out + ((int64_t)b * num_q_heads + (int64_t)h0 * group) * head_dim;
        float *lb = lse ? lse + (int64_t)b * num_q_heads + (int64_t)h0 * group : NULL;
        status |= attend_item(qb, q_stride_h, k_cache, v_cache, kv_kind, cache_stride_block,
                              block_tables + b * table_stride, len, starts ? starts[b] : 0, group,
                              num_kv_heads, h0, h0 + heads_per_item, head_dim, block_size, scale, window,
                              softcap, sinks, ob, lb) != 0;
    }
    return status ? -1 : 0;
}


/* Cascade decode, the shared-prefix half, merged into the suffix half.
 *
 * Groups of sequences share their first prefix_blocks[g] blocks (block ids: prefix_tables row g, all blocks
 * full); group g's sequences are group_seqs[group_offsets[g] .. group_offsets[g + 1] - 1]. out [B, Hq, D] and
 * lse [B, Hq] hold each sequence's attention over its own keys after the prefix (the suffix kernel's results,
 * lse -inf with a zero output where there are none); for every sequence of a group they are replaced by the
 * attention over prefix and suffix together: the prefix's output and log-sum-exp, merged with the suffix's by
 * their log-sum-exps. Sequences in no group are left as they are.
 *
 * Work item = (group, KV head, chunk of at most `chunk` of the group's sequences): the prefix's K (then V) rows
 * of that head are read once for the chunk's query rows (sequences x query heads of the KV head), eight keys
 * at a time per row. Each row's result depends only on its own query and the prefix, in a fixed key order:
 * results do not depend on the thread count or the chunking. Returns 0, or -1 on a bad argument, a block id
 * out of range or an allocation failure (out and lse are then unspecified). */
int batchgen_cascade_prefix_f32(const float *q, int64_t q_stride_b, int64_t q_stride_h, const void *k_cache,
                                const void *v_cache, int64_t cache_stride_block, int64_t num_blocks,
                                int num_groups, const int32_t *group_offsets, const int32_t *group_seqs,
                                const int32_t *prefix_tables, int64_t prefix_table_stride,
                                const int32_t *prefix_blocks, float *out, float *lse, int batch, int num_q_heads,
                                int num_kv_heads, int head_dim, int block_size, float scale, int chunk,
                                int num_threads, int kv_kind) {
    if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 || chunk <= 0 || num_groups < 0) return -1;
    if (kv_kind < KV_F32 || kv_kind > KV_E5M2) return -1;
    const int group = num_q_heads / num_kv_heads;
    int64_t items = 0;
    for (int g = 0; g < num_groups; g++) {
        const int n = group_offsets[g + 1] - group_offsets[g];
        if (n < 0 || prefix_blocks[g] < 0 || prefix_blocks[g] > prefix_table_stride) return -1;
        for (int j = 0; j < prefix_blocks[g]; j++) {
            const int32_t id = prefix_tables[(int64_t)g * prefix_table_stride + j];
            if (id < 0 || id >= num_blocks) return -1;
        }
        for (int i = group_offsets[g]; i < group_offsets[g + 1]; i++)
            if (group_seqs[i] < 0 || group_seqs[i] >= batch) return -1;
        items += (int64_t)num_kv_heads * ((n + chunk - 1) / chunk);
    }
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    int status = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : status)
    for (int64_t it = 0; it < items; it++) {
        /* Find item `it`: groups in order, then KV heads, then chunks. */
        int g = 0;
        int64_t rest = it;
        for (;; g++) {
            const int n = group_offsets[g + 1] - group_offsets[g];
            const int64_t here = (int64_t)num_kv_heads * ((n + chunk - 1) / chunk);
            if (rest < here) break;
            rest -= here;
        }
        const int n = group_offsets[g + 1] - group_offsets[g];
        const int chunks = (n + chunk - 1) / chunk;
        const int h = (int)(rest / chunks), c0 = (int)(rest % chunks) * chunk;
        const int c1 = c0 + chunk < n ? c0 + chunk : n;
        const int rows = (c1 - c0) * group; /* query rows: sequence-major, then the KV head's query heads */
        const int keys = prefix_blocks[g] * block_size;
        if (keys == 0) continue;
        const int32_t *table = prefix_tables + (int64_t)g * prefix_table_stride;
        const int32_t *seqs = group_seqs + group_offsets[g] + c0;
        const size_t ss = score_stride(keys, block_size);
        float *buf = scratch((size_t)rows * (ss + (size_t)head_dim + 2));
        QueryRow *qr = row_scratch((size_t)rows);
        if (buf == NULL || qr == NULL) {
            status |= 1;
            continue;
        }
        float *s = buf, *acc = buf + (size_t)rows * ss, *stats = acc + (size_t)rows * head_dim;
        for (int r = 0; r < rows; r++) {
            qr[r].q = q + (int64_t)seqs[r / group] * q_stride_b + (int64_t)(h * group + r % group) * q_stride_h;
            qr[r].keys = keys;
        }
        if (attend_rows(qr, rows, keys, table, k_cache, v_cache, kv_kind, cache_stride_block, row, (int64_t)h * head_dim,
                        head_dim, block_size, scale, s, acc, stats) != 0) {
            status |= 1;
            continue;
        }
        /* Merge with the suffix: weights of the two halves from their log-sum-exps. */
        for (int r = 0; r < rows; r++) {
            const int b = seqs[r / group], qh = h * group + r % group;
            const float sum = stats[2 * r + 1], lse_prefix = stats[2 * r] + logf(sum);
            float *o = out + ((int64_t)b * num_q_heads + qh) * head_dim;
            float *l = lse + (int64_t)b * num_q_heads + qh;
            const float top = *l > lse_prefix ? *l : lse_prefix;
            const float w_suffix = *l == -INFINITY ? 0.0f : expf(*l - top);
            const float w_prefix = expf(lse_prefix - top);
            const float total = w_suffix + w_prefix;
            const float a = w_suffix / total, c = w_prefix / (total * sum);
            const float *ar = acc + (size_t)r * head_dim;
            for (int d = 0; d < head_dim; d++) o[d] = o[d] * a + ar[d] * c;
            *l = top + logf(total);
        }
    }
    return status ? -1 : 0;
}

/* Paged prefill attention: packed query chunks attending to their sequence's cached keys.
 *
 * Sequence b owns queries q[cu_q[b] .. cu_q[b + 1] - 1] at positions seq_lens[b] - q_len + i; with `causal` a
 * query at position p attends to keys 0..p, else to all seq_lens[b] keys (the new tokens' K/V already stored).
 * out [T, Hq, D] contiguous; lse [T, Hq] (NULL: not written) receives each row's natural log-sum-exp.
 *
 * Work item = (sequence, KV head, chunk of at most `chunk` query tokens): the keys the chunk's last query sees
 * are read block by block once for all the chunk's query rows (tokens x the KV head's query heads), each row
 * stopping at its own last key; exact two-pass softmax per row. Each row depends only on its own query and
 * keys, in a fixed order: results do not depend on the thread count or the chunking. Returns 0, or -1 on a
 * bad argument, a block id out of range or an allocation failure. */
int batchgen_paged_prefill_f32(const float *q, int64_t q_stride_t, int64_t q_stride_h, const void *k_cache,
                               const void *v_cache, int64_t cache_stride_block, int64_t num_blocks,
                               const int32_t *block_tables, int64_t table_stride, int64_t table_cols,
                               const int32_t *seq_lens, const int32_t *cu_q, int batch, int num_q_heads,
                               int num_kv_heads, int head_dim, int block_size, float scale, int causal, int chunk,
                               float *out, float *lse, int num_threads, int kv_kind) {
    if (batch < 0 || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0 || chunk <= 0 || block_size <= 0)
        return -1;
    if (kv_kind < KV_F32 || kv_kind > KV_E5M2) return -1;
    const int group = num_q_heads / num_kv_heads;
    int64_t items = 0;
    for (int b = 0; b < batch; b++) {
        const int q_len = cu_q[b + 1] - cu_q[b], len = seq_lens[b];
        if (q_len < 0 || len < q_len || (len > 0 && (int64_t)(len - 1) / block_size >= table_cols)) return -1;
        for (int j = 0; j < (len + block_size - 1) / block_size; j++) {
            const int32_t id = block_tables[(int64_t)b * table_stride + j];
            if (id < 0 || id >= num_blocks) return -1;
        }
        items += (int64_t)num_kv_heads * ((q_len + chunk - 1) / chunk);
    }
    int32_t *item_seq = (int32_t *)malloc(sizeof(int32_t) * (size_t)(items > 0 ? items : 1));
    int32_t *item_rest = (int32_t *)malloc(sizeof(int32_t) * (size_t)(items > 0 ? items : 1));
    if (item_seq == NULL || item_rest == NULL) {
        free(item_seq), free(item_rest);
        return -1;
    }
    for (int b = 0, at = 0; b < batch; b++) {
        const int n = num_kv_heads * ((cu_q[b + 1] - cu_q[b] + chunk - 1) / chunk);
        for (int i = 0; i < n; i++, at++) item_seq[at] = b, item_rest[at] = i;
    }
    const int64_t row = (int64_t)num_kv_heads * head_dim;
    int status = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) reduction(| : status)
    for (int64_t it = 0; it < items; it++) {
        const int b = item_seq[it], q_len = cu_q[b + 1] - cu_q[b], len = seq_lens[b];
        const int chunks = (q_len + chunk - 1) / chunk;
        const int h = item_rest[it] / chunks, c0 = (item_rest[it] % chunks) * chunk;
        const int c1 = c0 + chunk < q_len ? c0 + chunk : q_len;
        const int ctx = len - q_len;
        const int rows = (c1 - c0) * group; /* token-major, then the KV head's query heads */
        const int keys = causal ? ctx + c1 : len; /* what the chunk's last query sees */
        const int32_t *table = block_tables + (int64_t)b * table_stride;
        const size_t ss = score_stride(keys, block_size);
        float *buf = scratch((size_t)rows * (ss + (size_t)head_dim + 2));
        QueryRow *qr = row_scratch((size_t)rows);
        if (buf == NULL || qr == NULL) {
            status |= 1;
            continue;
        }
        float *s = buf, *acc = buf + (size_t)rows * ss, *stats = acc + (size_t)rows * head_dim;
        for (int r = 0; r < rows; r++) {
            const int64_t t = cu_q[b] + c0 + r / group;
            qr[r].q = q + t * q_stride_t + (int64_t)(h * group + r % group) * q_stride_h;
            qr[r].keys = causal ? ctx + c0 + r / group + 1 : len; /* a causal row: keys up to its position */
        }
        if (attend_rows(qr, rows, keys, table, k_cache, v_cache, kv_kind, cache_stride_block, row, (int64_t)h * head_dim,
                        head_dim, block_size, scale, s, acc, stats) != 0) {
            status |= 1;
            continue;
        }
        for (int r = 0; r < rows; r++) {
            const int64_t t = cu_q[b] + c0 + r / group, qh = h * group + r % group;
            const float inv = 1.0f / stats[2 * r + 1];
            float *o = out + (t * num_q_heads + qh) * head_dim;
            const float *ar = acc + (size_t)r * head_dim;
            for (int d = 0; d < head_dim; d++) o[d] = ar[d] * inv;
            if (lse) lse[t * num_q_heads + qh] = stats[2 * r] + logf(stats[2 * r + 1]);
        }
    }
    free(item_seq), free(item_rest);
    return status ? -1 : 0;
}
