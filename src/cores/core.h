// Attention cores: the middle of the forward pass, from the head tiles Q, K, V (and the masks)
// to the attention output tiles (and, for the cores that have them, the weights). Every core
// implements this one interface; the forward pass asks the dispatch (clmha__core_select()) for
// the core of a call.
//
// Adding a core (split-K decode, backward) takes:
//   - src/cores/NAME.c: a `const clmha__core clmha__core_NAME` and everything of the core, its
//     per-layer state included (create/release; clmha__core_state(layer, &clmha__core_NAME));
//   - cl/cores/NAME.cl: its kernels; the core builds them as program family "NAME"
//     (clmha__program_get() finds every embedded cl/ file by name, with cl/common.cl in front
//     of those in cl/cores/: no entry in src/context/programs.c);
//   - in src/cores/core.c, its declaration and its row in the dispatch table;
//   - the two file names in CMakeLists.txt (CLMHA_SOURCES, CLMHA_CL_SOURCES).
// A core that others use beyond this interface (the tuner, tests) adds its own header
// (fused.h, unfused.h).
#ifndef CLMHA_CORES_CORE_H
#define CLMHA_CORES_CORE_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "cache/kv_cache.h"
#include "layer/layer.h"
#include "layer/shape.h"

// One call of a core: the forward call's arguments, their sizes, and where weights go.
typedef struct clmha__core_call {
    const clmha_forward_args *args;
    const clmha__dims *dims;
    cl_mem weights;         // the caller's weights buffer (when args->need_weights)
    size_t weights_offset;  // in floats
    bool weights_written;   // set by the core when it wrote the weights there itself
    // When not NULL (a forward call that saves for its backward): N*H*L floats where a core
    // that can writes each score row's log-sum-exp (see clmha__backward_call::lse), setting
    // lse_written.
    cl_mem lse;
    bool lse_written;
    // With a KV cache (clmha_forward_args::kv_cache; only the decode core runs such calls):
    // the call's plan of lengths, and whether the new key and value tiles are to be appended
    // (false: kv_attend_only, no new keys).
    const clmha__kv_plan *kv;
    bool kv_append;
    // Grouped-query attention: the query heads per key/value plane of this call's key and value
    // tiles (the layer's h / kvh where the core reads them grouped, clmha__core::grouped_kv;
    // 1 where the forward pass repeated them: the user core, and calls that save for the
    // backward pass, whose cores take one key/value plane per query head).
    size_t kv_group;
    // For a core with clmha__core::takes_rows: where the call's projected query, key and value
    // rows are in layer->proj (floats: head 0's first column in the first row, and the row
    // pitch; in_proj_bias not added), and the caller's output rows (offset in floats), which the
    // core fills with out_proj.bias for the output projection to add to.
    size_t q_at, q_ld, k_at, k_ld, v_at, v_ld;
    cl_mem output;
    size_t output_offset;
} clmha__core_call;

// One backward call of a core: what the forward call saved, the gradient of the attention
// result, and where the gradients of the head tiles go (src/backward/backward.c does the rest:
// output projection, head merge/split, input projections).
typedef struct clmha__backward_call {
    const clmha_forward_args *args;  // the forward call's arguments, device buffers: masks,
                                     // is_causal, training, rng
    const clmha__dims *dims;
    // Saved by the forward call: q (N*H, L, D), k and v (N*H, S', D) as the core saw them
    // (in_proj_bias added, bias_k/bias_v and the zero row appended), o (N*H, L, D) the attention
    // result (weights · V); lse (N*H*L floats, natural log of the row's sum of exp(score),
    // scores scaled and masked, -INFINITY on a fully masked row) when the fused core ran, else
    // NULL.
    cl_mem q, k, v, o, lse;
    cl_mem d_o;  // the gradient of o (N*H, L, D)
    // Optional (NULL): the caller's gradient of the returned weights, in the forward's weights
    // layout: (N, H, L, S') with per_head_weights, else (N, L, S') (the mean over heads).
    cl_mem grad_weights;
    size_t grad_weights_offset;  // floats
    // Where the core writes (overwrites) the gradients of the tiles: dq (N*H, L, D), dk and dv
    // (N*H, S', D), the appended rows included (the bias_k/bias_v row's gradient; the zero
    // row's is written too and ignored).
    cl_mem dq, dk, dv;
    // Optional (NULL): a float mask's gradient, in the mask's own layout (attn_mask: shared
    // (L, S), per head (N*H, L, S) or per batch (N, L, S), dims->attn_layout; key_padding_mask
    // (N, S)): the gradient of the scores summed over the dimensions the mask is broadcast
    // along, added to what is there when *_accumulate.
    cl_mem grad_attn_mask, grad_kpm;
    size_t grad_attn_offset, grad_kpm_offset;  // floats
    bool grad_attn_accumulate, grad_kpm_accumulate;
} clmha__backward_call;

