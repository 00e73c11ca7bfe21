// Fuzz target: .npy files, clmha__npy_parse() (see targets.h).
#include "targets.h"

#include "cli/npy.h"

#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

// ---- .npy ------------------------------------------------------------------------------------

int clmha_fuzz_npy(const uint8_t *data, size_t size) {
    static const char *const name = "fuzz.npy";
    char msg[512] = "";
    clmha__npy a;
    clmha_status st = clmha__npy_parse(data, size, name, &a, msg, sizeof msg);
    if (st != CLMHA_SUCCESS) {
        CLMHA_FUZZ_CHECK(st == CLMHA_INVALID_FILE || st == CLMHA_SIZE_OVERFLOW ||
                         st == CLMHA_OUT_OF_MEMORY);
        CLMHA_FUZZ_CHECK(strncmp(msg, name, strlen(name)) == 0);
        CLMHA_FUZZ_CHECK(!a.f32 && !a.u8 && a.count == 0 && a.ndim == 0);
        return st;
    }
    CLMHA_FUZZ_CHECK(a.ndim <= CLMHA__NPY_MAX_DIMS);
    size_t count = 0;
    bool zero = false;
    for (size_t k = 0; k < a.ndim; ++k) zero = zero || a.shape[k] == 0;
    if (!zero) CLMHA_FUZZ_CHECK(!clmha_fuzz_prod_overflows(a.shape, a.ndim, &count));
    CLMHA_FUZZ_CHECK(a.count == count);
    CLMHA_FUZZ_CHECK(strlen(a.dtype) >= 2 && strlen(a.dtype) <= 3);
    // The data section is in the input: count * itemsize <= size.
    CLMHA_FUZZ_CHECK(a.count <= size);
    if (a.kind == CLMHA__NPY_FLOAT) {
        CLMHA_FUZZ_CHECK(a.f32 && !a.u8);
        CLMHA_FUZZ_CHECK(a.count * 4 <= size);
        volatile float sink = 0.0f;  // reads every element: ASan checks the allocation size
        for (size_t i = 0; i < a.count; ++i) sink += a.f32[i];
        (void)sink;
    } else {
        CLMHA_FUZZ_CHECK(a.kind == CLMHA__NPY_BOOL);
        CLMHA_FUZZ_CHECK(a.u8 && !a.f32);
        volatile unsigned sink = 0;
        for (size_t i = 0; i < a.count; ++i) sink += a.u8[i];
        (void)sink;
    }
    clmha__npy_free(&a);
    CLMHA_FUZZ_CHECK(!a.f32 && !a.u8 && a.count == 0);
    return CLMHA_SUCCESS;
}
