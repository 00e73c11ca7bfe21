// The fused core's backward pass (src/cores/fused_backward.c, kernels
// cl/cores/fused_backward.cl): the hooks the fused core (src/cores/fused.c) hands on, with the
// place in its state where the backward pass keeps its own.
#ifndef CLMHA_CORES_FUSED_BACKWARD_H
#define CLMHA_CORES_FUSED_BACKWARD_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"

struct clmha__backward_call;
struct clmha__core_answer;

// The fused backward pass's per-layer state (its kernels, tile and scratch), kept in the fused
// core's state and freed with it.
typedef struct clmha__fused_backward clmha__fused_backward;

// The fused core's backward_supports hook (*@p slot: the state, made on first use): it runs
// the call when the forward call saved the log-sum-exp rows (it ran the fused core), the call
// gives no weights gradient and asks for no mask gradient, and the backward kernels build on
// the device and (unless the products run in GEMMs: clmha__fused_backward_run()) stay within
// its loop limit. Past the loop limit, or when the forward call fell back, a call that asked
// for it (CLMHA_IMPL_FUSED) falls back; it refuses the call's other reasons.
CLMHA__HIDDEN clmha_status clmha__fused_backward_supports(clmha__fused_backward **slot,
                                                          clmha_layer *layer,
                                                          const struct clmha__backward_call *call,
                                                          struct clmha__core_answer *answer);

// The fused core's backward hook (*@p slot: the state, made on first use): Drow, then either dk
// and dv, then dq (two tiled kernels), or, where the GEMMs run in the host BLAS (or
// CLMHA_FUSED_BACKWARD=gemms), the products in GEMMs over blocks of query rows with an
// elementwise kernel between them.
CLMHA__HIDDEN clmha_status clmha__fused_backward_run(clmha__fused_backward **slot,
                                                     clmha_layer *layer,
                                                     struct clmha__backward_call *call);

// Frees @p b (NULL is ignored).
CLMHA__HIDDEN void clmha__fused_backward_release(clmha__fused_backward *b);

// The rows one work-group of the kernels of @p b covers (work-group size times rows per
// work-item; 0: NULL or not built).
CLMHA__HIDDEN size_t clmha__fused_backward_rows(const clmha__fused_backward *b);

// Test hook: the floats of each block buffer of the fused backward's GEMM variant (0: its
// default), so that small shapes run in several blocks of rows and of planes.
CLMHA__HIDDEN void clmha__test_set_fused_backward_block(size_t floats);

#endif
