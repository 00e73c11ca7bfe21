// A layer's projection weight packed once for the host path's products (src/context/gemm.c),
// where the host BLAS would pack it again in every call.
//
// Why: a forward's projections multiply the rows by a weight W (rows, k) as C = A·Wᵀ. A BLAS
// packs op(B) = Wᵀ into panels each call; with few rows (N 1, L 128: 128 × 1536 × 512) that
// copy of the whole weight is a large share of the product. Packed once, when the layer's
// parameter is set, the product reads the panels directly: at 128 rows 1.08-1.18× oneDNN 2.6's
// speed on 2 cores of an AMD EPYC (Zen 4), docs/design.md ("Packed weights").
//
// Layout: W's rows in panels of 32, each panel k × 32 floats, k-major (for each k, the 32 rows'
// values side by side), rows past W's end zero. The micro-kernel broadcasts 6 rows of A and
// multiplies them into the 32 columns held in two AVX-512 registers, over blocks of 128 k; each
// element of C sums a block's products in k order in float32 (fused multiply-adds) from zero,
// then adds that to its value (after the first block: the bias, and C when accumulating).
//
// Only on x86-64 CPUs with AVX-512 (F) compiled by GCC or Clang: elsewhere
// clmha__packed_weight_new() returns NULL and the products stay in the host BLAS.
#ifndef CLMHA_DEVICE_PACKED_WEIGHT_H
#define CLMHA_DEVICE_PACKED_WEIGHT_H

#include <stdbool.h>
#include <stddef.h>

#include "base/defs.h"

// The rows of the panels (C's columns per micro-kernel).
#define CLMHA__PACKED_PANEL 32

typedef struct clmha__packed_weight {
    size_t rows, k;  // W (rows, k), row-major
    float *panels;   // ceil(rows / 32) panels of k × 32 floats
} clmha__packed_weight;

// A zero weight (rows, k) (what a layer's new parameter buffer holds), or NULL where this CPU
// or compiler has no kernel for it, or the host memory is short.
CLMHA__HIDDEN clmha__packed_weight *clmha__packed_weight_new(size_t rows, size_t k);

CLMHA__HIDDEN void clmha__packed_weight_free(clmha__packed_weight *w);

// Writes rows [first, first + count) of W from @p src (count rows of k floats, row-major).
CLMHA__HIDDEN void clmha__packed_weight_write(clmha__packed_weight *w, size_t first,
                                              size_t count, const float *src);

// Whether a product with op(B) = rows [first, first + n) of W, transposed, and inner size @p k
// can read the panels: @p first a multiple of 32, the rows inside W, @p k its width.
CLMHA__HIDDEN bool clmha__packed_weight_fits(const clmha__packed_weight *w, size_t first,
                                             size_t n, size_t k);

// Columns [c0, c1) of C (m, n) = A (m, k)·W[first .. first + n)ᵀ + bias (a row of n floats; may
// be NULL) + C when @p accumulate (else C's old values are not read). @p c0 a multiple of 32;
// the product must fit (clmha__packed_weight_fits()). Leading dimensions in floats.
CLMHA__HIDDEN void clmha__packed_weight_gemm(const clmha__packed_weight *w, size_t first,
                                             size_t m, size_t n, const float *a, size_t lda,
                                             float *c, size_t ldc, const float *bias,
                                             bool accumulate, size_t c0, size_t c1);

#endif
