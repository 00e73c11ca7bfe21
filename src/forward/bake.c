// Baking a layer (clmha_layer_bake()): one forward pass on zeros at a given shape, so that later
// calls of that shape neither compile nor allocate.
#include "base/half.h"
#include "cores/core.h"
#include "device/held.h"
#include "layer/layer.h"
#include "layer/mods.h"

clmha_status clmha_layer_bake(clmha_layer *layer, size_t batch, size_t tgt_len, size_t src_len,
                              bool need_weights) {
    if (!layer) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "layer is NULL");
    clmha_context *ctx = layer->ctx;
    if (!batch || !tgt_len || !src_len)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "bake sizes must be positive (batch %zu, tgt_len %zu, src_len %zu)",
                           batch, tgt_len, src_len);
    // One forward pass on zeros at this shape sizes the scratch and makes CLBlast compile the
    // GEMM kernels it picks for these sizes. Self-attention (the packed projection) when the
    // shape allows it, else cross-attention.
    size_t e = layer->e, kd = layer->desc.kdim, vd = layer->desc.vdim;
    bool self = tgt_len == src_len && kd == e && vd == e;
    clmha_forward_args args = {
        .struct_size = sizeof args,
        .query = {.ndim = 3, .shape = {tgt_len, batch, e}},
        .need_weights = need_weights};
    if (!self) {
        args.key = (clmha_tensor){.ndim = 3, .shape = {src_len, batch, kd}};
        args.value = (clmha_tensor){.ndim = 3, .shape = {src_len, batch, vd}};
    }
    if (layer->desc.batch_first) {
        clmha_tensor *t[3] = {&args.query, &args.key, &args.value};
        for (int i = 0; i < 3; ++i) {
            size_t seq = t[i]->shape[0];
            t[i]->shape[0] = t[i]->shape[1];
            t[i]->shape[1] = seq;
        }
    }
    size_t out_count = 0, w_count = 0;
    clmha_status st = clmha_layer_output_counts(layer, &args, &out_count, &w_count);
    if (st) return st;
    size_t counts[5] = {out_count, self ? 0 : batch * src_len * kd,
                        self ? 0 : batch * src_len * vd, out_count, w_count};
    cl_mem bufs[5] = {NULL};  // query, key, value, output, weights
    for (int i = 0; i < 5 && !st; ++i) {
        if (!counts[i]) continue;
        st = clmha__zero_buffer(ctx, counts[i], clmha__dtype_size(layer->desc.dtype),
                                "bake buffers", &bufs[i]);
    }
    args.query.buffer = bufs[0];
    args.key.buffer = bufs[1];
    args.value.buffer = bufs[2];
    if (!st)
        st = clmha_layer_forward(layer, &args, bufs[3], 0, bufs[4], 0, 0, NULL, NULL);
    // A user mask function's block mask (the fused core's: its kernel and buffer) comes with a
    // pass without weights: a second one where the first had them.
    if (!st && need_weights && (layer->mods & CLMHA__MOD_MASK)) {
        args.need_weights = false;
        st = clmha_layer_forward(layer, &args, bufs[3], 0, NULL, 0, 0, NULL, NULL);
    }
    // The pass ran one core: every core builds now what a later call of this layer would
    // build on first use (a pass with weights did not run the core for the calls without).
    if (!st) st = clmha__cores_bake(layer);
    cl_int err = clFinish(ctx->queue);
    if (!st && err != CL_SUCCESS) st = clmha__cl_fail(ctx, err, "clFinish");
    for (int i = 0; i < 5; ++i) clmha__release_mem(bufs[i]);
    return st;
}
