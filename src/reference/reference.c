// CPU reference of the forward pass in double precision. Written for clarity, not speed: every
// step of nn.MultiheadAttention is a separate loop nest over plain row-major arrays, in the
// order the data flows:
//
//   validate -> input projections -> split heads (+ bias_k/bias_v, + zero key/value)
//   -> scores q.k^T / sqrt(D) -> masks -> softmax -> dropout -> weights . V
//   -> merge heads -> output projection
//
// Shapes are checked by the same code as the OpenCL path (src/layer/shape.c), so both accept
// and refuse exactly the same calls.
#include "base/checked.h"
#include "base/message.h"
#include "base/philox.h"
#include "layer/shape.h"

#include "base/struct_in.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// ---- input layout ----------------------------------------------------------------------------

// Element index of (position i, batch item n, feature f) in an input tensor of `seq` positions,
// `batch` items and `feat` features: (seq, batch, feat), (batch, seq, feat) with batch_first, or
// (seq, feat) unbatched (batch == 1, where the seq-first formula gives the same index).
static size_t input_index(const clmha__dims *d, size_t seq, size_t feat, size_t i, size_t n,
                          size_t f) {
    if (d->batch_first) return (n * seq + i) * feat + f;
    return (i * d->n + n) * feat + f;
}

// ---- projections -----------------------------------------------------------------------------

// out (N, seq, E) = x . W^T + b, where x is an input tensor (see input_index) of `feat` features,
// W is (E, feat) row-major and b is (E) or NULL.
static void project(const clmha__dims *d, const float *x, size_t seq, size_t feat,
                    const float *w, const float *b, double *out) {
    for (size_t n = 0; n < d->n; ++n)
        for (size_t i = 0; i < seq; ++i)
            for (size_t o = 0; o < d->e; ++o) {
                double acc = b ? (double)b[o] : 0.0;
                for (size_t f = 0; f < feat; ++f)
                    acc += (double)x[input_index(d, seq, feat, i, n, f)] * (double)w[o * feat + f];
                out[(n * seq + i) * d->e + o] = acc;
            }
}

// ---- heads -----------------------------------------------------------------------------------

// Splits x (N, seq, E) into heads (N*H, seq_out, D); positions seq .. seq_out-1 are appended:
// first `extra` (E) when not NULL (bias_k / bias_v), then zeros (add_zero_attn). seq_out must be
// seq + (extra != NULL) + zero_row.
static void split_heads(const clmha__dims *d, const double *x, size_t seq, const float *extra,
                        size_t seq_out, double *out) {
    for (size_t n = 0; n < d->n; ++n)
        for (size_t h = 0; h < d->h; ++h)
            for (size_t i = 0; i < seq_out; ++i)
                for (size_t k = 0; k < d->d; ++k) {
                    size_t e = h * d->d + k;
                    double v;
                    if (i < seq)
                        v = x[(n * seq + i) * d->e + e];
                    else if (i == seq && extra)
                        v = (double)extra[e];
                    else
                        v = 0.0;  // the zero key / value of add_zero_attn
                    out[((n * d->h + h) * seq_out + i) * d->d + k] = v;
                }
}

// Merges heads (N*H, L, D) into (N, L, E).
static void merge_heads(const clmha__dims *d, const double *x, double *out) {
    for (size_t n = 0; n < d->n; ++n)
        for (size_t h = 0; h < d->h; ++h)
            for (size_t i = 0; i < d->l; ++i)
                for (size_t k = 0; k < d->d; ++k)
                    out[(n * d->l + i) * d->e + h * d->d + k] =
                        x[((n * d->h + h) * d->l + i) * d->d + k];
}

// ---- masks -----------------------------------------------------------------------------------

// The additive value of element `index` of a mask: 0 or -inf for boolean masks, the value for
// float masks.
static double mask_value(const clmha_mask *m, size_t index) {
    switch (m->kind) {
    case CLMHA_MASK_BOOL_IGNORE:
        return ((const unsigned char *)m->tensor.data)[index] ? -INFINITY : 0.0;
    case CLMHA_MASK_BOOL_ATTEND:
        return ((const unsigned char *)m->tensor.data)[index] ? 0.0 : -INFINITY;
    case CLMHA_MASK_FLOAT:
        return (double)((const float *)m->tensor.data)[index];
    default:
        return 0.0;
    }
}

