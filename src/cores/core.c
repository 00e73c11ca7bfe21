// The dispatch of attention cores (core.h): one table, in the order the cores are tried; row i
// keeps its per-layer state in slot i of clmha_layer::core_state, as a clmha__core_slot that
// names the core, so that a core finds its state (clmha__core_state(), core.h) without this
// file: the table calls the cores, never the other way. Nothing here knows what a core does:
// the walks ask each row's hooks and flags.
#include "cores/core.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The cores, one row each, in the order they are asked; each is defined in its own file
// (src/cores/NAME.c as `const clmha__core clmha__core_NAME`).
#define CLMHA__CORE_TABLE(X)                                                                  \
    X(decode)  /* calls with a KV cache, and only those */                                    \
    X(user)    /* the caller's clmha_attention_fn, when one is set */                         \
    X(host_fused) /* plain calls on the host path (CPU devices), CLMHA_IMPL_AUTO only */  \
    X(fused)   /* no weights asked for, or CLMHA_IMPL_FUSED; built on first use */            \
    X(unfused) /* everything else, and wherever the fused core cannot run */

#define DECLARE(name) CLMHA__HIDDEN extern const clmha__core clmha__core_##name;
#define ROW(name) &clmha__core_##name,
CLMHA__CORE_TABLE(DECLARE)
static const clmha__core *const cores[] = {CLMHA__CORE_TABLE(ROW)};
#undef DECLARE
#undef ROW

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

clmha_status clmha__cores_bake(clmha_layer *layer) {
    for (size_t i = 0; i < CORE_COUNT; ++i) {
        clmha_status st = cores[i]->bake ? cores[i]->bake(layer) : CLMHA_SUCCESS;
        if (st) return st;
    }
    return CLMHA_SUCCESS;
}

// The reasons of the cores that did not run a call, "the NAME core: why; ...", for the message
// when none does.
typedef struct reasons {
    char text[1024];
    size_t used;
} reasons;

static void reasons_add(reasons *r, const clmha__core *core, const char *why) {
    if (r->used >= sizeof r->text - 1) return;
    int n = snprintf(r->text + r->used, sizeof r->text - r->used, "%sthe %s core: %s",
                     r->used ? "; " : "", core->name, why[0] ? why : "it does not run it");
    if (n > 0) r->used += (size_t)n;
}

// What the walks do with @p a of @p core: true when the walk ends (the core runs the call, or
// refuses it: *st says which); false to ask the next row.
static bool settle(clmha_layer *layer, const clmha__core *core, const clmha__core_answer *a,
                   reasons *r, bool *fell_back, clmha_status *st) {
    *st = CLMHA_SUCCESS;
    switch (a->reason) {
    case CLMHA__CORE_RUNS: return true;
    case CLMHA__CORE_REFUSES:
        *st = clmha__fail(layer->ctx, a->status ? a->status : CLMHA_UNSUPPORTED, "%s", a->why);
        return true;
    case CLMHA__CORE_FALLS_BACK:
        if (fell_back) *fell_back = true;
        reasons_add(r, core, a->why);
        return false;
    default: reasons_add(r, core, a->why); return false;
    }
}

// A call with need_weights that asked (impl) for @p core, which returns none: *a refuses it,
// naming the impl values of the cores that do.
static void no_weights(const clmha_layer *layer, const clmha__core *core,
                       const clmha__core_call *call, clmha__core_answer *a) {
    char others[128] = "";
    size_t used = 0;
    for (size_t i = 0; i < CORE_COUNT; ++i) {
        if (!cores[i]->returns_weights || cores[i]->impl == CLMHA_IMPL_AUTO) continue;
        char upper[32] = "";
        const char *name = clmha_impl_name(cores[i]->impl);
        for (size_t c = 0; name[c] && c + 1 < sizeof upper; ++c)
            upper[c] = (char)toupper((unsigned char)name[c]);
        int n = snprintf(others + used, sizeof others - used, " or CLMHA_IMPL_%s", upper);
        if (n < 0 || (size_t)n >= sizeof others - used) break;
        used += (size_t)n;
    }
    clmha__core_answer_set(a, CLMHA__CORE_REFUSES, CLMHA_INVALID_ARGUMENT,
                           "need_weights is set but the %s core (impl %s%s) does not return "
                           "weights: use CLMHA_IMPL_AUTO%s",
                           core->name, clmha_impl_name(clmha__impl_of(layer, call->args)),
                           call->args->impl == CLMHA_IMPL_AUTO ? ", the layer's choice" : "",
                           others);
}

