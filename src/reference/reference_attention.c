// CPU reference of attention as a function (clmha_reference_attention()) in double precision:
// scaled dot-product attention written as plainly as PyTorch's documentation of
// scaled_dot_product_attention gives it, one (batch item, head, query row) at a time:
//
//   scores = q·kᵀ·scale + attn_mask (or the causal mask) -> softmax -> dropout -> ·v
//
// with the library's rules where PyTorch has none (zeros for a fully masked row, the Philox
// dropout of clmha_dropout_rng). Shapes are checked by the same code as the device function
// (src/layer/attention_shape.c), so both accept and refuse exactly the same calls.
#include "base/message.h"
#include "base/philox.h"
#include "base/struct_in.h"
#include "layer/attention_shape.h"
#include "reference/reference_math.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

// Element (n, h, t, f) of a tensor of @p heads heads, @p seq positions and @p feat features
// in @p layout.
static size_t at(clmha_attention_layout layout, size_t heads, size_t seq, size_t feat,
                 size_t n, size_t h, size_t t, size_t f) {
    return layout == CLMHA_LAYOUT_NLHD ? ((n * seq + t) * heads + h) * feat + f
                                       : ((n * heads + h) * seq + t) * feat + f;
}

// The index of score (n, h, i, j)'s term in the caller's attn_mask, by SDPA's broadcasting of
// its shape (leading ones added) to (N, H, L, S): 0 along a dimension of size 1. Worked out
// from the shape itself, not from the strides the cores get (clmha__dims::attn_sn, attn_sh,
// attn_si), so that comparing the two checks those.
static size_t mask_index(const clmha_attention_args *a, size_t n, size_t h, size_t i,
                         size_t j) {
    const clmha_tensor *t = &a->attn_mask.tensor;
    size_t x[4] = {1, 1, 1, 1}, at[4] = {n, h, i, j}, k = 0;
    for (size_t e = 0; e < t->ndim; ++e) x[4 - t->ndim + e] = t->shape[e];
    for (int e = 0; e < 4; ++e) k = k * x[e] + (x[e] == 1 ? 0 : at[e]);
    return k;
}

// The additive mask term of score (n, h, i, j): the caller's attn_mask and is_causal.
static double mask_term(const clmha_attention_args *a, size_t n, size_t h, size_t i, size_t j) {
    const clmha_mask *m = &a->attn_mask;
    if (a->is_causal && j > i) return -INFINITY;
    if (!clmha__ref_window_allows(a->window, a->window_left, a->window_right, i, j))
        return -INFINITY;
    if (m->kind == CLMHA_MASK_NONE) return 0.0;
    size_t k = mask_index(a, n, h, i, j);
    if (m->kind == CLMHA_MASK_FLOAT) return ((const float *)m->tensor.data)[k];
    bool on = ((const unsigned char *)m->tensor.data)[k] != 0;
    bool allowed = m->kind == CLMHA_MASK_BOOL_ATTEND ? on : !on;
    return allowed ? 0.0 : -INFINITY;
}

// The call's user functions in their host forms (args->host_score_mod, ...), p from
// mod_params.data.
static clmha__ref_mods mods_of(const clmha_attention_args *a) {
    return (clmha__ref_mods){a->host_score_mod, a->host_score_mod_grad, a->host_mask_mod,
                             a->mod_params.ndim ? a->mod_params.data : NULL};
}

