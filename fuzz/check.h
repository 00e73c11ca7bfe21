// What the fuzz targets (fuzz/target_*.c) share: the invariant check and an overflow-checked
// product of sizes. Private to those files.
#ifndef CLMHA_FUZZ_CHECK_H
#define CLMHA_FUZZ_CHECK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

// An invariant of the code under test: print it and stop with SIGILL (libFuzzer and Criterion
// both report that as a crash).
#define CLMHA_FUZZ_CHECK(cond)                                                                \
    do {                                                                                      \
        if (!(cond)) {                                                                        \
            fprintf(stderr, "%s:%d: fuzz invariant failed: %s\n", __FILE__, __LINE__, #cond); \
            __builtin_trap();                                                                 \
        }                                                                                     \
    } while (0)

// true when the product of @p n sizes overflows size_t; else *out is the product.
static inline bool clmha_fuzz_prod_overflows(const size_t *v, size_t n, size_t *out) {
    size_t p = 1;
    for (size_t i = 0; i < n; ++i)
        if (__builtin_mul_overflow(p, v[i], &p)) return true;
    *out = p;
    return false;
}

#endif
