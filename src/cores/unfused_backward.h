// The unfused core's backward pass (src/cores/unfused_backward.c, kernels
// cl/cores/unfused_backward.cl): the hooks the unfused core (src/cores/unfused.c) hands on, with
// the place in its state where the backward pass keeps its own.
#ifndef CLMHA_CORES_UNFUSED_BACKWARD_H
#define CLMHA_CORES_UNFUSED_BACKWARD_H

#include <stdbool.h>

#include "clmha.h"

#include "base/defs.h"
#include "cores/unfused_shared.h"
#include "layer/layer.h"

struct clmha__backward_call;
struct clmha__core_answer;

// The unfused backward pass's per-layer state (kernels, the dS scratch), kept in the unfused
// core's state and freed with it.
typedef struct clmha__unfused_backward clmha__unfused_backward;

// The unfused core's backward_supports hook (*@p slot: the state, made on first use): it runs
// every call whose scores fit in one chunk (clmha__scores_chunks()), building its kernels on
// first use, and refuses the others (it is the last core: no other runs them).
CLMHA__HIDDEN clmha_status clmha__unfused_backward_supports(clmha__unfused_backward **slot,
                                                            clmha_layer *layer,
                                                            const struct clmha__backward_call *call,
                                                            struct clmha__core_answer *answer);

// The unfused core's backward hook (*@p slot: the state, made on first use): P recomputed with
// the core's masked_softmax @p sm, dPd = dO·V'ᵀ, softmax_backward, the three gradient GEMMs,
// the mask gradients.
CLMHA__HIDDEN clmha_status clmha__unfused_backward_run(clmha__unfused_backward **slot,
                                                       const clmha__unfused_softmax *sm,
                                                       clmha_layer *layer,
                                                       struct clmha__backward_call *call);

// Frees @p b (NULL is ignored).
CLMHA__HIDDEN void clmha__unfused_backward_release(clmha__unfused_backward *b);

#endif
