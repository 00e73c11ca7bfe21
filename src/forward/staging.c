// The device copies of a host-array call's tensors, kept by the layer between calls.
#include "forward/staging.h"

#include "context/context.h"
#include "device/held.h"
#include "base/half.h"
#include "errors/errors.h"
#include "forward/enqueue.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

clmha_status clmha__host_read_all(clmha_context *ctx, int n, const cl_mem *src,
                                  void *const *dst, const size_t *bytes,
                                  const char *const *what) {
    enum { MAX = 4 };
    void *copy[MAX] = {NULL};
    int last = -1;
    for (int i = 0; i < n && i < MAX; ++i)
        if (dst[i]) last = i;
    clmha_status st = CLMHA_SUCCESS;
    for (int i = 0; i <= last && !st; ++i) {
        if (!dst[i]) continue;
        void *to = i == last ? dst[i] : (copy[i] = malloc(bytes[i] ? bytes[i] : 1));
        if (!to) {
            st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory (%s)", what[i]);
            break;
        }
        cl_int err = clEnqueueReadBuffer(ctx->queue, src[i], CL_TRUE, 0, bytes[i], to, 0, NULL,
                                         NULL);
        if (err) st = clmha__cl_fail_on(ctx, err, "clEnqueueReadBuffer", what[i]);
    }
    for (int i = 0; i < MAX; ++i) {
        if (!st && copy[i]) memcpy(dst[i], copy[i], bytes[i]);
        free(copy[i]);
    }
    return st;
}

clmha_status clmha__host_room(clmha_layer *layer, int slot, const char *what, size_t bytes,
                              cl_mem *out) {
    // Sizes in floats, as the layer's other scratch; a float64 or 16-bit tensor rounds up.
    size_t floats = bytes / sizeof(float) + (bytes % sizeof(float) != 0);
    if (!floats) floats = 1;
    *out = NULL;
    if (floats > layer->host_caps[slot] || !layer->host[slot]) {
        // The caller's whole tensor, in one buffer whatever the device's largest allocation
        // (the driver refuses what it cannot hold): unlike scratch, it cannot come in chunks.
        clmha_context *ctx = layer->ctx;
        cl_int err;
        clmha__count(ctx, 0, 1);
        cl_mem m = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE, floats * sizeof(float), NULL,
                                  &err);
        clmha__held_new(CLMHA__HELD_MEM, m);
        if (err != CL_SUCCESS) return clmha__cl_fail_on(ctx, err, "clCreateBuffer", what);
        clmha__release_mem(layer->host[slot]);  // freed once the work queued on it has finished
        layer->host[slot] = m;
        layer->host_caps[slot] = floats;
    }
    *out = layer->host[slot];
    return CLMHA_SUCCESS;
}

clmha_status clmha__host_upload(clmha_layer *layer, int slot, const char *what,
                                const void *data, size_t bytes, cl_mem *out) {
    clmha_status st = clmha__host_room(layer, slot, what, bytes, out);
    if (st || !bytes) return st;
    cl_int err = clEnqueueWriteBuffer(layer->ctx->queue, *out, CL_TRUE, 0, bytes, data, 0, NULL,
                                      NULL);
    if (err != CL_SUCCESS) {
        *out = NULL;
        return clmha__cl_fail_on(layer->ctx, err, "clEnqueueWriteBuffer", what);
    }
    return CLMHA_SUCCESS;
}

void clmha__host_drop(clmha_layer *layer) {
    for (int i = 0; i < CLMHA__HOST_COUNT; ++i) {
        clmha__release_mem(layer->host[i]);
        layer->host[i] = NULL;
        layer->host_caps[i] = 0;
    }
}

clmha_status clmha__host_upload_values(clmha_layer *layer, int slot, const char *what,
                                       const void *data, size_t count, bool f64, cl_mem *out) {
    clmha_dtype t = layer->desc.dtype;
    size_t elem = clmha__dtype_size(t);
    if (elem == (f64 ? 8 : 4))
        return clmha__host_upload(layer, slot, what, data, count * elem, out);
    void *conv = malloc((count ? count : 1) * elem);
    if (!conv)
        return clmha__fail(layer->ctx, CLMHA_OUT_OF_MEMORY, "out of host memory (%s)", what);
    const float *xf = data;
    const double *xd = data;
    for (size_t i = 0; i < count; ++i) {
        if (t == CLMHA_DTYPE_F64) {
            ((double *)conv)[i] = xf[i];
            continue;
        }
        float x = f64 ? clmha__double_to_float(xd[i]) : xf[i];
        if (t == CLMHA_DTYPE_F32) ((float *)conv)[i] = x;
        else if (t == CLMHA_DTYPE_F16) ((uint16_t *)conv)[i] = clmha__f32_to_f16(x);
        else ((uint16_t *)conv)[i] = clmha__f32_to_bf16(x);
    }
    clmha_status st = clmha__host_upload(layer, slot, what, conv, count * elem, out);
    free(conv);
    return st;
}

clmha_status clmha__host_upload_tensor(clmha_layer *layer, int slot, const char *what,
                                       clmha_tensor *t, size_t count, bool f64) {
    t->offset = 0;
    return clmha__host_upload_values(layer, slot, what, t->data, count, f64, &t->buffer);
}

// A mask of a host call: float masks as the layer's dtype, boolean ones as they are.
static clmha_status upload_mask(clmha_layer *layer, int slot, const char *what, clmha_mask *m,
                                size_t count, bool f64) {
    m->tensor.offset = 0;
    if (m->kind == CLMHA_MASK_FLOAT)
        return clmha__host_upload_values(layer, slot, what, m->tensor.data, count, f64,
                                         &m->tensor.buffer);
    return clmha__host_upload(layer, slot, what, m->tensor.data,
                              count * clmha__mask_elem(m->kind), &m->tensor.buffer);
}

clmha_status clmha__host_upload_inputs(clmha_layer *layer, const clmha__dims *d, bool f64,
                                       clmha_forward_args *dev) {
    clmha_status st;
    if ((st = clmha__host_upload_tensor(layer, CLMHA__HOST_QUERY, "query upload", &dev->query,
                                        d->query_count, f64)) ||
        (!d->key_is_query &&
         (st = clmha__host_upload_tensor(layer, CLMHA__HOST_KEY, "key upload", &dev->key,
                                         d->key_count, f64))) ||
        (!d->value_is_key &&
         (st = clmha__host_upload_tensor(layer, CLMHA__HOST_VALUE, "value upload", &dev->value,
                                         d->value_count, f64))) ||
        (d->kpm_kind && (st = upload_mask(layer, CLMHA__HOST_KPM, "key_padding_mask upload",
                                          &dev->key_padding_mask, d->kpm_count, f64))))
        return st;
    if (d->attn_kind)
        return upload_mask(layer, CLMHA__HOST_ATTN, "attn_mask upload", &dev->attn_mask,
                           d->attn_count, f64);
    return CLMHA_SUCCESS;
}
