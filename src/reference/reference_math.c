// The shared steps of the CPU reference (reference_math.h). Written for clarity, not speed: every
// step is a separate loop nest over plain row-major arrays.
#include "reference/reference_math.h"

#include "base/checked.h"
#include "base/message.h"
#include "base/philox.h"
#include "base/struct_in.h"
#include "layer/mods.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// ---- validation ------------------------------------------------------------------------------

static clmha_status check_params(const clmha_layer_desc *desc, const clmha_reference_params *p,
                                 char *msg, size_t msg_size) {
    // PyTorch uses the packed in_proj_weight exactly when kdim == vdim == embed_dim (and, for
    // grouped-query attention, which has none, num_kv_heads == num_heads).
    bool gqa = desc->num_kv_heads != desc->num_heads;
    bool packed = p->in_proj_weight && desc->kdim == desc->embed_dim &&
                  desc->vdim == desc->embed_dim && !gqa;
    if (!packed && !(p->q_proj_weight && p->k_proj_weight && p->v_proj_weight))
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          p->in_proj_weight
                              ? (gqa ? "in_proj_weight does not exist with num_kv_heads below "
                                       "num_heads: give q_proj_weight, k_proj_weight and "
                                       "v_proj_weight"
                                     : "in_proj_weight needs kdim == vdim == embed_dim: give "
                                       "q_proj_weight, k_proj_weight and v_proj_weight")
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
    if (desc->sinks && !p->sinks)
        return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                          "the layer has sinks: params->sinks must be given");
    return CLMHA_SUCCESS;
}

clmha_status clmha__ref_validate(const clmha_layer_desc *desc,
                                 const clmha_reference_params *params,
                                 const clmha_forward_args *args, bool backward,
                                 clmha__ref_call *call, char *msg, size_t msg_size) {
    // The caller's structs are read in this library's layout (docs/abi.md).
    clmha_layer_desc desc_copy;
    clmha_status st;
    if ((st = CLMHA__STRUCT_IN(clmha_layer_desc, &desc_copy, desc, "desc", msg, msg_size)))
        return st;
    if ((st = clmha__desc_check(&desc_copy, &call->desc, msg, msg_size))) return st;
    if ((st = CLMHA__STRUCT_IN(clmha_forward_args, &call->args, args, "args", msg, msg_size)))
        return st;
    if ((st = clmha__dims_resolve(&call->desc, &call->args, &call->d, msg, msg_size))) return st;
    if ((st = CLMHA__STRUCT_IN(clmha_reference_params, &call->params, params, "params", msg,
                               msg_size)))
        return st;
    if ((st = check_params(&call->desc, &call->params, msg, msg_size))) return st;
    static const char *const names[3] = {"params->score_mod", "params->score_mod_grad",
                                         "params->mask_mod"};
    clmha__ref_mods mods = {call->params.score_mod, call->params.score_mod_grad,
                            call->params.mask_mod, NULL};
    if ((st = clmha__ref_mods_check(call->desc.mod_source, &mods, backward, names, msg,
                                    msg_size)))
        return st;
    return clmha__check_host_data(&call->d, &call->args, msg, msg_size);
}

// Element counts of the key-side scratch: k_count = N*S*E (projections), kp_count = N*S'*E
// (heads).
static clmha_status key_counts(const clmha__dims *d, size_t *k_count, size_t *kp_count,
                               char *msg, size_t msg_size) {
    if (!clmha__mul(d->n, d->s, k_count) || !clmha__mul(*k_count, d->e, k_count) ||
        !clmha__mul(d->n, d->s_padded, kp_count) || !clmha__mul(*kp_count, d->e, kp_count) ||
        *kp_count > SIZE_MAX / sizeof(double))
        return clmha__msg(msg, msg_size, CLMHA_SIZE_OVERFLOW,
                          "key sizes overflow: N %zu, S %zu, E %zu", d->n, d->s, d->e);
    return CLMHA_SUCCESS;
}

