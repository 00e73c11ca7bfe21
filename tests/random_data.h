// Deterministic random test data shared by the randomised suites: splitmix64 numbers and
// arrays of uniform or normal floats. Header-only (static functions); needs Criterion.
#ifndef CLMHA_TESTS_RANDOM_DATA_H
#define CLMHA_TESTS_RANDOM_DATA_H

#include <criterion/criterion.h>

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct prng {
    uint64_t state;
} prng;

static inline uint64_t prng_next(prng *r) {
    uint64_t z = (r->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Uniform in [0, 1).
static inline double prng_uniform(prng *r) { return (double)(prng_next(r) >> 11) * 0x1.0p-53; }

// Uniform integer in [lo, hi].
static inline size_t prng_range(prng *r, size_t lo, size_t hi) {
    return lo + (size_t)(prng_next(r) % (uint64_t)(hi - lo + 1));
}

static inline bool prng_bool(prng *r) { return prng_next(r) >> 63; }

// Standard normal (Box-Muller).
static inline double prng_normal(prng *r) {
    double u1 = 1.0 - prng_uniform(r);  // (0, 1]
    double u2 = prng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

// malloc'd room for @p count floats (at least one); fails the test when out of memory.
static inline float *alloc_floats(size_t count) {
    float *p = malloc((count ? count : 1) * sizeof *p);
    cr_assert_not_null(p, "out of memory");
    return p;
}

// @p count floats uniform in [-bound, bound).
static inline float *uniform_floats(prng *r, size_t count, double bound) {
    float *p = alloc_floats(count);
    for (size_t i = 0; i < count; ++i) p[i] = (float)((2.0 * prng_uniform(r) - 1.0) * bound);
    return p;
}

// @p count standard normal floats.
static inline float *normal_floats(prng *r, size_t count) {
    float *p = alloc_floats(count);
    for (size_t i = 0; i < count; ++i) p[i] = (float)prng_normal(r);
    return p;
}

#endif
