// clmha_reference_backward() against central finite differences of clmha_reference_forward():
// for tiny layers covering every option, the analytic gradient of the scalar loss
//   loss = sum dY * Y (+ sum dW * W with a weights gradient),   dY, dW random,
// with respect to every element of every input, parameter and float mask must match
//   (loss(x + h) - loss(x - h)) / (actual step),
// where x +- h are rounded to float (the inputs are float arrays) and the step divided by is
// the difference of the two rounded values; steps h and 2h are combined by Richardson
// extrapolation. Error bound per tensor: FD_TOL (1 + max|FD|).
// The reference runs on the CPU: no OpenCL context is made.
//
// Also: calls the backward pass refuses.
#include <criterion/criterion.h>
#include <criterion/logging.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clmha.h"
#include "support.h"

// Measured: 1.1e-9 at most (dropout_self_averaged, in_proj_weight); --verbose logs every tensor.
#define FD_TOL 1e-8

enum { SELF, CROSS, KV_SAME };                  // key and value: none, both, key only
enum { ATTN_2D, ATTN_PER_HEAD, ATTN_PER_BATCH };  // attn_mask layout
enum { FULL_NONE, FULL_KPM_FLOAT, FULL_ATTN_BOOL, FULL_ATTN_FLOAT };  // a fully masked row

typedef struct fd_case {
    const char *name;
    size_t e, h, l, s, n;  // n == 0: unbatched
    size_t kdim, vdim;     // 0: E
    int mode;
    bool no_bias, bias_kv, zero_attn, batch_first;
    float dropout;  // applied (training) when > 0
    clmha_mask_kind kpm, attn;
    int attn_layout;
    bool causal, need_weights, per_head, grad_weights;
    int full;
    double softcap;  // score variants (clmha_layer_desc): soft-capping, ALiBi (geometric)
    bool alibi, sinks;  // and attention sinks, whose gradient is checked too
    bool user;          // the user functions of support.h (mod_source), in their host forms
} fd_case;

#define MAX_SLOTS 16

// One differentiated tensor: its float values and where its analytic gradient goes.
typedef struct slot {
    const char *name;
    float *data;
    size_t count;
    double *grad;
} slot;

typedef struct fd_setup {
    clmha_layer_desc desc;
    clmha_forward_args args;
    clmha_reference_params params;
    clmha_reference_grads grads;
    slot slots[MAX_SLOTS];
    size_t num_slots;
    unsigned char *bool_masks[2];
    float *dy, *dw;
    size_t n_out, n_w;
} fd_setup;

// ---- building a case -------------------------------------------------------------------------

static float *add_slot(fd_setup *su, const char *name, size_t count, prng *r, double scale,
                       double **grad_field) {
    cr_assert_lt(su->num_slots, MAX_SLOTS);
    slot *sl = &su->slots[su->num_slots++];
    sl->name = name;
    sl->count = count;
    sl->data = normal_floats(r, count);
    for (size_t i = 0; i < count; i++) sl->data[i] = (float)(sl->data[i] * scale);
    sl->grad = calloc(count, sizeof *sl->grad);
    cr_assert_not_null(sl->grad);
    *grad_field = sl->grad;
    return sl->data;
}

static clmha_tensor input_tensor(const fd_case *c, size_t seq, size_t feat) {
    clmha_tensor t;
    memset(&t, 0, sizeof t);
    if (c->n == 0) {
        t.ndim = 2, t.shape[0] = seq, t.shape[1] = feat;
    } else {
        t.ndim = 3;
        t.shape[0] = c->batch_first ? c->n : seq;
        t.shape[1] = c->batch_first ? seq : c->n;
        t.shape[2] = feat;
    }
    return t;
}

// A mask tensor's shape: key_padding_mask (N, S) or (S); attn_mask by layout.
static clmha_tensor mask_tensor(const fd_case *c, bool kpm) {
    clmha_tensor t;
    memset(&t, 0, sizeof t);
    size_t nb = c->n ? c->n : 1;
    if (kpm) {
        if (c->n) t.ndim = 2, t.shape[0] = c->n, t.shape[1] = c->s;
        else t.ndim = 1, t.shape[0] = c->s;
    } else if (c->attn_layout == ATTN_2D) {
        t.ndim = 2, t.shape[0] = c->l, t.shape[1] = c->s;
    } else {
        t.ndim = 3;
        t.shape[0] = c->attn_layout == ATTN_PER_HEAD ? nb * c->h : nb;
        t.shape[1] = c->l, t.shape[2] = c->s;
    }
    return t;
}