void clmha__ref_operands_of(const clmha__ref_call *call, clmha__ref_operands *ops) {
    const clmha__dims *d = &call->d;
    const clmha_reference_params *p = &call->params;
    const size_t e = d->e, kve = d->kvh * d->d;
    // in_proj_weight rows [0,E) are W_q, [E,2E) W_k, [2E,3E) W_v (not with grouped-query
    // attention, whose W_k and W_v are (num_kv_heads * D, feat)).
    const bool packed = p->in_proj_weight && d->kdim == e && d->vdim == e && kve == e;
    const float *b_in = call->desc.bias ? p->in_proj_bias : NULL;
    ops->x[0] = call->args.query.data;
    ops->x[1] = d->key_is_query ? ops->x[0] : call->args.key.data;
    ops->x[2] = d->value_is_key ? ops->x[1] : call->args.value.data;
    ops->w[0] = packed ? p->in_proj_weight : p->q_proj_weight;
    ops->w[1] = packed ? p->in_proj_weight + e * e : p->k_proj_weight;
    ops->w[2] = packed ? p->in_proj_weight + 2 * e * e : p->v_proj_weight;
    ops->b[0] = b_in;  // in_proj_bias: q (E), k (KVE), v (KVE)
    ops->b[1] = b_in ? b_in + e : NULL;
    ops->b[2] = b_in ? b_in + e + kve : NULL;
    ops->width[0] = e, ops->width[1] = ops->width[2] = kve;
    ops->seq[0] = d->l, ops->seq[1] = d->s, ops->seq[2] = d->s;
    ops->feat[0] = e, ops->feat[1] = d->kdim, ops->feat[2] = d->vdim;
}

// ---- layouts, projections, heads -------------------------------------------------------------

size_t clmha__ref_input_index(const clmha__dims *d, size_t seq, size_t feat, size_t i, size_t n,
                              size_t f) {
    if (d->batch_first) return (n * seq + i) * feat + f;
    return (i * d->n + n) * feat + f;
}

void clmha__ref_project(const clmha__dims *d, const float *x, size_t seq, size_t feat,
                        const float *w, const float *b, size_t width, double *out) {
    for (size_t n = 0; n < d->n; ++n)
        for (size_t i = 0; i < seq; ++i)
            for (size_t o = 0; o < width; ++o) {
                double acc = b ? (double)b[o] : 0.0;
                for (size_t f = 0; f < feat; ++f)
                    acc += (double)x[clmha__ref_input_index(d, seq, feat, i, n, f)] *
                           (double)w[o * feat + f];
                out[(n * seq + i) * width + o] = acc;
            }
}

void clmha__ref_split_heads(const clmha__dims *d, const double *x, size_t seq, size_t width,
                            size_t group, const float *extra, size_t seq_out, double *out) {
    for (size_t n = 0; n < d->n; ++n)
        for (size_t h = 0; h < d->h; ++h)
            for (size_t i = 0; i < seq_out; ++i)
                for (size_t k = 0; k < d->d; ++k) {
                    size_t e = h / group * d->d + k;
                    double v;
                    if (i < seq)
                        v = x[(n * seq + i) * width + e];
                    else if (i == seq && extra)
                        v = (double)extra[e];
                    else
                        v = 0.0;  // the zero key / value of add_zero_attn
                    out[((n * d->h + h) * seq_out + i) * d->d + k] = v;
                }
}