// One query row (n, h, i): its weights into @p p (S doubles), its result into @p out, its
// log-sum-exp returned; when @p grad is not NULL, the derivative of each score in q·k·scale
// (the soft-capping's) into it (S doubles).
static double row(const clmha_attention_args *a, const clmha__attention_dims *d, size_t n,
                  size_t h, size_t i, double *p, double *out, double *grad) {
    const clmha__dims *c = &d->core;
    const float *q = a->query.data, *k = a->key.data, *v = a->value.data;
    size_t kh = h / (c->h / c->kvh);
    double m = -INFINITY;
    double slope = a->alibi ? clmha__ref_alibi_slope(a->alibi_slopes.ndim ? a->alibi_slopes.data
                                                                         : NULL,
                                                     c->h, h)
                            : 0.0;
    const clmha__ref_mods mods = mods_of(a);
    for (size_t j = 0; j < c->s; ++j) {
        double acc = 0.0;
        for (size_t f = 0; f < c->d; ++f)
            acc += (double)q[at(d->layout, c->h, c->l, c->d, n, h, i, f)] *
                   (double)k[at(d->layout, c->kvh, c->s, c->d, n, kh, j, f)];
        double *g = grad ? &grad[j] : NULL;
        double x = clmha__ref_score_mod(acc * d->scale, a->softcap, slope, i, j, true, g);
        p[j] = clmha__ref_user_score(&mods, x, n, h, i, j, g) + mask_term(a, n, h, i, j);
        if (!clmha__ref_user_allows(&mods, n, h, i, j)) p[j] = -INFINITY;
        if (p[j] > m || isnan(p[j])) m = isnan(m) ? m : p[j];
    }
    // A sink (args.sinks): one more logit of the row, with a zero value.
    double sink = a->sinks.ndim ? (double)((const float *)a->sinks.data)[h] : -INFINITY;
    if (sink > m) m = sink;
    double sum = a->sinks.ndim && m != -INFINITY ? exp(sink - m) : 0.0;
    for (size_t j = 0; j < c->s; ++j) {
        p[j] = m == -INFINITY ? 0.0 : exp(p[j] - m);
        sum += p[j];
    }
    uint32_t threshold = clmha__dropout_threshold(a->dropout_p);
    double keep = 1.0 / (1.0 - (double)a->dropout_p);
    for (size_t j = 0; j < c->s; ++j) {
        p[j] = m == -INFINITY ? 0.0 : p[j] / sum;
        if (a->dropout_p > 0.0f)
            p[j] = clmha__dropout_keep(a->rng, threshold, n * c->h + h, i, j) ? p[j] * keep : 0.0;
    }
    for (size_t f = 0; f < d->dv; ++f) {
        double acc = 0.0;
        for (size_t j = 0; j < c->s; ++j)
            acc += p[j] * (double)v[at(d->layout, c->kvh, c->s, d->dv, n, kh, j, f)];
        out[f] = acc;
    }
    return m == -INFINITY ? -INFINITY : m + log(sum);
}

// The host arrays: present where the call reads or writes them, of the call's counts.
static clmha_status check_arrays(const clmha_attention_args *a, const clmha__attention_dims *d,
                                 const double *output, size_t output_count, const double *lse,
                                 size_t lse_count, const double *weights, size_t weights_count,
                                 char *msg, size_t msg_size) {
    const char *missing = !a->query.data                                   ? "query.data"
                          : !a->key.data                                   ? "key.data"
                          : !a->value.data                                 ? "value.data"
                          : a->attn_mask.kind && !a->attn_mask.tensor.data ? "attn_mask.tensor.data"
                          : a->alibi_slopes.ndim && !a->alibi_slopes.data  ? "alibi_slopes.data"
                          : a->sinks.ndim && !a->sinks.data                ? "sinks.data"
                          : a->mod_params.ndim && !a->mod_params.data      ? "mod_params.data"
                          : !output                                        ? "output"
                                                                           : NULL;
    if (missing) return clmha__msg(msg, msg_size, CLMHA_INVALID_ARGUMENT, "%s is NULL", missing);
    if (output_count != d->output_count)
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "output_count is %zu, the output has %zu elements", output_count,
                          d->output_count);
    if (lse_count != (lse ? d->lse_count : 0))
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "lse_count is %zu: it must be %zu with lse, 0 without", lse_count,
                          d->lse_count);
    if (weights_count != (weights ? d->weights_count : 0))
        return clmha__msg(msg, msg_size, CLMHA_SHAPE_MISMATCH,
                          "weights_count is %zu: it must be %zu with weights, 0 without",
                          weights_count, d->weights_count);
    return CLMHA_SUCCESS;
}

