// CPU reference of the backward pass in double precision: the gradients of every input,
// parameter and float mask of clmha_reference_forward(), given the gradient of the output (and
// of the returned weights). The forward quantities are recomputed with the forward pass's own
// steps (reference_math.c); then the chain rule runs the data flow backwards:
//
//   output projection -> merge heads -> weights . V -> dropout -> softmax -> scores
//   -> split heads (bias_k / bias_v; the zero key's gradient is dropped) -> input projections
//
// Notation: P the probabilities (N*H, L, S'), Pd = P after dropout, O = Pd . V' the attention
// result, M its merged form (N, L, E), Y = M Wo^T + bo. A fully masked row has P = 0, so its
// score gradient P (dP - sum P dP) is 0 as well, never NaN.
#include "base/message.h"
#include "base/struct_in.h"
#include "layer/packed.h"
#include "reference/reference_math.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// ---- validation ------------------------------------------------------------------------------

// A gradient asked for (@p dest non-NULL) that the call has no tensor for.
static clmha_status refuse(char *msg, size_t msg_size, const char *name, const char *why) {
    return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "grads->%s is given but %s", name,
                      why);
}

static clmha_status check_mask_grad(const double *dest, clmha_mask_kind kind, const char *name,
                                    char *msg, size_t msg_size) {
    if (!dest) return CLMHA_SUCCESS;
    if (kind == CLMHA_MASK_NONE) return refuse(msg, msg_size, name, "the call has no such mask");
    if (kind != CLMHA_MASK_FLOAT)
        return refuse(msg, msg_size, name,
                      "the mask is boolean: only a float mask (CLMHA_MASK_FLOAT) has a gradient");
    return CLMHA_SUCCESS;
}

static clmha_status check_grads(const clmha__ref_call *call, const clmha_reference_grads *g,
                                const float *grad_output, const float *grad_weights, char *msg,
                                size_t msg_size) {
    const clmha__dims *d = &call->d;
    clmha_status st;
    if (!grad_output)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "grad_output is NULL");
    if (grad_weights && !call->args.need_weights)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "grad_weights is given but the forward call has no need_weights");
    if (d->key_is_query && g->key)
        return refuse(msg, msg_size, "key",
                      "key was not given (self-attention): its gradient is in grads->query");
    if (d->value_is_key && g->value)
        return refuse(msg, msg_size, "value",
                      d->key_is_query
                          ? "value was not given (self-attention): its gradient is in "
                            "grads->query"
                          : "value was not given (key is value): its gradient is in grads->key");
    if (g->in_proj_weight && !(d->kdim == d->e && d->vdim == d->e))
        return refuse(msg, msg_size, "in_proj_weight",
                      "the layer has kdim or vdim != embed_dim: ask for q_proj_weight, "
                      "k_proj_weight and v_proj_weight");
    if (g->in_proj_weight && d->kvh != d->h)
        return refuse(msg, msg_size, "in_proj_weight",
                      "a grouped-query layer (num_kv_heads below num_heads) has none: ask for "
                      "q_proj_weight, k_proj_weight and v_proj_weight");
    if (g->in_proj_weight && (g->q_proj_weight || g->k_proj_weight || g->v_proj_weight))
        return refuse(msg, msg_size, "in_proj_weight",
                      "so is a row block of it (q_proj_weight, k_proj_weight or v_proj_weight)");
    if (!call->desc.bias && g->in_proj_bias)
        return refuse(msg, msg_size, "in_proj_bias", "the layer has no bias");
    if (!call->desc.bias && g->out_proj_bias)
        return refuse(msg, msg_size, "out_proj_bias", "the layer has no bias");
    if (!call->desc.add_bias_kv && g->bias_k)
        return refuse(msg, msg_size, "bias_k", "the layer has no add_bias_kv");
    if (!call->desc.add_bias_kv && g->bias_v)
        return refuse(msg, msg_size, "bias_v", "the layer has no add_bias_kv");
    if (!call->desc.sinks && g->sinks) return refuse(msg, msg_size, "sinks", "the layer has no sinks");
    if ((st = check_mask_grad(g->attn_mask, d->attn_kind, "attn_mask", msg, msg_size))) return st;
    return check_mask_grad(g->key_padding_mask, d->kpm_kind, "key_padding_mask", msg, msg_size);
}