void clmha__ref_merge_heads(const clmha__dims *d, const double *x, size_t seq_in, size_t seq,
                            double *out) {
    for (size_t n = 0; n < d->n; ++n)
        for (size_t h = 0; h < d->h; ++h)
            for (size_t i = 0; i < seq; ++i)
                for (size_t k = 0; k < d->d; ++k)
                    out[(n * seq + i) * d->e + h * d->d + k] =
                        x[((n * d->h + h) * seq_in + i) * d->d + k];
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

bool clmha__ref_window_allows(bool window, int64_t left, int64_t right, size_t p, size_t j) {
    if (!window) return true;
    double first = left < 0 ? -INFINITY : (double)p - (double)left;
    double last = right < 0 ? INFINITY : (double)p + (double)right;
    return (double)j >= first && (double)j <= last;
}

double clmha__ref_score_mod(double s, double softcap, double slope, size_t p, size_t j,
                            bool real, double *grad) {
    double g = 1.0;
    if (softcap > 0.0) {
        double t = tanh(s / softcap);
        s = softcap * t;
        g = 1.0 - t * t;
    }
    if (grad) *grad = g;
    return real ? s - slope * fabs((double)p - (double)j) : s;
}

clmha_status clmha__ref_mods_check(const char *source, const clmha__ref_mods *m, bool backward,
                                   const char *const names[3], char *msg, size_t msg_size) {
    static const char *const fns[3] = {"clmha_score_mod", "clmha_score_mod_grad",
                                       "clmha_mask_mod"};
    const unsigned bits[3] = {CLMHA__MOD_SCORE, CLMHA__MOD_GRAD, CLMHA__MOD_MASK};
    const bool given[3] = {m->score != NULL, m->grad != NULL, m->mask != NULL};
    unsigned defined = source && *source ? clmha__mods_scan(source) : 0;
    for (int t = 0; t < 3; ++t) {
        if (given[t] && !(defined & bits[t]))
            return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT,
                              "%s is given but mod_source does not define %s (the host forms "
                              "stand for mod_source's functions)",
                              names[t], fns[t]);
        bool needed = (defined & bits[t]) && (t != 1 || backward);
        if (needed && !given[t])
            return clmha__msg(msg, msg_size, CLMHA_UNSUPPORTED,
                              "mod_source defines %s: the reference runs no OpenCL C, give its "
                              "host form in %s",
                              fns[t], names[t]);
    }
    if (backward && (defined & CLMHA__MOD_SCORE) && !(defined & CLMHA__MOD_GRAD))
        return clmha__msg(msg, msg_size, CLMHA_UNSUPPORTED,
                          "the backward pass needs clmha_score_mod_grad: mod_source defines "
                          "clmha_score_mod without it");
    return CLMHA_SUCCESS;
}

double clmha__ref_user_score(const clmha__ref_mods *m, double s, size_t b, size_t h, size_t q,
                             size_t k, double *grad) {
    if (!m || !m->score) return s;
    if (grad) *grad *= m->grad ? m->grad(s, (int)b, (int)h, (int)q, (int)k, m->p) : 1.0;
    return m->score(s, (int)b, (int)h, (int)q, (int)k, m->p);
}

bool clmha__ref_user_allows(const clmha__ref_mods *m, size_t b, size_t h, size_t q, size_t k) {
    return !m || !m->mask || m->mask((int)b, (int)h, (int)q, (int)k, m->p) != 0;
}

double clmha__ref_alibi_slope(const float *given, size_t heads, size_t h) {
    return given ? (double)given[h] : clmha__alibi_slope(heads, h);
}

double clmha__ref_mask_sum(const clmha__dims *d, const clmha_forward_args *args, size_t n,
                           size_t h, size_t i, size_t j) {
    double sum = 0.0;
    if (d->attn_kind != CLMHA_MASK_NONE)
        sum += mask_value(&args->attn_mask, n * d->attn_sn + h * d->attn_sh + i * d->attn_si + j);
    if (d->kpm_kind != CLMHA_MASK_NONE) sum += mask_value(&args->key_padding_mask, n * d->s + j);
    if (args->is_causal && j > i) sum += -INFINITY;
    if (!clmha__ref_window_allows(d->win_left >= 0 || d->win_right >= 0, d->win_left,
                                  d->win_right, i, j))
        sum += -INFINITY;
    return sum;
}

// ---- attention -------------------------------------------------------------------------------

