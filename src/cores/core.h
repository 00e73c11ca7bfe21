// Attention cores: the middle of the forward pass, from the head tiles Q, K, V (and the masks)
// to the attention output tiles (and, for the cores that have them, the weights). Every core
// implements this one interface; the forward pass asks the dispatch (clmha__core_select()) for
// the core of a call. Adding a core (split-K decode, backward) takes one host file in
// src/cores/, its kernels in cl/cores/ (a program family in src/context/programs.c) and a row
// of the table in src/cores/core.c.
#ifndef CLMHA_CORES_CORE_H
#define CLMHA_CORES_CORE_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"
#include "layer/shape.h"

// One call of a core: the forward call's arguments, their sizes, and where weights go.
typedef struct clmha__core_call {
    const clmha_forward_args *args;
    const clmha__dims *dims;
    cl_mem weights;         // the caller's weights buffer (when args->need_weights)
    size_t weights_offset;  // in floats
    bool weights_written;   // set by the core when it wrote the weights there itself
} clmha__core_call;

typedef struct clmha__core {
    const char *name;
    // Whether the core runs @p call on @p layer (*yes), building what it needs on first use
    // (kernels, kept in the layer). A status other than CLMHA_SUCCESS fails the forward call
    // before anything is enqueued.
    clmha_status (*supports)(clmha_layer *layer, const clmha__core_call *call, bool *yes);
    // The core reads and writes layer->scores (clmha__layer_reserve()'s `scores`).
    bool uses_scores;
    // Enqueues the core's work on the context's queue, marking its profiling stages
    // (clmha__layer_mark()). Weights asked for go to layer->scores, (N*H, L, S'), for the
    // forward pass to return, or straight to call->weights (then call->weights_written).
    clmha_status (*run)(clmha_layer *layer, clmha__core_call *call);
} clmha__core;

// The cores (src/cores/user.c, fused.c, unfused.c).
CLMHA__HIDDEN extern const clmha__core clmha__core_user;
CLMHA__HIDDEN extern const clmha__core clmha__core_fused;
CLMHA__HIDDEN extern const clmha__core clmha__core_unfused;

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
