// ALiBi's default slopes (Press et al., "Train Short, Test Long", 2022): the geometric sequence
// 2^(-8/H), 2^(-16/H), ... for H a power of two; for other H, those of the largest power of two
// P below H, then every other slope of 2P heads (the odd-numbered ones, which interleave with
// the first P), until there are H.
#include "layer/shape.h"

#include "errors/errors.h"

#include <math.h>

// Slope h (from 0) of the power-of-two sequence of @p p heads: 2^(-8(h+1)/p).
static double power_of_two_slope(size_t p, size_t h) {
    return exp2(-8.0 * (double)(h + 1) / (double)p);
}

double clmha__alibi_slope(size_t heads, size_t h) {
    size_t p = 1;  // the largest power of two not above heads
    while (p * 2 <= heads) p *= 2;
    return h < p ? power_of_two_slope(p, h) : power_of_two_slope(2 * p, 2 * (h - p));
}

clmha_status clmha_alibi_slopes(size_t heads, float *out) {
    if (!out || heads == 0)
        return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "%s",
                           out ? "heads must be at least 1" : "out is NULL");
    for (size_t h = 0; h < heads; ++h) out[h] = (float)clmha__alibi_slope(heads, h);
    return CLMHA_SUCCESS;
}
