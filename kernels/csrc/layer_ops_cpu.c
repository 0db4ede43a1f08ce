/* A decoder layer's elementwise steps for the CPU, float32, each one pass over its rows (OpenMP over rows):
 * RMSNorm (optionally after adding a residual), SiLU(gate) * up, rotary embeddings, and the KV-cache store.
 * Semantics are the torch code they replace in batchgen/models/llama.py and kernels/torch_backend.py:
 *
 *   rms_norm:   r = 1 / sqrt(sum(x^2) / D + eps); out = w * (x * r), or (x * r) * (1 + w) (Gemma)
 *   silu_mul:   out = silu(gate) * up, silu(g) = g / (1 + e^-g)
 *   rope:       out[c] = x[c] * cos[c] + x[c +- R/2] * sin[c] for c < R (sin's first half negated by the
 *               caller), x[c] for R <= c < D
 *   store_kv:   k_cache[slot] = k, v_cache[slot] = v for each token whose slot is >= 0
 *
 * Every product and sum is rounded as torch rounds it: separate multiplies and adds, never contracted into a
 * fused multiply-add (the pragmas below), so RoPE and the norm's scaling are bit for bit torch's; a sum of
 * squares is added in a fixed order of 8 lanes, so it may differ from torch's in the last bit but never from
 * run to run or with the thread count. exp is the polynomial of the attention kernel (relative error ~2e-7). */

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__) && !defined(BATCHGEN_GENERIC)
#include <immintrin.h>
#define SIMD 1
#else
#define SIMD 0
#endif

/* e^x for x <= 0 (x clamped at -87), the polynomial of paged_attention_cpu.c's exp_nonpos. */
static inline float exp_neg(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float shifter = 12582912.0f;
    float t = x * 1.44269504088896341f + shifter;
    float n = t - shifter;
    float r = x - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits;
    memcpy(&bits, &t, sizeof bits);
    int32_t sbits = ((bits - 0x4B400000) + 127) << 23;
    float s;
    memcpy(&s, &sbits, sizeof s);
    return p * s;
}

/* sum of x[i]^2 over d values, eight lanes then the lanes in a fixed order. */
static inline float sum_squares(const float *x, int d) {
    float lanes[8] = {0};
    int i = 0;
    for (; i + 8 <= d; i += 8)
        for (int l = 0; l < 8; l++) {
            const float sq = x[i + l] * x[i + l];
            lanes[l] = lanes[l] + sq;
        }
    for (int l = 0; i < d; i++, l++) {
        const float sq = x[i] * x[i];
        lanes[l] = lanes[l] + sq;
    }
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

/* Rows (t, h) of x: x + t * xs_t + h * xs_h, D contiguous floats; out [T, H, D] contiguous. When add is not
 * NULL (same layout as x, H == 1), x += add first, in place, and the norm is of the sum. weight: [weight_rows,
 * D], row h % weight_rows. Returns 0. */
int batchgen_rms_norm_f32(float *x, int64_t xs_t, int64_t xs_h, const float *add, int64_t adds_t,
                          const float *weight, int weight_rows, float *out, int T, int H, int D, float eps,
                          int gemma, int num_threads) {
    const int64_t rows = (int64_t)T * H;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t row = 0; row < rows; row++) {
        const int t = (int)(row / H), h = (int)(row % H);
        float *xr = x + t * xs_t + h * xs_h;
        if (add != NULL) {
            const float *ar = add + t * adds_t;
            for (int c = 0; c < D; c++) xr[c] = xr[c] + ar[c];
        }
        const float mean = sum_squares(xr, D) / (float)D;
        const float r = 1.0f / sqrtf(mean + eps);
        const float *w = weight + (int64_t)(h % weight_rows) * D;
        float *o = out + row * D;
        if (gemma)
            for (int c = 0; c < D; c++) {
                const float n = xr[c] * r;
                const float s = 1.0f + w[c];
                o[c] = n * s;
            }
        else
            for (int c = 0; c < D; c++) {
                const float n = xr[c] * r;
                o[c] = w[c] * n;
            }
    }
    return 0;
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, I + i] for i < I; gate_up rows gs_t floats apart, out [T, I]
 * contiguous. silu(g) = g / (1 + e^-g), with e^-g from exp_neg of -|g| (for g < 0, e^-g = 1 / e^g). */
