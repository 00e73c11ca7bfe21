// The GEMMs of a context: every matrix product of the forward pass, the cores and the backward
// goes through clmha__gemm(), which enqueues it on the context's queue either as CLBlast's
// OpenCL kernels or, on CPU devices that run native kernels, as a call into the host BLAS
// (src/device/host_blas.h) through clEnqueueNativeKernel: in queue order, after the commands
// before it and before those after it, on the device buffers themselves, with no host
// synchronisation. The choice is per context (clmha_context_set_gemm(), CLMHA_GEMM).
#ifndef CLMHA_CONTEXT_GEMM_H
#define CLMHA_CONTEXT_GEMM_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"

// Row-major C (m, n) = alpha·op(A) (m, k)·op(B) (k, n) + beta·C, op(X) = Xᵀ when its flag is
// set, @p batch times (0 counts as 1) with the operands @p *_stride elements further each time
// (a stride of 0 reuses the operand). Offsets and leading dimensions in elements: floats, or
// doubles with f64 (a float64 layer's products: on the host path where the process has a
// dgemm, clmha__host_dgemm_get(), else CLBlast's DGEMM). alpha and beta are rounded to float for a float product.
typedef struct clmha__gemm_op {
    bool ta, tb;
    bool f64;
    size_t m, n, k;
    double alpha, beta;
    cl_mem a;
    size_t a_off, lda, a_stride;
    cl_mem b;
    size_t b_off, ldb, b_stride;
    cl_mem c;
    size_t c_off, ldc, c_stride;
    size_t batch;
    // Optional (NULL): a row of n elements at bias_off added to every row of C: C =
    // alpha·op(A)·op(B) + bias, on the host path only (clmha__gemm_adds_bias()), which adds it
    // in the thread that wrote the row's columns.
    cl_mem bias;
    size_t bias_off;
    // Optional (NULL): B's buffer packed for the host path (a layer's projection weight,
    // src/device/packed_weight.h), which reads it instead of B where it fits
    // (clmha__host_blas_sgemm_packed()). It must hold what B's buffer holds when the product runs.
    const struct clmha__packed_weight *b_packed;
} clmha__gemm_op;

// Whether clmha__gemm() takes @p op with a bias (clmha__gemm_op::bias): a product on the host
// path, with beta 0 and batch 1. Otherwise the caller writes the bias rows into C first and
// runs the product with beta 1.
CLMHA__HIDDEN bool clmha__gemm_adds_bias(const clmha_context *ctx, const clmha__gemm_op *op);

// Enqueues @p op on the context's queue; @p what names it in an error message.
CLMHA__HIDDEN clmha_status clmha__gemm(clmha_context *ctx, const char *what,
                                       const clmha__gemm_op *op);

// Decides the context's GEMM path at creation: from CLMHA_GEMM (auto, clblast or host; unset
// means auto), the device and the host BLAS. Never fails: an impossible "host" is noted and
// CLBlast used.
CLMHA__HIDDEN void clmha__gemm_init(clmha_context *ctx);

#endif
