// The saved state of a forward call (clmha_saved): what its backward pass needs, kept in
// buffers the caller's object owns. A forward call with clmha_forward_args::save runs its head
// tiles in the object's buffers instead of the layer's scratch (clmha__saved_swap()), so that
// saving costs no copy; src/backward/ reads them.
#ifndef CLMHA_FORWARD_SAVED_H
#define CLMHA_FORWARD_SAVED_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"
#include "layer/shape.h"

struct clmha_saved {
    clmha_layer *layer;    // the layer whose forward calls fill it (not retained)
    clmha_context *ctx;    // retained: the buffers belong to its cl_context
    // q (N*H, L, D), k and v (N*H, S', D), o (N*H, L, D): the head tiles of the call, the
    // layer's CLMHA__TILE_* order; caps in floats.
    cl_mem tiles[CLMHA__TILE_COUNT];
    size_t caps[CLMHA__TILE_COUNT];
    // N*H*L floats of log-sum-exp rows, written by a core that writes them (has_lse), then
    // room for each row's maximum and log(sum) apart (clmha__core_call::lse_split), written
    // where lse_split.
    cl_mem lse;
    size_t lse_cap;
    bool filled;           // a forward call succeeded with it (dims, has_lse, core are its)
    bool has_lse, lse_split;
    clmha__dims dims;      // the sizes of that call
    const void *core;      // the core (const clmha__core *) that ran it
    // The options of that call that its backward must repeat.
    bool is_causal, need_weights, per_head_weights, training;
    // The core the call asked for could not run it here (a driver bug: clmha_impl) and the next
    // one did (clmha__core_select()); its backward may fall back too.
    bool fell_back;
    clmha_dropout_rng rng;
    // A packed call's (clmha_forward_args::seq_lens; src/forward/packed.c): each sequence's
    // state in an object of its own (parts[i], made on demand, parts_cap of them), and the
    // call's lengths (lens: num_seqs query lengths, then as many key/value lengths).
    bool packed;
    struct clmha_saved **parts;
    size_t parts_cap;
    size_t *lens;
};

// Makes @p saved ready for a forward call of @p layer with sizes @p dims: checks that it
// belongs to @p layer, grows its buffers, and marks it not filled (until clmha__saved_filled()).
CLMHA__HIDDEN clmha_status clmha__saved_prepare(clmha_saved *saved, clmha_layer *layer,
                                                const clmha__dims *dims);

// Makes @p saved ready for the packed call of sizes @p d (d->packed): a part for every
// sequence, and the call's lengths; not filled until clmha__saved_packed_filled().
CLMHA__HIDDEN clmha_status clmha__saved_packed_prepare(clmha_saved *saved, clmha_layer *layer,
                                                       const clmha__dims *d);

// Records that the packed call @p args (sizes @p d) filled the parts of @p saved.
CLMHA__HIDDEN void clmha__saved_packed_filled(clmha_saved *saved, const clmha_forward_args *args,
                                              const clmha__dims *d);

// Exchanges the layer's head tiles with those of @p saved (twice puts them back).
CLMHA__HIDDEN void clmha__saved_swap(clmha_saved *saved, clmha_layer *layer);

// Records that the forward call @p args (sizes @p dims, core @p core, log-sum-exp written when
// @p has_lse; @p fell_back as clmha_saved says) has been enqueued with @p saved.
CLMHA__HIDDEN void clmha__saved_filled(clmha_saved *saved, const clmha_forward_args *args,
                                       const clmha__dims *dims, const void *core, bool has_lse,
                                       bool fell_back);

#endif