// ---- backward steps --------------------------------------------------------------------------

// Gradients of a projection out (N, seq, width) = x W^T + b from dout (N, seq, width): dW
// (width, feat) and db (width) when not NULL are written; dx (the input's layout, see
// clmha__ref_input_index) is written, or added to with @p add_dx, when not NULL.
static void project_backward(const clmha__dims *d, const double *dout, const float *x,
                             size_t seq, size_t feat, const float *w, size_t width, double *dw,
                             double *db, double *dx, bool add_dx) {
    const size_t e = width;
    if (db)
        for (size_t o = 0; o < e; ++o) {
            double acc = 0.0;
            for (size_t r = 0; r < d->n * seq; ++r) acc += dout[r * e + o];
            db[o] = acc;
        }
    if (dw)
        for (size_t o = 0; o < e; ++o)
            for (size_t f = 0; f < feat; ++f) {
                double acc = 0.0;
                for (size_t n = 0; n < d->n; ++n)
                    for (size_t i = 0; i < seq; ++i)
                        acc += dout[(n * seq + i) * e + o] *
                               (double)x[clmha__ref_input_index(d, seq, feat, i, n, f)];
                dw[o * feat + f] = acc;
            }
    if (dx)
        for (size_t n = 0; n < d->n; ++n)
            for (size_t i = 0; i < seq; ++i)
                for (size_t f = 0; f < feat; ++f) {
                    double acc = 0.0;
                    for (size_t o = 0; o < e; ++o)
                        acc += dout[(n * seq + i) * e + o] * (double)w[o * feat + f];
                    double *at = &dx[clmha__ref_input_index(d, seq, feat, i, n, f)];
                    *at = add_dx ? *at + acc : acc;
                }
}

// The gradient of an appended bias row (bias_k or bias_v, (1, 1, KVH*D)): row S of the heads'
// gradient dheads (N*H, S', D), summed over the batch and over the query heads that share a
// key/value head (grouped-query attention; one each without).
static void appended_bias_grad(const clmha__dims *d, const double *dheads, double *out) {
    const size_t sp = d->s_padded, group = d->h / d->kvh;
    for (size_t kh = 0; kh < d->kvh; ++kh)
        for (size_t c = 0; c < d->d; ++c) {
            double acc = 0.0;
            for (size_t n = 0; n < d->n; ++n)
                for (size_t h = kh * group; h < (kh + 1) * group; ++h)
                    acc += dheads[((n * d->h + h) * sp + d->s) * d->d + c];
            out[kh * d->d + c] = acc;
        }
}

// Merges the first @p seq rows of the key or value heads' gradient x (N*H, seq_in, D) into
// (N, seq, KVH*D), the query heads that share a key/value head summed (grouped-query attention:
// the gradient of the repeated heads; without it, clmha__ref_merge_heads()).
static void merge_kv_heads(const clmha__dims *d, const double *x, size_t seq_in, size_t seq,
                           double *out) {
    const size_t group = d->h / d->kvh, width = d->kvh * d->d;
    for (size_t n = 0; n < d->n; ++n)
        for (size_t i = 0; i < seq; ++i)
            for (size_t kh = 0; kh < d->kvh; ++kh)
                for (size_t c = 0; c < d->d; ++c) {
                    double acc = 0.0;
                    for (size_t h = kh * group; h < (kh + 1) * group; ++h)
                        acc += x[((n * d->h + h) * seq_in + i) * d->d + c];
                    out[(n * seq + i) * width + kh * d->d + c] = acc;
                }
}

