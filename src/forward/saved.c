// The saved state of forward calls (saved.h): its public lifetime and its use by the forward
// pass.
#include "forward/saved.h"

#include "device/held.h"

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
    clmha_context_release(saved->ctx);
    free(saved);
}

size_t clmha_saved_bytes(const clmha_saved *saved) {
    if (!saved || !saved->filled) return 0;
    size_t floats = saved->lse_cap;
    for (int i = 0; i < CLMHA__TILE_COUNT; ++i) floats += saved->caps[i];
    return floats * sizeof(float);
}

clmha_status clmha__saved_prepare(clmha_saved *saved, clmha_layer *layer,
                                  const clmha__dims *d) {
    clmha_context *ctx = layer->ctx;
    if (saved->layer != layer)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "args->save was made for another layer (clmha_saved_create())");
    saved->filled = false;
    size_t q = d->n * d->l * d->e, kvp = d->n * d->s_padded * d->e;  // checked by the layer's
    size_t need[CLMHA__TILE_COUNT] = {q, kvp, kvp, q};                 // own reserve
    static const char *const name[CLMHA__TILE_COUNT] = {
        "saved query tiles", "saved key tiles", "saved value tiles", "saved attention output"};
    clmha_status st;
    for (int i = 0; i < CLMHA__TILE_COUNT; ++i)
        if ((st = clmha__grow_buffer(ctx, &saved->tiles[i], &saved->caps[i], need[i], name[i])))
            return st;
    return clmha__grow_buffer(ctx, &saved->lse, &saved->lse_cap, d->n * d->h * d->l,
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
    saved->fell_back = fell_back;
    saved->is_causal = args->is_causal;
    saved->need_weights = args->need_weights;
    saved->per_head_weights = args->per_head_weights;
    saved->training = args->training;
    saved->rng = args->rng;
}
