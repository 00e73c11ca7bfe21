// The host-array backward pass (clmha_layer_backward_host()): copies into the layer's staging
// buffers (forward/staging.c), clmha_layer_backward(), then reads the gradients back, like
// clmha_layer_forward_host() for the forward pass.
#include "backward/backward.h"

#include "base/half.h"
#include "base/struct_in.h"
#include "forward/enqueue.h"
#include "forward/staging.h"

#include <stdlib.h>
#include <string.h>

// The call's inputs, masks, grad_output and grad_weights into the layer's staging buffers,
// @p dev (the forward arguments, a copy of the caller's) and @p b pointing at them.
static clmha_status upload_inputs(clmha_layer *layer, const clmha__dims *d,
                                  clmha_forward_args *dev, clmha_backward_args *b, bool f64) {
    clmha_status st;
    if ((st = clmha__host_upload_inputs(layer, d, f64, dev)) ||
        (st = clmha__host_upload_tensor(layer, CLMHA__HOST_GRAD_OUTPUT, "grad_output upload",
                                        &b->grad_output, d->output_count, f64)))
        return st;
    if (b->grad_weights.ndim)
        return clmha__host_upload_tensor(layer, CLMHA__HOST_GRAD_WEIGHTS, "grad_weights upload",
                                         &b->grad_weights, d->weights_count, f64);
    return CLMHA_SUCCESS;
}

// Uploads @p n values of the caller's array @p data (doubles with @p f64, else floats) into
// slot @p slot as @p elem-byte elements (float32, or float64 for a float64 layer), converted
// where the two differ.
static clmha_status host_upload(clmha_layer *layer, int slot, const void *data, bool f64,
                                size_t n, size_t elem, cl_mem *out) {
    size_t have = f64 ? sizeof(double) : sizeof(float);
    void *tmp = have == elem ? NULL : malloc((n ? n : 1) * elem);
    if (have != elem && !tmp)
        return clmha__fail(layer->ctx, CLMHA_OUT_OF_MEMORY, "out of host memory (gradient)");
    for (size_t i = 0; tmp && i < n; ++i)  // float <-> double
        if (elem == sizeof(double)) ((double *)tmp)[i] = ((const float *)data)[i];
        else ((float *)tmp)[i] = (float)((const double *)data)[i];
    clmha_status st =
        clmha__host_upload(layer, slot, "gradient upload", tmp ? tmp : data, n * elem, out);
    free(tmp);
    return st;
}

// @p n values of @p elem bytes at @p from into the caller's array @p to (doubles with @p f64,
// else floats), converted where the two differ.
static void place(void *to, const void *from, bool f64, size_t n, size_t elem) {
    if ((f64 ? sizeof(double) : sizeof(float)) == elem) {
        memcpy(to, from, n * elem);
        return;
    }
    for (size_t i = 0; i < n; ++i)
        if (f64) ((double *)to)[i] = ((const float *)from)[i];
        else ((float *)to)[i] = (float)((const double *)from)[i];
}

// Reads every gradient asked for into host copies and, only once all are read, into the
// caller's arrays: a failed read writes none of them.
static clmha_status download_gradients(clmha_layer *layer, const clmha_backward_args *b,
                                       const clmha__dims *d, bool f64) {
    enum { MAX = CLMHA__HOST_COUNT - CLMHA__HOST_GRAD };
    void *copy[MAX] = {NULL};
    size_t n[MAX] = {0}, elem = layer->rs;
    int count = clmha__backward_grad_count();  // at most MAX (backward.c checks it)
    clmha_status st = CLMHA_SUCCESS;
    for (int g = 0; g < count && !st; ++g) {
        const clmha_grad *gr = clmha__backward_grad(b, g);
        if (!gr->data) continue;
        n[g] = clmha__backward_grad_floats(layer, d, g);
        if (!(copy[g] = malloc((n[g] ? n[g] : 1) * elem))) {
            st = clmha__fail(layer->ctx, CLMHA_OUT_OF_MEMORY, "out of host memory (gradient)");
            break;
        }
        cl_int err = clEnqueueReadBuffer(layer->ctx->queue, gr->buffer, CL_TRUE, 0,
                                         n[g] * elem, copy[g], 0, NULL, NULL);
        if (err) st = clmha__cl_fail(layer->ctx, err, "clEnqueueReadBuffer(gradient)");
    }
    for (int g = 0; g < count; ++g) {
        if (!st && copy[g]) place(clmha__backward_grad(b, g)->data, copy[g], f64, n[g], elem);
        free(copy[g]);
    }
    return st;
}

