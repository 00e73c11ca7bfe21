// Checks and enqueue helpers shared by the forward pass (forward.c) and the backward pass
// (src/backward/): the buffers, wait lists and overlaps a call is given, the head reshapes'
// launch and the projection GEMM (host arrays go through the layer's staging buffers: staging.h).
#ifndef CLMHA_FORWARD_ENQUEUE_H
#define CLMHA_FORWARD_ENQUEUE_H

#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "cores/kernel_args.h"
#include "layer/layer.h"

// Checks that @p buf is a buffer (not an image) of the context holding @p count elements of
// @p elem bytes after @p offset elements (@p name names it in the message).
CLMHA__HIDDEN clmha_status clmha__check_buffer(clmha_context *ctx, const char *name, cl_mem buf,
                                               size_t offset, size_t count, size_t elem);

// Bytes per element of a mask of @p kind: 4 for float masks, 1 for boolean ones.
CLMHA__HIDDEN size_t clmha__mask_elem(clmha_mask_kind kind);

// Checks that output buffer @p buf may be written by kernels (not CL_MEM_READ_ONLY).
CLMHA__HIDDEN clmha_status clmha__check_writable(clmha_context *ctx, const char *name,
                                                 cl_mem buf);

// Checks that @p num_wait and @p wait_list agree and that the list holds valid events of this
// context, none of which has failed.
CLMHA__HIDDEN clmha_status clmha__check_wait_list(clmha_context *ctx, cl_uint num_wait,
                                                  const cl_event *wait_list);

// Makes the work enqueued next wait for @p wait_list (a barrier; nothing when it is empty).
CLMHA__HIDDEN clmha_status clmha__enqueue_wait(clmha_context *ctx, cl_uint num_wait,
                                               const cl_event *wait_list);

// Stores in *event (when not NULL) a new event that completes with the work enqueued so far.
CLMHA__HIDDEN clmha_status clmha__enqueue_event(clmha_context *ctx, cl_event *event);

// The bytes [begin, end) of a tensor argument in the buffer that holds them (a sub-buffer's
// parent: its sub-buffers alias it).
typedef struct clmha__span {
    const char *name;
    cl_mem root;
    size_t begin, end;
} clmha__span;

// The span of @p count elements of @p elem bytes at element @p offset of @p buf.
CLMHA__HIDDEN clmha__span clmha__span_of(const char *name, cl_mem buf, size_t offset,
                                         size_t count, size_t elem);

// Fails when one of the first @p outputs spans of @p all overlaps any other span: an output
// must not alias another output or an input (sizes checked, so the ranges do not overflow).
CLMHA__HIDDEN clmha_status clmha__check_overlaps(clmha_context *ctx, const clmha__span *all,
                                                 size_t n, size_t outputs);

// Enqueues split_heads or merge_heads (@p k, a kernel of cl/heads.cl) over @p planes
// (batch·head) x @p seq rows of head_dim floats, in the mapping its program was built with.
CLMHA__HIDDEN clmha_status clmha__launch_heads(clmha_layer *l, cl_kernel k, const char *name,
                                               size_t planes, size_t seq, size_t wg,
                                               const clmha__arg *args, cl_uint nargs);

// Row-major C (m, n) = A (m, k) · W (n, k)ᵀ + beta·C: the shape of every projection, in the
// layer's elements (floats, or doubles for a float64 layer).
CLMHA__HIDDEN clmha_status clmha__gemm_nt(clmha_layer *l, const char *what, size_t m,
                                          size_t n, size_t k, cl_mem a, size_t a_off, size_t lda,
                                          cl_mem w, size_t w_off, size_t ldw, double beta,
                                          cl_mem c, size_t c_off, size_t ldc);

// The same with beta 0 and @p bias (n elements, e.g. out_proj.bias) added to every row of C:
// C = A·Wᵀ + bias. On the host path the product adds it (clmha__gemm_op::bias); else kernel
// fill_rows writes it into C's rows (ldc = n) and the product runs with beta 1.
CLMHA__HIDDEN clmha_status clmha__gemm_nt_bias(clmha_layer *l, const char *what, size_t m,
                                               size_t n, size_t k, cl_mem a, size_t a_off,
                                               size_t lda, cl_mem w, size_t w_off, size_t ldw,
                                               cl_mem bias, cl_mem c, size_t c_off, size_t ldc);

#endif