// Sum of every mask at score (n, h, i, j) for a key j < S.
static double mask_sum(const clmha__dims *d, const clmha_forward_args *args, size_t n, size_t h,
                       size_t i, size_t j) {
    double sum = 0.0;
    switch (d->attn_layout) {
    case CLMHA__ATTN_SHARED:
        sum += mask_value(&args->attn_mask, i * d->s + j);
        break;
    case CLMHA__ATTN_PER_HEAD:
        sum += mask_value(&args->attn_mask, ((n * d->h + h) * d->l + i) * d->s + j);
        break;
    case CLMHA__ATTN_PER_BATCH:
        sum += mask_value(&args->attn_mask, (n * d->l + i) * d->s + j);
        break;
    case CLMHA__ATTN_NONE:
        break;
    }
    if (d->kpm_kind != CLMHA_MASK_NONE) sum += mask_value(&args->key_padding_mask, n * d->s + j);
    if (args->is_causal && j > i) sum += -INFINITY;
    return sum;
}

// ---- validation ------------------------------------------------------------------------------

static clmha_status check_params(const clmha_layer_desc *desc, const clmha_reference_params *p,
                                 char *msg, size_t msg_size) {
    if (!p) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "params is NULL");
    // PyTorch uses the packed in_proj_weight exactly when kdim == vdim == embed_dim.
    bool packed = p->in_proj_weight && desc->kdim == desc->embed_dim &&
                  desc->vdim == desc->embed_dim;
    if (!packed && !(p->q_proj_weight && p->k_proj_weight && p->v_proj_weight))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          p->in_proj_weight
                              ? "in_proj_weight needs kdim == vdim == embed_dim: give "
                                "q_proj_weight, k_proj_weight and v_proj_weight"
                              : "give in_proj_weight or all of q_proj_weight, k_proj_weight "
                                "and v_proj_weight");
    if (!p->out_proj_weight)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "out_proj_weight is NULL");
    if (desc->bias && (!p->in_proj_bias || !p->out_proj_bias))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "the layer has bias: in_proj_bias and out_proj_bias must be given");
    if (desc->add_bias_kv && (!p->bias_k || !p->bias_v))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "the layer has add_bias_kv: bias_k and bias_v must be given");
    return CLMHA_SUCCESS;
}

// ---- the forward pass ------------------------------------------------------------------------

