// The checks of a forward call (forward.h): shapes and masks resolved into sizes, the options
// against each other and against the cores (one must run the call), the device buffers or host
// arrays, overlaps; clmha_layer_output_counts(). Nothing here enqueues anything.
#include "base/checked.h"
#include "base/struct_in.h"
#include "cores/core.h"
#include "forward/enqueue.h"
#include "forward/forward.h"
#include "layer/layer.h"
#include "layer/shape.h"

#include <stdio.h>

// ---- sizes and options --------------------------------------------------------------------------

clmha_status clmha__forward_args_in(clmha_context *ctx, clmha_forward_args *in,
                                    const clmha_forward_args **args) {
    char msg[512];
    clmha_status st = CLMHA__STRUCT_IN(clmha_forward_args, in, *args, "args", msg, sizeof msg);
    if (st) return clmha__fail(ctx, st, "%s", msg);
    *args = in;
    return CLMHA_SUCCESS;
}

// Outputs must not overlap each other or an input (as in PyTorch, where an out= tensor must not
// alias an input): the pass writes parts of them while it still reads others. Sizes were
// checked (clmha__check_buffer()), so the byte ranges do not overflow.
// @p elem: bytes per element of the inputs, outputs and float masks (the layer's dtype's).
static size_t mask_elem(clmha_mask_kind kind, size_t elem) {
    return kind == CLMHA_MASK_FLOAT ? elem : clmha__mask_elem(kind);
}

static clmha_status check_aliasing(clmha_context *ctx, const clmha_forward_args *a,
                                   const clmha__dims *d, cl_mem output, size_t output_offset,
                                   cl_mem weights, size_t weights_offset, size_t elem) {
    clmha__span all[7];
    size_t n = 0, outputs;
    all[n++] = clmha__span_of("output", output, output_offset, d->output_count, elem);
    if (a->need_weights) all[n++] = clmha__span_of("weights", weights, weights_offset,
                                            d->weights_count, elem);
    outputs = n;
    all[n++] = clmha__span_of("query", a->query.buffer, a->query.offset, d->query_count, elem);
    if (!d->key_is_query)
        all[n++] = clmha__span_of("key", a->key.buffer, a->key.offset, d->key_count, elem);
    if (!d->value_is_key)
        all[n++] =
            clmha__span_of("value", a->value.buffer, a->value.offset, d->value_count, elem);
    if (d->kpm_kind)
        all[n++] = clmha__span_of("key_padding_mask", a->key_padding_mask.tensor.buffer,
                           a->key_padding_mask.tensor.offset, d->kpm_count,
                           mask_elem(d->kpm_kind, elem));
    if (d->attn_kind)
        all[n++] =
            clmha__span_of("attn_mask", a->attn_mask.tensor.buffer, a->attn_mask.tensor.offset,
                           d->attn_count, mask_elem(d->attn_kind, elem));
    return clmha__check_overlaps(ctx, all, n, outputs);
}

// Resolves the sizes of @p args. A call with kv_attend_only has no key or value: its sizes
// are resolved as if key and value had the query's shape with kdim and vdim features, and
// nothing reads them (key_is_query and value_is_key).
clmha_status clmha__forward_resolve(clmha_layer *layer, const clmha_forward_args *args, clmha__dims *d) {
    char msg[1024];
    clmha_forward_args shaped;
    if (args->kv_cache && args->kv_attend_only) {
        shaped = *args;
        shaped.key = shaped.value = args->query;
        if (args->query.ndim >= 2) {
            shaped.key.shape[args->query.ndim - 1] = layer->desc.kdim;
            shaped.value.shape[args->query.ndim - 1] = layer->desc.vdim;
        }
        args = &shaped;
    }
    clmha_status st = clmha__dims_resolve(&layer->desc, args, d, msg, sizeof msg);
    if (st) return clmha__fail(layer->ctx, st, "%s", msg);
    if (args == &shaped) d->key_is_query = d->value_is_key = true;
    return CLMHA_SUCCESS;
}

// With a bias the output projection reads @p output back (it adds to the bias rows), so the
// output must not be CL_MEM_WRITE_ONLY.
clmha_status clmha__forward_output_readable(clmha_layer *layer, cl_mem output) {
    cl_mem_flags flags = 0;
    clGetMemObjectInfo(output, CL_MEM_FLAGS, sizeof flags, &flags, NULL);
    if (layer->desc.bias && (flags & CL_MEM_WRITE_ONLY))
        return clmha__fail(layer->ctx, CLMHA_INVALID_ARGUMENT,
                           "output buffer is CL_MEM_WRITE_ONLY, but a layer with bias reads it "
                           "back (the output projection adds to the bias rows): create it "
                           "CL_MEM_READ_WRITE");
    return CLMHA_SUCCESS;
}

