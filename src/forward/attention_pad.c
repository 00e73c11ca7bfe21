// D_v ≠ D in attention as a function. The cores take one head dimension, so a call whose value
// is narrower or wider than its query and key runs on copies padded with zeros to
// D' = max(D, D_v): zero columns add nothing to q·kᵀ nor to the weights' product with v, and
// their gradients are zero. The results keep their first D (dq, dk) or D_v (output, dv)
// columns. Both layouts keep the head dimension last, so every pad and unpad is one rectangle
// copy of rows (clEnqueueCopyBufferRect); the padded copies live in the bare layer's staging
// slots from CLMHA__ATTENTION_PAD_SLOT on (src/forward/staging.c).
#include "forward/attention.h"

#include "forward/staging.h"

size_t clmha__attention_width(const clmha__attention_dims *d) {
    return d->dv > d->core.d ? d->dv : d->core.d;
}

// Tensor @p t with its last dimension @p width, in staging slot @p slot at offset 0.
static clmha_status widen(clmha_layer *l, clmha_tensor *t, size_t width, int slot,
                          const char *what) {
    size_t rows = 1;
    for (size_t i = 0; i + 1 < t->ndim; ++i) rows *= t->shape[i];
    t->shape[t->ndim - 1] = width;
    t->offset = 0;
    t->data = NULL;
    return clmha__host_room(l, slot, what, rows * width * l->rs, &t->buffer);
}

clmha_status clmha__attention_pad_call(clmha_layer *l, const clmha_attention_args *a,
                                       const clmha__attention_dims *d, int slot,
                                       clmha_attention_args *p, clmha__attention_dims *pd) {
    size_t w = clmha__attention_width(d);
    *p = *a;
    p->scale = d->scale;  // 1/sqrt(D) of the caller's D, not of D'
    clmha_status st;
    if ((st = widen(l, &p->query, w, slot, "padded query")) ||
        (st = widen(l, &p->key, w, slot + 1, "padded key")) ||
        (st = widen(l, &p->value, w, slot + 2, "padded value")))
        return st;
    char msg[256];
    if ((st = clmha__attention_resolve(p, pd, msg, sizeof msg)))
        return clmha__fail(l->ctx, st, "padding to D' = %zu: %s", w, msg);
    pd->attn = d->attn;  // the mask where the cores read it (a host form's staged copy)
    return CLMHA_SUCCESS;
}

clmha_status clmha__attention_pad_rows(clmha_layer *l, cl_mem src, size_t src_off, size_t from,
                                       cl_mem dst, size_t dst_off, size_t to, size_t rows,
                                       cl_uint num_wait, const cl_event *wait_list) {
    clmha_context *ctx = l->ctx;
    cl_int err = CL_SUCCESS;
    size_t rs = l->rs;  // the call's element: float, or double
    if (to > from) {  // the columns past `from` are zeros (all bits zero in either type)
        double zero = 0.0;
        err = clEnqueueFillBuffer(ctx->queue, dst, &zero, rs, dst_off * rs, rows * to * rs,
                                  num_wait, wait_list, NULL);
        num_wait = 0, wait_list = NULL;  // the copy follows the fill on the in-order queue
    }
    if (!err && rows) {
        size_t src_origin[3] = {src_off * rs, 0, 0};
        size_t dst_origin[3] = {dst_off * rs, 0, 0};
        size_t region[3] = {(to < from ? to : from) * rs, rows, 1};
        err = clEnqueueCopyBufferRect(ctx->queue, src, dst, src_origin, dst_origin, region,
                                      from * rs, 0, to * rs, 0, num_wait, wait_list, NULL);
    }
    return err ? clmha__cl_fail(ctx, err, "clEnqueueCopyBufferRect(D_v padding)")
               : CLMHA_SUCCESS;
}

clmha_status clmha__attention_pad_inputs(clmha_layer *l, const clmha_attention_args *a,
                                         const clmha__attention_dims *d,
                                         const clmha_attention_args *p, cl_uint num_wait,
                                         const cl_event *wait_list) {
    size_t w = clmha__attention_width(d), dk = d->core.d, dv = d->dv;
    clmha_status st;
    if ((st = clmha__attention_pad_rows(l, a->query.buffer, a->query.offset, dk,
                                        p->query.buffer, 0, w, d->query_count / dk, num_wait,
                                        wait_list)) ||
        (st = clmha__attention_pad_rows(l, a->key.buffer, a->key.offset, dk, p->key.buffer, 0,
                                        w, d->key_count / dk, num_wait, wait_list)))
        return st;
    return clmha__attention_pad_rows(l, a->value.buffer, a->value.offset, dv, p->value.buffer,
                                     0, w, d->value_count / dv, num_wait, wait_list);
}
