// Packed variable-length batches (clmha_forward_args::seq_lens): query (T, E), key/value
// (T_kv, kdim/vdim), one sequence after another.
//   - the forward and backward passes on the device (fused and unfused cores) against the
//     double-precision CPU reference of the same packed call: output and every gradient within
//     TOLERANCE * (1 + max |reference|);
//   - the reference's packed call against its padded call (N sequences padded to the longest,
//     keys beyond each sequence's length masked by a boolean key_padding_mask, padded rows'
//     output gradient zero): the same output rows and gradients (without dropout, whose
//     pattern differs by construction), which checks that a sequence attends only within
//     itself independently of how the packed call is cut;
//   - 16-bit and float64 layers' packed forward against the reference;
//   - the calls a packed batch refuses, and a sequence without queries.
// One line per case goes to stderr: packed <case> forward ... backward ...
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clmha.h"
#include "random_case.h"
#include "support.h"

#define TOLERANCE 1e-4      // device float32 vs the reference
#define PADDED_TOL 1e-12    // the reference's packed vs padded call (both double)

enum { MAX_SEQS = 8 };

// A packed case: the layer options of @p c (l and s ignored) and the sequences' lengths.
typedef struct pcase {
    const char *name;
    rcase c;
    size_t n;
    size_t q[MAX_SEQS], k[MAX_SEQS];  // k all 0: self-attention's (the queries')
} pcase;

typedef struct packed {
    instance in;  // unbatched (T, E) query, (T_kv, kdim) key, ...
    size_t t, tk, lmax, smax;
    const size_t *kl;
    clmha_forward_args args;
} packed;

static void packed_make(packed *p, const pcase *pc) {
    rcase c = pc->c;
    p->kl = c.self_attn ? pc->q : pc->k;
    p->t = p->tk = p->lmax = p->smax = 0;
    for (size_t i = 0; i < pc->n; ++i) {
        p->t += pc->q[i], p->tk += p->kl[i];
        p->lmax = pc->q[i] > p->lmax ? pc->q[i] : p->lmax;
        p->smax = p->kl[i] > p->smax ? p->kl[i] : p->smax;
    }
    c.unbatched = true, c.l = p->t, c.s = p->tk;
    c.kpm = c.am = CLMHA_MASK_NONE;
    c.need_weights = c.per_head = false;
    instance_make(&p->in, &c);
    p->args = p->in.args;
    p->args.seq_lens = pc->q;
    p->args.kv_seq_lens = c.self_attn ? NULL : pc->k;
    p->args.num_seqs = pc->n;
}

static double max_rel(const float *got, const double *want, size_t count) {
    double err = 0, scale = 0;
    for (size_t i = 0; i < count; ++i) {
        double e = fabs((double)got[i] - want[i]);
        err = isnan(e) ? INFINITY : fmax(err, e);
        scale = fmax(scale, fabs(want[i]));
    }
    return err / (1 + scale);
}

static double max_rel_d(const double *got, const double *want, size_t count) {
    double err = 0, scale = 0;
    for (size_t i = 0; i < count; ++i) {
        double e = fabs(got[i] - want[i]);
        err = isnan(e) ? INFINITY : fmax(err, e);
        scale = fmax(scale, fabs(want[i]));
    }
    return err / (1 + scale);
}

// The gradients a case has: query, key, value, q/k/v or in_proj weight, in_proj_bias,
// out_proj weight and bias, bias_k, bias_v, sinks.
enum { GQ, GK, GV, GW_IN, GWQ, GWK, GWV, GB_IN, GW_OUT, GB_OUT, GBK, GBV, GSINKS, GN };
static const char *const gname[GN] = {"query", "key", "value", "in_proj_weight",
                                      "q_proj_weight", "k_proj_weight", "v_proj_weight",
                                      "in_proj_bias", "out_proj.weight", "out_proj.bias",
                                      "bias_k", "bias_v", "sinks"};

// Floats of gradient @p g for @p in with @p rows query and @p krows key rows.
static size_t gcount(const instance *in, int g, size_t rows, size_t krows) {
    const rcase *c = &in->c;
    size_t e = c->e;
    bool one = in->params.in_proj_weight != NULL;
    switch (g) {
    case GQ: return rows * e;
    case GK: return c->self_attn ? 0 : krows * in->kdim;
    case GV: return c->self_attn || c->value_is_key ? 0 : krows * in->vdim;
    case GW_IN: return one ? 3 * e * e : 0;
    case GWQ: return one ? 0 : e * e;
    case GWK: return one ? 0 : in->kve * in->kdim;
    case GWV: return one ? 0 : in->kve * in->vdim;
    case GB_IN: return c->bias ? e + 2 * in->kve : 0;
    case GW_OUT: return e * e;
    case GB_OUT: return c->bias ? e : 0;
    case GBK:
    case GBV: return c->add_bias_kv ? in->kve : 0;
    case GSINKS: return c->sinks ? c->h : 0;
    default: return 0;
    }
}

typedef struct grads {
    double *r[GN];  // the reference's
    float *f[GN];   // the device's
} grads;

static void grads_free(grads *g) {
    for (int i = 0; i < GN; ++i) free(g->r[i]), free(g->f[i]);
}

