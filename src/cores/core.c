// The dispatch of attention cores (core.h): one table, in the order the cores are tried.
#include "cores/core.h"

static const clmha__core *const cores[] = {
    &clmha__core_user,     // the caller's clmha_attention_fn, when one is set
    &clmha__core_fused,    // no weights asked for, or CLMHA_IMPL_FUSED; built on first use
    &clmha__core_unfused,  // everything else, and wherever the fused core cannot run
};

clmha_status clmha__core_select(clmha_layer *layer, const clmha__core_call *call,
                                const clmha__core **out) {
    for (size_t i = 0; i < sizeof cores / sizeof cores[0]; ++i) {
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
