// Arithmetic on sizes that reports overflow instead of wrapping.
#ifndef CLMHA_BASE_CHECKED_H
#define CLMHA_BASE_CHECKED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

// *out = a * b; false when the product overflows size_t.
static inline bool clmha__mul(size_t a, size_t b, size_t *out) {
    if (a != 0 && b > SIZE_MAX / a) return false;
    *out = a * b;
    return true;
}

// *out = a * b * c; false when the product overflows size_t.
static inline bool clmha__mul3(size_t a, size_t b, size_t c, size_t *out) {
    size_t ab;
    return clmha__mul(a, b, &ab) && clmha__mul(ab, c, out);
}

// *out = a + b; false when the sum overflows size_t.
static inline bool clmha__add(size_t a, size_t b, size_t *out) {
    if (b > SIZE_MAX - a) return false;
    *out = a + b;
    return true;
}

#endif