// The gradients of the float masks: the score gradient ds (N*H, L, S') of the first S keys,
// summed over the dimensions each mask is broadcast along.
static void mask_grads(const clmha__dims *d, const double *ds, double *d_attn, double *d_kpm) {
    const size_t sp = d->s_padded;
    if (d_attn) {
        memset(d_attn, 0, d->attn_count * sizeof *d_attn);
        for (size_t n = 0; n < d->n; ++n)
            for (size_t h = 0; h < d->h; ++h)
                for (size_t i = 0; i < d->l; ++i)
                    for (size_t j = 0; j < d->s; ++j)
                        d_attn[n * d->attn_sn + h * d->attn_sh + i * d->attn_si + j] +=
                            ds[((n * d->h + h) * d->l + i) * sp + j];
    }
    if (d_kpm)
        for (size_t n = 0; n < d->n; ++n)
            for (size_t j = 0; j < d->s; ++j) {
                double acc = 0.0;
                for (size_t h = 0; h < d->h; ++h)
                    for (size_t i = 0; i < d->l; ++i)
                        acc += ds[((n * d->h + h) * d->l + i) * sp + j];
                d_kpm[n * d->s + j] = acc;
            }
}

// ---- the backward pass -----------------------------------------------------------------------

// The backward pass's gradients of the intermediate tensors.
typedef struct {
    double *dy, *dctx, *dctx_heads;  // dY and dM (N, L, E), dO
    double *dprobs;                  // dPd, then dP, then dS (N*H, L, S')
    double *dq, *dk, *dv;            // head gradients (N*H, L|S', D)
    double *dq_in, *dk_in, *dv_in;   // projection gradients (N, L|S, E)
} grads_scratch;

static void scratch_free(grads_scratch *s) {
    free(s->dy);
    free(s->dctx);
    free(s->dctx_heads);
    free(s->dprobs);
    free(s->dq);
    free(s->dk);
    free(s->dv);
    free(s->dq_in);
    free(s->dk_in);
    free(s->dv_in);
}

// Allocates every buffer of @p s for the sizes of @p d; false (some NULL) when out of memory.
static bool scratch_alloc(const clmha__dims *d, grads_scratch *s) {
    const size_t q_count = d->output_count, kp_count = d->n * d->s_padded * d->e,
                 k_count = d->n * d->s * d->e;
    s->dy = malloc(q_count * sizeof *s->dy);
    s->dctx = malloc(q_count * sizeof *s->dctx);
    s->dctx_heads = malloc(q_count * sizeof *s->dctx_heads);
    s->dprobs = malloc(d->scores_count * sizeof *s->dprobs);
    s->dq = malloc(q_count * sizeof *s->dq);
    s->dk = malloc(kp_count * sizeof *s->dk);
    s->dv = malloc(kp_count * sizeof *s->dv);
    s->dq_in = malloc(q_count * sizeof *s->dq_in);
    s->dk_in = malloc(k_count * sizeof *s->dk_in);
    s->dv_in = malloc(k_count * sizeof *s->dv_in);
    return s->dy && s->dctx && s->dctx_heads && s->dprobs && s->dq && s->dk && s->dv &&
           s->dq_in && s->dk_in && s->dv_in;
}

// Output projection Y = M Wo^T + bo: dbo = sum of dY rows, dWo = dY^T M, dM = dY Wo (s->dctx),
// from grad_output (s->dy: dY as doubles).
static void out_proj_backward(const clmha__ref_call *call, const float *grad_output,
                              const double *ctx, clmha_reference_grads *g, grads_scratch *s) {
    const clmha__dims *d = &call->d;
    const size_t e = d->e, rows = d->n * d->l;
    double *dy = s->dy;
    for (size_t n = 0; n < d->n; ++n)
        for (size_t i = 0; i < d->l; ++i)
            for (size_t o = 0; o < e; ++o)
                dy[(n * d->l + i) * e + o] =
                    (double)grad_output[clmha__ref_input_index(d, d->l, e, i, n, o)];
    const float *w_out = call->params.out_proj_weight;
    for (size_t r = 0; r < rows; ++r)
        for (size_t c = 0; c < e; ++c) {
            double acc = 0.0;
            for (size_t o = 0; o < e; ++o) acc += dy[r * e + o] * (double)w_out[o * e + c];
            s->dctx[r * e + c] = acc;
        }
    if (g->out_proj_bias)
        for (size_t o = 0; o < e; ++o) {
            double acc = 0.0;
            for (size_t r = 0; r < rows; ++r) acc += dy[r * e + o];
            g->out_proj_bias[o] = acc;
        }
    if (g->out_proj_weight)
        for (size_t o = 0; o < e; ++o)
            for (size_t c = 0; c < e; ++c) {
                double acc = 0.0;
                for (size_t r = 0; r < rows; ++r) acc += dy[r * e + o] * ctx[r * e + c];
                g->out_proj_weight[o * e + c] = acc;
            }
}