// Steps 2 to 6: projections, heads, scores, masks and softmax into probs (N*H, L, S').
static void attention_probs(const clmha__ref_call *call, const clmha__ref_mods *mods,
                            double *q_in, double *k_in, double *v_in, double *q, double *k,
                            double *v, double *probs) {
    const clmha__dims *d = &call->d;
    const size_t sp = d->s_padded;
    clmha__ref_operands ops;
    clmha__ref_operands_of(call, &ops);

    // 2. Input projections.
    double *proj[3] = {q_in, k_in, v_in};
    for (int t = 0; t < 3; ++t)
        clmha__ref_project(d, ops.x[t], ops.seq[t], ops.feat[t], ops.w[t], ops.b[t],
                           ops.width[t], proj[t]);

    // 3. Split heads; append bias_k / bias_v, then the zero key / value, after the S keys.
    const bool bias_kv = call->desc.add_bias_kv;
    // Grouped-query attention: every query head gets its key/value head's rows.
    const size_t kve = ops.width[1], group = d->h / d->kvh;
    clmha__ref_split_heads(d, q_in, d->l, d->e, 1, NULL, d->l, q);
    clmha__ref_split_heads(d, k_in, d->s, kve, group, bias_kv ? call->params.bias_k : NULL, sp,
                           k);
    clmha__ref_split_heads(d, v_in, d->s, kve, group, bias_kv ? call->params.bias_v : NULL, sp,
                           v);

    // 4. Scores q . k^T / sqrt(D) with the variants (soft-capping; ALiBi on the first S keys),
    // then 5. masks on the first S keys (appended keys are never masked).
    const double scale = 1.0 / sqrt((double)d->d);
    for (size_t n = 0; n < d->n; ++n)
        for (size_t h = 0; h < d->h; ++h) {
            size_t bh = n * d->h + h;
            double slope =
                d->alibi ? clmha__ref_alibi_slope(call->params.alibi_slopes, d->h, h) : 0.0;
            for (size_t i = 0; i < d->l; ++i)
                for (size_t j = 0; j < sp; ++j) {
                    double dot = 0.0;
                    for (size_t c = 0; c < d->d; ++c)
                        dot += q[(bh * d->l + i) * d->d + c] * k[(bh * sp + j) * d->d + c];
                    double score = clmha__ref_score_mod(dot * scale, d->softcap, slope, i,
                                                        j, j < d->s, NULL);
                    if (j < d->s) {  // user functions and masks see the real keys only
                        score = clmha__ref_user_score(mods, score, n, h, i, j, NULL);
                        score += clmha__ref_mask_sum(d, &call->args, n, h, i, j);
                        if (!clmha__ref_user_allows(mods, n, h, i, j)) score = -INFINITY;
                    }
                    probs[(bh * d->l + i) * sp + j] = score;
                }
        }

    // 6. Softmax per row; a fully masked row (every score -inf) gives zeros, not NaN. A NaN
    //    score makes the row NaN, as in PyTorch (and the device kernel). With sinks, the
    //    head's sink is one more logit of the row, with a zero value (no column).
    for (size_t row = 0; row < d->n * d->h * d->l; ++row) {
        double *r = probs + row * sp;
        double max = -INFINITY;
        for (size_t j = 0; j < sp; ++j)
            if (r[j] > max || isnan(r[j])) max = r[j];
        double sink = d->sinks ? (double)call->params.sinks[row / d->l % d->h] : -INFINITY;
        if (sink > max) max = sink;
        if (max == -INFINITY) {
            for (size_t j = 0; j < sp; ++j) r[j] = 0.0;
            continue;
        }
        double sum = d->sinks ? exp(sink - max) : 0.0;
        for (size_t j = 0; j < sp; ++j) {
            r[j] = exp(r[j] - max);
            sum += r[j];
        }
        for (size_t j = 0; j < sp; ++j) r[j] /= sum;
    }
}

void clmha__ref_dropout(const clmha__ref_call *call, double *x) {
    const clmha__dims *d = &call->d;
    const float p = call->desc.dropout;
    if (!call->args.training || !(p > 0.0f)) return;
    const size_t sp = d->s_padded;
    const uint32_t threshold = clmha__dropout_threshold(p);
    const double keep_scale = 1.0 / (1.0 - (double)p);
    for (size_t bh = 0; bh < d->n * d->h; ++bh)
        for (size_t i = 0; i < d->l; ++i)
            for (size_t j = 0; j < sp; ++j) {
                double *w = &x[(bh * d->l + i) * sp + j];
                *w = clmha__dropout_keep(call->args.rng, threshold, bh, i, j) ? *w * keep_scale
                                                                              : 0.0;
            }
}