// The reference reads host arrays only: a KV cache lives on a device. It runs no OpenCL C: the
// user functions need their host forms (for the backward pass when @p backward).
static clmha_status host_only(const clmha_attention_args *a, bool backward, char *msg,
                              size_t msg_size) {
    static const char *const names[3] = {"args->host_score_mod", "args->host_score_mod_grad",
                                         "args->host_mask_mod"};
    if (a->kv_cache)
        return clmha__msg(msg, msg_size, CLMHA_UNSUPPORTED,
                          "kv_cache is set: the reference reads no KV cache (give it the cached "
                          "keys and values as key and value)");
    clmha__ref_mods mods = mods_of(a);
    return clmha__ref_mods_check(a->mod_source, &mods, backward, names, msg, msg_size);
}

// A packed call (clmha_attention_args::seq_lens), checked: one reference call per sequence on
// its rows (clmha__attention_packed_args()), its log-sum-exp rows to its (H, L_i) block.
static clmha_status packed_forward(const clmha_attention_args *a, const clmha__attention_dims *d,
                                   double *output, double *lse, char *msg, size_t msg_size) {
    const clmha__dims *c = &d->core;
    size_t q0 = 0, k0 = 0;
    for (size_t i = 0; i < c->n; q0 += c->seq_lens[i], k0 += c->kv_seq_lens[i], ++i) {
        size_t rows = c->seq_lens[i];
        if (!rows) continue;
        clmha_attention_args sub;
        clmha__attention_packed_args(d, a, i, q0, k0, &sub);
        clmha_status st = clmha_reference_attention(
            &sub, output + q0 * c->h * d->dv, rows * c->h * d->dv, lse ? lse + q0 * c->h : NULL,
            lse ? rows * c->h : 0, NULL, 0, msg, msg_size);
        if (st) return st;
    }
    return CLMHA_SUCCESS;
}

clmha_status clmha_reference_attention(const clmha_attention_args *args, double *output,
                                       size_t output_count, double *lse, size_t lse_count,
                                       double *weights, size_t weights_count, char *message,
                                       size_t message_size) {
    if (message && message_size) message[0] = '\0';
    clmha_attention_args a;
    clmha__attention_dims d;
    clmha_status st = CLMHA__STRUCT_IN(clmha_attention_args, &a, args, "args", message,
                                       message_size);
    if (st || (st = host_only(&a, false, message, message_size)) ||
        (st = clmha__attention_resolve(&a, &d, message, message_size)) ||
        (st = check_arrays(&a, &d, output, output_count, lse, lse_count, weights,
                           weights_count, message, message_size)))
        return st;
    if (d.core.packed && weights)
        return clmha__msg(message, message_size, CLMHA_UNSUPPORTED,
                          "a packed call (seq_lens) returns no attention weights");
    if (d.core.packed) return packed_forward(&a, &d, output, lse, message, message_size);
    const clmha__dims *c = &d.core;
    double *p = malloc(c->s * sizeof *p), *out = malloc(d.dv * sizeof *out);
    if (!p || !out) {
        free(p);
        free(out);
        return clmha__msg(message, message_size, CLMHA_OUT_OF_MEMORY, "out of host memory");
    }
    for (size_t n = 0; n < c->n; ++n)
        for (size_t h = 0; h < c->h; ++h)
            for (size_t i = 0; i < c->l; ++i) {
                size_t r = (n * c->h + h) * c->l + i;
                double x = row(&a, &d, n, h, i, p, out, NULL);
                if (lse) lse[r] = x;
                for (size_t j = 0; weights && j < c->s; ++j) weights[r * c->s + j] = p[j];
                for (size_t f = 0; f < d.dv; ++f)
                    output[at(d.layout, c->h, c->l, d.dv, n, h, i, f)] = out[f];
            }
    free(p);
    free(out);
    return CLMHA_SUCCESS;
}

// ---- the backward pass --------------------------------------------------------------------------

// What one row's backward needs: the gradients (zeroed by the caller) and scratch: S doubles
// each for the probabilities before dropout and their gradient, D_v for the row's output.
typedef struct grads_out {
    double *dq, *dk, *dv, *dmask;
    double *p, *dp, *out, *g;  // g: the scores' derivatives through the variants (row())
    double *dsinks;            // the sinks' gradient (H), or NULL
} grads_out;