// O = Pd V' (Pd: @p dropped, V': @p v): dPd = dO V'^T (+ the weights' gradient, per head, or
// its average's share 1/H in every head) into s->dprobs, dV' = Pd^T dO into s->dv.
static void attend_backward(const clmha__ref_call *call, const float *grad_weights,
                            const double *dropped, const double *v, grads_scratch *s) {
    const clmha__dims *d = &call->d;
    const size_t sp = d->s_padded, nh = d->n * d->h;
    const double *dctx_heads = s->dctx_heads;
    for (size_t bh = 0; bh < nh; ++bh)
        for (size_t i = 0; i < d->l; ++i)
            for (size_t j = 0; j < sp; ++j) {
                double acc = 0.0;
                for (size_t c = 0; c < d->d; ++c)
                    acc += dctx_heads[(bh * d->l + i) * d->d + c] * v[(bh * sp + j) * d->d + c];
                if (grad_weights) {
                    if (call->args.per_head_weights)
                        acc += (double)grad_weights[(bh * d->l + i) * sp + j];
                    else
                        acc += (double)grad_weights[((bh / d->h) * d->l + i) * sp + j] /
                               (double)d->h;
                }
                s->dprobs[(bh * d->l + i) * sp + j] = acc;
            }
    for (size_t bh = 0; bh < nh; ++bh)
        for (size_t j = 0; j < sp; ++j)
            for (size_t c = 0; c < d->d; ++c) {
                double acc = 0.0;
                for (size_t i = 0; i < d->l; ++i)
                    acc += dropped[(bh * d->l + i) * sp + j] *
                           dctx_heads[(bh * d->l + i) * d->d + c];
                s->dv[(bh * sp + j) * d->d + c] = acc;
            }
}

// Softmax: dS = P (dP - sum_j P_j dP_j), row by row, in place in @p dprobs (@p rows rows of
// @p sp); 0 wherever P is (masked keys and fully masked rows), so the masks' gradients are 0
// there too.
static void softmax_backward(const double *probs, double *dprobs, size_t rows, size_t sp) {
    for (size_t row = 0; row < rows; ++row) {
        const double *p = probs + row * sp;
        double *r = dprobs + row * sp;
        double dot = 0.0;
        for (size_t j = 0; j < sp; ++j) dot += p[j] * r[j];
        for (size_t j = 0; j < sp; ++j) r[j] = p[j] * (r[j] - dot);
    }
}

// The sinks' gradient (clmha_layer_desc::sinks) from the probabilities P and dP (N*H, L, S'):
// a sink is one more logit with a zero value, so its score's gradient is
// P_sink (0 - sum_j P_j dP_j), P_sink = 1 - sum_j P_j; summed over n and i into out[h].
static void sinks_backward(const clmha__dims *d, const double *probs, const double *dprobs,
                           double *out) {
    const size_t sp = d->s_padded;
    for (size_t h = 0; h < d->h; ++h) out[h] = 0.0;
    for (size_t row = 0; row < d->n * d->h * d->l; ++row) {
        const double *p = probs + row * sp, *dp = dprobs + row * sp;
        double dot = 0.0, psum = 0.0;
        for (size_t j = 0; j < sp; ++j) dot += p[j] * dp[j], psum += p[j];
        out[row / d->l % d->h] -= (1.0 - psum) * dot;
    }
}

