// The host-array forward pass (clmha_layer_forward_host(), clmha_layer_forward_host_f64()): the
// caller's arrays are copied into the layer's staging buffers (staging.c), the device call runs
// (forward.c), the queue is waited for, and only then are the results read into the caller's
// arrays, so that a failed call writes none of them.
#include "base/half.h"
#include "device/held.h"
#include "errors/errors.h"
#include "forward/enqueue.h"
#include "forward/forward.h"
#include "forward/staging.h"
#include "layer/layer.h"
#include "layer/shape.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Reads @p count results of the layer's dtype from @p buf into floats, or doubles with @p f64
// (a blocking read): widened exactly, or a float64 layer's rounded to float.
static clmha_status read_values(clmha_layer *layer, cl_mem buf, size_t count, void *out,
                                bool f64) {
    clmha_context *ctx = layer->ctx;
    clmha_dtype t = layer->desc.dtype;
    size_t elem = clmha__dtype_size(t);
    cl_int err;
    if (elem == (f64 ? 8 : 4)) {
        err = clEnqueueReadBuffer(ctx->queue, buf, CL_TRUE, 0, count * elem, out, 0, NULL, NULL);
    } else {
        void *conv = malloc((count ? count : 1) * elem);
        if (!conv) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory (results)");
        err = clEnqueueReadBuffer(ctx->queue, buf, CL_TRUE, 0, count * elem, conv, 0, NULL, NULL);
        for (size_t i = 0; err == CL_SUCCESS && i < count; ++i) {
            if (t == CLMHA_DTYPE_F64) {
                ((float *)out)[i] = clmha__double_to_float(((double *)conv)[i]);
                continue;
            }
            uint16_t h = elem == 2 ? ((uint16_t *)conv)[i] : 0;
            float x = t == CLMHA_DTYPE_F32   ? ((float *)conv)[i]
                      : t == CLMHA_DTYPE_F16 ? clmha__f16_to_f32(h)
                                             : clmha__bf16_to_f32(h);
            if (f64) ((double *)out)[i] = x;
            else ((float *)out)[i] = x;
        }
        free(conv);
    }
    if (err != CL_SUCCESS) return clmha__cl_fail(ctx, err, "clEnqueueReadBuffer(result)");
    return CLMHA_SUCCESS;
}

// The output arrays of a host call, checked against the call's dims @p d.
static clmha_status check_outputs(clmha_layer *layer, const clmha_forward_args *args,
                                  const clmha__dims *d, const void *output, size_t output_count,
                                  const void *weights, size_t weights_count) {
    clmha_context *ctx = layer->ctx;
    if (!output) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "output is NULL");
    if (output_count != d->output_count)
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                           "output holds %zu values, the result has %zu (N %zu, L %zu, E %zu)",
                           output_count, d->output_count, d->n, d->l, d->e);
    if (args->need_weights && !weights)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "need_weights is set but weights is NULL");
    if (weights_count != d->weights_count)
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                           "weights_count is %zu, the call returns %zu weights (need_weights %d, "
                           "N %zu, %sL %zu, S' %zu)",
                           weights_count, d->weights_count, (int)args->need_weights, d->n,
                           args->per_head_weights ? "H, " : "", d->l, d->s_padded);
    return CLMHA_SUCCESS;
}


// The host-array call, on float arrays, or double arrays with @p f64.
static clmha_status forward_host(clmha_layer *layer, const clmha_forward_args *args,
                                 void *output, size_t output_count, void *weights,
                                 size_t weights_count, bool f64) {
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_context *ctx = layer->ctx;
    clmha_forward_args in;
    clmha_status st = clmha__forward_args_in(ctx, &in, &args);
    if (st) return st;
    clmha__dims d;
    if ((st = clmha__forward_validate(layer, args, false, &d))) return st;
    if ((st = check_outputs(layer, args, &d, output, output_count, weights, weights_count)))
        return st;

    clmha_forward_args dev = *args;
    size_t elem = clmha__dtype_size(layer->desc.dtype);
    cl_mem out = NULL, w = NULL;
    if ((st = clmha__host_upload_inputs(layer, &d, f64, &dev))) goto fail;
    // With a bias, the output GEMM reads the bias rows back (beta = 1): the slot is read-write.
    if ((st = clmha__host_room(layer, CLMHA__HOST_OUTPUT, "output", d.output_count * elem, &out)))
        goto fail;
    if (args->need_weights &&
        (st = clmha__host_room(layer, CLMHA__HOST_WEIGHTS, "weights", d.weights_count * elem,
                               &w)))
        goto fail;
    if ((st = clmha_layer_forward(layer, &dev, out, 0, w, 0, 0, NULL, NULL))) goto fail;
    // Read into the caller's arrays only once the whole pass has run.
    cl_int err = clFinish(ctx->queue);
    if (err != CL_SUCCESS) {
        st = clmha__cl_fail(ctx, err, "clFinish");
        goto fail;
    }
    // The weights through a host copy, so that a failed read leaves both arrays as they were.
    size_t host_elem = f64 ? sizeof(double) : sizeof(float);
    void *wcopy = NULL;
    if (args->need_weights &&
        !(wcopy = malloc((d.weights_count ? d.weights_count : 1) * host_elem))) {
        st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory (weights)");
        goto fail;
    }
    if ((wcopy && (st = read_values(layer, w, d.weights_count, wcopy, f64))) ||
        (st = read_values(layer, out, d.output_count, output, f64))) {
        free(wcopy);
        goto fail;
    }
    if (wcopy) memcpy(weights, wcopy, d.weights_count * host_elem);
    free(wcopy);
    return CLMHA_SUCCESS;
fail:
    clmha__host_drop(layer);
    return st;
}

clmha_status clmha_layer_forward_host(clmha_layer *layer, const clmha_forward_args *args,
                                      float *output, size_t output_count, float *weights,
                                      size_t weights_count) {
    return clmha__forward_times_dropped(layer, forward_host(layer, args, output, output_count,
                                                            weights, weights_count, false));
}

clmha_status clmha_layer_forward_host_f64(clmha_layer *layer, const clmha_forward_args *args,
                                          double *output, size_t output_count, double *weights,
                                          size_t weights_count) {
    return clmha__forward_times_dropped(layer, forward_host(layer, args, output, output_count,
                                                            weights, weights_count, true));
}