static void ref_grads_point(clmha_reference_grads *rg, grads *g, const instance *in,
                            size_t rows, size_t krows) {
    double **dst[GN] = {&rg->query, &rg->key, &rg->value, &rg->in_proj_weight,
                        &rg->q_proj_weight, &rg->k_proj_weight, &rg->v_proj_weight,
                        &rg->in_proj_bias, &rg->out_proj_weight, &rg->out_proj_bias,
                        &rg->bias_k, &rg->bias_v, &rg->sinks};
    for (int i = 0; i < GN; ++i) {
        size_t n = gcount(in, i, rows, krows);
        if (!n) continue;
        g->r[i] = calloc(n, sizeof(double));
        cr_assert_not_null(g->r[i]);
        *dst[i] = g->r[i];
    }
}

static void dev_grads_point(clmha_backward_args *b, grads *g, const instance *in, size_t rows,
                            size_t krows) {
    clmha_grad *dst[GN] = {&b->query, &b->key, &b->value, &b->in_proj_weight,
                           &b->q_proj_weight, &b->k_proj_weight, &b->v_proj_weight,
                           &b->in_proj_bias, &b->out_proj_weight, &b->out_proj_bias,
                           &b->bias_k, &b->bias_v, &b->sinks};
    for (int i = 0; i < GN; ++i) {
        size_t n = gcount(in, i, rows, krows);
        if (!n) continue;
        g->f[i] = alloc_floats(n);
        for (size_t j = 0; j < n; ++j) g->f[i][j] = NAN;  // anything unwritten shows
        dst[i]->data = g->f[i];
    }
}

// The reference's packed call against its padded one: the output rows and the gradients.
static double padded_check(const packed *p, const pcase *pc, const double *out,
                           const float *gy, const grads *g) {
    const instance *in = &p->in;
    size_t e = in->c.e, n = pc->n, lm = p->lmax, sm = p->smax;
    float *q = calloc(lm * n * e, sizeof(float)), *k = NULL, *v = NULL;
    float *gyp = calloc(lm * n * e, sizeof(float));
    unsigned char *kpm = calloc(n * sm, 1);
    cr_assert(q && gyp && kpm);
    size_t q0 = 0, k0 = 0;
    bool self = in->c.self_attn, vk = in->c.value_is_key;
    if (!self) k = calloc(sm * n * in->kdim, sizeof(float));
    if (!self && !vk) v = calloc(sm * n * in->vdim, sizeof(float));
    for (size_t i = 0; i < n; q0 += pc->q[i], k0 += p->kl[i], ++i) {
        for (size_t t = 0; t < pc->q[i]; ++t) {  // (L, N, E): row t * N + i
            memcpy(q + (t * n + i) * e, in->query + (q0 + t) * e, e * sizeof(float));
            memcpy(gyp + (t * n + i) * e, gy + (q0 + t) * e, e * sizeof(float));
        }
        for (size_t t = 0; t < p->kl[i]; ++t) {
            if (k) memcpy(k + (t * n + i) * in->kdim, in->key + (k0 + t) * in->kdim,
                          in->kdim * sizeof(float));
            if (v) memcpy(v + (t * n + i) * in->vdim, in->value + (k0 + t) * in->vdim,
                          in->vdim * sizeof(float));
        }
        for (size_t t = p->kl[i]; t < sm; ++t) kpm[i * sm + t] = 1;
    }
    clmha_forward_args a = p->args;
    a.seq_lens = a.kv_seq_lens = NULL, a.num_seqs = 0;
    a.query = (clmha_tensor){.ndim = 3, .shape = {lm, n, e}, .data = q};
    if (!self) a.key = (clmha_tensor){.ndim = 3, .shape = {sm, n, in->kdim}, .data = k};
    if (!self && !vk) a.value = (clmha_tensor){.ndim = 3, .shape = {sm, n, in->vdim}, .data = v};
    if (self) {  // the padded call's keys are its queries: the masks cut them to each length
        cr_assert_eq(lm, sm);
    }
    a.key_padding_mask = (clmha_mask){.kind = CLMHA_MASK_BOOL_IGNORE,
                                      .tensor = {.ndim = 2, .shape = {n, sm}, .data = kpm}};
    double *outp = calloc(lm * n * e, sizeof(double));
    char msg[512];
    cr_assert_eq(clmha_reference_forward(&in->desc, &in->params, &a, outp, lm * n * e, NULL, 0,
                                         msg, sizeof msg),
                 CLMHA_SUCCESS, "padded reference: %s", msg);
    grads gp;
    memset(&gp, 0, sizeof gp);
    clmha_reference_grads rg = {.struct_size = sizeof rg};
    ref_grads_point(&rg, &gp, in, lm * n, sm * n);
    cr_assert_eq(clmha_reference_backward(&in->desc, &in->params, &a, gyp, NULL, &rg, msg,
                                          sizeof msg),
                 CLMHA_SUCCESS, "padded reference backward: %s", msg);
    double worst = 0;
    q0 = k0 = 0;
    for (size_t i = 0; i < n; q0 += pc->q[i], k0 += p->kl[i], ++i) {
        for (size_t t = 0; t < pc->q[i]; ++t) {
            worst = fmax(worst, max_rel_d(out + (q0 + t) * e, outp + (t * n + i) * e, e));
            worst = fmax(worst, max_rel_d(g->r[GQ] + (q0 + t) * e, gp.r[GQ] + (t * n + i) * e, e));
        }
        for (size_t t = 0; t < p->kl[i]; ++t) {
            if (gp.r[GK])
                worst = fmax(worst, max_rel_d(g->r[GK] + (k0 + t) * in->kdim,
                                              gp.r[GK] + (t * n + i) * in->kdim, in->kdim));
            if (gp.r[GV])
                worst = fmax(worst, max_rel_d(g->r[GV] + (k0 + t) * in->vdim,
                                              gp.r[GV] + (t * n + i) * in->vdim, in->vdim));
        }
    }
    for (int j = GW_IN; j < GN; ++j)
        if (gp.r[j]) worst = fmax(worst, max_rel_d(g->r[j], gp.r[j], gcount(in, j, 0, 0)));
    cr_expect_leq(worst, PADDED_TOL, "%s: the packed reference differs from the padded one by %.3g",
                  pc->name, worst);
    grads_free(&gp);
    free(q), free(k), free(v), free(gyp), free(kpm), free(outp);
    return worst;
}