// What the table's flags say of @p core and @p call before the core is asked: true, with *a
// set, when the core is not asked (a call with a KV cache for a core without them or the other
// way round; a call that needs the log-sum-exp rows or the weights, which the core does not
// give, unless the call asks for the core by its impl: then the core is asked and the call
// refused after, so that the message names it).
static bool not_asked(const clmha_layer *layer, const clmha__core *core,
                      const clmha__core_call *call, clmha__core_answer *a) {
    const clmha_forward_args *args = call->args;
    bool named = core->impl != CLMHA_IMPL_AUTO && clmha__impl_of_call(layer, call) == core->impl;
    const char *why = (args->kv_cache != NULL) != core->kv_cache
                          ? (core->kv_cache ? "it runs the calls with a KV cache only"
                                            : "it takes no KV cache")
                      : call->need_lse && !core->writes_lse ? "it writes no log-sum-exp rows"
                      : args->need_weights && !core->returns_weights && !named && !core->kv_cache
                          ? "it returns no weights (need_weights)"
                          : NULL;
    if (why) clmha__core_answer_set(a, CLMHA__CORE_PASSES, CLMHA_SUCCESS, "%s", why);
    return why != NULL;
}

clmha_status clmha__core_select(clmha_layer *layer, const clmha__core_call *call,
                                const clmha__core **out, bool *fell_back) {
    reasons r = {.used = 0};
    if (fell_back) *fell_back = false;
    for (size_t i = 0; i < CORE_COUNT; ++i) {
        clmha__core_answer a;
        clmha__core_runs(&a);
        if (!not_asked(layer, cores[i], call, &a)) {
            clmha_status st = cores[i]->supports(layer, call, &a);
            if (st) return st;
            if (a.reason == CLMHA__CORE_RUNS && call->args->need_weights &&
                !cores[i]->returns_weights)
                no_weights(layer, cores[i], call, &a);
        }
        clmha_status st;
        if (settle(layer, cores[i], &a, &r, fell_back, &st)) {
            if (!st) *out = cores[i];
            return st;
        }
    }
    return clmha__fail(layer->ctx, CLMHA_UNSUPPORTED,
                       "no attention core runs this call%s on this device (%s): %s",
                       call->need_lse ? " (it needs the log-sum-exp rows)" : "",
                       clmha_context_device_name(layer->ctx), r.text);
}

clmha_status clmha__backward_select(clmha_layer *layer, const clmha__backward_call *call,
                                    const clmha__core **out) {
    reasons r = {.used = 0};
    *out = NULL;
    for (size_t i = 0; i < CORE_COUNT; ++i) {
        if (!cores[i]->backward_supports) continue;
        clmha__core_answer a;
        clmha__core_runs(&a);
        clmha_status st = cores[i]->backward_supports(layer, call, &a);
        if (st) return st;
        if (a.reason == CLMHA__CORE_RUNS && !cores[i]->backward)
            clmha__core_answer_set(&a, CLMHA__CORE_PASSES, CLMHA_SUCCESS, "it has no backward");
        if (settle(layer, cores[i], &a, &r, NULL, &st)) {
            if (!st) *out = cores[i];
            return st;
        }
    }
    return clmha__fail(layer->ctx, CLMHA_UNSUPPORTED,
                       "no attention core's backward runs this call: %s", r.text);
}

clmha_status clmha__core_merge(clmha_context *ctx, const clmha__merge_call *call) {
    for (size_t i = 0; i < CORE_COUNT; ++i)
        if (cores[i]->merge) return cores[i]->merge(ctx, call);
    return clmha__fail(ctx, CLMHA_UNSUPPORTED, "no attention core merges partial results");
}