// Soft-capping (clmha_layer_desc::softcap) and the user score function (mod_source's
// clmha_score_mod, on the real keys): dS (N*H, L, S') in place times the derivative of the
// score function at each score before it, s = scale q·k' recomputed (with ALiBi's term, which
// the user function sees). Nothing without either.
static void score_fn_backward(const clmha__ref_call *call, const clmha__ref_mods *mods,
                              const double *q, const double *k, double *ds) {
    const clmha__dims *d = &call->d;
    if (!(d->softcap > 0.0) && !mods->score) return;
    const size_t sp = d->s_padded;
    const double scale = 1.0 / sqrt((double)d->d);
    for (size_t bh = 0; bh < d->n * d->h; ++bh) {
        size_t n = bh / d->h, h = bh % d->h;
        double slope =
            d->alibi ? clmha__ref_alibi_slope(call->params.alibi_slopes, d->h, h) : 0.0;
        for (size_t i = 0; i < d->l; ++i)
            for (size_t j = 0; j < sp; ++j) {
                double dot = 0.0, g;
                for (size_t c = 0; c < d->d; ++c)
                    dot += q[(bh * d->l + i) * d->d + c] * k[(bh * sp + j) * d->d + c];
                double x = clmha__ref_score_mod(dot * scale, d->softcap, slope, i, j, j < d->s,
                                                &g);
                if (j < d->s) clmha__ref_user_score(mods, x, n, h, i, j, &g);
                ds[(bh * d->l + i) * sp + j] *= g;
            }
    }
}

// Scores S = scale Q K'^T + masks: dQ = scale dS K' (s->dq), dK' = scale dS^T Q (s->dk).
static void scores_backward(const clmha__dims *d, const double *q, const double *k,
                            grads_scratch *s) {
    const size_t sp = d->s_padded, nh = d->n * d->h;
    const double scale = 1.0 / sqrt((double)d->d);
    const double *dprobs = s->dprobs;
    for (size_t bh = 0; bh < nh; ++bh) {
        for (size_t i = 0; i < d->l; ++i)
            for (size_t c = 0; c < d->d; ++c) {
                double acc = 0.0;
                for (size_t j = 0; j < sp; ++j)
                    acc += dprobs[(bh * d->l + i) * sp + j] * k[(bh * sp + j) * d->d + c];
                s->dq[(bh * d->l + i) * d->d + c] = acc * scale;
            }
        for (size_t j = 0; j < sp; ++j)
            for (size_t c = 0; c < d->d; ++c) {
                double acc = 0.0;
                for (size_t i = 0; i < d->l; ++i)
                    acc += dprobs[(bh * d->l + i) * sp + j] * q[(bh * d->l + i) * d->d + c];
                s->dk[(bh * sp + j) * d->d + c] = acc * scale;
            }
    }
}

// Input projections, from the projections' gradients (s->dq_in, dk_in, dv_in). The weight and
// bias blocks go to the packed gradients or to the blocks asked for; an input used several
// times (self-attention, key is value) gets the sum of its uses.
static void in_proj_backward(const clmha__ref_call *call, clmha_reference_grads *g,
                             const grads_scratch *s) {
    const clmha__dims *d = &call->d;
    const size_t e = d->e;
    clmha__ref_operands ops;
    clmha__ref_operands_of(call, &ops);
    const double *dproj[3] = {s->dq_in, s->dk_in, s->dv_in};
    double *dw_block[3] = {g->q_proj_weight, g->k_proj_weight, g->v_proj_weight};
    double *dx_of[3] = {g->query, d->key_is_query ? g->query : g->key,
                        d->value_is_key ? (d->key_is_query ? g->query : g->key) : g->value};
    // in_proj_bias: q (E), then k and v (KVE each: E without grouped-query attention).
    const size_t b_off[3] = {0, e, e + ops.width[1]};
    for (size_t t = 0; t < 3; ++t) {
        double *dw = g->in_proj_weight ? g->in_proj_weight + t * e * e : dw_block[t];
        double *db = g->in_proj_bias ? g->in_proj_bias + b_off[t] : NULL;
        bool add = (t == 1 && d->key_is_query) || (t == 2 && d->value_is_key);
        project_backward(d, dproj[t], ops.x[t], ops.seq[t], ops.feat[t], ops.w[t],
                         ops.width[t], dw, db, dx_of[t], add);
    }
}