// The input buffers of a device call: each holds its tensor from its offset on (@p elem: as
// in check_aliasing()).
clmha_status clmha__forward_check_inputs(clmha_layer *layer, const clmha_forward_args *args,
                                        const clmha__dims *d, size_t elem) {
    clmha_context *ctx = layer->ctx;
    clmha_status st;
    if ((st = clmha__check_buffer(ctx, "query", args->query.buffer, args->query.offset,
                                  d->query_count, elem)))
        return st;
    if (!d->key_is_query && (st = clmha__check_buffer(ctx, "key", args->key.buffer,
                                                      args->key.offset, d->key_count, elem)))
        return st;
    if (!d->value_is_key && (st = clmha__check_buffer(ctx, "value", args->value.buffer,
                                               args->value.offset, d->value_count, elem)))
        return st;
    if (d->kpm_kind && (st = clmha__check_buffer(ctx, "key_padding_mask",
                                          args->key_padding_mask.tensor.buffer,
                                          args->key_padding_mask.tensor.offset, d->kpm_count,
                                          mask_elem(d->kpm_kind, elem))))
        return st;
    if (d->attn_kind && (st = clmha__check_buffer(ctx, "attn_mask", args->attn_mask.tensor.buffer,
                                                  args->attn_mask.tensor.offset, d->attn_count,
                                                  mask_elem(d->attn_kind, elem))))
        return st;
    return CLMHA_SUCCESS;
}

// What every call checks, on the device or the host, before its buffers or arrays.
clmha_status clmha__forward_check_call(clmha_layer *layer, const clmha_forward_args *args,
                                  clmha__dims *d) {
    clmha_context *ctx = layer->ctx;
    clmha_status st;
    if (!args->kv_cache && (args->kv_append || args->kv_attend_only))
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "%s is set but kv_cache is NULL: it says how a call uses its cache",
                           args->kv_append ? "kv_append" : "kv_attend_only");
    if (args->kv_attend_only && (args->key.ndim || args->value.ndim))
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "kv_attend_only appends nothing: key and value must be absent "
                           "(ndim 0)");
    if (args->kv_attend_only && args->kv_append)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "kv_attend_only appends nothing: kv_append must be NULL");
    if ((st = clmha__forward_resolve(layer, args, d))) return st;
    if (args->impl != CLMHA_IMPL_AUTO && args->impl != CLMHA_IMPL_FUSED &&
        args->impl != CLMHA_IMPL_UNFUSED)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "impl %d is not CLMHA_IMPL_AUTO, _FUSED or _UNFUSED", (int)args->impl);
    // Some core must run the call: one that refuses it (the options a KV cache call may not
    // take, weights asked by impl of a core without them) fails it here, before anything is
    // allocated.
    clmha__core_call call = {.args = args, .dims = d};
    const clmha__core *core;
    return clmha__core_select(layer, &call, &core, NULL);
}

// Everything a forward call checks before it enqueues anything (forward.h).
clmha_status clmha__forward_validate(clmha_layer *layer, const clmha_forward_args *args,
                             bool on_device, clmha__dims *d) {
    char msg[1024];
    clmha_status st = clmha__forward_check_call(layer, args, d);
    if (st) return st;
    if (on_device) return clmha__forward_check_inputs(layer, args, d, layer->rs);
    if ((st = clmha__check_host_data(d, args, msg, sizeof msg)))
        return clmha__fail(layer->ctx, st, "%s", msg);
    return CLMHA_SUCCESS;
}

// ---- buffers ------------------------------------------------------------------------------------

// The output and weights buffers of a device call (@p elem: as in check_aliasing()).
clmha_status clmha__forward_check_results(clmha_layer *layer, const clmha_forward_args *args,
                                         const clmha__dims *d, cl_mem output,
                                         size_t output_offset, cl_mem weights,
                                         size_t weights_offset, size_t elem) {
    clmha_context *ctx = layer->ctx;
    clmha_status st;
    if ((st = clmha__check_buffer(ctx, "output", output, output_offset, d->output_count, elem)))
        return st;
    if (elem == layer->rs && (st = clmha__forward_output_readable(layer, output))) return st;
    if (args->need_weights && (st = clmha__check_buffer(ctx, "weights", weights, weights_offset,
                                                        d->weights_count, elem)))
        return st;
    if ((st = clmha__check_writable(ctx, "output", output)) ||
        (args->need_weights && (st = clmha__check_writable(ctx, "weights", weights))))
        return st;
    return check_aliasing(ctx, args, d, output, output_offset, weights, weights_offset, elem);
}

clmha_status clmha_layer_output_counts(clmha_layer *layer, const clmha_forward_args *args,
                                       size_t *output_count, size_t *weights_count) {
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_forward_args in;
    clmha_status st = clmha__forward_args_in(layer->ctx, &in, &args);
    if (st) return st;
    clmha__dims d;
    if ((st = clmha__forward_resolve(layer, args, &d))) return st;
    if (output_count) *output_count = d.output_count;
    if (weights_count) *weights_count = d.weights_count;
    return CLMHA_SUCCESS;
}
