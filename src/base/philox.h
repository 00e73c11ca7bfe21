// Dropout randomness: Philox4x32-10, the same function as cl/common.cl, so that the CPU
// reference drops exactly the weights the kernels drop.
#ifndef CLMHA_BASE_PHILOX_H
#define CLMHA_BASE_PHILOX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "clmha.h"

// Philox4x32-10, first output word.
static inline uint32_t clmha__philox_word0(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                           uint32_t k0, uint32_t k1) {
    for (int round = 0; round < 10; ++round) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0;
        uint32_t n1 = (uint32_t)p1;
        uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        uint32_t n3 = (uint32_t)p0;
        c0 = n0; c1 = n1; c2 = n2; c3 = n3;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    return c0;
}

// The dropout threshold: weight dropped when word0 < threshold. p in [0, 1).
static inline uint32_t clmha__dropout_threshold(float p) {
    double t = (double)p * 4294967296.0;
    return t >= 4294967295.0 ? 0xFFFFFFFFu : (uint32_t)t;
}

// true when attention weight (bh, i, j) is kept.
static inline bool clmha__dropout_keep(clmha_dropout_rng rng, uint32_t threshold, size_t bh,
                                       size_t i, size_t j) {
    uint32_t w = clmha__philox_word0((uint32_t)j, (uint32_t)i, (uint32_t)bh, (uint32_t)rng.offset,
                                     (uint32_t)rng.seed,
                                     (uint32_t)(rng.seed >> 32) ^ (uint32_t)(rng.offset >> 32));
    return w >= threshold;
}

#endif
