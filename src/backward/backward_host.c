// The host-array backward pass (clmha_layer_backward_host()): uploads, clmha_layer_backward(),
// then downloads, like clmha_layer_forward_host() for the forward pass.
#include "backward/backward.h"

#include "base/struct_in.h"
#include "device/held.h"
#include "forward/enqueue.h"

#include <string.h>

// The device buffers of one call: inputs, masks, grad_output, grad_weights, then one per
// gradient asked for.
enum { B_QUERY, B_KEY, B_VALUE, B_KPM, B_ATTN, B_GRAD_OUT, B_GRAD_W, B_FIXED };
#define B_MAX (B_FIXED + 16)

static clmha_status backward_host(clmha_layer *layer, const clmha_backward_args *args) {
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_context *ctx = layer->ctx;
    clmha_backward_args a;
    char msg[512];
    clmha_status st = CLMHA__STRUCT_IN(clmha_backward_args, &a, args, "args", msg, sizeof msg);
    if (st) return clmha__fail(ctx, st, "%s", msg);
    clmha_forward_args f;
    clmha__dims d;
    if ((st = clmha__backward_resolve(layer, &a, &f, &d, false))) return st;

    cl_mem bufs[B_MAX] = {NULL};
    int count = clmha__backward_grad_count();
    clmha_forward_args dev = f;
    clmha_backward_args b = a;
    b.forward = &dev;
    if ((st = clmha__upload(ctx, "query upload", f.query.data, d.query_count, 4,
                            &bufs[B_QUERY])))
        goto done;
    dev.query.buffer = bufs[B_QUERY], dev.query.offset = 0;
    if (!d.key_is_query) {
        if ((st = clmha__upload(ctx, "key upload", f.key.data, d.key_count, 4, &bufs[B_KEY])))
            goto done;
        dev.key.buffer = bufs[B_KEY], dev.key.offset = 0;
    }
    if (!d.value_is_key) {
        if ((st = clmha__upload(ctx, "value upload", f.value.data, d.value_count, 4,
                                &bufs[B_VALUE])))
            goto done;
        dev.value.buffer = bufs[B_VALUE], dev.value.offset = 0;
    }
    if (d.kpm_kind) {
        if ((st = clmha__upload(ctx, "key_padding_mask upload", f.key_padding_mask.tensor.data,
                                d.kpm_count, clmha__mask_elem(d.kpm_kind), &bufs[B_KPM])))
            goto done;
        dev.key_padding_mask.tensor.buffer = bufs[B_KPM];
        dev.key_padding_mask.tensor.offset = 0;
    }
    if (d.attn_kind) {
        if ((st = clmha__upload(ctx, "attn_mask upload", f.attn_mask.tensor.data, d.attn_count,
                                clmha__mask_elem(d.attn_kind), &bufs[B_ATTN])))
            goto done;
        dev.attn_mask.tensor.buffer = bufs[B_ATTN], dev.attn_mask.tensor.offset = 0;
    }
    if ((st = clmha__upload(ctx, "grad_output upload", a.grad_output.data, d.output_count, 4,
                            &bufs[B_GRAD_OUT])))
        goto done;
    b.grad_output.buffer = bufs[B_GRAD_OUT], b.grad_output.offset = 0;
    if (a.grad_weights.ndim) {
        if ((st = clmha__upload(ctx, "grad_weights upload", a.grad_weights.data,
                                d.weights_count, 4, &bufs[B_GRAD_W])))
            goto done;
        b.grad_weights.buffer = bufs[B_GRAD_W], b.grad_weights.offset = 0;
    }
    // A destination buffer per gradient asked for, holding the caller's values when the
    // gradient accumulates.
    for (int g = 0; g < count; ++g) {
        clmha_grad *gr = (clmha_grad *)clmha__backward_grad(&b, g);
        gr->buffer = NULL;
        gr->offset = 0;
        if (!gr->data) continue;
        size_t n = clmha__backward_grad_floats(layer, &d, g);
        cl_int err;
        cl_mem m = clCreateBuffer(ctx->cl_ctx,
                                  CL_MEM_READ_WRITE | (gr->accumulate ? CL_MEM_COPY_HOST_PTR : 0),
                                  n * sizeof(float), gr->accumulate ? gr->data : NULL, &err);
        clmha__held_new(CLMHA__HELD_MEM, m);
        bufs[B_FIXED + g] = m;
        if (err != CL_SUCCESS) {
            st = clmha__cl_fail(ctx, err, "clCreateBuffer(gradient)");
            goto done;
        }
        gr->buffer = m;
    }
    if ((st = clmha_layer_backward(layer, &b, 0, NULL, NULL))) goto done;
    cl_int err = clFinish(ctx->queue);
    if (err != CL_SUCCESS) {
        st = clmha__cl_fail(ctx, err, "clFinish");
        goto done;
    }
    // Read into the caller's arrays only once the whole pass has run.
    for (int g = 0; g < count && err == CL_SUCCESS; ++g) {
        const clmha_grad *gr = clmha__backward_grad(&b, g);
        if (!gr->data) continue;
        size_t n = clmha__backward_grad_floats(layer, &d, g);
        err = clEnqueueReadBuffer(ctx->queue, gr->buffer, CL_TRUE, 0, n * sizeof(float),
                                  gr->data, 0, NULL, NULL);
    }
    if (err != CL_SUCCESS) st = clmha__cl_fail(ctx, err, "clEnqueueReadBuffer(gradient)");
done:
    for (int i = 0; i < B_MAX; ++i) clmha__release_mem(bufs[i]);
    return st;
}

clmha_status clmha_layer_backward_host(clmha_layer *layer, const clmha_backward_args *args) {
    return backward_host(layer, args);
}
