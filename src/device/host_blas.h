// A host BLAS library (oneDNN, OpenBLAS, BLIS or MKL), loaded at run time with dlopen, for the
// GEMMs of CPU devices that run native kernels (src/context/gemm.c calls it from
// clEnqueueNativeKernel, in queue order).
//
// Why: on CPU drivers the matrix products are most of a forward pass, and CLBlast's OpenCL
// kernels compiled by a CPU driver reach a fraction of what an optimised CPU BLAS does (PoCL 3.1
// on a 2-core AVX-512 Xeon: sgemm 1024³ ~16 GFLOP/s with CLBlast's defaults, ~63 tuned; oneDNN's
// dnnl_sgemm ~270, OpenBLAS ~235 when it detects the CPU). Loading at run time keeps the library
// free of a link dependency: without a BLAS the GEMMs stay on CLBlast.
//
// Which library: the environment variable CLMHA_HOST_BLAS names a file (a path or a soname) to
// load instead of the search, or "none" to load nothing. The search tries, in order, oneDNN
// (libdnnl.so.3, .2: its dnnl_sgemm picks its kernel from the CPU's features at run time),
// OpenBLAS (libopenblas.so.0), BLIS (libblis.so.4, .3) and MKL (libmkl_rt.so.2, .so): the first
// that loads and has its GEMM symbol is used, for the whole process. Float64 layers' products
// take cblas_dgemm (clmha__host_dgemm_get()), loaded only when the first one runs.
#ifndef CLMHA_DEVICE_HOST_BLAS_H
#define CLMHA_DEVICE_HOST_BLAS_H

#include <stdbool.h>
#include <stddef.h>

#include "base/defs.h"
#include "device/packed_weight.h"

// Row-major C (m, n) = alpha·op(A)·op(B) + beta·C, op(X) = Xᵀ when its flag is set; leading
// dimensions in floats. Sizes must be at most clmha__host_blas::max_dim.
typedef void (*clmha__host_sgemm_fn)(const void *impl, bool ta, bool tb, size_t m, size_t n,
                                     size_t k, float alpha, const float *a, size_t lda,
                                     const float *b, size_t ldb, float beta, float *c,
                                     size_t ldc);

// The same in double precision.
typedef void (*clmha__host_dgemm_fn)(const void *impl, bool ta, bool tb, size_t m, size_t n,
                                     size_t k, double alpha, const double *a, size_t lda,
                                     const double *b, size_t ldb, double beta, double *c,
                                     size_t ldc);

// The loaded library.
typedef struct clmha__host_blas {
    char name[16];          // "oneDNN", "OpenBLAS", "BLIS", "MKL"
    char file[128];         // what was loaded (the soname or the CLMHA_HOST_BLAS value)
    char detail[160];       // version and kernel where the library says, e.g. "2.6.3" or
                            // "0.3.21, kernels for SkylakeX"
    char warning[240];      // "" or why it is slower than it could be (OpenBLAS that took its
                            // kernels for an older CPU: set OPENBLAS_CORETYPE)
    size_t max_dim;         // the largest m, n, k and leading dimension its interface takes
    clmha__host_sgemm_fn sgemm;
    const void *impl;       // the library's entry point, for sgemm
} clmha__host_blas;

// The dgemm of float64 layers' products.
typedef struct clmha__host_dgemm {
    char name[16];  // "OpenBLAS", "BLIS", "MKL", "CBLAS"
    clmha__host_dgemm_fn dgemm;
    const void *impl;
} clmha__host_dgemm;

// The process's host BLAS, loaded on the first call (thread-safe), or NULL when none loads (or
// CLMHA_HOST_BLAS is "none"). @p why (may be NULL) receives "" or, when NULL is returned, what
// was tried.
CLMHA__HIDDEN const clmha__host_blas *clmha__host_blas_get(const char **why);

// A batched product: item i is C_i = alpha·op(A_i)·op(B_i) + beta·C_i with X_i = x + i·x_stride.
typedef struct clmha__host_batch {
    bool ta, tb;
    size_t m, n, k, batch;
    float alpha, beta;
    const float *a, *b;
    float *c;
    size_t lda, ldb, ldc, a_stride, b_stride, c_stride;
    const float *bias;  // optional (NULL): n floats added to every row of each C_i after it
} clmha__host_batch;

// Runs @p p's items in @p blas, in queue order from a driver's native kernel. Under oneDNN: a
// product small in all (a decode step's projections) in one OpenMP thread, since waking other
// threads from a driver's worker thread costs more than a second core gives there; small items
// of a larger batch (per-head products) shared out among a team of the host threads
// (device/host_pool.h, as many as oneDNN's OpenMP threads), each item in one thread; the
// columns of others split among the team, each thread's slice in one thread
// (oneDNN splits a product of few rows poorly: 1.5x at 128 rows); the rows of narrow ones
// (fewer than 64 columns a thread, 64 rows or more a thread) split likewise; the rest (other
// libraries, small narrow products) in turn, each over the library's threads (docs/design.md,
// "Where the GEMMs run"). The splits depend only on the team's size, so results repeat bit for bit.
CLMHA__HIDDEN void clmha__host_blas_sgemm_batch(const clmha__host_blas *blas,
                                               const clmha__host_batch *p);

// Runs @p p from @p w's panels instead (its op(B) = rows [first, first + n) of the weight,
// transposed: p->b is not read) and returns true, or returns false, having done nothing, where
// they do not apply: not oneDNN with its OpenMP runtime (whose thread count sizes the team of
// host threads that shares the columns, one thread per slice, as the column split above), a
// batch, ta, alpha other than 1, beta other than 0 or 1, more than 1024 rows (where oneDNN's
// own packing pays for itself), or a product the panels do not fit
// (clmha__packed_weight_fits()). Columns split in multiples of 32, fixed by the team's size:
// results repeat bit for bit.
CLMHA__HIDDEN bool clmha__host_blas_sgemm_packed(const clmha__host_blas *blas,
                                                 const clmha__host_batch *p,
                                                 const clmha__packed_weight *w, size_t first);

// The size of the team of host threads for a native kernel of @p blas: oneDNN's OpenMP thread
// count (1 or more), or 0 where @p blas is another library or the OpenMP runtime was not found
// (no team to run clmha__host_blas_team_run() over).
CLMHA__HIDDEN size_t clmha__host_blas_team(const clmha__host_blas *blas);

// Runs @p fn(@p arg, t, team) once for each member t of a team of the host threads
// (device/host_pool.h; in parallel, a team of 1 in the calling thread; oneDNN's products in fn
// keep to their member's thread) and returns when all have; the team has at most @p most
// members (what the caller made room for; the calling thread's clmha__host_blas_team() may
// differ from the one it had when it planned), at most clmha__host_blas_team() and at least 1.
CLMHA__HIDDEN void clmha__host_blas_team_run(const clmha__host_blas *blas, size_t most,
                                             void (*fn)(void *arg, size_t t, size_t team),
                                             void *arg);

// The process's dgemm, loaded on the first call (thread-safe): cblas_dgemm of the
// CLMHA_HOST_BLAS library, else of the first of OpenBLAS, BLIS and MKL (the search above; oneDNN
// has no dgemm) that loads; NULL without one, or with CLMHA_HOST_BLAS "none". Loaded apart from
// the sgemm, so that processes without float64 layers never load a second BLAS.
CLMHA__HIDDEN const clmha__host_dgemm *clmha__host_dgemm_get(void);

#endif