// A staging buffer per gradient asked for (@p elem bytes an element), holding the caller's
// values when the gradient accumulates.
static clmha_status stage_gradients(clmha_layer *layer, const clmha__dims *d,
                                    clmha_backward_args *b, bool f64, size_t elem) {
    int count = clmha__backward_grad_count();  // at most the slots (backward.c checks it)
    for (int g = 0; g < count; ++g) {
        clmha_grad *gr = (clmha_grad *)clmha__backward_grad(b, g);
        gr->buffer = NULL;
        gr->offset = 0;
        if (!gr->data) continue;
        size_t n = clmha__backward_grad_floats(layer, d, g);
        clmha_status st =
            gr->accumulate
                ? host_upload(layer, CLMHA__HOST_GRAD + g, gr->data, f64, n, elem,
                              &gr->buffer)
                : clmha__host_room(layer, CLMHA__HOST_GRAD + g, "gradient", n * elem,
                                   &gr->buffer);
        if (st) return st;
    }
    return CLMHA_SUCCESS;
}

// A 16-bit layer's gradients rounded to its dtype in the caller's arrays (as its device call
// writes them), unless the call asks for float32 ones.
static void round_gradients(const clmha_layer *layer, const clmha_backward_args *a,
                            const clmha__dims *d, bool f64) {
    clmha_dtype t = layer->desc.dtype;
    if ((t != CLMHA_DTYPE_F16 && t != CLMHA_DTYPE_BF16) || a->grad_dtype == CLMHA_GRAD_F32)
        return;
    for (int g = 0; g < clmha__backward_grad_count(); ++g) {
        void *x = clmha__backward_grad(a, g)->data;
        size_t n = x ? clmha__backward_grad_floats(layer, d, g) : 0;
        for (size_t i = 0; i < n; ++i)
            if (f64) ((double *)x)[i] = clmha__dtype_round(t, (float)((double *)x)[i]);
            else ((float *)x)[i] = clmha__dtype_round(t, ((float *)x)[i]);
    }
}

static clmha_status backward_host(clmha_layer *layer, const clmha_backward_args *args,
                                  bool f64) {
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_context *ctx = layer->ctx;
    clmha_backward_args a;
    char msg[512];
    clmha_status st = CLMHA__STRUCT_IN(clmha_backward_args, &a, args, "args", msg, sizeof msg);
    if (st) return clmha__fail(ctx, st, "%s", msg);
    clmha_forward_args f;
    clmha__dims d;
    if ((st = clmha__backward_resolve(layer, &a, &f, &d, false))) return st;

    clmha_forward_args dev = f;
    clmha_backward_args b = a;
    b.forward = &dev;
    // The device gradients: float32 staging for a 16-bit layer (rounded below when the caller
    // asks), the layer's elements otherwise.
    if (layer->rs == sizeof(float)) b.grad_dtype = CLMHA_GRAD_F32;
    if ((st = upload_inputs(layer, &d, &dev, &b, f64))) goto fail;
    if ((st = stage_gradients(layer, &d, &b, f64, layer->rs))) goto fail;
    if ((st = clmha_layer_backward(layer, &b, 0, NULL, NULL))) goto fail;
    cl_int err = clFinish(ctx->queue);
    if (err != CL_SUCCESS) {
        st = clmha__cl_fail(ctx, err, "clFinish");
        goto fail;
    }
    // Read into the caller's arrays only once the whole pass has run.
    if (!(st = download_gradients(layer, &b, &d, f64))) {
        round_gradients(layer, &a, &d, f64);
        return CLMHA_SUCCESS;
    }
fail:
    clmha__host_drop(layer);
    return st;
}

clmha_status clmha_layer_backward_host(clmha_layer *layer, const clmha_backward_args *args) {
    return backward_host(layer, args, false);
}

clmha_status clmha_layer_backward_host_f64(clmha_layer *layer,
                                           const clmha_backward_args *args) {
    return backward_host(layer, args, true);
}
