// The user's attention core (clmha_layer_set_attention()): an adapter from the core interface
// to clmha_attention_fn. It gets the head tiles and enqueues its own work on the queue; with
// weights asked for, it writes them into the layer's scores buffer (all of them: no chunks).
#include "base/half.h"
#include "cores/core.h"

#include <math.h>

CLMHA__HIDDEN extern const clmha__core clmha__core_user;  // this core, at the end of this file

// Every call of a layer with a user core is this core's (a call with a KV cache is the decode
// core's, asked first).
static clmha_status supports(clmha_layer *l, const clmha__core_call *call,
                             clmha__core_answer *answer) {
    const clmha__dims *d = call->dims;
    if (l->core && (clmha__windowed(d) || d->softcap > 0.0 || d->alibi || d->sinks || l->mods))
        clmha__core_answer_set(answer, CLMHA__CORE_REFUSES, CLMHA_UNSUPPORTED,
                               "a layer with a user attention core (clmha_layer_set_attention()) "
                               "takes no %s (clmha_core_args has none)",
                               clmha__windowed(d) ? "sliding window"
                               : l->mods          ? "user functions (mod_source)"
                               : d->alibi         ? "ALiBi"
                               : d->sinks         ? "sinks"
                                                  : "soft-capping");
    else if (l->core) clmha__core_runs(answer);
    else
        clmha__core_answer_set(answer, CLMHA__CORE_PASSES, CLMHA_SUCCESS,
                               "no clmha_attention_fn is set (clmha_layer_set_attention())");
    return CLMHA_SUCCESS;
}

// The backward calls of a layer with a user core are this core's too, and it has no backward.
static clmha_status backward_supports(clmha_layer *l, const clmha__backward_call *call,
                                      clmha__core_answer *answer) {
    (void)call;
    if (l->core)
        clmha__core_answer_set(answer, CLMHA__CORE_REFUSES, CLMHA_UNSUPPORTED,
                               "the layer has a user attention core "
                               "(clmha_layer_set_attention()), which has no backward pass");
    else
        clmha__core_answer_set(answer, CLMHA__CORE_PASSES, CLMHA_SUCCESS,
                               "no clmha_attention_fn is set");
    return CLMHA_SUCCESS;
}

static clmha_status run(clmha_layer *l, clmha__core_call *call) {
    const clmha_forward_args *a = call->args;
    const clmha__dims *d = call->dims;
    clmha_context *ctx = l->ctx;
    cl_event done = NULL;
    clmha_core_args ca = {
        .struct_size = sizeof ca,
        .queue = ctx->queue, .batch = d->n, .num_heads = l->h, .tgt_len = d->l,
        .src_len = d->s, .src_len_padded = d->s_padded, .head_dim = l->d,
        .scale = (float)clmha__core_scale(l, call->scale), .q = l->tiles[CLMHA__TILE_Q],
        .k = l->tiles[CLMHA__TILE_K], .v = l->tiles[CLMHA__TILE_V],
        .out = l->tiles[CLMHA__TILE_OUT], .weights = a->need_weights ? l->scores : NULL,
        .key_padding_mask = &a->key_padding_mask, .attn_mask = &a->attn_mask,
        .is_causal = a->is_causal, .training = a->training, .dropout = l->desc.dropout,
        .rng = a->rng, .num_wait = 0, .wait_list = NULL, .event = &done,
        // Its tiles are the layer's elements: doubles for float64; a 16-bit layer's pass is
        // float32 (forward/convert.c).
        .dtype = l->rs == sizeof(double) ? CLMHA_DTYPE_F64 : CLMHA_DTYPE_F32,
        .scale_f64 = clmha__core_scale(l, call->scale)};
    clmha_status st = l->core(&ca, l->core_data);
    if (done) clReleaseEvent(done);  // the in-order queue orders what follows after it
    if (st)
        return clmha__fail(ctx, CLMHA_CALLBACK_FAILED, "the user attention core returned %s",
                           clmha_status_string(st));
    return clmha__layer_mark(l, 1 + CLMHA_STAGE_SCORES);
}

const clmha__core clmha__core_user = {.name = "user",
                                      .returns_weights = true,
                                      .supports = supports,
                                      .uses_scores = true,
                                      .run = run,
                                      .backward_supports = backward_supports};