static void check(clmha_context *ctx, const pcase *pc) {
    packed p;
    packed_make(&p, pc);
    instance *in = &p.in;
    size_t count = p.t * in->c.e;
    char msg[512];
    double *want = calloc(count, sizeof(double));
    cr_assert_eq(clmha_reference_forward(&in->desc, &in->params, &p.args, want, count, NULL, 0,
                                         msg, sizeof msg),
                 CLMHA_SUCCESS, "%s: reference: %s", pc->name, msg);
    prng r = {in->c.data_seed ^ 0xD1CE};
    float *gy = normal_floats(&r, count);
    grads g;
    memset(&g, 0, sizeof g);
    clmha_reference_grads rg = {.struct_size = sizeof rg};
    ref_grads_point(&rg, &g, in, p.t, p.tk);
    cr_assert_eq(clmha_reference_backward(&in->desc, &in->params, &p.args, gy, NULL, &rg, msg,
                                          sizeof msg),
                 CLMHA_SUCCESS, "%s: reference backward: %s", pc->name, msg);
    double pad = in->c.training ? NAN : padded_check(&p, pc, want, gy, &g);

    clmha_layer *layer = instance_layer(ctx, in);
    clmha_saved *saved;
    cr_assert_eq(clmha_saved_create(&saved, layer), CLMHA_SUCCESS);
    float *out = alloc_floats(count);
    double fwd[2], bwd[2];
    static const clmha_impl impls[2] = {CLMHA_IMPL_FUSED, CLMHA_IMPL_UNFUSED};
    for (int m = 0; m < 2; ++m) {
        clmha_forward_args a = p.args;
        a.impl = impls[m], a.save = saved;
        for (size_t i = 0; i < count; ++i) out[i] = NAN;
        cr_assert_eq(clmha_layer_forward_host(layer, &a, out, count, NULL, 0), CLMHA_SUCCESS,
                     "%s %s: %s", pc->name, clmha_impl_name(impls[m]),
                     clmha_context_last_error(ctx));
        fwd[m] = max_rel(out, want, count);
        cr_expect_leq(fwd[m], TOLERANCE, "%s %s: output max rel err %.3g", pc->name,
                      clmha_impl_name(impls[m]), fwd[m]);
        clmha_backward_args b = {.struct_size = sizeof b, .forward = &a, .saved = saved,
                                 .grad_output = a.query, .impl = impls[m]};
        b.grad_output.data = gy;
        grads d;
    memset(&d, 0, sizeof d);
        dev_grads_point(&b, &d, in, p.t, p.tk);
        cr_assert_eq(clmha_layer_backward_host(layer, &b), CLMHA_SUCCESS, "%s %s backward: %s",
                     pc->name, clmha_impl_name(impls[m]), clmha_context_last_error(ctx));
        bwd[m] = 0;
        for (int j = 0; j < GN; ++j) {
            if (!d.f[j]) continue;
            double e = max_rel(d.f[j], g.r[j], gcount(in, j, p.t, p.tk));
            cr_expect_leq(e, TOLERANCE, "%s %s: gradient of %s: max rel err %.3g", pc->name,
                          clmha_impl_name(impls[m]), gname[j], e);
            bwd[m] = fmax(bwd[m], e);
        }
        grads_free(&d);
    }
    fprintf(stderr,
            "packed %-22s T %3zu T_kv %3zu: forward fused %.2e unfused %.2e, backward fused "
            "%.2e unfused %.2e, reference packed vs padded %.1e\n",
            pc->name, p.t, p.tk, fwd[0], fwd[1], bwd[0], bwd[1], pad);
    free(out), free(want), free(gy);
    grads_free(&g);
    clmha_saved_release(saved);
    clmha_layer_release(layer);
    instance_free(in);
}

static rcase base(uint64_t seed) {
    rcase c = rcase_base(seed);
    c.e = 16, c.h = 2;
    return c;
}