// ---- a packed call -------------------------------------------------------------------------

// A packed call (clmha_forward_args::seq_lens), validated into @p call: one reference backward
// call per sequence on its rows (layer/packed.h); the parameters' gradients summed over the
// sequences in double precision, keys that no query sees given zeros.
// The parameter gradients of a reference backward call: their destinations in @p g, and their
// sizes for the layer of @p call (0: none).
enum { PARAMS = 10 };
static void param_grads(const clmha__ref_call *call, clmha_reference_grads *g, double **dst[PARAMS],
                        size_t count[PARAMS]) {
    const clmha__dims *d = &call->d;
    size_t e = d->e, kve = d->kvh * d->d;
    double **p[PARAMS] = {&g->in_proj_weight,  &g->q_proj_weight, &g->k_proj_weight,
                          &g->v_proj_weight,   &g->in_proj_bias,  &g->out_proj_weight,
                          &g->out_proj_bias,   &g->bias_k,        &g->bias_v, &g->sinks};
    size_t c[PARAMS] = {3 * e * e, e * e, kve * d->kdim, kve * d->vdim, e + 2 * kve,
                        e * e, e, kve, kve, d->h};
    memcpy(dst, p, sizeof p);
    memcpy(count, c, sizeof c);
}

static clmha_status backward_packed(const clmha__ref_call *call, const float *grad_output,
                                        const clmha_reference_grads *grads, char *message,
                                        size_t message_size) {
    const clmha__dims *d = &call->d;
    clmha_reference_grads g = *grads, sub_g = *grads;
    double **dst[PARAMS], **sub_dst[PARAMS], *part[PARAMS] = {0};
    size_t count[PARAMS];
    param_grads(call, &g, dst, count);
    param_grads(call, &sub_g, sub_dst, count);
    clmha_status st = CLMHA_SUCCESS;
    for (int j = 0; j < PARAMS; ++j) {  // each sequence's into part[j], summed into *dst[j]
        if (!*dst[j]) continue;
        memset(*dst[j], 0, count[j] * sizeof **dst[j]);
        if (!(part[j] = calloc(count[j], sizeof *part[j]))) {
            st = clmha__msg(message, message_size, CLMHA_OUT_OF_MEMORY,
                            "out of host memory for the reference's gradients");
            goto done;
        }
        *sub_dst[j] = part[j];
    }
    clmha__packed_at at = {0, 0};
    for (size_t i = 0; i < d->n; at = clmha__packed_next(d, i, at), ++i) {
        if (!d->seq_lens[i]) {  // keys no query sees: a zero gradient
            size_t rows = d->kv_seq_lens[i];
            if (grads->key) memset(grads->key + at.k0 * d->kdim, 0, rows * d->kdim * 8);
            if (grads->value) memset(grads->value + at.k0 * d->vdim, 0, rows * d->vdim * 8);
            continue;
        }
        clmha_forward_args sub;
        clmha__packed_args(d, &call->args, i, at, sizeof(float), &sub);
        if (grads->query) sub_g.query = grads->query + at.q0 * d->e;
        if (grads->key) sub_g.key = grads->key + at.k0 * d->kdim;
        if (grads->value) sub_g.value = grads->value + at.k0 * d->vdim;
        for (int j = 0; j < PARAMS; ++j)
            if (part[j]) memset(part[j], 0, count[j] * sizeof *part[j]);
        if ((st = clmha_reference_backward(&call->desc, &call->params, &sub,
                                           grad_output + at.q0 * d->e, NULL, &sub_g, message,
                                           message_size)))
            goto done;
        for (int j = 0; j < PARAMS; ++j)
            for (size_t k = 0; part[j] && k < count[j]; ++k) (*dst[j])[k] += part[j][k];
    }
done:
    for (int j = 0; j < PARAMS; ++j) free(part[j]);
    return st;
}