// Step 8: out (N*H, L, D) = w (N*H, L, S') . v (N*H, S', D).
static void weights_v(const clmha__dims *d, const double *w, const double *v, double *out) {
    const size_t sp = d->s_padded;
    for (size_t bh = 0; bh < d->n * d->h; ++bh)
        for (size_t i = 0; i < d->l; ++i)
            for (size_t c = 0; c < d->d; ++c) {
                double acc = 0.0;
                for (size_t j = 0; j < sp; ++j)
                    acc += w[(bh * d->l + i) * sp + j] * v[(bh * sp + j) * d->d + c];
                out[(bh * d->l + i) * d->d + c] = acc;
            }
}

// ---- the forward pass up to the merged result ------------------------------------------------

clmha_status clmha__ref_forward_run(const clmha__ref_call *call, bool keep_probs,
                                    clmha__ref_forward *f, char *msg, size_t msg_size) {
    const clmha__dims *d = &call->d;
    clmha_status st;
    memset(f, 0, sizeof *f);
    // Scratch sizes: projections (N, L|S|S', E), scores (N*H, L, S'), context (N, L, E).
    size_t q_count = d->output_count, k_count = 0, kp_count = 0;
    if ((st = key_counts(d, &k_count, &kp_count, msg, msg_size))) return st;
    f->q_in = malloc(q_count * sizeof *f->q_in);
    f->k_in = malloc(k_count * sizeof *f->k_in);
    f->v_in = malloc(k_count * sizeof *f->v_in);
    f->q = malloc(q_count * sizeof *f->q);
    f->k = malloc(kp_count * sizeof *f->k);
    f->v = malloc(kp_count * sizeof *f->v);
    f->weights = malloc(d->scores_count * sizeof *f->weights);
    f->probs = keep_probs ? malloc(d->scores_count * sizeof *f->probs) : NULL;
    f->ctx_heads = malloc(q_count * sizeof *f->ctx_heads);
    f->ctx = malloc(q_count * sizeof *f->ctx);
    // The user functions' p: the layer's mod_params, zeros when NULL (as clmha_layer_create()).
    const clmha_layer_desc *desc = &call->desc;
    f->mods = (clmha__ref_mods){call->params.score_mod, call->params.score_mod_grad,
                                call->params.mask_mod, desc->mod_params};
    bool zeros = desc->mod_source && !desc->mod_params;
    // (A count that overflows is out of memory, never handed to calloc: ASan aborts on that.)
    size_t p_count = desc->mod_params_count ? desc->mod_params_count : 1;
    if (zeros && p_count <= SIZE_MAX / sizeof(float))
        f->mods.p = f->mod_zeros = calloc(p_count, sizeof(float));
    if (!f->q_in || !f->k_in || !f->v_in || !f->q || !f->k || !f->v || !f->weights ||
        (keep_probs && !f->probs) || !f->ctx_heads || !f->ctx || (zeros && !f->mod_zeros)) {
        clmha__ref_forward_free(f);
        return clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY,
                          "out of host memory for the reference scratch");
    }

    // 2.-6. Projections, heads, scores, masks, softmax; 7. dropout (training only): keep with
    // probability 1-p and scale by 1/(1-p).
    double *p = keep_probs ? f->probs : f->weights;
    attention_probs(call, &f->mods, f->q_in, f->k_in, f->v_in, f->q, f->k, f->v, p);
    if (keep_probs) memcpy(f->weights, f->probs, d->scores_count * sizeof *f->weights);
    clmha__ref_dropout(call, f->weights);

    // 8. weights . V -> (N*H, L, D); 9. merge heads -> (N, L, E).
    weights_v(d, f->weights, f->v, f->ctx_heads);
    clmha__ref_merge_heads(d, f->ctx_heads, d->l, d->l, f->ctx);
    return CLMHA_SUCCESS;
}

void clmha__ref_forward_free(clmha__ref_forward *f) {
    free(f->q_in);
    free(f->k_in);
    free(f->v_in);
    free(f->q);
    free(f->k);
    free(f->v);
    free(f->probs);
    free(f->weights);
    free(f->ctx_heads);
    free(f->ctx);
    free(f->mod_zeros);
    memset(f, 0, sizeof *f);
}
