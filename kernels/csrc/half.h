/* IEEE half (binary16) bits -> float, exact (subnormals, infinities and NaNs included). Shared by the
 * kernels that read float16 weights, KV caches and quantized blocks' scales. */
#ifndef BATCHGEN_HALF_H
#define BATCHGEN_HALF_H

#include <stdint.h>
#include <string.h>

static inline float half_bits_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) bits = sign | 0x7f800000u | (mant << 13);
    else if (exp != 0) bits = sign | ((exp + 112) << 23) | (mant << 13);
    else if (mant == 0) bits = sign;
    else { /* subnormal: normalise */
        int e = -1;
        uint32_t m = mant;
        do { m <<= 1, e++; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif
