// Widening a 16-bit layer's inputs and narrowing its results (convert.h).
#include "forward/convert.h"

#include "cores/kernel_args.h"

typedef clmha__arg arg;
#define ARG CLMHA__ARG

clmha_status clmha__convert_result(clmha_layer *layer, int slot, const char *what, size_t count,
                                   cl_mem *out) {
    clmha_status st = clmha__grow_buffer(layer->ctx, &layer->staged[slot],
                                         &layer->staged_caps[slot], count ? count : 1, what);
    *out = layer->staged[slot];
    return st;
}

clmha_status clmha__convert_in(clmha_layer *layer, int slot, const char *what, cl_mem src,
                               size_t offset, size_t count, cl_mem *out) {
    clmha_status st = clmha__convert_result(layer, slot, what, count, out);
    if (st || !count) return st;
    cl_ulong off = offset, n = count;
    arg args[] = {ARG(src), ARG(off), ARG(*out), ARG(n)};
    return clmha__launch(layer->ctx, layer->to_f32, "to_f32", count, layer->heads_wg, args,
                         sizeof args / sizeof args[0]);
}

clmha_status clmha__convert_out(clmha_layer *layer, int slot, cl_mem dst, size_t offset,
                                size_t count) {
    if (!count) return CLMHA_SUCCESS;
    cl_ulong off = offset, n = count;
    arg args[] = {ARG(layer->staged[slot]), ARG(dst), ARG(off), ARG(n)};
    return clmha__launch(layer->ctx, layer->from_f32, "from_f32", count, layer->heads_wg, args,
                         sizeof args / sizeof args[0]);
}

// One tensor of the call widened into copy @p slot, @p t then pointing at it.
static clmha_status widen(clmha_layer *layer, int slot, const char *what, clmha_tensor *t,
                          size_t count) {
    clmha_status st = clmha__convert_in(layer, slot, what, t->buffer, t->offset, count,
                                        &t->buffer);
    t->offset = 0;
    return st;
}

clmha_status clmha__convert_inputs(clmha_layer *layer, const clmha__dims *d,
                                   clmha_forward_args *f) {
    clmha_status st;
    if ((st = widen(layer, CLMHA__STAGED_QUERY, "float32 query", &f->query, d->query_count)) ||
        (!d->key_is_query &&
         (st = widen(layer, CLMHA__STAGED_KEY, "float32 key", &f->key, d->key_count))) ||
        (!d->value_is_key &&
         (st = widen(layer, CLMHA__STAGED_VALUE, "float32 value", &f->value, d->value_count))))
        return st;
    if (d->kpm_kind == CLMHA_MASK_FLOAT &&
        (st = widen(layer, CLMHA__STAGED_KPM, "float32 key_padding_mask",
                    &f->key_padding_mask.tensor, d->kpm_count)))
        return st;
    if (d->attn_kind == CLMHA_MASK_FLOAT &&
        (st = widen(layer, CLMHA__STAGED_ATTN, "float32 attn_mask", &f->attn_mask.tensor,
                    d->attn_count)))
        return st;
    return CLMHA_SUCCESS;
}
