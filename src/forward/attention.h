// Attention as a function: what the device form (attention.c) offers the host-array form
// (attention_host.c).
#ifndef CLMHA_FORWARD_ATTENTION_H
#define CLMHA_FORWARD_ATTENTION_H

#include <stdbool.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/attention_shape.h"
#include "layer/layer.h"

// Where a call's results go (NULL lse or weights: not asked); offsets in floats.
typedef struct clmha__attention_out {
    cl_mem output, lse, weights;
    size_t output_offset, lse_offset, weights_offset;
} clmha__attention_out;

// Reads the caller's @p args into @p in (this library's layout), resolves it into @p d, and
// refuses what the cores cannot run: D_v ≠ D, and the log-sum-exp with the weights (@p lse,
// @p weights: asked for).
CLMHA__HIDDEN clmha_status clmha__attention_check_args(clmha_context *ctx,
                                                       const clmha_attention_args *args,
                                                       clmha_attention_args *in,
                                                       clmha__attention_dims *d, bool lse,
                                                       bool weights);

// Enqueues checked call @p a (sizes @p d, buffers checked) on bare layer @p layer (the
// attention cache locked): asks the dispatch for the core and reserves the scratch (nothing is
// enqueued before those succeed), then waits for @p wait_list, stages the inputs, runs the core,
// writes the results to @p out; the completion event in @p event.
CLMHA__HIDDEN clmha_status clmha__attention_enqueue(clmha_layer *layer,
                                                    const clmha_attention_args *a,
                                                    const clmha__attention_dims *d,
                                                    const clmha__attention_out *out,
                                                    cl_uint num_wait, const cl_event *wait_list,
                                                    cl_event *event);

#endif
