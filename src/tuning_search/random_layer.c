// The tuner's random layer (see random_layer.h).
#define _POSIX_C_SOURCE 200809L

#include "tuning_search/random_layer.h"

#include "tuning_search/tuner_state.h"  // rand_unit

#include <math.h>
#include <stdlib.h>
#include <string.h>

bool clmha__random_layer_make(clmha_context *ctx, uint64_t *rng, size_t e, size_t h,
                              clmha__random_layer *out) {
    memset(out, 0, sizeof *out);
    out->desc = (clmha_layer_desc){.struct_size = sizeof out->desc, .embed_dim = e,
                                   .num_heads = h, .bias = true};
    size_t nparam = 4 * e * e + 4 * e;
    if (!(out->params = malloc(nparam * sizeof *out->params)) ||
        clmha_layer_create(&out->layer, ctx, &out->desc)) {
        clmha__random_layer_free(out);
        return false;
    }
    double bound = 1.0 / sqrt((double)e);
    for (size_t i = 0; i < nparam; ++i) out->params[i] = (float)(bound * rand_unit(rng));
    const float *w_in = out->params, *w_out = out->params + 3 * e * e,
                *b_in = out->params + 4 * e * e, *b_out = out->params + 4 * e * e + 3 * e;
    out->rp = (clmha_reference_params){.struct_size = sizeof out->rp,
                                       .in_proj_weight = w_in, .in_proj_bias = b_in,
                                       .out_proj_weight = w_out, .out_proj_bias = b_out};
    if (clmha_layer_set_parameter(out->layer, "in_proj_weight", w_in, 3 * e * e) ||
        clmha_layer_set_parameter(out->layer, "out_proj.weight", w_out, e * e) ||
        clmha_layer_set_parameter(out->layer, "in_proj_bias", b_in, 3 * e) ||
        clmha_layer_set_parameter(out->layer, "out_proj.bias", b_out, e)) {
        clmha__random_layer_free(out);
        return false;
    }
    return true;
}

void clmha__random_layer_free(clmha__random_layer *rl) {
    clmha_layer_release(rl->layer);
    free(rl->params);
    memset(rl, 0, sizeof *rl);
}