Test(packed, against_reference_and_padded, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    pcase cases[8];
    size_t k = 0;
    // Self-attention, causal, lengths from 1, the last one across a fused tile edge.
    cases[k] = (pcase){.name = "self_causal", .c = base(1), .n = 4, .q = {5, 1, 8, 33}};
    cases[k].c.self_attn = cases[k].c.is_causal = true, ++k;
    // Cross-attention, other key lengths, kdim/vdim, appended keys, a sequence without queries.
    cases[k] = (pcase){.name = "cross_kdim_appended", .c = base(2), .n = 4, .q = {3, 0, 7, 1},
                       .k = {6, 4, 2, 9}};
    cases[k].c.kdim = 10, cases[k].c.vdim = 12;
    cases[k].c.add_bias_kv = cases[k].c.add_zero_attn = true, ++k;
    // Grouped-query attention (4 query heads on 1 key/value head), causal cross.
    cases[k] = (pcase){.name = "gqa_causal_cross", .c = base(3), .n = 3, .q = {9, 2, 17},
                       .k = {4, 12, 17}};
    cases[k].c.h = 4, cases[k].c.kv_heads = 1, cases[k].c.is_causal = true, ++k;
    // The attention variants: a window, ALiBi, soft-capping, sinks; key is value.
    cases[k] = (pcase){.name = "variants_value_is_key", .c = base(4), .n = 3, .q = {6, 11, 3},
                       .k = {7, 11, 5}};
    cases[k].c.value_is_key = cases[k].c.alibi = cases[k].c.sinks = true;
    cases[k].c.window = true, cases[k].c.win_left = 2, cases[k].c.win_right = 1;
    cases[k].c.softcap = 1.5, ++k;
    // Dropout in training (each sequence's own pattern: no padded comparison), no bias.
    cases[k] = (pcase){.name = "dropout_no_bias", .c = base(5), .n = 2, .q = {7, 12}};
    cases[k].c.self_attn = cases[k].c.training = true, cases[k].c.bias = false;
    cases[k].c.dropout = 0.3f, ++k;
    // One sequence: the packed call is the unbatched one.
    cases[k] = (pcase){.name = "one_sequence", .c = base(6), .n = 1, .q = {13}};
    cases[k].c.self_attn = true, ++k;
    for (size_t i = 0; i < k; ++i) check(ctx, &cases[i]);
    clmha_context_release(ctx);
}