clmha_status clmha_reference_backward(const clmha_layer_desc *desc,
                                      const clmha_reference_params *params,
                                      const clmha_forward_args *args,
                                      const float *grad_output, const float *grad_weights,
                                      const clmha_reference_grads *grads_in, char *message,
                                      size_t message_size) {
    clmha__ref_call call;
    clmha_reference_grads g;
    clmha_status st;
    clmha__ref_forward f;  // the forward quantities: P, Pd, O, M, ...
    grads_scratch s = {0};
    if (message && message_size) message[0] = '\0';

    // 1. Validate: the forward call as clmha_reference_forward() does, then the gradients.
    if ((st = clmha__ref_validate(desc, params, args, true, &call, message, message_size)))
        return st;
    if ((st = CLMHA__STRUCT_IN(clmha_reference_grads, &g, grads_in, "grads", message,
                               message_size)))
        return st;
    if ((st = check_grads(&call, &g, grad_output, grad_weights, message, message_size)))
        return st;
    const clmha__dims d = call.d;
    if (d.packed) return backward_packed(&call, grad_output, &g, message, message_size);

    // 2. The forward pass again, up to the merged attention result M (its sizes are checked
    //    for overflow there).
    if ((st = clmha__ref_forward_run(&call, true, &f, message, message_size))) return st;
    if (!scratch_alloc(&d, &s)) {
        st = clmha__msg(message, message_size, CLMHA_OUT_OF_MEMORY,
                        "out of host memory for the reference scratch");
        goto fail;
    }
    // 3. Output projection.
    out_proj_backward(&call, grad_output, f.ctx, &g, &s);
    // 4. Merge heads backwards: dO = split(dM).
    clmha__ref_split_heads(&d, s.dctx, d.l, d.e, 1, NULL, d.l, s.dctx_heads);
    // 5. O = Pd V'.
    attend_backward(&call, grad_weights, f.weights, f.v, &s);
    // 6. Dropout: the same keep mask and scale turn dPd into dP.
    clmha__ref_dropout(&call, s.dprobs);
    // 7. Softmax (first the sinks', from P and dP).
    if (g.sinks) sinks_backward(&d, f.probs, s.dprobs, g.sinks);
    softmax_backward(f.probs, s.dprobs, d.n * d.h * d.l, d.s_padded);
    // 8. The float masks' gradients (dS of the final scores), the score functions (soft-capping,
    //    the user's), the scores.
    mask_grads(&d, s.dprobs, g.attn_mask, g.key_padding_mask);
    score_fn_backward(&call, &f.mods, f.q, f.k, s.dprobs);
    scores_backward(&d, f.q, f.k, &s);
    // 9. Split heads backwards: the first L / S rows merge into the projections' gradients;
    //    row S is bias_k's / bias_v's (with add_bias_kv); the zero key's row is dropped.
    clmha__ref_merge_heads(&d, s.dq, d.l, d.l, s.dq_in);
    merge_kv_heads(&d, s.dk, d.s_padded, d.s, s.dk_in);
    merge_kv_heads(&d, s.dv, d.s_padded, d.s, s.dv_in);
    if (g.bias_k) appended_bias_grad(&d, s.dk, g.bias_k);
    if (g.bias_v) appended_bias_grad(&d, s.dv, g.bias_v);
    // 10. Input projections.
    in_proj_backward(&call, &g, &s);
    st = CLMHA_SUCCESS;

fail:
    clmha__ref_forward_free(&f);
    scratch_free(&s);
    return st;
}
