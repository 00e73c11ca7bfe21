// What the forward pass (forward.c) offers the host-array path (forward_host.c) and the backward
// pass besides its public functions.
#ifndef CLMHA_FORWARD_FORWARD_H
#define CLMHA_FORWARD_FORWARD_H

#include <stdbool.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"
#include "layer/shape.h"

struct clmha__core_call;

// Where a partial-attention call (clmha_layer_attend()) puts its results instead of the
// output projection's: the head tiles before the merge and the log-sum-exp rows.
typedef struct clmha__partial_out {
    cl_mem heads, lse;
    size_t heads_offset, lse_offset;
    bool appended_keys;  // the call's keys include those of add_bias_kv / add_zero_attn
} clmha__partial_out;

// ---- validate.c ---------------------------------------------------------------------------------

// Resolves the sizes of @p args into @p d. A call with kv_attend_only has no key or value: its
// sizes are resolved as if key and value had the query's shape with kdim and vdim features, and
// nothing reads them (key_is_query and value_is_key).
CLMHA__HIDDEN clmha_status clmha__forward_resolve(clmha_layer *layer,
                                                  const clmha_forward_args *args,
                                                  clmha__dims *d);

// What every call checks, on the device or the host, before its buffers or arrays: the KV
// cache options, the sizes (into @p d), impl, and that a core runs it (clmha__core_select()).
CLMHA__HIDDEN clmha_status clmha__forward_check_call(clmha_layer *layer,
                                                     const clmha_forward_args *args,
                                                     clmha__dims *d);

// The input buffers of a device call: each holds its tensor from its offset on; @p elem: bytes
// per element of the inputs and float masks (the layer's dtype's).
CLMHA__HIDDEN clmha_status clmha__forward_check_inputs(clmha_layer *layer,
                                                       const clmha_forward_args *args,
                                                       const clmha__dims *d, size_t elem);

// The output and weights buffers of a device call (@p elem: as clmha__forward_check_inputs()):
// sizes, flags, and no overlap with each other or an input.
CLMHA__HIDDEN clmha_status clmha__forward_check_results(clmha_layer *layer,
                                                        const clmha_forward_args *args,
                                                        const clmha__dims *d, cl_mem output,
                                                        size_t output_offset, cl_mem weights,
                                                        size_t weights_offset, size_t elem);

// With a bias the output projection reads @p output back (it adds to the bias rows), so the
// output must not be CL_MEM_WRITE_ONLY.
CLMHA__HIDDEN clmha_status clmha__forward_output_readable(clmha_layer *layer, cl_mem output);

// Everything a forward call checks before it enqueues anything: the shapes and masks of
// @p args (resolved into @p d), its impl, and either its device buffers (@p on_device: present,
// of this context, large enough) or its host data pointers. @p args is in this library's layout.
CLMHA__HIDDEN clmha_status clmha__forward_validate(clmha_layer *layer,
                                                   const clmha_forward_args *args,
                                                   bool on_device, clmha__dims *d);

// Reads the caller's args into @p in, this library's layout (base/struct_in.h, docs/abi.md), and
// points *args at it.
CLMHA__HIDDEN clmha_status clmha__forward_args_in(clmha_context *ctx, clmha_forward_args *in,
                                                  const clmha_forward_args **args);

// ---- forward.c ----------------------------------------------------------------------------------

// The rest of a checked call (sizes @p dims, @p call with its KV cache plan): the core, the
// scratch, the saved state, the stages; with @p partial, the head tiles and log-sum-exp rows go
// to the caller's buffers instead of the output projection.
CLMHA__HIDDEN clmha_status clmha__forward_planned(clmha_layer *layer,
                                                  const clmha_forward_args *args,
                                                  const clmha__dims *dims,
                                                  struct clmha__core_call *call,
                                                  const clmha__partial_out *partial,
                                                  cl_mem output, size_t output_offset,
                                                  cl_mem weights, size_t weights_offset,
                                                  cl_uint num_wait, const cl_event *wait_list,
                                                  cl_event *event);

// Stage 7: out = merged · out_proj.weightᵀ + out_proj.bias, @p merged the merged rows
// (layer->proj, or the result tile of a clmha__core::takes_rows core; @p fill: the bias rows
// are written here first, else that core wrote them).
CLMHA__HIDDEN clmha_status clmha__forward_out_project(clmha_layer *l, const clmha__dims *d,
                                                      cl_mem merged, cl_mem out,
                                                      size_t out_off, bool fill);

// Returns @p st; when it is a failure, first drops the layer's stage times: they are those of
// the last forward call, so a failed call drops the earlier call's (clmha_layer_stage_times()
// then says that the last call failed).
CLMHA__HIDDEN clmha_status clmha__forward_times_dropped(clmha_layer *layer, clmha_status st);

#endif