clmha_status clmha_reference_forward(const clmha_layer_desc *desc_in,
                                     const clmha_reference_params *params,
                                     const clmha_forward_args *args, double *output,
                                     size_t output_count, double *weights, size_t weights_count,
                                     char *message, size_t message_size) {
    clmha_layer_desc desc;
    clmha__dims d;
    clmha_status st;
    double *q_in = NULL, *k_in = NULL, *v_in = NULL;  // projections (N, L|S, E)
    double *q = NULL, *k = NULL, *v = NULL;           // heads (N*H, L|S', D)
    double *attn = NULL;                              // scores, then weights (N*H, L, S')
    double *ctx_heads = NULL, *ctx = NULL;            // weights . V, (N*H, L, D) and (N, L, E)
    if (message && message_size) message[0] = '\0';

    // 1. Validate. The caller's structs are read in this library's layout (docs/abi.md).
    clmha_layer_desc desc_copy;
    clmha_forward_args args_copy;
    clmha_reference_params params_copy;
    if ((st = CLMHA__STRUCT_IN(clmha_layer_desc, &desc_copy, desc_in, "desc", message,
                               message_size)))
        return st;
    if ((st = clmha__desc_check(&desc_copy, &desc, message, message_size))) return st;
    if ((st = CLMHA__STRUCT_IN(clmha_forward_args, &args_copy, args, "args", message,
                               message_size)))
        return st;
    args = &args_copy;
    if ((st = clmha__dims_resolve(&desc, args, &d, message, message_size))) return st;
    if ((st = CLMHA__STRUCT_IN(clmha_reference_params, &params_copy, params, "params", message,
                               message_size)))
        return st;
    params = &params_copy;
    if ((st = check_params(&desc, params, message, message_size))) return st;
    if ((st = clmha__check_host_data(&d, args, message, message_size))) return st;
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
    if (!clmha__mul(d.n, d.s, &k_count) || !clmha__mul(k_count, e, &k_count) ||
        !clmha__mul(d.n, sp, &kp_count) || !clmha__mul(kp_count, e, &kp_count) ||
        kp_count > SIZE_MAX / sizeof(double))
        return clmha__msg(message, message_size, CLMHA_SIZE_OVERFLOW,
                          "key sizes overflow: N %zu, S %zu, E %zu", d.n, d.s, e);
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

    // 2. Input projections. in_proj_weight rows [0,E) are W_q, [E,2E) W_k, [2E,3E) W_v.
    const float *x_q = args->query.data;
    const float *x_k = d.key_is_query ? x_q : args->key.data;
    const float *x_v = d.value_is_key ? x_k : args->value.data;
    const bool packed = params->in_proj_weight && d.kdim == e && d.vdim == e;
    const float *w_q = packed ? params->in_proj_weight : params->q_proj_weight;
    const float *w_k = packed ? params->in_proj_weight + e * e : params->k_proj_weight;
    const float *w_v = packed ? params->in_proj_weight + 2 * e * e : params->v_proj_weight;
    const float *b_in = desc.bias ? params->in_proj_bias : NULL;
    project(&d, x_q, d.l, e, w_q, b_in, q_in);
    project(&d, x_k, d.s, d.kdim, w_k, b_in ? b_in + e : NULL, k_in);
    project(&d, x_v, d.s, d.vdim, w_v, b_in ? b_in + 2 * e : NULL, v_in);

    // 3. Split heads; append bias_k / bias_v, then the zero key / value, after the S keys.
    split_heads(&d, q_in, d.l, NULL, d.l, q);
    split_heads(&d, k_in, d.s, desc.add_bias_kv ? params->bias_k : NULL, sp, k);
    split_heads(&d, v_in, d.s, desc.add_bias_kv ? params->bias_v : NULL, sp, v);

    // 4. Scores q . k^T / sqrt(D), then 5. masks on the first S keys (appended keys are never
    // masked).
    const double scale = 1.0 / sqrt((double)d.d);
    for (size_t n = 0; n < d.n; ++n)
        for (size_t h = 0; h < d.h; ++h) {
            size_t bh = n * d.h + h;
            for (size_t i = 0; i < d.l; ++i)
                for (size_t j = 0; j < sp; ++j) {
                    double dot = 0.0;
                    for (size_t c = 0; c < d.d; ++c)
                        dot += q[(bh * d.l + i) * d.d + c] * k[(bh * sp + j) * d.d + c];
                    double score = dot * scale;
                    if (j < d.s) score += mask_sum(&d, args, n, h, i, j);
                    attn[(bh * d.l + i) * sp + j] = score;
                }
        }

    // 6. Softmax per row; a fully masked row (every score -inf) gives zeros, not NaN. A NaN
    //    score makes the row NaN, as in PyTorch (and the device kernel).
    for (size_t row = 0; row < d.n * d.h * d.l; ++row) {
        double *r = attn + row * sp;
        double max = -INFINITY;
        for (size_t j = 0; j < sp; ++j)
            if (r[j] > max || isnan(r[j])) max = r[j];
        if (max == -INFINITY) {
            for (size_t j = 0; j < sp; ++j) r[j] = 0.0;
            continue;
        }
        double sum = 0.0;
        for (size_t j = 0; j < sp; ++j) {
            r[j] = exp(r[j] - max);
            sum += r[j];
        }
        for (size_t j = 0; j < sp; ++j) r[j] /= sum;
    }

    // 7. Dropout (training only): keep with probability 1-p and scale by 1/(1-p).
    if (args->training && desc.dropout > 0.0f) {
        const uint32_t threshold = clmha__dropout_threshold(desc.dropout);
        const double keep_scale = 1.0 / (1.0 - (double)desc.dropout);
        for (size_t bh = 0; bh < d.n * d.h; ++bh)
            for (size_t i = 0; i < d.l; ++i)
                for (size_t j = 0; j < sp; ++j) {
                    double *w = &attn[(bh * d.l + i) * sp + j];
                    *w = clmha__dropout_keep(args->rng, threshold, bh, i, j) ? *w * keep_scale
                                                                             : 0.0;
                }
    }

    // 8. weights . V -> (N*H, L, D).
    for (size_t bh = 0; bh < d.n * d.h; ++bh)
        for (size_t i = 0; i < d.l; ++i)
            for (size_t c = 0; c < d.d; ++c) {
                double acc = 0.0;
                for (size_t j = 0; j < sp; ++j)
                    acc += attn[(bh * d.l + i) * sp + j] * v[(bh * sp + j) * d.d + c];
                ctx_heads[(bh * d.l + i) * d.d + c] = acc;
            }

    // 9. Merge heads -> (N, L, E).
    merge_heads(&d, ctx_heads, ctx);

    // 10. Output projection, written in the query's layout.
    const float *b_out = desc.bias ? params->out_proj_bias : NULL;
    for (size_t n = 0; n < d.n; ++n)
        for (size_t i = 0; i < d.l; ++i)
            for (size_t o = 0; o < e; ++o) {
                double acc = b_out ? (double)b_out[o] : 0.0;
                for (size_t f = 0; f < e; ++f)
                    acc += ctx[(n * d.l + i) * e + f] * (double)params->out_proj_weight[o * e + f];
                output[input_index(&d, d.l, e, i, n, o)] = acc;
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
