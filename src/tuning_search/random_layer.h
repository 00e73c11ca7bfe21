// The layer the tuner's timed phases run on (fused_search.c, decode_search.c): self-attention
// of the shape's embed_dim and num_heads with bias, its parameters drawn from the tuner's
// random stream and kept for the double-precision reference.
#ifndef CLMHA_TUNING_SEARCH_RANDOM_LAYER_H
#define CLMHA_TUNING_SEARCH_RANDOM_LAYER_H

#include "clmha.h"

#include "base/defs.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct clmha__random_layer {
    clmha_layer_desc desc;
    clmha_layer *layer;
    float *params;              // in_proj_weight, out_proj.weight, in_proj_bias, out_proj.bias
    clmha_reference_params rp;  // the same parameters, for clmha_reference_forward()
} clmha__random_layer;

// Creates the layer (E @p e, H @p h) on @p ctx with parameters uniform in ±1/sqrt(e) drawn
// from @p rng. False when it could not be made (*out is then released already).
CLMHA__HIDDEN bool clmha__random_layer_make(clmha_context *ctx, uint64_t *rng, size_t e, size_t h,
                                            clmha__random_layer *out);

CLMHA__HIDDEN void clmha__random_layer_free(clmha__random_layer *rl);

#endif