// The backward of query row (n, h, i) given its output gradient @p g (D_v floats in the
// output's layout): softmax'(P)·(dO·Vᵀ ⊙ dropout), into dq, dk, dv and the mask's gradient.
static void row_backward(const clmha_attention_args *a, const clmha__attention_dims *d,
                         size_t n, size_t h, size_t i, const float *grad_output, grads_out *o) {
    const clmha__dims *c = &d->core;
    const float *q = a->query.data, *k = a->key.data, *v = a->value.data;
    size_t kh = h / (c->h / c->kvh);
    double *p = o->p, *dp = o->dp;
    // The probabilities without dropout: row() with dropout off.
    clmha_attention_args plain = *a;
    plain.dropout_p = 0.0f;
    double lse = row(&plain, d, n, h, i, p, o->out, o->g);
    uint32_t threshold = clmha__dropout_threshold(a->dropout_p);
    double keep = 1.0 / (1.0 - (double)a->dropout_p), dot = 0.0;
    for (size_t j = 0; j < c->s; ++j) {
        double dpd = 0.0, kept = 1.0;  // dPd_j = dO · v_j; the dropout factor of weight j
        for (size_t f = 0; f < d->dv; ++f)
            dpd += (double)grad_output[at(d->layout, c->h, c->l, d->dv, n, h, i, f)] *
                   (double)v[at(d->layout, c->kvh, c->s, d->dv, n, kh, j, f)];
        if (a->dropout_p > 0.0f)
            kept = clmha__dropout_keep(a->rng, threshold, n * c->h + h, i, j) ? keep : 0.0;
        for (size_t f = 0; f < d->dv; ++f)  // dv_j += Pd_j dO
            o->dv[at(d->layout, c->kvh, c->s, d->dv, n, kh, j, f)] +=
                p[j] * kept *
                (double)grad_output[at(d->layout, c->h, c->l, d->dv, n, h, i, f)];
        dp[j] = dpd * kept;
        dot += p[j] * dp[j];
    }
    if (o->dsinks && lse != -INFINITY)  // the sink's score: P_sink (0 - dot)
        o->dsinks[h] -= exp((double)((const float *)a->sinks.data)[h] - lse) * dot;
    for (size_t j = 0; j < c->s; ++j) {
        double ds = p[j] * (dp[j] - dot);  // the score's gradient
        if (o->dmask) o->dmask[mask_index(a, n, h, i, j)] += ds;
        ds *= o->g[j];  // through the score functions (soft-capping, the user's)
        for (size_t f = 0; f < c->d; ++f) {
            size_t qi = at(d->layout, c->h, c->l, c->d, n, h, i, f);
            size_t ki = at(d->layout, c->kvh, c->s, c->d, n, kh, j, f);
            o->dq[qi] += d->scale * ds * (double)k[ki];
            o->dk[ki] += d->scale * ds * (double)q[qi];
        }
    }
}

// The backward of a packed call, checked: one reference backward per sequence on its rows; the
// sinks' gradient summed over them; zeros for the keys that no query sees.
static clmha_status packed_backward(const clmha_attention_args *a, const clmha__attention_dims *d,
                                    const float *grad_output, const clmha_reference_grads *g,
                                    char *msg, size_t msg_size) {
    const clmha__dims *c = &d->core;
    size_t h = c->h, kvh = c->kvh, dk = c->d, dv = d->dv, q0 = 0, k0 = 0;
    double *sinks = g->sinks ? calloc(h, sizeof *sinks) : NULL;
    if (g->sinks && !sinks)
        return clmha__msg(msg, msg_size, CLMHA_OUT_OF_MEMORY, "out of host memory");
    if (g->sinks) memset(g->sinks, 0, h * sizeof *g->sinks);
    clmha_status st = CLMHA_SUCCESS;
    for (size_t i = 0; !st && i < c->n; q0 += c->seq_lens[i], k0 += c->kv_seq_lens[i], ++i) {
        if (!c->seq_lens[i]) {
            size_t rows = c->kv_seq_lens[i];
            if (g->key) memset(g->key + k0 * kvh * dk, 0, rows * kvh * dk * sizeof(double));
            if (g->value) memset(g->value + k0 * kvh * dv, 0, rows * kvh * dv * sizeof(double));
            continue;
        }
        clmha_attention_args sub;
        clmha__attention_packed_args(d, a, i, q0, k0, &sub);
        clmha_reference_grads sg = *g;
        if (g->query) sg.query = g->query + q0 * h * dk;
        if (g->key) sg.key = g->key + k0 * kvh * dk;
        if (g->value) sg.value = g->value + k0 * kvh * dv;
        sg.sinks = sinks;
        st = clmha_reference_attention_backward(&sub, grad_output + q0 * h * dv, &sg, msg,
                                                msg_size);
        for (size_t x = 0; !st && sinks && x < h; ++x) g->sinks[x] += sinks[x];
    }
    free(sinks);
    return st;
}