typedef struct clmha__core {
    const char *name;
    // Grouped-query attention: the core reads the key and value tiles as the layer's kvh heads
    // ((N*KVH, S', D), each shared by h / kvh query heads); false: the forward pass repeats
    // them for every query head ((N*H, S', D)) before the core runs.
    bool grouped_kv;
    // The core takes the projected rows, not head tiles, for its queries, keys and values
    // (clmha__core_call::q_at ...) and writes the attention result as merged rows (rows, E)
    // into layer->tiles[CLMHA__TILE_OUT] (not layer->proj, which it reads), the output rows
    // filled with out_proj.bias: the forward pass then skips the head split, the merge and the
    // bias fill (the decode core: fewer commands in a decode step, whose fixed cost they are).
    bool takes_rows;
    // Optional (NULL: the core keeps no state). Called by clmha_layer_create() on a new layer
    // (parameters and cl/heads.cl kernels made): makes the core's per-layer state, stored in
    // *state as soon as it exists (clmha__core_state() finds it later), and builds what the core
    // builds up front. On failure the layer is released, release() included.
    clmha_status (*create)(clmha_layer *layer, void **state);
    // Optional: frees @p state (NULL or what create() left, also after a failed create()).
    void (*release)(void *state);
    // Whether the core runs @p call on @p layer (*yes), building what it needs on first use
    // (kernels, kept in its state). A status other than CLMHA_SUCCESS fails the forward call
    // before anything is enqueued.
    clmha_status (*supports)(clmha_layer *layer, const clmha__core_call *call, bool *yes);
    // The core reads and writes layer->scores (clmha__layer_reserve()'s `scores`).
    bool uses_scores;
    // Enqueues the core's work on the context's queue, marking its profiling stages
    // (clmha__layer_mark()). Weights asked for go to layer->scores, (N*H, L, S'), for the
    // forward pass to return, or straight to call->weights (then call->weights_written).
    clmha_status (*run)(clmha_layer *layer, clmha__core_call *call);
    // Optional (NULL: the core has no backward pass). Whether it runs backward call @p call
    // (*yes; false with a reason in @p why, for CLMHA_IMPL_FUSED's message), building what it
    // needs on first use.
    clmha_status (*backward_supports)(clmha_layer *layer, const clmha__backward_call *call,
                                      bool *yes, const char **why);
    // Enqueues the backward pass of the core on the context's queue: fills call->dq, dk, dv
    // and the mask gradients asked for. Its scratch is its own (kept in its state) or the
    // layer's scores buffer (clmha__layer_reserve()).
    clmha_status (*backward)(clmha_layer *layer, clmha__backward_call *call);
} clmha__core;

// What a slot of clmha_layer::core_state holds (clmha__cores_create()): the core, and the state
// its create() made.
typedef struct clmha__core_slot {
    const clmha__core *core;
    void *state;
} clmha__core_slot;

// The state of @p core (a row of the dispatch table) in @p layer: what its create() made, or NULL.
// Read from the layer alone, so that a core finds its state without calling the dispatch.
static inline void *clmha__core_state(const clmha_layer *layer, const clmha__core *core) {
    for (size_t i = 0; i < CLMHA__CORE_SLOTS; ++i) {
        const clmha__core_slot *slot = layer->core_state[i];
        if (slot && slot->core == core) return slot->state;
    }
    return NULL;
}

// The core that runs backward call @p call with @p impl (CLMHA_IMPL_AUTO: the fused core when it
// supports the call, else the unfused one); fails with a message when none does. With
// CLMHA_IMPL_FUSED, a call that a driver bug keeps from the fused core runs the unfused one:
// @p fused_fell_back (its forward asked for the fused core and ran the unfused one), or the fused
// backward's own loop limit (clmha__fused_backward_loop_why).
CLMHA__HIDDEN clmha_status clmha__backward_select(clmha_layer *layer,
                                                  const clmha__backward_call *call,
                                                  clmha_impl impl, bool fused_fell_back,
                                                  const clmha__core **out);

// Runs every core's create() on @p layer, in table order; stops at the first failure.
CLMHA__HIDDEN clmha_status clmha__cores_create(clmha_layer *layer);

// Runs every core's release() on its state in @p layer and clears the slots.
CLMHA__HIDDEN void clmha__cores_release(clmha_layer *layer);

// The core that runs @p call: the first row of the dispatch table that supports it (the user's
// core, else the fused core when the call and the device allow it, else the unfused core).
CLMHA__HIDDEN clmha_status clmha__core_select(clmha_layer *layer, const clmha__core_call *call,
                                              const clmha__core **out);

// The core a call asks for: its own impl, else the layer's (either may be CLMHA_IMPL_AUTO).
static inline clmha_impl clmha__impl_of(const clmha_layer *layer,
                                        const clmha_forward_args *args) {
    return args->impl != CLMHA_IMPL_AUTO ? args->impl : layer->impl;
}

#endif
