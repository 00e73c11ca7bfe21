// The saved state of forward calls (saved.h): its public lifetime and its use by the forward
// pass.
#include "forward/saved.h"

#include "device/held.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

clmha_status clmha_saved_create(clmha_saved **out, clmha_layer *layer) {
    if (out) *out = NULL;
    if (!out) return clmha__fail(layer ? layer->ctx : NULL, CLMHA_INVALID_ARGUMENT, "out is NULL");
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_saved *s = calloc(1, sizeof *s);
    if (!s) return clmha__fail(layer->ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    s->layer = layer;
    s->ctx = layer->ctx;
    clmha_context_retain(s->ctx);
    *out = s;
    return CLMHA_SUCCESS;
}

void clmha_saved_release(clmha_saved *saved) {
    if (!saved) return;
    for (int i = 0; i < CLMHA__TILE_COUNT; ++i) clmha__release_mem(saved->tiles[i]);
    clmha__release_mem(saved->lse);
    for (size_t i = 0; i < saved->parts_cap; ++i) clmha_saved_release(saved->parts[i]);
    free(saved->parts);
    free(saved->lens);
    clmha_context_release(saved->ctx);
    free(saved);
}

size_t clmha_saved_bytes(const clmha_saved *saved) {
    if (!saved || !saved->filled) return 0;
    if (saved->packed) {
        size_t bytes = 0;
        for (size_t i = 0; i < saved->dims.n; ++i) bytes += clmha_saved_bytes(saved->parts[i]);
        return bytes;
    }
    size_t elems = saved->lse_cap;  // of the layer's elements (doubles for a float64 layer)
    for (int i = 0; i < CLMHA__TILE_COUNT; ++i) elems += saved->caps[i];
    return elems * saved->layer->rs;
}

clmha_status clmha__saved_prepare(clmha_saved *saved, clmha_layer *layer,
                                  const clmha__dims *d) {
    clmha_context *ctx = layer->ctx;
    if (saved->layer != layer)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "args->save was made for another layer (clmha_saved_create())");
    saved->filled = saved->packed = false;
    size_t q = d->n * d->l * d->e, kvp = d->n * d->s_padded * d->e;  // checked by the layer's
    size_t need[CLMHA__TILE_COUNT] = {q, kvp, kvp, q};                 // own reserve
    static const char *const name[CLMHA__TILE_COUNT] = {
        "saved query tiles", "saved key tiles", "saved value tiles", "saved attention output"};
    clmha_status st;
    // The layer's elements (a float64 layer's tiles and log-sum-exp rows are doubles).
    for (int i = 0; i < CLMHA__TILE_COUNT; ++i)
        if ((st = clmha__layer_grow(layer, &saved->tiles[i], &saved->caps[i], need[i], name[i])))
            return st;
    // The log-sum-exp rows, then each row's maximum and log(sum) (clmha__core_call::lse_split).
    return clmha__layer_grow(layer, &saved->lse, &saved->lse_cap, 3 * d->n * d->h * d->l,
                             "saved log-sum-exp");
}

void clmha__saved_swap(clmha_saved *saved, clmha_layer *layer) {
    for (int i = 0; i < CLMHA__TILE_COUNT; ++i) {
        cl_mem m = layer->tiles[i];
        size_t cap = layer->tile_caps[i];
        layer->tiles[i] = saved->tiles[i];
        layer->tile_caps[i] = saved->caps[i];
        saved->tiles[i] = m;
        saved->caps[i] = cap;
    }
}

void clmha__saved_filled(clmha_saved *saved, const clmha_forward_args *args,
                         const clmha__dims *dims, const void *core, bool has_lse,
                         bool fell_back) {
    saved->filled = true;
    saved->dims = *dims;
    saved->core = core;
    saved->has_lse = has_lse;
    saved->lse_split = false;  // (set by the caller where the core wrote them)
    saved->fell_back = fell_back;
    saved->is_causal = args->is_causal;
    saved->need_weights = args->need_weights;
    saved->per_head_weights = args->per_head_weights;
    saved->training = args->training;
    saved->rng = args->rng;
}

clmha_status clmha__saved_packed_prepare(clmha_saved *saved, clmha_layer *layer,
                                         const clmha__dims *d) {
    clmha_context *ctx = layer->ctx;
    if (saved->layer != layer)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "args->save was made for another layer (clmha_saved_create())");
    saved->filled = false;
    size_t n = d->n;
    if (n > SIZE_MAX / (2 * sizeof(size_t)))
        return clmha__fail(ctx, CLMHA_SIZE_OVERFLOW, "num_seqs %zu overflows", n);
    size_t *lens = malloc(2 * n * sizeof *lens);
    if (!lens) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    free(saved->lens);
    saved->lens = lens;
    if (n > saved->parts_cap) {
        clmha_saved **parts = realloc(saved->parts, n * sizeof *parts);
        if (!parts) return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
        memset(parts + saved->parts_cap, 0, (n - saved->parts_cap) * sizeof *parts);
        saved->parts = parts;
        saved->parts_cap = n;
    }
    clmha_status st;
    for (size_t i = 0; i < n; ++i)
        if (d->seq_lens[i] && !saved->parts[i] &&
            (st = clmha_saved_create(&saved->parts[i], layer)))
            return st;
    return CLMHA_SUCCESS;
}

void clmha__saved_packed_filled(clmha_saved *saved, const clmha_forward_args *args,
                                const clmha__dims *d) {
    clmha__saved_filled(saved, args, d, NULL, false, false);
    saved->packed = true;
    memcpy(saved->lens, d->seq_lens, d->n * sizeof *saved->lens);
    memcpy(saved->lens + d->n, d->kv_seq_lens, d->n * sizeof *saved->lens);
    saved->dims.seq_lens = saved->lens;
    saved->dims.kv_seq_lens = saved->lens + d->n;
}
