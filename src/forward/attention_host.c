// The host-array form of attention as a function (clmha_attention_forward_host()): the caller's
// arrays are copied into the bare layer's staging buffers (staging.c), the device call runs
// (attention.c), the queue is waited for, and only then are the results read into the caller's
// arrays, so that a failed call writes none of them. The arrays hold the call's elements:
// floats (clmha_attention_forward_host()) or doubles (clmha_attention_forward_host_f64()).
#include "forward/attention.h"

#include "base/half.h"
#include "forward/attention_cache.h"
#include "forward/enqueue.h"
#include "forward/staging.h"

#include <stdlib.h>

// The host arrays: present where the call reads or writes them, of the call's counts.
static clmha_status check_host(clmha_context *ctx, const clmha_attention_args *a,
                               const clmha__attention_dims *d, const void *output,
                               size_t output_count, const void *lse, size_t lse_count,
                               const void *weights, size_t weights_count) {
    const char *missing = !a->query.data                                   ? "query.data"
                          : !a->key.data                                   ? "key.data"
                          : !a->value.data                                 ? "value.data"
                          : a->attn_mask.kind && !a->attn_mask.tensor.data ? "attn_mask.tensor.data"
                          : a->alibi_slopes.ndim && !a->alibi_slopes.data  ? "alibi_slopes.data"
                          : a->sinks.ndim && !a->sinks.data                ? "sinks.data"
                          : a->mod_params.ndim && a->mod_params.shape[0] && !a->mod_params.data
                              ? "mod_params.data"
                          : !output                                        ? "output"
                                                                           : NULL;
    if (missing) return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "%s is NULL", missing);
    if (output_count != d->output_count)
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                           "output_count is %zu, the output has %zu elements", output_count,
                           d->output_count);
    if (lse_count != (lse ? d->lse_count : 0))
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                           "lse_count is %zu: it must be %zu with lse, 0 without", lse_count,
                           d->lse_count);
    if (weights_count != (weights ? d->weights_count : 0))
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                           "weights_count is %zu: it must be %zu with weights, 0 without",
                           weights_count, d->weights_count);
    return CLMHA_SUCCESS;
}

clmha_status clmha__attention_upload(clmha_layer *l, clmha_attention_args *a,
                                     clmha__attention_dims *d, bool lse, bool weights,
                                     clmha__attention_out *o) {
    clmha_status st;
    size_t es = l->rs;  // the call's element (clmha__attention_elem())
    clmha_tensor *t[3] = {&a->query, &a->key, &a->value};
    size_t count[3] = {d->query_count, d->key_count, d->value_count};
    static const int slot[3] = {CLMHA__HOST_QUERY, CLMHA__HOST_KEY, CLMHA__HOST_VALUE};
    static const char *const what[3] = {"query", "key", "value"};
    for (int i = 0; i < 3; ++i) {
        if ((st = clmha__host_upload(l, slot[i], what[i], t[i]->data, count[i] * es,
                                     &t[i]->buffer)))
            return st;
        t[i]->offset = 0;
    }
    clmha_mask *m = d->attn.kind ? &d->attn : NULL;
    if (m) {
        if ((st = clmha__host_upload(l, CLMHA__HOST_ATTN, "attn_mask", m->tensor.data,
                                     d->mask_count * clmha__attention_mask_elem(a, m->kind),
                                     &m->tensor.buffer)))
            return st;
        m->tensor.offset = 0;
    }
    if (a->alibi_slopes.ndim) {
        if ((st = clmha__host_upload(l, CLMHA__HOST_ALIBI, "alibi_slopes", a->alibi_slopes.data,
                                     d->core.h * es, &a->alibi_slopes.buffer)))
            return st;
        a->alibi_slopes.offset = 0;
    }
    if (a->sinks.ndim) {
        if ((st = clmha__host_upload(l, CLMHA__HOST_SINKS, "sinks", a->sinks.data,
                                     d->core.h * es, &a->sinks.buffer)))
            return st;
        a->sinks.offset = 0;
    }
    if (a->mod_params.ndim && a->mod_params.shape[0]) {
        if ((st = clmha__host_upload(l, CLMHA__HOST_MOD_PARAMS, "mod_params",
                                     a->mod_params.data, a->mod_params.shape[0] * sizeof(float),
                                     &a->mod_params.buffer)))
            return st;
        a->mod_params.offset = 0;
    } else {
        a->mod_params.ndim = 0;  // an empty p: none
    }
    *o = (clmha__attention_out){0};
    if ((st = clmha__host_room(l, CLMHA__HOST_OUTPUT, "output", d->output_count * es,
                               &o->output)) ||
        (lse && (st = clmha__host_room(l, CLMHA__HOST_LSE, "lse", d->lse_count * es, &o->lse))) ||
        (weights && (st = clmha__host_room(l, CLMHA__HOST_WEIGHTS, "weights",
                                           d->weights_count * es, &o->weights))))
        return st;
    return CLMHA_SUCCESS;
}

// Waits for the call and reads its results of @p es bytes each, all or none.
static clmha_status download(clmha_context *ctx, const clmha__attention_out *o,
                             const clmha__attention_dims *d, size_t es, void *output, void *lse,
                             void *weights) {
    cl_int err = clFinish(ctx->queue);
    if (err) return clmha__cl_fail_on(ctx, err, "clFinish", "the attention call");
    cl_mem src[3] = {o->lse, o->weights, o->output};  // the largest last: read in place
    void *dst[3] = {lse, weights, output};
    size_t bytes[3] = {d->lse_count * es, d->weights_count * es, d->output_count * es};
    static const char *const what[3] = {"lse", "weights", "output"};
    return clmha__host_read_all(ctx, 3, src, dst, bytes, what);
}

