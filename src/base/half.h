// 16-bit floating-point formats on the host: IEEE 754 binary16 (float16) and bfloat16, to and
// from float32, rounding to nearest even (as PyTorch's `.half()`, `.bfloat16()` and OpenCL's
// vstore_half_rte do). NaN stays NaN (quiet), infinities and signed zeros are kept, float16
// subnormals are exact; float32 values beyond float16's range round to infinity.
#ifndef CLMHA_BASE_HALF_H
#define CLMHA_BASE_HALF_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "clmha.h"

static inline uint32_t clmha__f32_bits(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    return x;
}

static inline float clmha__f32_of_bits(uint32_t x) {
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

// Rounds @p kept (the value shifted right by @p shift bits; @p rest the bits shifted out) to
// nearest, ties to even.
static inline uint32_t clmha__round_even(uint32_t kept, uint32_t rest, unsigned shift) {
    uint32_t half = 1u << (shift - 1);
    return kept + (rest > half || (rest == half && (kept & 1u)));
}

static inline uint16_t clmha__f32_to_f16(float f) {
    uint32_t x = clmha__f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN
    // 65520 (0x477ff000) lies halfway between float16's largest, 65504, and 2^16: it and all
    // above round to infinity.
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);
    if (ax >= 0x38800000u) {  // 2^-14 and above: a normal float16
        uint32_t r = ((ax - 0x38000000u) >> 13);  // exponent rebiased from 127 to 15
        return (uint16_t)(sign | clmha__round_even(r, ax & 0x1fffu, 13));  // may carry to inf
    }
    if (ax <= 0x33000000u) return sign;  // up to 2^-25 (a tie with 0): zero
    // A subnormal float16: units of 2^-24. ax's significand m (with its implicit bit) is
    // m 2^(e - 150) = (m >> (126 - e)) units.
    uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    unsigned shift = 126u - (ax >> 23);
    return (uint16_t)(sign | clmha__round_even(m >> shift, m & ((1u << shift) - 1u), shift));
}

static inline float clmha__f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1f) return clmha__f32_of_bits(sign | 0x7f800000u | (m << 13));
    if (e) return clmha__f32_of_bits(sign | ((e + 112u) << 23) | (m << 13));
    float v = (float)m * 0x1p-24f;  // zero or subnormal: exact
    return sign ? -v : v;
}

static inline uint16_t clmha__f32_to_bf16(float f) {
    uint32_t x = clmha__f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet NaN
    return (uint16_t)(clmha__round_even(x >> 16, x & 0xffffu, 16) & 0xffffu);
}

static inline float clmha__bf16_to_f32(uint16_t b) { return clmha__f32_of_bits((uint32_t)b << 16); }

// @p d rounded to float32 (to nearest even); values from FLT_MAX + half an ulp on give
// infinity (a plain conversion of those is undefined behaviour).
static inline float clmha__double_to_float(double d) {
    if (d >= 0x1.ffffffp127) return INFINITY;
    if (d <= -0x1.ffffffp127) return -INFINITY;
    return (float)d;
}

// Bytes per element of @p t.
static inline size_t clmha__dtype_size(clmha_dtype t) {
    return t == CLMHA_DTYPE_F64 ? 8 : t == CLMHA_DTYPE_F32 ? 4 : 2;
}

// PyTorch's name of @p t.
static inline const char *clmha__dtype_name(clmha_dtype t) {
    return t == CLMHA_DTYPE_F64   ? "float64"
           : t == CLMHA_DTYPE_F16 ? "float16"
           : t == CLMHA_DTYPE_BF16 ? "bfloat16"
                                   : "float32";
}

// @p v rounded to the nearest value of @p t (F32 and F64: @p v).
static inline float clmha__dtype_round(clmha_dtype t, float v) {
    if (t == CLMHA_DTYPE_F16) return clmha__f16_to_f32(clmha__f32_to_f16(v));
    if (t == CLMHA_DTYPE_BF16) return clmha__bf16_to_f32(clmha__f32_to_bf16(v));
    return v;
}

#endif