static size_t tensor_count(const clmha_tensor *t) {
    size_t n = 1;
    for (size_t i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

// Fills a mask. Key 0 is never masked and is_causal never masks it, so no row is fully masked
// unless the case asks for one (fd_case::full). Float masks get -inf at a few places.
static void fill_mask(const fd_case *c, clmha_mask *m, bool kpm, fd_setup *su, prng *r) {
    m->tensor = mask_tensor(c, kpm);
    m->per_batch = !kpm && c->attn_layout == ATTN_PER_BATCH;
    size_t count = tensor_count(&m->tensor);
    if (m->kind == CLMHA_MASK_FLOAT) {
        float *v = add_slot(su, kpm ? "key_padding_mask" : "attn_mask", count, r, 1.0,
                            kpm ? &su->grads.key_padding_mask : &su->grads.attn_mask);
        for (size_t i = 0; i < count; i++)
            if (i % c->s != 0 && i % 5 == 3) v[i] = -INFINITY;
        if (kpm && c->full == FULL_KPM_FLOAT)
            for (size_t j = 0; j < c->s; j++) v[(count / c->s - 1) * c->s + j] = -INFINITY;
        if (!kpm && c->full == FULL_ATTN_FLOAT)
            for (size_t j = 0; j < c->s; j++) v[1 * c->s + j] = -INFINITY;  // first matrix, row 1
        m->tensor.data = v;
    } else {
        unsigned char *b = calloc(count, 1);
        cr_assert_not_null(b);
        su->bool_masks[kpm] = b;
        bool attend = m->kind == CLMHA_MASK_BOOL_ATTEND;
        for (size_t i = 0; i < count; i++) {
            bool masked = i % c->s != 0 && (i / c->s + i) % 3 == 1;
            if (!kpm && c->full == FULL_ATTN_BOOL && i / c->s == 1) masked = true;
            b[i] = (unsigned char)(masked != attend);
        }
        m->tensor.data = b;
    }
}

static void free_setup(fd_setup *su) {
    for (size_t i = 0; i < su->num_slots; i++) {
        free(su->slots[i].data);
        free(su->slots[i].grad);
    }
    free(su->bool_masks[0]);
    free(su->bool_masks[1]);
    free(su->dy);
    free(su->dw);
    memset(su, 0, sizeof *su);
}

static void setup_case(const fd_case *c, fd_setup *su) {
    memset(su, 0, sizeof *su);
    prng r = {.state = 0x5eed};
    for (const char *ch = c->name; *ch; ch++) r.state = r.state * 131u + (unsigned char)*ch;
    size_t e = c->e, kdim = c->kdim ? c->kdim : e, vdim = c->vdim ? c->vdim : e;
    su->desc = (clmha_layer_desc){.struct_size = sizeof su->desc, .embed_dim = e,
                                  .num_heads = c->h, .kdim = kdim, .vdim = vdim,
                                  .bias = !c->no_bias, .add_bias_kv = c->bias_kv,
                                  .add_zero_attn = c->zero_attn, .batch_first = c->batch_first,
                                  .dropout = c->dropout, .softcap = c->softcap,
                                  .alibi = c->alibi, .sinks = c->sinks};
    clmha_reference_params *p = &su->params;
    clmha_reference_grads *g = &su->grads;
    clmha_forward_args *a = &su->args;
    p->struct_size = sizeof *p;
    g->struct_size = sizeof *g;
    if (c->user) {
        su->desc.mod_source = user_test_source;
        su->desc.mod_params = user_test_params;
        su->desc.mod_params_count = USER_TEST_PARAMS;
        p->score_mod = test_user_score;
        p->score_mod_grad = test_user_score_grad;
        p->mask_mod = test_user_mask;
    }

    // Parameters, scaled like PyTorch's initialisation so that the softmax is not saturated.
    if (kdim == e && vdim == e) {
        p->in_proj_weight = add_slot(su, "in_proj_weight", 3 * e * e, &r, 0.6, &g->in_proj_weight);
    } else {
        p->q_proj_weight = add_slot(su, "q_proj_weight", e * e, &r, 0.6, &g->q_proj_weight);
        p->k_proj_weight = add_slot(su, "k_proj_weight", e * kdim, &r, 0.6, &g->k_proj_weight);
        p->v_proj_weight = add_slot(su, "v_proj_weight", e * vdim, &r, 0.6, &g->v_proj_weight);
    }
    p->out_proj_weight = add_slot(su, "out_proj.weight", e * e, &r, 0.6, &g->out_proj_weight);
    if (!c->no_bias) {
        p->in_proj_bias = add_slot(su, "in_proj_bias", 3 * e, &r, 0.3, &g->in_proj_bias);
        p->out_proj_bias = add_slot(su, "out_proj.bias", e, &r, 0.3, &g->out_proj_bias);
    }
    if (c->bias_kv) {
        p->bias_k = add_slot(su, "bias_k", e, &r, 0.5, &g->bias_k);
        p->bias_v = add_slot(su, "bias_v", e, &r, 0.5, &g->bias_v);
    }
    if (c->sinks) p->sinks = add_slot(su, "sinks", c->h, &r, 1.0, &g->sinks);

    // Inputs and options.
    a->struct_size = sizeof *a;
    a->query = input_tensor(c, c->l, e);
    a->query.data = add_slot(su, "query", tensor_count(&a->query), &r, 1.0, &g->query);
    if (c->mode != SELF) {
        a->key = input_tensor(c, c->s, kdim);
        a->key.data = add_slot(su, "key", tensor_count(&a->key), &r, 1.0, &g->key);
    }
    if (c->mode == CROSS) {
        a->value = input_tensor(c, c->s, vdim);
        a->value.data = add_slot(su, "value", tensor_count(&a->value), &r, 1.0, &g->value);
    }
    a->key_padding_mask.kind = c->kpm;
    if (c->kpm != CLMHA_MASK_NONE) fill_mask(c, &a->key_padding_mask, true, su, &r);
    a->attn_mask.kind = c->attn;
    if (c->attn != CLMHA_MASK_NONE) fill_mask(c, &a->attn_mask, false, su, &r);
    a->is_causal = c->causal;
    a->need_weights = c->need_weights;
    a->per_head_weights = c->per_head;
    a->training = c->dropout > 0.0f;
    a->rng = (clmha_dropout_rng){.seed = 0x1234abcd5678ull, .offset = 3};

    // The loss's weights dY and dW.
    size_t nb = c->n ? c->n : 1, sp = c->s + c->bias_kv + c->zero_attn;
    su->n_out = nb * c->l * e;
    su->n_w = c->need_weights ? nb * (c->per_head ? c->h : 1) * c->l * sp : 0;
    su->dy = normal_floats(&r, su->n_out);
    if (c->grad_weights) su->dw = normal_floats(&r, su->n_w);
}

// ---- the loss and its finite differences -----------------------------------------------------

static double loss_of(const fd_setup *su) {
    double *out = calloc(su->n_out, sizeof *out);
    double *w = calloc(su->n_w + 1, sizeof *w);
    cr_assert(out && w);
    char msg[256];
    clmha_status st = clmha_reference_forward(&su->desc, &su->params, &su->args, out, su->n_out,
                                              su->n_w ? w : NULL, su->n_w, msg, sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_reference_forward: %s", msg);
    double loss = 0.0;
    for (size_t i = 0; i < su->n_out; i++) loss += (double)su->dy[i] * out[i];
    if (su->dw)
        for (size_t i = 0; i < su->n_w; i++) loss += (double)su->dw[i] * w[i];
    free(out);
    free(w);
    return loss;
}

static bool all_finite(const double *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return false;
    return true;
}

// The central difference of the loss in element i of a slot with step h, divided by the step
// actually taken between the two float points.
static double central(fd_setup *su, slot *sl, size_t i, double h) {
    float x0 = sl->data[i];
    float xp = (float)((double)x0 + h), xm = (float)((double)x0 - h);
    sl->data[i] = xp;
    double lp = loss_of(su);
    sl->data[i] = xm;
    double lm = loss_of(su);
    sl->data[i] = x0;
    return (lp - lm) / ((double)xp - (double)xm);
}

// Central differences with steps h and 2h combined by Richardson extrapolation, which cancels
// their h^2 error terms: with h = 2^-10 a plain central difference is off by ~1e-6 relative
// (the softmax's third derivative), this by ~1e-9. h is a power of two (2^-10 below 1, scaled
// with |x| above), so that x +- h are mostly exact floats.
static double richardson(fd_setup *su, slot *sl, size_t i) {
    double ax = fabs((double)sl->data[i]);
    double h = ldexp(1.0, -10 + (ax > 1.0 ? (int)floor(log2(ax)) : 0));
    double d1 = central(su, sl, i, h), d2 = central(su, sl, i, 2.0 * h);
    return d1 + (d1 - d2) / 3.0;
}

// Runs the analytic backward pass, then compares every slot with central differences. Returns
// the largest relative error over the slots.
static double check_case(const fd_case *c) {
    fd_setup su;
    setup_case(c, &su);
    char msg[256];
    clmha_status st = clmha_reference_backward(&su.desc, &su.params, &su.args, su.dy, su.dw,
                                               &su.grads, msg, sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: clmha_reference_backward: %s: %s", c->name,
                 clmha_status_string(st), msg);
    double worst = 0.0;
    for (size_t s = 0; s < su.num_slots; s++) {
        slot *sl = &su.slots[s];
        cr_assert(all_finite(sl->grad, sl->count), "%s: grad %s not finite", c->name, sl->name);
        double max_err = 0.0, max_fd = 0.0;
        for (size_t i = 0; i < sl->count; i++) {
            if (!isfinite(sl->data[i])) {  // a -inf mask entry: no gradient flows through it
                cr_assert_eq(sl->grad[i], 0.0, "%s: %s[%zu] is -inf, gradient %g", c->name,
                             sl->name, i, sl->grad[i]);
                continue;
            }
            double fd = richardson(&su, sl, i);
            double err = fabs(fd - sl->grad[i]);
            if (!(err <= max_err)) max_err = isnan(err) ? INFINITY : err;
            if (fabs(fd) > max_fd) max_fd = fabs(fd);
        }
        double rel = max_err / (1.0 + max_fd);
        cr_log_info("%s: %s max|analytic - FD| %.3e, max|FD| %.3e, relative %.3e", c->name,
                    sl->name, max_err, max_fd, rel);
        cr_expect_leq(rel, FD_TOL, "%s: %s: max|analytic - FD| = %.3e > %.0e (1 + %.3e)",
                      c->name, sl->name, max_err, FD_TOL, max_fd);
        if (rel > worst) worst = rel;
    }
    free_setup(&su);
    return worst;
}

// ---- the cases -------------------------------------------------------------------------------

#define F CLMHA_MASK_FLOAT
#define BI CLMHA_MASK_BOOL_IGNORE
#define BA CLMHA_MASK_BOOL_ATTEND

static const fd_case fd_cases[] = {
    {.name = "self", .e = 4, .h = 2, .l = 3, .s = 3, .n = 2, .mode = SELF, .need_weights = true,
     .grad_weights = true},
    {.name = "cross_per_head_weights", .e = 4, .h = 2, .l = 3, .s = 4, .n = 2, .mode = CROSS,
     .need_weights = true, .per_head = true, .grad_weights = true},
    {.name = "key_is_value", .e = 4, .h = 2, .l = 3, .s = 2, .n = 2, .mode = KV_SAME},
    {.name = "kdim_vdim", .e = 4, .h = 2, .l = 3, .s = 4, .n = 2, .kdim = 3, .vdim = 5,
     .mode = CROSS, .kpm = F, .attn = F, .attn_layout = ATTN_PER_HEAD, .need_weights = true,
     .grad_weights = true},
    {.name = "kdim_eq_vdim_key_is_value", .e = 4, .h = 2, .l = 2, .s = 3, .n = 2, .kdim = 3,
     .vdim = 3, .mode = KV_SAME},
    {.name = "batch_first", .e = 4, .h = 2, .l = 3, .s = 4, .n = 2, .mode = CROSS,
     .batch_first = true, .kpm = F, .need_weights = true, .grad_weights = true},
    {.name = "unbatched_masks", .e = 4, .h = 2, .l = 3, .s = 3, .mode = SELF, .kpm = F,
     .attn = F, .attn_layout = ATTN_PER_HEAD, .need_weights = true, .per_head = true,
     .grad_weights = true},
    {.name = "unbatched_cross_2d", .e = 4, .h = 2, .l = 2, .s = 4, .mode = CROSS, .attn = F},
    {.name = "no_bias", .e = 4, .h = 2, .l = 3, .s = 2, .n = 2, .mode = CROSS, .no_bias = true,
     .need_weights = true, .grad_weights = true},
    {.name = "bias_kv_masks", .e = 4, .h = 2, .l = 3, .s = 2, .n = 2, .mode = CROSS,
     .bias_kv = true, .kpm = F, .attn = F, .need_weights = true, .grad_weights = true},
    {.name = "zero_attn_masks", .e = 4, .h = 2, .l = 3, .s = 4, .n = 2, .mode = CROSS,
     .zero_attn = true, .kpm = F, .attn = F, .attn_layout = ATTN_PER_BATCH,
     .need_weights = true, .per_head = true, .grad_weights = true},
    {.name = "bias_kv_zero_attn_causal_L3_S2", .e = 4, .h = 2, .l = 3, .s = 2, .n = 2,
     .mode = CROSS, .bias_kv = true, .zero_attn = true, .causal = true, .attn = F,
     .need_weights = true, .grad_weights = true},
    {.name = "causal_L2_S4", .e = 4, .h = 2, .l = 2, .s = 4, .n = 2, .mode = CROSS,
     .causal = true, .kpm = F, .need_weights = true, .per_head = true, .grad_weights = true},
    {.name = "causal_self", .e = 4, .h = 2, .l = 3, .s = 3, .n = 2, .mode = SELF,
     .causal = true, .attn = F, .attn_layout = ATTN_PER_BATCH},
    {.name = "bool_masks", .e = 4, .h = 2, .l = 3, .s = 4, .n = 2, .mode = CROSS, .kpm = BI,
     .attn = BA, .attn_layout = ATTN_PER_HEAD, .need_weights = true, .grad_weights = true},
    {.name = "bool_kpm_float_attn", .e = 4, .h = 2, .l = 3, .s = 4, .n = 2, .mode = CROSS,
     .kpm = BA, .attn = F, .causal = true},
    {.name = "dropout", .e = 4, .h = 2, .l = 3, .s = 4, .n = 2, .mode = CROSS, .dropout = 0.3f,
     .kpm = F, .need_weights = true, .per_head = true, .grad_weights = true},
    {.name = "dropout_self_averaged", .e = 4, .h = 2, .l = 3, .s = 3, .n = 2, .mode = SELF,
     .dropout = 0.3f, .bias_kv = true, .need_weights = true, .grad_weights = true},
    {.name = "full_kpm_float", .e = 4, .h = 2, .l = 3, .s = 2, .n = 2, .mode = CROSS,
     .kpm = F, .attn = F, .need_weights = true, .grad_weights = true, .full = FULL_KPM_FLOAT},
    {.name = "full_attn_bool_row", .e = 4, .h = 2, .l = 3, .s = 4, .n = 2, .mode = CROSS,
     .attn = BI, .need_weights = true, .per_head = true, .grad_weights = true,
     .full = FULL_ATTN_BOOL},
    {.name = "full_attn_float_row_per_head", .e = 4, .h = 2, .l = 3, .s = 2, .n = 2,
     .mode = CROSS, .attn = F, .attn_layout = ATTN_PER_HEAD, .need_weights = true,
     .grad_weights = true, .full = FULL_ATTN_FLOAT},
    {.name = "full_row_zero_attn", .e = 4, .h = 2, .l = 3, .s = 2, .n = 2, .mode = CROSS,
     .zero_attn = true, .kpm = F, .full = FULL_KPM_FLOAT},
    // Score variants: soft-capping's derivative, ALiBi's term, the sinks' gradient.
    {.name = "softcap_alibi_masks", .e = 4, .h = 2, .l = 3, .s = 4, .n = 2, .mode = CROSS,
     .softcap = 0.7, .alibi = true, .kpm = F, .attn = F, .need_weights = true,
     .grad_weights = true},
    {.name = "sinks_self_weights", .e = 4, .h = 2, .l = 3, .s = 3, .n = 2, .mode = SELF,
     .sinks = true, .need_weights = true, .per_head = true, .grad_weights = true},
    {.name = "sinks_softcap_bias_kv_zero_attn_causal_dropout", .e = 4, .h = 2, .l = 3, .s = 2,
     .n = 2, .mode = CROSS, .sinks = true, .softcap = 1.3, .bias_kv = true, .zero_attn = true,
     .causal = true, .dropout = 0.3f, .attn = F, .need_weights = true, .grad_weights = true},
    {.name = "sinks_full_row", .e = 4, .h = 2, .l = 3, .s = 2, .n = 2, .mode = CROSS,
     .sinks = true, .kpm = F, .attn = F, .full = FULL_KPM_FLOAT},
    // User functions (host forms): the score function's derivative chained with soft-capping's,
    // after ALiBi's term; the mask function forbidding keys.
    {.name = "user_softcap_alibi_masks", .e = 4, .h = 2, .l = 5, .s = 4, .n = 2, .mode = CROSS,
     .user = true, .softcap = 0.9, .alibi = true, .kpm = F, .attn = F, .need_weights = true,
     .per_head = true, .grad_weights = true},
    {.name = "user_sinks_bias_kv_zero_attn_causal_dropout", .e = 4, .h = 2, .l = 5, .s = 5,
     .n = 2, .mode = SELF, .user = true, .sinks = true, .bias_kv = true, .zero_attn = true,
     .causal = true, .dropout = 0.3f, .attn = F, .need_weights = true, .grad_weights = true},
};
#define FD_NUM_CASES (sizeof fd_cases / sizeof *fd_cases)

Test(reference_backward, finite_differences, .timeout = 120) {
    double worst = 0.0;
    for (size_t i = 0; i < FD_NUM_CASES; i++) {
        double e = check_case(&fd_cases[i]);
        if (e > worst) worst = e;
    }
    cr_log_info("%zu cases: max relative |analytic - FD| %.3e (bound %.0e)", FD_NUM_CASES,
                worst, FD_TOL);
}

// A fully masked row: zero gradient on its query row, zero weights there, all finite.
Test(reference_backward, fully_masked_row_is_zero) {
    const fd_case *c = NULL;
    for (size_t i = 0; i < FD_NUM_CASES; i++)
        if (!strcmp(fd_cases[i].name, "full_attn_bool_row")) c = &fd_cases[i];
    cr_assert_not_null(c);
    fd_setup su;
    setup_case(c, &su);
    clmha_status st = clmha_reference_backward(&su.desc, &su.params, &su.args, su.dy, su.dw,
                                               &su.grads, NULL, 0);
    cr_assert_eq(st, CLMHA_SUCCESS);
    // attn_mask (L, S) masks row 1 entirely: query row 1 of every batch item gets no gradient.
    for (size_t n = 0; n < c->n; n++)
        for (size_t f = 0; f < c->e; f++)
            cr_expect_eq(su.grads.query[(1 * c->n + n) * c->e + f], 0.0);
    free_setup(&su);
}

// The block gradients equal the row blocks of in_proj_weight's gradient.
Test(reference_backward, blocks_of_in_proj_weight) {
    fd_setup su;
    setup_case(&fd_cases[0], &su);
    size_t e = fd_cases[0].e;
    clmha_status st = clmha_reference_backward(&su.desc, &su.params, &su.args, su.dy, su.dw,
                                               &su.grads, NULL, 0);
    cr_assert_eq(st, CLMHA_SUCCESS);
    double *blocks = calloc(3 * e * e, sizeof *blocks);
    cr_assert_not_null(blocks);
    clmha_reference_grads g = {.struct_size = sizeof g, .q_proj_weight = blocks,
                               .k_proj_weight = blocks + e * e,
                               .v_proj_weight = blocks + 2 * e * e};
    st = clmha_reference_backward(&su.desc, &su.params, &su.args, su.dy, su.dw, &g, NULL, 0);
    cr_assert_eq(st, CLMHA_SUCCESS);
    cr_assert_arr_eq(blocks, su.grads.in_proj_weight, 3 * e * e * sizeof *blocks);
    free(blocks);
    free_setup(&su);
}

// ---- refused calls ---------------------------------------------------------------------------

static void expect_refused(const fd_setup *su, const clmha_forward_args *a, const float *dw,
                           const clmha_reference_grads *g, clmha_status want, const char *what,
                           const char *needle) {
    char msg[256];
    clmha_status st = clmha_reference_backward(&su->desc, &su->params, a, su->dy, dw, g, msg,
                                               sizeof msg);
    cr_expect_eq(st, want, "%s: got %s (%s)", what, clmha_status_string(st), msg);
    if (needle)
        cr_expect(strstr(msg, needle) != NULL, "%s: message '%s' lacks '%s'", what, msg, needle);
}

Test(reference_backward, refused_calls) {
    double sink[256];
    fd_setup su;
    char msg[256];

    // Self-attention: no key or value gradient.
    setup_case(&fd_cases[0], &su);  // "self"
    clmha_reference_grads g = {.struct_size = sizeof g, .key = sink};
    expect_refused(&su, &su.args, su.dw, &g, CLMHA_INVALID_ARGUMENT, "key grad, no key", "key");
    g = (clmha_reference_grads){.struct_size = sizeof g, .value = sink};
    expect_refused(&su, &su.args, su.dw, &g, CLMHA_INVALID_ARGUMENT, "value grad, no value",
                   "value");
    // A mask gradient without the mask; the weights gradient without need_weights.
    g = (clmha_reference_grads){.struct_size = sizeof g, .attn_mask = sink};
    expect_refused(&su, &su.args, su.dw, &g, CLMHA_INVALID_ARGUMENT, "attn_mask grad, no mask",
                   "attn_mask");
    clmha_forward_args no_w = su.args;
    no_w.need_weights = false;
    g = (clmha_reference_grads){.struct_size = sizeof g, .query = sink};
    expect_refused(&su, &no_w, su.dw, &g, CLMHA_INVALID_ARGUMENT, "grad_weights, no weights",
                   "need_weights");
    // in_proj_weight with its blocks; bias gradients of a layer that has them is fine.
    g = (clmha_reference_grads){.struct_size = sizeof g, .in_proj_weight = sink,
                                .q_proj_weight = sink + 100};
    expect_refused(&su, &su.args, su.dw, &g, CLMHA_INVALID_ARGUMENT, "in_proj_weight + block",
                   "in_proj_weight");
    // NULL and malformed arguments.
    g = (clmha_reference_grads){.struct_size = sizeof g, .query = sink};
    cr_expect_eq(clmha_reference_backward(&su.desc, &su.params, &su.args, NULL, NULL, &g, msg,
                                          sizeof msg),
                 CLMHA_INVALID_ARGUMENT, "grad_output NULL");
    cr_expect_eq(clmha_reference_backward(&su.desc, &su.params, &su.args, su.dy, su.dw, NULL,
                                          msg, sizeof msg),
                 CLMHA_INVALID_ARGUMENT, "grads NULL");
    cr_expect_eq(clmha_reference_backward(NULL, &su.params, &su.args, su.dy, su.dw, &g, msg,
                                          sizeof msg),
                 CLMHA_INVALID_ARGUMENT, "desc NULL");
    cr_expect_eq(clmha_reference_backward(&su.desc, NULL, &su.args, su.dy, su.dw, &g, msg,
                                          sizeof msg),
                 CLMHA_INVALID_ARGUMENT, "params NULL");
    cr_expect_eq(clmha_reference_backward(&su.desc, &su.params, NULL, su.dy, su.dw, &g, msg,
                                          sizeof msg),
                 CLMHA_INVALID_ARGUMENT, "args NULL");
    clmha_reference_grads g0 = {.struct_size = 0, .query = sink};
    cr_expect_eq(clmha_reference_backward(&su.desc, &su.params, &su.args, su.dy, su.dw, &g0, msg,
                                          sizeof msg),
                 CLMHA_INVALID_ARGUMENT, "grads struct_size 0");
    clmha_forward_args a0 = su.args;
    a0.struct_size = 0;
    cr_expect_eq(clmha_reference_backward(&su.desc, &su.params, &a0, su.dy, su.dw, &g, msg,
                                          sizeof msg),
                 CLMHA_INVALID_ARGUMENT, "args struct_size 0");
    free_setup(&su);

    // Key is value: no value gradient. A layer without bias / add_bias_kv: no such gradient.
    setup_case(&fd_cases[2], &su);  // "key_is_value"
    g = (clmha_reference_grads){.struct_size = sizeof g, .value = sink};
    expect_refused(&su, &su.args, NULL, &g, CLMHA_INVALID_ARGUMENT, "value grad, key is value",
                   "value");
    g = (clmha_reference_grads){.struct_size = sizeof g, .bias_k = sink};
    expect_refused(&su, &su.args, NULL, &g, CLMHA_INVALID_ARGUMENT, "bias_k, no add_bias_kv",
                   "bias_k");
    free_setup(&su);
    setup_case(&fd_cases[8], &su);  // "no_bias"
    g = (clmha_reference_grads){.struct_size = sizeof g, .in_proj_bias = sink};
    expect_refused(&su, &su.args, su.dw, &g, CLMHA_INVALID_ARGUMENT, "in_proj_bias, no bias",
                   "in_proj_bias");
    g = (clmha_reference_grads){.struct_size = sizeof g, .out_proj_bias = sink};
    expect_refused(&su, &su.args, su.dw, &g, CLMHA_INVALID_ARGUMENT, "out_proj_bias, no bias",
                   "out_proj_bias");
    free_setup(&su);

    // kdim != E: no packed in_proj_weight gradient.
    setup_case(&fd_cases[3], &su);  // "kdim_vdim"
    g = (clmha_reference_grads){.struct_size = sizeof g, .in_proj_weight = sink};
    expect_refused(&su, &su.args, su.dw, &g, CLMHA_INVALID_ARGUMENT, "in_proj_weight, kdim != E",
                   "in_proj_weight");
    free_setup(&su);

    // A boolean mask has no gradient.
    setup_case(&fd_cases[14], &su);  // "bool_masks"
    g = (clmha_reference_grads){.struct_size = sizeof g, .attn_mask = sink};
    expect_refused(&su, &su.args, su.dw, &g, CLMHA_INVALID_ARGUMENT, "bool attn_mask grad",
                   "boolean");
    g = (clmha_reference_grads){.struct_size = sizeof g, .key_padding_mask = sink};
    expect_refused(&su, &su.args, su.dw, &g, CLMHA_INVALID_ARGUMENT, "bool kpm grad",
                   "boolean");
    // The forward call's own checks still apply (a wrong mask shape).
    clmha_forward_args bad = su.args;
    bad.key_padding_mask.tensor.shape[1] += 1;
    g = (clmha_reference_grads){.struct_size = sizeof g, .query = sink};
    expect_refused(&su, &bad, su.dw, &g, CLMHA_INVALID_MASK, "kpm shape", NULL);
    free_setup(&su);
}

// ---- user functions ----------------------------------------------------------------------------

// Host forms of ALiBi with slopes p[h] and of the window (1, 0) as user functions.
static double alibi_host(double s, int b, int h, int q, int k, const float *p) {
    (void)b;
    return s - p[h] * fabs((double)(q - k));
}
static double one_host(double s, int b, int h, int q, int k, const float *p) {
    (void)s, (void)b, (void)h, (void)q, (void)k, (void)p;
    return 1.0;
}
static int window_host(int b, int h, int q, int k, const float *p) {
    (void)b, (void)h, (void)p;
    return q - 1 <= k && k <= q;
}

// The reference's user functions give what its built-in variants give when they compute the
// same: ALiBi as clmha_score_mod, the window (1, 0) as clmha_mask_mod, forward and backward.
Test(reference_backward, user_host_forms_match_builtins) {
    const fd_case c = {.name = "user_vs_builtin", .e = 4, .h = 2, .l = 5, .s = 5, .n = 2,
                       .mode = SELF, .kpm = F, .need_weights = true, .grad_weights = true};
    fd_setup su[2];
    setup_case(&c, &su[0]);
    setup_case(&c, &su[1]);
    const float slopes[2] = {0.5f, 0.125f};
    su[0].desc.alibi = true;
    su[0].desc.window = true, su[0].desc.window_left = 1, su[0].desc.window_right = 0;
    su[0].params.alibi_slopes = slopes;
    su[1].desc.mod_source = "clmha_score_mod clmha_score_mod_grad clmha_mask_mod";
    su[1].desc.mod_params = slopes;
    su[1].desc.mod_params_count = 2;
    su[1].params.score_mod = alibi_host;
    su[1].params.score_mod_grad = one_host;
    su[1].params.mask_mod = window_host;
    double out[2][2 * 5 * 4], w[2][2 * 5 * 5];
    for (int t = 0; t < 2; ++t) {
        char msg[256];
        clmha_status st = clmha_reference_forward(&su[t].desc, &su[t].params, &su[t].args,
                                                  out[t], 40, w[t], 50, msg, sizeof msg);
        cr_assert_eq(st, CLMHA_SUCCESS, "forward %d: %s", t, msg);
        st = clmha_reference_backward(&su[t].desc, &su[t].params, &su[t].args, su[t].dy,
                                      su[t].dw, &su[t].grads, msg, sizeof msg);
        cr_assert_eq(st, CLMHA_SUCCESS, "backward %d: %s", t, msg);
    }
    double worst = 0.0;
    for (size_t i = 0; i < 40; ++i) worst = fmax(worst, fabs(out[0][i] - out[1][i]));
    for (size_t i = 0; i < 50; ++i) worst = fmax(worst, fabs(w[0][i] - w[1][i]));
    for (size_t s = 0; s < su[0].num_slots; ++s)
        for (size_t i = 0; i < su[0].slots[s].count; ++i)
            worst = fmax(worst, fabs(su[0].slots[s].grad[i] - su[1].slots[s].grad[i]));
    cr_log_info("user functions vs built-ins: max |difference| %.3e", worst);
    cr_expect_leq(worst, 1e-14, "user functions differ from the built-ins by %g", worst);
    // Not vacuous: the window forbids most keys (weights of 0 where the plain layer has none).
    cr_expect_eq(w[0][2], 0.0);
    free_setup(&su[0]);
    free_setup(&su[1]);
}

// The reference runs no OpenCL C: a source needs the host forms of the functions it defines,
// host forms need a source that defines them, and the backward pass needs the derivative.
Test(reference_backward, user_host_forms_refused) {
    fd_setup su;
    setup_case(&fd_cases[2], &su);  // key_is_value: output (3, 2, 4), no weights
    su.desc.mod_source = "int clmha_mask_mod(int b, int h, int q, int k, __global const float *p)"
                         " { return 1; }";
    double out[2 * 3 * 4];
    char msg[256];
    clmha_status st = clmha_reference_forward(&su.desc, &su.params, &su.args, out, 24, NULL, 0,
                                              msg, sizeof msg);
    cr_expect_eq(st, CLMHA_UNSUPPORTED, "%s", msg);
    cr_expect(strstr(msg, "params->mask_mod"), "%s", msg);
    su.params.mask_mod = window_host;
    su.params.score_mod = alibi_host;
    st = clmha_reference_forward(&su.desc, &su.params, &su.args, out, 24, NULL, 0, msg,
                                 sizeof msg);
    cr_expect_eq(st, CLMHA_INVALID_ARGUMENT, "%s", msg);
    cr_expect(strstr(msg, "params->score_mod is given"), "%s", msg);
    su.desc.mod_source = "clmha_score_mod clmha_mask_mod";
    su.desc.mod_params_count = 2;  // p NULL: zeros, as clmha_layer_create() takes it
    st = clmha_reference_forward(&su.desc, &su.params, &su.args, out, 24, NULL, 0, msg,
                                 sizeof msg);
    cr_expect_eq(st, CLMHA_SUCCESS, "%s", msg);
    expect_refused(&su, &su.args, su.dw, &su.grads, CLMHA_UNSUPPORTED, "no derivative",
                   "needs clmha_score_mod_grad");
    su.desc.mod_source = "clmha_score_mod clmha_score_mod_grad clmha_mask_mod";
    expect_refused(&su, &su.args, su.dw, &su.grads, CLMHA_UNSUPPORTED, "no host derivative",
                   "params->score_mod_grad");
    su.params.score_mod_grad = one_host;
    expect_refused(&su, &su.args, su.dw, &su.grads, CLMHA_SUCCESS, "complete", NULL);
    // A count of zeros that cannot be allocated: out of memory, not a read past p.
    su.desc.mod_params_count = SIZE_MAX;
    expect_refused(&su, &su.args, su.dw, &su.grads, CLMHA_OUT_OF_MEMORY, "p too large",
                   "out of host memory");
    free_setup(&su);
}
