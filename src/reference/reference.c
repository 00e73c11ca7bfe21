// CPU reference of the forward pass in double precision. Written for clarity, not speed: every
// step of nn.MultiheadAttention is a separate loop nest over plain row-major arrays, in the
// order the data flows:
//
//   validate -> input projections -> split heads (+ bias_k/bias_v, + zero key/value)
//   -> scores q.k^T / sqrt(D) -> masks -> softmax -> dropout -> weights . V
//   -> merge heads -> output projection
//
// The steps up to weights . V are shared with the backward pass (reference_math.c). Shapes are
// checked by the same code as the OpenCL path (src/layer/shape.c), so both accept and refuse
// exactly the same calls.
#include "base/message.h"
#include "layer/packed.h"
#include "reference/reference_math.h"

#include <stdlib.h>
#include <string.h>

// A packed call (clmha_forward_args::seq_lens), validated into @p call: one reference call per
// sequence on its rows, cut as the device pass cuts it (layer/packed.h).
static clmha_status forward_packed(const clmha__ref_call *call, double *output,
                                       char *message, size_t message_size) {
    const clmha__dims *d = &call->d;
    clmha__packed_at at = {0, 0};
    for (size_t i = 0; i < d->n; at = clmha__packed_next(d, i, at), ++i) {
        if (!d->seq_lens[i]) continue;
        clmha_forward_args sub;
        clmha__packed_args(d, &call->args, i, at, sizeof(float), &sub);
        size_t count = d->seq_lens[i] * d->e;
        clmha_status st = clmha_reference_forward(&call->desc, &call->params, &sub,
                                                  output + at.q0 * d->e, count, NULL, 0,
                                                  message, message_size);
        if (st) return st;
    }
    return CLMHA_SUCCESS;
}

clmha_status clmha_reference_forward(const clmha_layer_desc *desc_in,
                                     const clmha_reference_params *params,
                                     const clmha_forward_args *args_in, double *output,
                                     size_t output_count, double *weights, size_t weights_count,
                                     char *message, size_t message_size) {
    clmha__ref_call call;
    clmha__ref_forward f;
    clmha_status st;
    if (message && message_size) message[0] = '\0';

    // 1. Validate.
    if ((st = clmha__ref_validate(desc_in, params, args_in, false, &call, message,
                                  message_size)))
        return st;
    const clmha__dims d = call.d;
    const clmha_forward_args *args = &call.args;
    if (!output)
        return clmha__msg(message, message_size, CLMHA_INVALID_ARGUMENT, "output is NULL");
    if (output_count != d.output_count)
        return clmha__msg(message, message_size, CLMHA_SHAPE_MISMATCH,
                          "output_count is %zu, the output has %zu elements", output_count,
                          d.output_count);
    if (args->need_weights && !weights)
        return clmha__msg(message, message_size, CLMHA_INVALID_ARGUMENT,
                          "need_weights is set but weights is NULL");
    if (weights_count != d.weights_count)
        return clmha__msg(message, message_size, CLMHA_SHAPE_MISMATCH,
                          "weights_count is %zu, the weights have %zu elements%s", weights_count,
                          d.weights_count, args->need_weights ? "" : " (need_weights is off)");

    if (d.packed) return forward_packed(&call, output, message, message_size);

    // 2.-9. Projections, heads, scores, masks, softmax, dropout, weights . V, merged heads.
    if ((st = clmha__ref_forward_run(&call, false, &f, message, message_size))) return st;

    // 10. Output projection, written in the query's layout.
    const size_t e = d.e, sp = d.s_padded;
    const float *b_out = call.desc.bias ? call.params.out_proj_bias : NULL;
    const float *w_out = call.params.out_proj_weight;
    for (size_t n = 0; n < d.n; ++n)
        for (size_t i = 0; i < d.l; ++i)
            for (size_t o = 0; o < e; ++o) {
                double acc = b_out ? (double)b_out[o] : 0.0;
                for (size_t c = 0; c < e; ++c)
                    acc += f.ctx[(n * d.l + i) * e + c] * (double)w_out[o * e + c];
                output[clmha__ref_input_index(&d, d.l, e, i, n, o)] = acc;
            }

    // 11. Weights: per head (N, H, L, S') is the layout of f.weights itself; else averaged over
    //     heads.
    if (args->need_weights) {
        if (args->per_head_weights) {
            memcpy(weights, f.weights, d.scores_count * sizeof *weights);
        } else {
            for (size_t n = 0; n < d.n; ++n)
                for (size_t i = 0; i < d.l; ++i)
                    for (size_t j = 0; j < sp; ++j) {
                        double sum = 0.0;
                        for (size_t h = 0; h < d.h; ++h)
                            sum += f.weights[((n * d.h + h) * d.l + i) * sp + j];
                        weights[(n * d.l + i) * sp + j] = sum / (double)d.h;
                    }
        }
    }
    clmha__ref_forward_free(&f);
    return CLMHA_SUCCESS;
}