// A 16-bit or float64 layer's packed forward and backward against the reference (the inputs
// rounded to the layer's dtype on upload: a tolerance of the dtype's; the float64 layer's
// results are read as float32).
Test(packed, dtypes_forward_and_backward) {
    clmha_context *ctx = context_or_skip();
    static const struct {
        clmha_dtype t;
        double tol;
    } dts[] = {{CLMHA_DTYPE_F64, 2e-7}, {CLMHA_DTYPE_F16, 5e-3}, {CLMHA_DTYPE_BF16, 4e-2}};
    pcase pc = {.name = "dtype", .c = base(7), .n = 3, .q = {4, 9, 2}, .k = {5, 3, 8}};
    pc.c.is_causal = true;
    packed p;
    packed_make(&p, &pc);
    size_t count = p.t * p.in.c.e;
    double *want = calloc(count, sizeof(double));
    char msg[512];
    cr_assert_eq(clmha_reference_forward(&p.in.desc, &p.in.params, &p.args, want, count, NULL,
                                         0, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    float *out = alloc_floats(count);
    prng r = {0x9ac4};
    float *gy = normal_floats(&r, count);
    grads g;
    memset(&g, 0, sizeof g);
    clmha_reference_grads rg = {.struct_size = sizeof rg};
    ref_grads_point(&rg, &g, &p.in, p.t, p.tk);
    cr_assert_eq(clmha_reference_backward(&p.in.desc, &p.in.params, &p.args, gy, NULL, &rg, msg,
                                          sizeof msg),
                 CLMHA_SUCCESS, "reference backward: %s", msg);
    for (size_t i = 0; i < sizeof dts / sizeof dts[0]; ++i) {
        p.in.desc.dtype = dts[i].t;
        clmha_layer *probe = NULL;  // float64 needs cl_khr_fp64 (llvmpipe has none)
        if (clmha_layer_create(&probe, ctx, &p.in.desc) == CLMHA_UNSUPPORTED) {
            fprintf(stderr, "packed dtype %d: skipped: %s\n", (int)dts[i].t,
                    clmha_context_last_error(ctx));
            continue;
        }
        clmha_layer_release(probe);
        clmha_layer *layer = instance_layer(ctx, &p.in);
        clmha_saved *saved;
        cr_assert_eq(clmha_saved_create(&saved, layer), CLMHA_SUCCESS);
        clmha_forward_args a = p.args;
        a.save = saved;
        cr_assert_eq(clmha_layer_forward_host(layer, &a, out, count, NULL, 0),
                     CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
        double e = max_rel(out, want, count);
        cr_expect_leq(e, dts[i].tol, "dtype %d: max rel err %.3g", (int)dts[i].t, e);
        clmha_backward_args b = {.struct_size = sizeof b, .forward = &a, .saved = saved,
                                 .grad_output = a.query};
        b.grad_output.data = gy;
        grads d;
        memset(&d, 0, sizeof d);
        dev_grads_point(&b, &d, &p.in, p.t, p.tk);
        cr_assert_eq(clmha_layer_backward_host(layer, &b), CLMHA_SUCCESS, "dtype %d: %s",
                     (int)dts[i].t, clmha_context_last_error(ctx));
        double eb = 0.0;
        for (int j = 0; j < GN; ++j)
            if (d.f[j]) eb = fmax(eb, max_rel(d.f[j], g.r[j], gcount(&p.in, j, p.t, p.tk)));
        cr_expect_leq(eb, dts[i].tol, "dtype %d: gradients: max rel err %.3g", (int)dts[i].t,
                      eb);
        fprintf(stderr, "packed dtype %d: forward max rel err %.2e, backward %.2e\n",
                (int)dts[i].t, e, eb);
        grads_free(&d);
        clmha_saved_release(saved);
        clmha_layer_release(layer);
    }
    grads_free(&g);
    free(out), free(want), free(gy);
    instance_free(&p.in);
    clmha_context_release(ctx);
}

// What a packed call refuses, with the status; and a call whose every sequence lacks queries.
Test(packed, refusals) {
    clmha_context *ctx = context_or_skip();
    pcase pc = {.name = "refusals", .c = base(8), .n = 3, .q = {2, 3, 1}, .k = {4, 1, 2}};
    packed p;
    packed_make(&p, &pc);
    clmha_layer *layer = instance_layer(ctx, &p.in);
    size_t count = p.t * p.in.c.e;
    float *out = alloc_floats(count + 64), *w = alloc_floats(1024);
    unsigned char mask[64] = {0};
    struct {
        const char *what;
        clmha_status want;
        clmha_forward_args a;
    } bad[16];
    size_t k = 0;
    for (size_t i = 0; i < 16; ++i) bad[i].a = p.args;
    bad[k].what = "key_padding_mask", bad[k].want = CLMHA_UNSUPPORTED;
    bad[k].a.key_padding_mask = (clmha_mask){.kind = CLMHA_MASK_BOOL_IGNORE,
                                             .tensor = {.ndim = 2, .shape = {3, 4}, .data = mask}};
    ++k;
    bad[k].what = "attn_mask", bad[k].want = CLMHA_UNSUPPORTED;
    bad[k].a.attn_mask = (clmha_mask){.kind = CLMHA_MASK_BOOL_IGNORE,
                                      .tensor = {.ndim = 2, .shape = {3, 4}, .data = mask}};
    ++k;
    bad[k].what = "need_weights", bad[k].want = CLMHA_UNSUPPORTED;
    bad[k].a.need_weights = true, ++k;
    bad[k].what = "num_seqs 0", bad[k].want = CLMHA_INVALID_ARGUMENT;
    bad[k].a.num_seqs = 0, ++k;
    static const size_t longer[3] = {2, 3, 2}, no_keys[3] = {4, 0, 2}, empty[3] = {0, 0, 0};
    bad[k].what = "seq_lens summing past the query", bad[k].want = CLMHA_SHAPE_MISMATCH;
    bad[k].a.seq_lens = longer, ++k;
    bad[k].what = "queries without keys", bad[k].want = CLMHA_SHAPE_MISMATCH;
    bad[k].a.kv_seq_lens = no_keys, ++k;
    bad[k].what = "no query at all", bad[k].want = CLMHA_SHAPE_MISMATCH;
    bad[k].a.seq_lens = empty, ++k;
    bad[k].what = "kv_seq_lens without seq_lens", bad[k].want = CLMHA_INVALID_ARGUMENT;
    bad[k].a.seq_lens = NULL, ++k;
    static const size_t counts[3] = {1, 1, 1};
    clmha_kv_cache *cache = NULL;
    cr_assert_eq(clmha_kv_cache_create(&cache, layer, 3, 8), CLMHA_SUCCESS);
    bad[k].what = "kv_append", bad[k].want = CLMHA_UNSUPPORTED;
    bad[k].a.kv_append = counts, bad[k].a.kv_cache = cache, ++k;
    bad[k].what = "a 3-D query", bad[k].want = CLMHA_SHAPE_MISMATCH;
    bad[k].a.query.ndim = 3, bad[k].a.query.shape[2] = p.in.c.e, bad[k].a.query.shape[1] = 1;
    ++k;
    for (size_t i = 0; i < k; ++i) {
        clmha_status st = clmha_layer_forward_host(layer, &bad[i].a, out, count, w, 1024);
        cr_expect_eq(st, bad[i].want, "%s: got %s (%s)", bad[i].what, clmha_status_string(st),
                     clmha_context_last_error(ctx));
        fprintf(stderr, "packed refuses %s: %s\n", bad[i].what, clmha_context_last_error(ctx));
    }
    // Partial attention does not take a packed batch.
    clmha_forward_args a = p.args;
    cr_expect_eq(clmha_layer_attend(layer, &a, false, NULL, 0, NULL, 0, 0, NULL, NULL),
                 CLMHA_UNSUPPORTED, "%s", clmha_context_last_error(ctx));
    free(out), free(w);
    clmha_kv_cache_release(cache);
    clmha_layer_release(layer);
    instance_free(&p.in);
    clmha_context_release(ctx);
}

// A KV cache filled and extended by packed calls (each sequence appending its own tokens):
// a causal packed prefill of the first tokens of each sequence, then packed steps of one token
// for each sequence that has tokens left (0 for those that are done). Every output row against
// the reference's one-shot packed causal call over the whole sequences; float32 and bfloat16
// (the bfloat16 layer against the reference on its rounded inputs: a bfloat16 tolerance), and
// grouped-query attention.
static void cached(clmha_context *ctx, clmha_dtype dtype, size_t kv_heads, double tol) {
    pcase pc = {.name = "cached", .c = base(9), .n = 3, .q = {7, 3, 12}};
    pc.c.self_attn = pc.c.is_causal = true;
    pc.c.h = 4, pc.c.kv_heads = kv_heads;
    packed p;
    packed_make(&p, &pc);
    instance *in = &p.in;
    size_t e = in->c.e, count = p.t * e;
    double *want = calloc(count, sizeof(double));
    char msg[512];
    cr_assert_eq(clmha_reference_forward(&in->desc, &in->params, &p.args, want, count, NULL, 0,
                                         msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    in->desc.dtype = dtype;
    clmha_layer *layer = instance_layer(ctx, in);
    clmha_kv_cache *cache = NULL;
    cr_assert_eq(clmha_kv_cache_create(&cache, layer, pc.n, 16), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    const size_t first[3] = {4, 1, 9}, start[3] = {0, 7, 10};
    float *q = alloc_floats(count), *out = alloc_floats(count), *got = alloc_floats(count);
    size_t done[3] = {0, 0, 0}, calls = 0;
    for (bool more = true; more; ++calls) {  // prefill, then one token a step
        size_t lens[3], rows = 0;
        for (size_t i = 0; i < 3; ++i) {
            lens[i] = calls == 0 ? first[i] : done[i] < pc.q[i] ? 1 : 0;
            memcpy(q + rows * e, in->query + (start[i] + done[i]) * e, lens[i] * e * 4);
            rows += lens[i];
        }
        clmha_forward_args a = p.args;
        a.query = (clmha_tensor){.ndim = 2, .shape = {rows, e}, .data = q};
        a.seq_lens = lens, a.kv_cache = cache;
        cr_assert_eq(clmha_layer_forward_host(layer, &a, out, rows * e, NULL, 0), CLMHA_SUCCESS,
                     "call %zu: %s", calls, clmha_context_last_error(ctx));
        rows = 0, more = false;
        for (size_t i = 0; i < 3; ++i) {
            memcpy(got + (start[i] + done[i]) * e, out + rows * e, lens[i] * e * 4);
            rows += lens[i], done[i] += lens[i];
            more = more || done[i] < pc.q[i];
        }
    }
    double err = max_rel(got, want, count);
    cr_expect_leq(err, tol, "dtype %d, kv_heads %zu: max rel err %.3g", (int)dtype, kv_heads,
                  err);
    fprintf(stderr, "packed through a KV cache (dtype %d, kv_heads %zu, %zu calls): max rel "
            "err %.2e\n", (int)dtype, kv_heads, calls, err);
    clmha_kv_cache_release(cache);
    clmha_layer_release(layer);
    free(q), free(out), free(got), free(want);
    instance_free(in);
}

Test(packed, through_a_kv_cache) {
    clmha_context *ctx = context_or_skip();
    cached(ctx, CLMHA_DTYPE_F32, 0, TOLERANCE);
    cached(ctx, CLMHA_DTYPE_F32, 2, TOLERANCE);
    cached(ctx, CLMHA_DTYPE_BF16, 1, 4e-2);
    clmha_context_release(ctx);
}

// Cross-attention through a KV cache: a packed call appends each sequence's keys and values
// (kv_seq_lens) with its first queries, a packed kv_attend_only call brings the rest of the
// queries; against the reference's one-shot packed call.
Test(packed, cross_attention_through_a_kv_cache) {
    clmha_context *ctx = context_or_skip();
    pcase pc = {.name = "cached_cross", .c = base(10), .n = 3, .q = {3, 2, 5}, .k = {4, 6, 2}};
    pc.c.kdim = 6, pc.c.vdim = 10;
    packed p;
    packed_make(&p, &pc);
    instance *in = &p.in;
    size_t e = in->c.e, count = p.t * e;
    double *want = calloc(count, sizeof(double));
    char msg[512];
    cr_assert_eq(clmha_reference_forward(&in->desc, &in->params, &p.args, want, count, NULL, 0,
                                         msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    clmha_layer *layer = instance_layer(ctx, in);
    clmha_kv_cache *cache = NULL;
    cr_assert_eq(clmha_kv_cache_create(&cache, layer, pc.n, 8), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    const size_t a_lens[3] = {1, 0, 3}, b_lens[3] = {2, 2, 2}, start[3] = {0, 3, 5};
    float *q = alloc_floats(count), *out = alloc_floats(count), *got = alloc_floats(count);
    for (int call = 0; call < 2; ++call) {
        const size_t *lens = call ? b_lens : a_lens;
        size_t rows = 0;
        for (size_t i = 0; i < 3; ++i) {
            memcpy(q + rows * e, in->query + (start[i] + (call ? a_lens[i] : 0)) * e,
                   lens[i] * e * 4);
            rows += lens[i];
        }
        clmha_forward_args a = p.args;
        a.query = (clmha_tensor){.ndim = 2, .shape = {rows, e}, .data = q};
        a.seq_lens = lens, a.kv_cache = cache;
        if (call) {  // the queries alone, over the cached keys
            a.key = a.value = (clmha_tensor){0};
            a.kv_seq_lens = NULL, a.kv_attend_only = true;
        }
        cr_assert_eq(clmha_layer_forward_host(layer, &a, out, rows * e, NULL, 0), CLMHA_SUCCESS,
                     "call %d: %s", call, clmha_context_last_error(ctx));
        rows = 0;
        for (size_t i = 0; i < 3; ++i) {
            memcpy(got + (start[i] + (call ? a_lens[i] : 0)) * e, out + rows * e,
                   lens[i] * e * 4);
            rows += lens[i];
        }
    }
    double err = max_rel(got, want, count);
    cr_expect_leq(err, TOLERANCE, "max rel err %.3g", err);
    fprintf(stderr, "packed cross-attention through a KV cache: max rel err %.2e\n", err);
    clmha_kv_cache_release(cache);
    clmha_layer_release(layer);
    free(q), free(out), free(got), free(want);
    instance_free(in);
    clmha_context_release(ctx);
}

// ---- attention as a function ---------------------------------------------------------------

// A packed call of the function: query (T, H, D), key (T_kv, H_kv, D), value (T_kv, H_kv, D_v)
// with GQA, is_causal, a window, sinks and dropout as chosen; the device's output, lse and
// gradients against the reference's packed call; without dropout, the reference's packed call
// against its padded one ((N, H, L_max, D) with a boolean (N, 1, L_max, S_max) mask that is the
// causal mask and the sequences' key lengths together), output, lse and every gradient.
typedef struct fcase {
    const char *name;
    size_t n, q[MAX_SEQS], k[MAX_SEQS];
    size_t h, kvh, d, dv;
    bool causal, window, sinks;
    float dropout;
} fcase;

static double rel_d(const double *a, const double *b, size_t count) {
    return max_rel_d(a, b, count);
}

static double function_padded(const fcase *f, const clmha_attention_args *a, const double *out,
                              const double *lse, const float *gy, double *const g[4]) {
    size_t n = f->n, lm = 0, sm = 0, h = f->h, kvh = f->kvh, d = f->d, dv = f->dv;
    for (size_t i = 0; i < n; ++i) {
        lm = f->q[i] > lm ? f->q[i] : lm;
        sm = f->k[i] > sm ? f->k[i] : sm;
    }
    float *q = calloc(n * h * lm * d, 4), *k = calloc(n * kvh * sm * d, 4);
    float *v = calloc(n * kvh * sm * dv, 4), *gyp = calloc(n * h * lm * dv, 4);
    unsigned char *m = calloc(n * lm * sm, 1);
    const float *pq = a->query.data, *pk = a->key.data, *pv = a->value.data;
    size_t q0 = 0, k0 = 0;
    for (size_t i = 0; i < n; q0 += f->q[i], k0 += f->k[i], ++i) {
        for (size_t t = 0; t < f->q[i]; ++t)
            for (size_t x = 0; x < h; ++x) {  // packed (t, x, :) -> padded (i, x, t, :)
                memcpy(q + ((i * h + x) * lm + t) * d, pq + ((q0 + t) * h + x) * d, d * 4);
                memcpy(gyp + ((i * h + x) * lm + t) * dv, gy + ((q0 + t) * h + x) * dv, dv * 4);
            }
        for (size_t t = 0; t < f->k[i]; ++t)
            for (size_t x = 0; x < kvh; ++x) {
                memcpy(k + ((i * kvh + x) * sm + t) * d, pk + ((k0 + t) * kvh + x) * d, d * 4);
                memcpy(v + ((i * kvh + x) * sm + t) * dv, pv + ((k0 + t) * kvh + x) * dv, dv * 4);
            }
        for (size_t t = 0; t < lm; ++t)
            for (size_t j = 0; j < f->k[i]; ++j) m[(i * lm + t) * sm + j] = !f->causal || j <= t;
    }
    clmha_attention_args p = *a;
    p.seq_lens = p.kv_seq_lens = NULL, p.num_seqs = 0;
    p.layout = CLMHA_LAYOUT_NHLD, p.is_causal = false;
    p.query = (clmha_tensor){.ndim = 4, .shape = {n, h, lm, d}, .data = q};
    p.key = (clmha_tensor){.ndim = 4, .shape = {n, kvh, sm, d}, .data = k};
    p.value = (clmha_tensor){.ndim = 4, .shape = {n, kvh, sm, dv}, .data = v};
    p.attn_mask = (clmha_mask){.kind = CLMHA_MASK_BOOL_ATTEND,
                               .tensor = {.ndim = 4, .shape = {n, 1, lm, sm}, .data = m}};
    double *po = calloc(n * h * lm * dv, 8), *pl = calloc(n * h * lm, 8);
    double *pg[4] = {calloc(n * h * lm * d, 8), calloc(n * kvh * sm * d, 8),
                     calloc(n * kvh * sm * dv, 8), f->sinks ? calloc(h, 8) : NULL};
    char msg[512];
    cr_assert_eq(clmha_reference_attention(&p, po, n * h * lm * dv, pl, n * h * lm, NULL, 0, msg,
                                           sizeof msg), CLMHA_SUCCESS, "%s", msg);
    clmha_reference_grads rg = {.struct_size = sizeof rg, .query = pg[0], .key = pg[1],
                                .value = pg[2], .sinks = pg[3]};
    cr_assert_eq(clmha_reference_attention_backward(&p, gyp, &rg, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    double worst = 0;
    q0 = k0 = 0;
    for (size_t i = 0; i < n; q0 += f->q[i], k0 += f->k[i], ++i) {
        for (size_t t = 0; t < f->q[i]; ++t)
            for (size_t x = 0; x < h; ++x) {
                size_t r = (i * h + x) * lm + t, pr = (q0 + t) * h + x;
                worst = fmax(worst, rel_d(out + pr * dv, po + r * dv, dv));
                worst = fmax(worst, rel_d(lse + q0 * h + x * f->q[i] + t, pl + r, 1));
                worst = fmax(worst, rel_d(g[0] + pr * d, pg[0] + r * d, d));
            }
        for (size_t t = 0; t < f->k[i]; ++t)
            for (size_t x = 0; x < kvh; ++x) {
                size_t r = (i * kvh + x) * sm + t, pr = (k0 + t) * kvh + x;
                worst = fmax(worst, rel_d(g[1] + pr * d, pg[1] + r * d, d));
                worst = fmax(worst, rel_d(g[2] + pr * dv, pg[2] + r * dv, dv));
            }
    }
    if (f->sinks) worst = fmax(worst, rel_d(g[3], pg[3], h));
    cr_expect_leq(worst, PADDED_TOL, "%s: the function's packed reference differs from the "
                  "padded one by %.3g", f->name, worst);
    for (int i = 0; i < 4; ++i) free(pg[i]);
    free(q), free(k), free(v), free(gyp), free(m), free(po), free(pl);
    return worst;
}

static void function_case(clmha_context *ctx, const fcase *f) {
    size_t t = 0, tk = 0;
    for (size_t i = 0; i < f->n; ++i) t += f->q[i], tk += f->k[i];
    prng r = {0xF00D + f->h};
    float *q = normal_floats(&r, t * f->h * f->d), *k = normal_floats(&r, tk * f->kvh * f->d);
    float *v = normal_floats(&r, tk * f->kvh * f->dv), *gy = normal_floats(&r, t * f->h * f->dv);
    float *sinks = normal_floats(&r, f->h);
    clmha_attention_args a = {
        .struct_size = sizeof a, .is_causal = f->causal, .enable_gqa = f->kvh != f->h,
        .dropout_p = f->dropout, .rng = {.seed = 99, .offset = 5},
        .query = {.ndim = 3, .shape = {t, f->h, f->d}, .data = q},
        .key = {.ndim = 3, .shape = {tk, f->kvh, f->d}, .data = k},
        .value = {.ndim = 3, .shape = {tk, f->kvh, f->dv}, .data = v},
        .window = f->window, .window_left = 2, .window_right = 0,
        .seq_lens = f->q, .kv_seq_lens = f->k, .num_seqs = f->n};
    if (f->sinks) a.sinks = (clmha_tensor){.ndim = 1, .shape = {f->h}, .data = sinks};
    size_t oc = t * f->h * f->dv, lc = t * f->h;
    double *out = calloc(oc, 8), *lse = calloc(lc, 8);
    double *g[4] = {calloc(t * f->h * f->d, 8), calloc(tk * f->kvh * f->d, 8),
                    calloc(tk * f->kvh * f->dv, 8), f->sinks ? calloc(f->h, 8) : NULL};
    char msg[512];
    cr_assert_eq(clmha_reference_attention(&a, out, oc, lse, lc, NULL, 0, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s: %s", f->name, msg);
    clmha_reference_grads rg = {.struct_size = sizeof rg, .query = g[0], .key = g[1],
                                .value = g[2], .sinks = g[3]};
    cr_assert_eq(clmha_reference_attention_backward(&a, gy, &rg, msg, sizeof msg), CLMHA_SUCCESS,
                 "%s: %s", f->name, msg);
    double pad = f->dropout > 0 ? NAN : function_padded(f, &a, out, lse, gy, g);
    float *dout = alloc_floats(oc), *dlse = alloc_floats(lc);
    float *dg[3] = {alloc_floats(t * f->h * f->d), alloc_floats(tk * f->kvh * f->d),
                    alloc_floats(tk * f->kvh * f->dv)};
    if (f->sinks) {  // the device's sinks are a buffer
        cl_int err;
        a.sinks.buffer = clCreateBuffer(clmha_context_cl_context(ctx),
                                        CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, f->h * 4,
                                        sinks, &err);
        cr_assert_eq(err, CL_SUCCESS);
    }
    cr_assert_eq(clmha_attention_forward_host(ctx, &a, dout, oc, dlse, lc, NULL, 0),
                 CLMHA_SUCCESS, "%s: %s", f->name, clmha_context_last_error(ctx));
    for (size_t i = 0; i < 3; ++i) {
        size_t c = i == 0 ? t * f->h * f->d : i == 1 ? tk * f->kvh * f->d : tk * f->kvh * f->dv;
        for (size_t x = 0; x < c; ++x) dg[i][x] = NAN;
    }
    cr_assert_eq(clmha_attention_backward_host(ctx, &a, gy, oc, dg[0], dg[1], dg[2], NULL),
                 CLMHA_SUCCESS, "%s: %s", f->name, clmha_context_last_error(ctx));
    double eo = max_rel(dout, out, oc), el = max_rel(dlse, lse, lc);
    double eg = fmax(max_rel(dg[0], g[0], t * f->h * f->d),
                     fmax(max_rel(dg[1], g[1], tk * f->kvh * f->d),
                          max_rel(dg[2], g[2], tk * f->kvh * f->dv)));
    cr_expect_leq(fmax(eo, fmax(el, eg)), TOLERANCE, "%s: output %.3g, lse %.3g, gradients %.3g",
                  f->name, eo, el, eg);
    fprintf(stderr, "packed function %-18s: output %.2e, lse %.2e, gradients %.2e; reference "
            "packed vs padded %.1e\n", f->name, eo, el, eg, pad);
    if (a.sinks.buffer) clReleaseMemObject(a.sinks.buffer);
    for (int i = 0; i < 4; ++i) free(g[i]);
    for (int i = 0; i < 3; ++i) free(dg[i]);
    free(q), free(k), free(v), free(gy), free(sinks), free(out), free(lse), free(dout), free(dlse);
}

Test(packed, attention_function) {
    clmha_context *ctx = context_or_skip();
    const fcase cases[] = {
        {"causal_gqa", 3, {5, 1, 9}, {5, 1, 9}, 4, 2, 8, 8, true, false, false, 0.0f},
        {"cross_empty_dv", 4, {3, 0, 6, 2}, {4, 5, 2, 7}, 2, 2, 8, 12, false, false, false, 0.0f},
        {"window_sinks", 2, {7, 12}, {7, 12}, 4, 1, 16, 16, true, true, true, 0.0f},
        {"dropout", 2, {6, 4}, {8, 3}, 2, 2, 8, 8, false, false, false, 0.25f},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) function_case(ctx, &cases[i]);
    clmha_context_release(ctx);
}