clmha_status clmha_reference_attention_backward(const clmha_attention_args *args,
                                                const float *grad_output,
                                                const clmha_reference_grads *grads,
                                                char *message, size_t message_size) {
    if (message && message_size) message[0] = '\0';
    clmha_attention_args a;
    clmha_reference_grads g;
    clmha__attention_dims d;
    double none;
    clmha_status st = CLMHA__STRUCT_IN(clmha_attention_args, &a, args, "args", message,
                                       message_size);
    if (st || (st = host_only(&a, true, message, message_size)) ||
        (st = CLMHA__STRUCT_IN(clmha_reference_grads, &g, grads, "grads", message,
                               message_size)) ||
        (st = clmha__attention_resolve(&a, &d, message, message_size)) ||
        (st = check_arrays(&a, &d, &none, d.output_count, NULL, 0, NULL, 0, message,
                           message_size)))
        return st;
    if (!grad_output)
        return clmha__msg(message, message_size, CLMHA_INVALID_ARGUMENT, "grad_output is NULL");
    if (g.attn_mask && a.attn_mask.kind != CLMHA_MASK_FLOAT)
        return clmha__msg(message, message_size, CLMHA_INVALID_ARGUMENT,
                          "grads->attn_mask is set but attn_mask is not a float mask");
    if (g.sinks && !a.sinks.ndim)
        return clmha__msg(message, message_size, CLMHA_INVALID_ARGUMENT,
                          "grads->sinks is set but the call has no sinks");
    if (d.core.packed) return packed_backward(&a, &d, grad_output, &g, message, message_size);
    const clmha__dims *c = &d.core;
    size_t counts[5] = {d.query_count, d.key_count, d.value_count, d.mask_count, c->h};
    double *mine[5] = {NULL, NULL, NULL, NULL, NULL};
    double *want[5] = {g.query, g.key, g.value, g.attn_mask, g.sinks};
    grads_out o = {.p = malloc(c->s * sizeof(double)), .dp = malloc(c->s * sizeof(double)),
                   .out = malloc(d.dv * sizeof(double)), .g = malloc(c->s * sizeof(double))};
    bool ok = o.p && o.dp && o.out && o.g;
    for (int t = 0; t < 5 && ok; ++t)  // every gradient, kept only where asked for
        ok = (mine[t] = calloc(counts[t] ? counts[t] : 1, sizeof(double))) != NULL;
    if (ok) {
        o.dq = mine[0], o.dk = mine[1], o.dv = mine[2];
        o.dmask = a.attn_mask.kind == CLMHA_MASK_FLOAT ? mine[3] : NULL;
        o.dsinks = a.sinks.ndim ? mine[4] : NULL;
        for (size_t n = 0; n < c->n; ++n)
            for (size_t h = 0; h < c->h; ++h)
                for (size_t i = 0; i < c->l; ++i) row_backward(&a, &d, n, h, i, grad_output, &o);
        for (int t = 0; t < 5; ++t)
            for (size_t x = 0; want[t] && x < counts[t]; ++x) want[t][x] = mine[t][x];
    }
    for (int t = 0; t < 5; ++t) free(mine[t]);
    free(o.p);
    free(o.dp);
    free(o.g);
    free(o.out);
    return ok ? CLMHA_SUCCESS
              : clmha__msg(message, message_size, CLMHA_OUT_OF_MEMORY, "out of host memory");
}
