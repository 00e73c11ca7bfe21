// Creating and releasing layers (clmha_layer_create(), clmha_layer_release()): the layer itself
// (src/layer/: parameters, the cl/heads.cl kernels), then the state of every attention core
// (src/cores/: their create and release hooks), which the layer cannot reach from below them.
#include "cores/core.h"
#include "layer/layer.h"

clmha_status clmha_layer_create(clmha_layer **out, clmha_context *ctx,
                                const clmha_layer_desc *desc) {
    clmha_status st = clmha__layer_new(out, ctx, desc);
    if (st) return st;
    if ((st = clmha__cores_create(*out))) {
        clmha_layer_release(*out);
        *out = NULL;
    }
    return st;
}

void clmha_layer_release(clmha_layer *layer) {
    if (!layer) return;
    clmha__cores_release(layer);
    clmha__layer_free(layer);
}
