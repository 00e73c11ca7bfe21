// The dispatch of attention cores (core.h): one table, in the order the cores are tried; row i
// keeps its per-layer state in slot i of clmha_layer::core_state, as a clmha__core_slot that
// names the core, so that a core finds its state (clmha__core_state(), core.h) without this
// file: the table calls the cores, never the other way.
#include "cores/core.h"
#include "cores/fused_backward.h"

#include <stdlib.h>

// The cores, each defined in its own file (src/cores/NAME.c), which declares it too.
CLMHA__HIDDEN extern const clmha__core clmha__core_decode, clmha__core_user, clmha__core_fused,
    clmha__core_unfused;

static const clmha__core *const cores[] = {
    &clmha__core_decode,   // calls with a KV cache, and only those
    &clmha__core_user,     // the caller's clmha_attention_fn, when one is set
    &clmha__core_fused,    // no weights asked for, or CLMHA_IMPL_FUSED; built on first use
    &clmha__core_unfused,  // everything else, and wherever the fused core cannot run
};

enum { CORE_COUNT = sizeof cores / sizeof cores[0] };
_Static_assert(CORE_COUNT <= CLMHA__CORE_SLOTS, "raise CLMHA__CORE_SLOTS (src/layer/layer.h)");

clmha_status clmha__cores_create(clmha_layer *layer) {
    for (size_t i = 0; i < CORE_COUNT; ++i) {
        if (!cores[i]->create) continue;
        clmha__core_slot *slot = calloc(1, sizeof *slot);
        if (!slot) return clmha__fail(layer->ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
        slot->core = cores[i];
        layer->core_state[i] = slot;
        clmha_status st = cores[i]->create(layer, &slot->state);
        if (st) return st;
    }
    return CLMHA_SUCCESS;
}

void clmha__cores_release(clmha_layer *layer) {
    for (size_t i = 0; i < CORE_COUNT; ++i) {
        clmha__core_slot *slot = layer->core_state[i];
        if (cores[i]->release) cores[i]->release(slot ? slot->state : NULL);
        free(slot);
        layer->core_state[i] = NULL;
    }
}

clmha_status clmha__core_select(clmha_layer *layer, const clmha__core_call *call,
                                const clmha__core **out) {
    for (size_t i = 0; i < CORE_COUNT; ++i) {
        bool yes = false;
        clmha_status st = cores[i]->supports(layer, call, &yes);
        if (st) return st;
        if (yes) {
            *out = cores[i];
            return CLMHA_SUCCESS;
        }
    }
    return clmha__fail(layer->ctx, CLMHA_UNSUPPORTED, "no attention core supports this call");
}

// Asks @p core whether it runs @p call: *yes, and why not in *why.
static clmha_status backward_asks(clmha_layer *layer, const clmha__core *core,
                                  const clmha__backward_call *call, bool *yes, const char **why) {
    *yes = false;
    *why = NULL;
    return core->backward ? core->backward_supports(layer, call, yes, why) : CLMHA_SUCCESS;
}

clmha_status clmha__backward_select(clmha_layer *layer, const clmha__backward_call *call,
                                    clmha_impl impl, bool fused_fell_back,
                                    const clmha__core **out) {
    *out = NULL;
    if (layer->core)
        return clmha__fail(layer->ctx, CLMHA_UNSUPPORTED,
                           "the layer has a user attention core (clmha_layer_set_attention()), "
                           "which has no backward pass");
    bool yes;
    const char *why;
    clmha_status st;
    if (impl != CLMHA_IMPL_UNFUSED) {
        if ((st = backward_asks(layer, &clmha__core_fused, call, &yes, &why))) return st;
        if (yes) {
            *out = &clmha__core_fused;
            return CLMHA_SUCCESS;
        }
        // CLMHA_IMPL_FUSED gets the reason, unless a driver bug keeps the fused core from this
        // call (its forward ran the unfused core for it, or the backward's loops would pass the
        // loop limit): then it runs the unfused one, as the forward does.
        if (impl == CLMHA_IMPL_FUSED && !fused_fell_back && why != clmha__fused_backward_loop_why)
            return clmha__fail(layer->ctx, CLMHA_UNSUPPORTED,
                               "the fused backward core cannot run this call: %s",
                               why ? why : "unsupported");
    }
    if ((st = backward_asks(layer, &clmha__core_unfused, call, &yes, &why))) return st;
    if (yes) {
        *out = &clmha__core_unfused;
        return CLMHA_SUCCESS;
    }
    return clmha__fail(layer->ctx, CLMHA_UNSUPPORTED,
                       "the unfused backward core cannot run this call: %s",
                       why ? why : "unsupported");
}
