// The unfused attention core (src/cores/unfused.c, kernel cl/cores/unfused.cl): what the tests
// read of it besides the core interface (core.h).
#ifndef CLMHA_CORES_UNFUSED_H
#define CLMHA_CORES_UNFUSED_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"
#include "layer/shape.h"

// The work-group of @p layer's masked_softmax kernel (its -DWG), within the kernel's limit.
CLMHA__HIDDEN size_t clmha__unfused_softmax_wg(const clmha_layer *layer);

// Recomputes the probabilities of a call for its backward pass: scores = Q·Kᵀ/√D from @p q
// (N*H, L, D) and @p k (N*H, S', D), both at offset 0, then masks and softmax without dropout,
// into layer->scores, all rows at once (the caller has reserved them:
// clmha__layer_reserve(), one chunk).
CLMHA__HIDDEN clmha_status clmha__unfused_probabilities(clmha_layer *layer,
                                                        const clmha_forward_args *args,
                                                        const clmha__dims *dims, cl_mem q,
                                                        cl_mem k);

// ---- backward (src/cores/unfused_backward.c, kernels cl/cores/unfused_backward.cl) ---------------

struct clmha__backward_call;

// The unfused backward pass's per-layer state (kernels, the dS scratch), kept in the unfused
// core's state and freed with it.
typedef struct clmha__unfused_backward clmha__unfused_backward;

// Where the unfused core's state keeps @p layer's backward state (NULL until first used).
CLMHA__HIDDEN clmha__unfused_backward **clmha__unfused_backward_slot(const clmha_layer *layer);

// The unfused core's backward_supports hook: yes when the scores fit in one chunk
// (clmha__scores_chunks()), building its kernels on first use.
CLMHA__HIDDEN clmha_status clmha__unfused_backward_supports(
    clmha_layer *layer, const struct clmha__backward_call *call, bool *yes, const char **why);

// The unfused core's backward hook: P recomputed, dPd = dO·V'ᵀ, softmax_backward, the three
// gradient GEMMs, the mask gradients.
CLMHA__HIDDEN clmha_status clmha__unfused_backward_run(clmha_layer *layer,
                                                       struct clmha__backward_call *call);

// Frees @p b (NULL is ignored).
CLMHA__HIDDEN void clmha__unfused_backward_release(clmha__unfused_backward *b);

#endif