int batchgen_silu_mul_f32(const float *gate_up, int64_t gs_t, float *out, int T, int I, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int t = 0; t < T; t++) {
        const float *g = gate_up + t * gs_t, *u = g + I;
        float *o = out + (int64_t)t * I;
        int i = 0;
#if SIMD
        const __m256 lo = _mm256_set1_ps(-87.0f), shifter = _mm256_set1_ps(12582912.0f);
        const __m256 log2e = _mm256_set1_ps(1.44269504088896341f), ln2_hi = _mm256_set1_ps(0.693145751953125f);
        const __m256 ln2_lo = _mm256_set1_ps(1.428606765330187e-06f), one = _mm256_set1_ps(1.0f);
        const __m256 c6 = _mm256_set1_ps(1.0f / 720.0f), c5 = _mm256_set1_ps(1.0f / 120.0f);
        const __m256 c4 = _mm256_set1_ps(1.0f / 24.0f), c3 = _mm256_set1_ps(1.0f / 6.0f), c2 = _mm256_set1_ps(0.5f);
        const __m256i bias = _mm256_set1_epi32(0x4B400000 - 127);
        const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
        for (; i + 8 <= I; i += 8) { /* exp_neg's steps, eight lanes at once, each rounded as in C */
            const __m256 x = _mm256_loadu_ps(g + i);
            const __m256 a = _mm256_max_ps(_mm256_or_ps(x, sign), lo); /* -|x|, clamped */
            const __m256 tt = _mm256_add_ps(_mm256_mul_ps(a, log2e), shifter);
            const __m256 n = _mm256_sub_ps(tt, shifter);
            __m256 r = _mm256_sub_ps(a, _mm256_mul_ps(n, ln2_hi));
            r = _mm256_sub_ps(r, _mm256_mul_ps(n, ln2_lo));
            __m256 p = _mm256_add_ps(_mm256_mul_ps(c6, r), c5);
            p = _mm256_add_ps(_mm256_mul_ps(p, r), c4);
            p = _mm256_add_ps(_mm256_mul_ps(p, r), c3);
            p = _mm256_add_ps(_mm256_mul_ps(p, r), c2);
            p = _mm256_add_ps(_mm256_mul_ps(p, r), one);
            p = _mm256_add_ps(_mm256_mul_ps(p, r), one);
            const __m256i e_bits = _mm256_slli_epi32(_mm256_sub_epi32(_mm256_castps_si256(tt), bias), 23);
            const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(e_bits)); /* e^-|x| */
            const __m256 pos = _mm256_cmp_ps(x, zero, _CMP_GE_OQ);
            const __m256 den = _mm256_add_ps(one, _mm256_blendv_ps(_mm256_div_ps(one, e), e, pos));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, den), _mm256_loadu_ps(u + i)));
        }
#endif
        for (; i < I; i++) {
            const float x = g[i];
            const float e = exp_neg(x >= 0.0f ? -x : x); /* e^-|x| */
            const float den = x >= 0.0f ? 1.0f + e : 1.0f + 1.0f / e;
            const float s = x / den;
            o[i] = s * u[i];
        }
    }
    return 0;
}

/* out [T, H, D] contiguous from x rows x + t * xs_t + h * D; cos/sin [T, R] contiguous (R even, <= D). */
int batchgen_rope_f32(const float *x, int64_t xs_t, const float *cos_t, const float *sin_t, float *out, int T,
                      int H, int D, int R, int num_threads) {
    const int half = R / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int t = 0; t < T; t++) {
        const float *cs = cos_t + (int64_t)t * R, *sn = sin_t + (int64_t)t * R;
        for (int h = 0; h < H; h++) {
            const float *xr = x + t * xs_t + (int64_t)h * D;
            float *o = out + ((int64_t)t * H + h) * D;
            for (int c = 0; c < half; c++) {
                const float a = xr[c] * cs[c], b = xr[c + half] * sn[c];
                o[c] = a + b;
            }
            for (int c = half; c < R; c++) {
                const float a = xr[c] * cs[c], b = xr[c - half] * sn[c];
                o[c] = a + b;
            }
            for (int c = R; c < D; c++) o[c] = xr[c];
        }
    }
    return 0;
}

/* k_cache/v_cache: num_slots token rows of row = Hkv * D floats; k/v token t: head h at k + t * ks_t + h * ks_h
 * (D contiguous). Tokens with slot < 0 are skipped. Returns 0, or -1 (nothing written) when a slot is >=
 * num_slots. */
int batchgen_store_kv_f32(const float *k, int64_t ks_t, int64_t ks_h, const float *v, int64_t vs_t,
                          int64_t vs_h, const int64_t *slots, float *k_cache, float *v_cache, int64_t num_slots,
                          int T, int Hkv, int D) {
    for (int t = 0; t < T; t++)
        if (slots[t] >= num_slots) return -1;
    const int64_t row = (int64_t)Hkv * D;
    for (int t = 0; t < T; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        for (int h = 0; h < Hkv; h++) {
            memcpy(k_cache + s * row + (int64_t)h * D, k + t * ks_t + h * ks_h, sizeof(float) * D);
            memcpy(v_cache + s * row + (int64_t)h * D, v + t * vs_t + h * vs_h, sizeof(float) * D);
        }
    }
    return 0;
}
