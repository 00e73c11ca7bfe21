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
#include "reference/reference_math.h"

#include <stdlib.h>
#include <string.h>

clmha_status clmha_reference_forward(const clmha_layer_desc *desc_in,
                                     const clmha_reference_params *params,
                                     const clmha_forward_args *args_in, double *output,
                                     size_t output_count, double *weights, size_t weights_count,
                                     char *message, size_t message_size) {
    clmha__ref_call call;
    clmha_status st;
    double *q_in = NULL, *k_in = NULL, *v_in = NULL;  // projections (N, L|S, E)
    double *q = NULL, *k = NULL, *v = NULL;           // heads (N*H, L|S', D)
    double *attn = NULL;                              // probabilities, then weights (N*H, L, S')
    double *ctx_heads = NULL, *ctx = NULL;            // weights . V, (N*H, L, D) and (N, L, E)
    if (message && message_size) message[0] = '\0';

    // 1. Validate.
    if ((st = clmha__ref_validate(desc_in, params, args_in, &call, message, message_size)))
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

    // Scratch sizes: projections (N, L|S|S', E), scores (N*H, L, S'), context (N, L, E).
    const size_t e = d.e, sp = d.s_padded;
    size_t q_count = d.output_count, k_count, kp_count;
    if ((st = clmha__ref_key_counts(&d, &k_count, &kp_count, message, message_size))) return st;
    q_in = malloc(q_count * sizeof *q_in);
    k_in = malloc(k_count * sizeof *k_in);
    v_in = malloc(k_count * sizeof *v_in);
    q = malloc(q_count * sizeof *q);
    k = malloc(kp_count * sizeof *k);
    v = malloc(kp_count * sizeof *v);
    attn = malloc(d.scores_count * sizeof *attn);
    ctx_heads = malloc(q_count * sizeof *ctx_heads);
    ctx = malloc(q_count * sizeof *ctx);
    if (!q_in || !k_in || !v_in || !q || !k || !v || !attn || !ctx_heads || !ctx) {
        st = clmha__msg(message, message_size, CLMHA_OUT_OF_MEMORY,
                        "out of host memory for the reference scratch");
        goto fail;
    }

    // 2.-6. Projections, heads, scores, masks, softmax.
    clmha__ref_attention_probs(&call, q_in, k_in, v_in, q, k, v, attn);

    // 7. Dropout (training only): keep with probability 1-p and scale by 1/(1-p).
    clmha__ref_dropout(&call, attn);

    // 8. weights . V -> (N*H, L, D); 9. merge heads -> (N, L, E).
    clmha__ref_weights_v(&d, attn, v, ctx_heads);
    clmha__ref_merge_heads(&d, ctx_heads, d.l, d.l, ctx);

    // 10. Output projection, written in the query's layout.
    const float *b_out = call.desc.bias ? call.params.out_proj_bias : NULL;
    const float *w_out = call.params.out_proj_weight;
    for (size_t n = 0; n < d.n; ++n)
        for (size_t i = 0; i < d.l; ++i)
            for (size_t o = 0; o < e; ++o) {
                double acc = b_out ? (double)b_out[o] : 0.0;
                for (size_t f = 0; f < e; ++f)
                    acc += ctx[(n * d.l + i) * e + f] * (double)w_out[o * e + f];
                output[clmha__ref_input_index(&d, d.l, e, i, n, o)] = acc;
            }

    // 11. Weights: per head (N, H, L, S') is the attn layout itself; else averaged over heads.
    if (args->need_weights) {
        if (args->per_head_weights) {
            memcpy(weights, attn, d.scores_count * sizeof *weights);
        } else {
            for (size_t n = 0; n < d.n; ++n)
                for (size_t i = 0; i < d.l; ++i)
                    for (size_t j = 0; j < sp; ++j) {
                        double sum = 0.0;
                        for (size_t h = 0; h < d.h; ++h)
                            sum += attn[((n * d.h + h) * d.l + i) * sp + j];
                        weights[(n * d.l + i) * sp + j] = sum / (double)d.h;
                    }
        }
    }
    st = CLMHA_SUCCESS;

fail:
    free(q_in);
    free(k_in);
    free(v_in);
    free(q);
    free(k);
    free(v);
    free(attn);
    free(ctx_heads);
    free(ctx);
    return st;
}
