/* Paged decode attention for the CPU, float32, reading K/V blocks in place (no gather).
 *
 * Semantics: batchgen/kernels/reference.py (paged_decode_attention). One query per sequence, the token at
 * position seq_lens[b] - 1; query head h reads kv head h / G (G = Hq / Hkv); logits s = scale * q.k, soft-capped
 * to softcap * tanh(s / softcap) when softcap > 0; keys at positions max(0, len - window) .. len - 1 (window > 0)
 * or 0 .. len - 1; with sinks, one more logit sinks[h] in the softmax denominator (no value).
 *
 * Work item = (sequence, range of KV heads h0..h1-1): each token's K (then V) rows of those heads are one
 * contiguous span, read once for all their query heads (G per KV head); the same rows of the next block are
 * prefetched meanwhile. Per item, exact two-pass softmax: scores of every visible key into a per-thread
 * buffer, their maximum, exp and sum, then out = sum_k p_k v_k / sum. Dot products use 16 explicit lane
 * accumulators (the compiler turns them into vector FMAs without -ffast-math) reduced in a fixed order; exp is
 * a polynomial written so that it vectorises. Every query head's result is computed by one thread in a fixed
 * order, whatever the items, so results do not depend on the number of threads and are bit-identical run to
 * run.
 *
 * Cascade support: `starts` [B] int32 (NULL: all 0) makes sequence b attend only to keys at positions
 * >= starts[b] (its suffix after a prefix attended elsewhere); `lse` [B, Hq] (NULL: not written) receives the
 * natural log-sum-exp of each head's scaled logits, so a caller can merge this partial result with another
 * (-inf, and a zero output, when a sequence has no key to attend to).
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

static __thread float *tls_buf = NULL;
static __thread size_t tls_cap = 0;

static float *scratch(size_t n) {
    if (n > tls_cap) {
        free(tls_buf);
        tls_buf = (float *)malloc(n * sizeof(float));
        tls_cap = tls_buf ? n : 0;
    }
    return tls_buf;
}

/* Prefetch the `bytes` bytes at p (one hint per cache line). */
static inline void prefetch_span(const float *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 3);
}

/* Where token t's rows of heads h0.. start in `cache` (offset: h0 * head_dim); the same token row of the next
 * block of the table is prefetched (`span` bytes) while the caller reads this one. */
static inline const float *token_rows(const float *cache, const int32_t *table, int t, int block_size,
                                      int last_block, int64_t stride_block, int64_t row, int64_t offset,
                                      int64_t span) {
    const int j = t / block_size, r = t % block_size;
    if (j < last_block) prefetch_span(cache + (int64_t)table[j + 1] * stride_block + r * row + offset, span);
    return cache + (int64_t)table[j] * stride_block + r * row + offset;
}

/* One item: sequence `len` tokens long (table: its block table), keys from position `start` on, KV heads
 * h0 .. h1 - 1 and their query heads (q, out, lse: the first of them; lse may be NULL). Returns 0, or -1 when
 * scratch memory could not be allocated. */
static int attend_item(const float *q, int64_t q_stride_h, const float *k_cache, const float *v_cache,
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
    const int64_t span = (int64_t)(h1 - h0) * head_dim * (int64_t)sizeof(float); /* bytes read per token */
    const int last_block = (len - 1) / block_size;
    const int64_t offset = (int64_t)h0 * head_dim;
    /* Pass 1: scores. Each token's K rows of heads h0..h1 are one contiguous span, read once for all the
     * query heads; the same token's span in the next block is prefetched meanwhile. */
    for (int t = first; t < len; t++) {
        const float *base = token_rows(k_cache, table, t, block_size, last_block, cache_stride_block, row, offset, span);
        for (int h = 0; h < h1 - h0; h++)
            for (int g = 0; g < group; g++) {
                const int qh = h * group + g;
                s[(size_t)qh * n + (t - first)] = dot(q + qh * q_stride_h, base + h * head_dim, head_dim) * scale;
            }
    }
    float inv_sum[MAX_HEADS];
    for (int qh = 0; qh < heads; qh++) {
        float *sg = s + (size_t)qh * n;
        if (softcap > 0.0f)
            for (int i = 0; i < n; i++) sg[i] = softcap * tanhf(sg[i] / softcap);
        float m = sg[0];
        for (int i = 1; i < n; i++) m = sg[i] > m ? sg[i] : m;
        const float sink = sinks ? sinks[h0 * group + qh] : 0.0f;
        if (sinks && sink > m) m = sink;
        float acc[LANES] = {0};
        int i = 0;
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
        float total = acc[0];
        if (sinks) total += exp_nonpos(sink - m);
        inv_sum[qh] = 1.0f / total;
        if (lse) lse[qh] = m + logf(total);
    }
    /* Pass 2: out_qh = sum_t p_qh[t] v_t, each token's V span read once for all the query heads. */
    memset(out, 0, sizeof(float) * (size_t)heads * head_dim);
    for (int t = first; t < len; t++) {
        const float *base = token_rows(v_cache, table, t, block_size, last_block, cache_stride_block, row, offset, span);
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
int batchgen_paged_decode_f32(const float *q, int64_t q_stride_b, int64_t q_stride_h, const float *k_cache,
                              const float *v_cache, int64_t cache_stride_block, const int32_t *block_tables,
                              int64_t table_stride, const int32_t *seq_lens, float *out, int batch,
                              int num_q_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                              int window, float softcap, const float *sinks, int num_threads, int heads_per_item,
                              int64_t table_cols, int64_t num_blocks, const int32_t *starts, float *lse) {
    if (batch < 0 || num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) return -1;
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
        const float *qb = q + b * q_stride_b + (int64_t)h0 * group * q_stride_h;
        float *ob = out + ((int64_t)b * num_q_heads + (int64_t)h0 * group) * head_dim;
        float *lb = lse ? lse + (int64_t)b * num_q_heads + (int64_t)h0 * group : NULL;
        status |= attend_item(qb, q_stride_h, k_cache, v_cache, cache_stride_block,
                              block_tables + b * table_stride, len, starts ? starts[b] : 0, group,
                              num_kv_heads, h0, h0 + heads_per_item, head_dim, block_size, scale, window,
                              softcap, sinks, ob, lb) != 0;
    }
    return status ? -1 : 0;
}