clmha_status clmha__attention_host_dtype(clmha_context *ctx, const clmha_attention_args *a,
                                         clmha_dtype takes, const char *function) {
    if (a->dtype == takes) return CLMHA_SUCCESS;
    if (takes == CLMHA_DTYPE_F32 && clmha__attention_16(a)) return CLMHA_SUCCESS;  // rounded
    return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                       "args->dtype is %d: %s takes %s arrays (dtype %s)%s", (int)a->dtype,
                       function, takes == CLMHA_DTYPE_F64 ? "double" : "float",
                       takes == CLMHA_DTYPE_F64 ? "CLMHA_DTYPE_F64" : "CLMHA_DTYPE_F32",
                       a->dtype == CLMHA_DTYPE_F64 ? "; float64 calls: its _f64 form"
                       : takes == CLMHA_DTYPE_F64  ? "; float32 calls: the form without _f64"
                                                   : "");
}

clmha_status clmha__attention_round_copy(clmha_context *ctx, clmha_dtype t,
                                        const float *from, size_t count, float **copy) {
    if (!(*copy = malloc((count ? count : 1) * sizeof(float))))
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    for (size_t k = 0; k < count; ++k) (*copy)[k] = clmha__dtype_round(t, from[k]);
    return CLMHA_SUCCESS;
}

clmha_status clmha__attention_round_inputs(clmha_context *ctx, clmha_attention_args *a,
                                           clmha__attention_dims *d, clmha_dtype t,
                                           float *copies[CLMHA__ATTENTION_ROUNDED]) {
    clmha_tensor *in[CLMHA__ATTENTION_ROUNDED] = {&a->query, &a->key, &a->value,
                                                  &a->attn_mask.tensor, &a->sinks,
                                                  &a->alibi_slopes};
    size_t h = d->core.h;
    size_t count[CLMHA__ATTENTION_ROUNDED] = {
        d->query_count, d->key_count, d->value_count,
        a->attn_mask.kind == CLMHA_MASK_FLOAT ? d->mask_count : 0, a->sinks.ndim ? h : 0,
        a->alibi_slopes.ndim ? h : 0};
    for (int i = 0; i < CLMHA__ATTENTION_ROUNDED; ++i) {
        if (!count[i]) continue;
        clmha_status st = clmha__attention_round_copy(ctx, t, in[i]->data, count[i], &copies[i]);
        if (st) return st;
        in[i]->data = copies[i];
    }
    if (copies[3]) d->attn.tensor.data = copies[3];  // where the upload reads the mask
    a->dtype = CLMHA_DTYPE_F32;
    return CLMHA_SUCCESS;
}

void clmha__attention_round_results(clmha_dtype t, float *x, size_t count) {
    for (size_t i = 0; x && i < count; ++i) x[i] = clmha__dtype_round(t, x[i]);
}

// Both host forms: @p takes the dtype of their arrays.
static clmha_status forward_host(clmha_context *ctx, const clmha_attention_args *args,
                                 clmha_dtype takes, const char *function, void *output,
                                 size_t output_count, void *lse, size_t lse_count,
                                 void *weights, size_t weights_count) {
    if (!ctx) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "ctx is NULL");
    clmha_attention_args a;
    clmha__attention_dims d;
    clmha_layer *l;
    clmha_status st;
    float *copies[CLMHA__ATTENTION_ROUNDED] = {NULL};
    clmha_dtype t = CLMHA_DTYPE_F32;  // a 16-bit call's, computed as float32 on rounded copies
    if ((st = clmha__attention_check_args(ctx, args, &a, &d)) ||
        (st = clmha__attention_host_dtype(ctx, &a, takes, function)) ||
        (st = check_host(ctx, &a, &d, output, output_count, lse, lse_count, weights,
                         weights_count)) ||
        (clmha__attention_16(&a) &&
         (t = a.dtype, st = clmha__attention_round_inputs(ctx, &a, &d, t, copies))) ||
        (st = clmha__attention_lock(ctx, &d.core, clmha__attention_width(&d), a.dtype, &l)))
        goto done;
    clmha__attention_out o;
    if ((st = clmha__attention_upload(l, &a, &d, lse != NULL, weights != NULL, &o)) ||
        (st = clmha__attention_enqueue(l, &a, &d, &o, 0, NULL, NULL)) ||
        (st = download(ctx, &o, &d, l->rs, output, lse, weights)))
        clmha__host_drop(l);
    clmha__attention_unlock(ctx);
    if (!st && t != CLMHA_DTYPE_F32) {
        clmha__attention_round_results(t, output, output_count);
        clmha__attention_round_results(t, lse, lse_count);
        clmha__attention_round_results(t, weights, weights_count);
    }
done:
    for (int i = 0; i < CLMHA__ATTENTION_ROUNDED; ++i) free(copies[i]);
    return st;
}

clmha_status clmha_attention_forward_host(clmha_context *ctx, const clmha_attention_args *args,
                                          float *output, size_t output_count, float *lse,
                                          size_t lse_count, float *weights,
                                          size_t weights_count) {
    return forward_host(ctx, args, CLMHA_DTYPE_F32, "clmha_attention_forward_host()", output,
                        output_count, lse, lse_count, weights, weights_count);
}

clmha_status clmha_attention_forward_host_f64(clmha_context *ctx,
                                              const clmha_attention_args *args, double *output,
                                              size_t output_count, double *lse,
                                              size_t lse_count, double *weights,
                                              size_t weights_count) {
    return forward_host(ctx, args, CLMHA_DTYPE_F64, "clmha_attention_forward_host_f64()",
                        output, output_count, lse, lse_count, weights, weights_count);
}
