// Randomised comparisons of the OpenCL backward pass (clmha_layer_forward_host() with args.save,
// then clmha_layer_backward_host()) against the double-precision CPU reference
// (clmha_reference_backward()): random combinations of every option, shapes across the fused
// kernels' tile edges, masks with their gradients, fully masked rows, dropout; through both
// backward cores. Also: accumulation adds to what the destination holds, and the same call gives
// bit-identical gradients every time.
// Every case prints one line per core to stderr with the largest relative error over its
// gradients.
#define _POSIX_C_SOURCE 200112L  // setenv, unsetenv
#include <criterion/criterion.h>

#include <clmha.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/half.h"
#include "device/device_class.h"
#include "random_case.h"
#include "support.h"

// max |device - reference| <= TOLERANCE * (1 + max |reference|), per gradient.
#define TOLERANCE 1e-4

// ---- the gradients of a case ---------------------------------------------------------------------

enum {
    G_QUERY, G_KEY, G_VALUE, G_IN_W, G_Q_W, G_K_W, G_V_W, G_IN_B, G_OUT_W, G_OUT_B, G_BIAS_K,
    G_BIAS_V, G_ATTN, G_KPM, G_SINKS, G_COUNT
};
static const char *const gname[G_COUNT] = {
    "query", "key", "value", "in_proj_weight", "q_proj_weight", "k_proj_weight",
    "v_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias", "bias_k", "bias_v",
    "attn_mask", "key_padding_mask", "sinks"};

static clmha_grad *bgrad(clmha_backward_args *b, int g) {
    clmha_grad *all[G_COUNT] = {&b->query, &b->key, &b->value, &b->in_proj_weight,
                                &b->q_proj_weight, &b->k_proj_weight, &b->v_proj_weight,
                                &b->in_proj_bias, &b->out_proj_weight, &b->out_proj_bias,
                                &b->bias_k, &b->bias_v, &b->attn_mask, &b->key_padding_mask,
                                &b->sinks};
    return all[g];
}

static double **rgrad(clmha_reference_grads *r, int g) {
    double **all[G_COUNT] = {&r->query, &r->key, &r->value, &r->in_proj_weight,
                             &r->q_proj_weight, &r->k_proj_weight, &r->v_proj_weight,
                             &r->in_proj_bias, &r->out_proj_weight, &r->out_proj_bias,
                             &r->bias_k, &r->bias_v, &r->attn_mask, &r->key_padding_mask,
                             &r->sinks};
    return all[g];
}

// Floats of gradient @p g of @p in (0: the case has none); mask gradients only with @p masks.
static size_t gcount(const instance *in, int g, bool masks) {
    const rcase *c = &in->c;
    size_t e = c->e, n = in->n, l = c->l, s = in->c.s;
    bool packed = in->kdim == e && in->vdim == e;
    switch (g) {
    case G_QUERY: return n * l * e;
    case G_KEY: return c->self_attn ? 0 : n * s * in->kdim;
    case G_VALUE: return c->self_attn || c->value_is_key ? 0 : n * s * in->vdim;
    case G_IN_W: return packed ? 3 * e * e : 0;
    case G_Q_W: return packed ? 0 : e * e;
    case G_K_W: return packed ? 0 : e * in->kdim;
    case G_V_W: return packed ? 0 : e * in->vdim;
    case G_IN_B: return c->bias ? 3 * e : 0;
    case G_OUT_W: return e * e;
    case G_OUT_B: return c->bias ? e : 0;
    case G_BIAS_K:
    case G_BIAS_V: return c->add_bias_kv ? e : 0;
    case G_ATTN:
        if (!masks || c->am != CLMHA_MASK_FLOAT) return 0;
        return (c->layout == LAYOUT_PER_HEAD ? n * c->h : c->layout == LAYOUT_PER_BATCH ? n : 1) *
               l * s;
    case G_KPM: return masks && c->kpm == CLMHA_MASK_FLOAT ? n * s : 0;
    case G_SINKS: return c->sinks ? c->h : 0;
    default: return 0;
    }
}

typedef struct dev_grads {
    float *g[G_COUNT];
} dev_grads;

typedef struct ref_grads {
    double *g[G_COUNT];
} ref_grads;

static void dev_grads_free(dev_grads *d) {
    for (int g = 0; g < G_COUNT; ++g) free(d->g[g]);
}

static void ref_grads_free(ref_grads *r) {
    for (int g = 0; g < G_COUNT; ++g) free(r->g[g]);
}

// The forward arguments of @p in for @p impl: without weights for the fused core.
static clmha_forward_args forward_args(const instance *in, clmha_impl impl) {
    clmha_forward_args a = in->args;
    a.impl = impl;
    if (impl == CLMHA_IMPL_FUSED) a.need_weights = false, a.per_head_weights = false;
    return a;
}

static clmha_tensor shaped_like(const clmha_tensor *t, const void *data) {
    clmha_tensor r = *t;
    r.data = data;
    return r;
}

// The weights' tensor shape of @p a on @p in.
static clmha_tensor weights_tensor(const instance *in, const clmha_forward_args *a,
                                   const void *data) {
    clmha_tensor t = {.data = data};
    if (!in->c.unbatched) t.shape[t.ndim++] = in->n;
    if (a->per_head_weights) t.shape[t.ndim++] = in->c.h;
    t.shape[t.ndim++] = in->c.l;
    t.shape[t.ndim++] = in->s_padded;
    return t;
}

// Random gradients of the output and (with need_weights) of the weights.
typedef struct upstream {
    float *gy, *gw;
} upstream;

static upstream upstream_make(const instance *in, uint64_t seed) {
    prng r = {seed};
    upstream u = {normal_floats(&r, in->output_count), NULL};
    size_t wc = in->c.need_weights ? in->n * in->c.h * in->c.l * in->s_padded : 0;
    if (wc) u.gw = normal_floats(&r, wc);
    return u;
}

// The reference gradients of @p a (masks' gradients with @p masks).
static ref_grads reference(const instance *in, const clmha_forward_args *a, const upstream *u,
                           bool masks) {
    ref_grads r = {{NULL}};
    clmha_reference_grads rg = {.struct_size = sizeof rg};
    for (int g = 0; g < G_COUNT; ++g) {
        size_t n = gcount(in, g, masks);
        if (!n) continue;
        r.g[g] = malloc(n * sizeof(double));
        cr_assert_not_null(r.g[g]);
        *rgrad(&rg, g) = r.g[g];
    }
    char msg[512];
    clmha_status st = clmha_reference_backward(&in->desc, &in->params, a, u->gy,
                                               a->need_weights ? u->gw : NULL, &rg, msg,
                                               sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_reference_backward: %s", msg);
    return r;
}

// Forward with save, then backward, on the device; gradients into fresh arrays (NaN-filled
// first, so that anything not written shows up), or added to @p init with accumulate.
static dev_grads device_as(clmha_layer *layer, clmha_saved *saved, const instance *in,
                           const clmha_forward_args *fa, const upstream *u, bool masks,
                           clmha_impl impl, float init, clmha_grad_dtype grad_dtype) {
    clmha_context *ctx = clmha_layer_context(layer);
    clmha_forward_args a = *fa;
    a.save = saved;
    float *out = alloc_floats(in->output_count);
    size_t wc = a.need_weights ? in->n * (a.per_head_weights ? in->c.h : 1) * in->c.l *
                                     in->s_padded
                               : 0;
    float *w = wc ? alloc_floats(wc) : NULL;
    clmha_status st = clmha_layer_forward_host(layer, &a, out, in->output_count, w, wc);
    cr_assert_eq(st, CLMHA_SUCCESS, "forward: %s", clmha_context_last_error(ctx));
    clmha_backward_args b = {.struct_size = sizeof b, .forward = &a, .saved = saved,
                             .grad_output = shaped_like(&a.query, u->gy), .impl = impl,
                             .grad_dtype = grad_dtype};
    if (a.need_weights) b.grad_weights = weights_tensor(in, &a, u->gw);
    dev_grads d = {{NULL}};
    for (int g = 0; g < G_COUNT; ++g) {
        size_t n = gcount(in, g, masks);
        if (!n) continue;
        d.g[g] = alloc_floats(n);
        for (size_t i = 0; i < n; ++i) d.g[g][i] = isnan(init) ? NAN : init;
        *bgrad(&b, g) = (clmha_grad){.data = d.g[g], .accumulate = !isnan(init)};
    }
    st = clmha_layer_backward_host(layer, &b);
    cr_assert_eq(st, CLMHA_SUCCESS, "backward (impl %s): %s (%s)", clmha_impl_name(impl),
                 clmha_context_last_error(ctx), clmha_status_string(st));
    free(out);
    free(w);
    return d;
}

static dev_grads device(clmha_layer *layer, clmha_saved *saved, const instance *in,
                        const clmha_forward_args *fa, const upstream *u, bool masks,
                        clmha_impl impl, float init) {
    return device_as(layer, saved, in, fa, u, masks, impl, init, CLMHA_GRAD_LAYER);
}

// The largest error of @p d against @p r over every gradient, as a fraction of what is allowed:
// r (|want| + t) + t per value, t = TOLERANCE (1 + max |want|) of its gradient and @p rnd the
// final rounding of a 16-bit layer's gradients (0: float32 ones); fails the test when a value
// is beyond it.
static double compare_within(const instance *in, const dev_grads *d, const ref_grads *r,
                             bool masks, float init, const char *what, double rnd) {
    double worst = 0;
    for (int g = 0; g < G_COUNT; ++g) {
        size_t n = gcount(in, g, masks);
        if (!n) continue;
        double scale = 0, err = 0, ratio = 0;
        for (size_t i = 0; i < n; ++i)
            scale = fmax(scale, fabs(r->g[g][i] + (isnan(init) ? 0.0 : (double)init)));
        double t = TOLERANCE * (1 + scale);
        for (size_t i = 0; i < n; ++i) {
            double want = r->g[g][i] + (isnan(init) ? 0.0 : (double)init);
            double e = fabs((double)d->g[g][i] - want);
            if (isnan(e)) e = INFINITY;
            err = fmax(err, e);
            ratio = fmax(ratio, e / (rnd * (fabs(want) + t) + t));
        }
        worst = fmax(worst, ratio);
        cr_expect(ratio <= 1.0, "%s: gradient of %s: max |err| %.3g (scale %.3g), %.2f of the "
                  "allowed", what, gname[g], err, scale, ratio);
    }
    return worst;
}

// The largest error of @p d against @p r over every gradient relative to 1 + max |want| of its
// gradient; fails the test when one is beyond TOLERANCE.
static double compare(const instance *in, const dev_grads *d, const ref_grads *r, bool masks,
                      float init, const char *what) {
    return TOLERANCE * compare_within(in, d, r, masks, init, what, 0.0);
}

// Runs @p in (named @p name) through both backward cores against the reference; returns the
// larger error (relative, as compare(); a 16-bit layer's within its contract as
// sixteen_bit_layers checks it). A float64 layer's backward runs in the unfused core whatever core its forward
// ran: its "fused" run is the fused forward, then the backward with impl auto.
static double check_instance(clmha_context *ctx, const instance *inp, const char *name) {
    const instance in = *inp;  // (a copy: the body's name for it)
    const rcase *c = &in.c;
    bool f64 = in.desc.dtype == CLMHA_DTYPE_F64;
    clmha_layer *layer = instance_layer(ctx, &in);
    clmha_saved *saved;
    cr_assert_eq(clmha_saved_create(&saved, layer), CLMHA_SUCCESS);
    upstream u = upstream_make(&in, c->data_seed ^ 0x5EED);
    // A 16-bit layer's: upstream gradients of its dtype, within half an ulp of it more.
    clmha_dtype t = in.desc.dtype;
    bool narrow = t == CLMHA_DTYPE_F16 || t == CLMHA_DTYPE_BF16;
    double rnd = !narrow ? 0.0 : t == CLMHA_DTYPE_F16 ? 0x1p-11 : 0x1p-8;
    size_t wc = u.gw ? in.n * c->h * c->l * in.s_padded : 0;
    for (size_t i = 0; narrow && i < in.output_count; ++i)
        u.gy[i] = clmha__dtype_round(t, u.gy[i]);
    for (size_t i = 0; narrow && i < wc; ++i) u.gw[i] = clmha__dtype_round(t, u.gw[i]);

    // Unfused: everything, weights gradient and mask gradients included.
    clmha_forward_args au = forward_args(&in, CLMHA_IMPL_UNFUSED);
    ref_grads ru = reference(&in, &au, &u, true);
    dev_grads du = device(layer, saved, &in, &au, &u, true, CLMHA_IMPL_UNFUSED, NAN);
    double eu = TOLERANCE * compare_within(&in, &du, &ru, true, NAN, name, rnd);
    // Fused: without weights, without mask gradients.
    clmha_forward_args af = forward_args(&in, CLMHA_IMPL_FUSED);
    ref_grads rf = reference(&in, &af, &u, false);
    dev_grads df = device(layer, saved, &in, &af, &u, false,
                          f64 ? CLMHA_IMPL_AUTO : CLMHA_IMPL_FUSED, NAN);
    double ef = TOLERANCE * compare_within(&in, &df, &rf, false, NAN, name, rnd);
    fprintf(stderr, "backward random: %-78s unfused %.2e fused %.2e\n", name, eu, ef);

    dev_grads_free(&du), dev_grads_free(&df);
    ref_grads_free(&ru), ref_grads_free(&rf);
    free(u.gy), free(u.gw);
    clmha_saved_release(saved);
    clmha_layer_release(layer);
    return fmax(eu, ef);
}

// Runs @p c through both backward cores against the reference.
static void check_case(clmha_context *ctx, const rcase *c) {
    char name[256];
    rcase_describe(c, name, sizeof name);
    instance in;
    instance_make(&in, c);
    check_instance(ctx, &in, name);
    instance_free(&in);
}

// ---- tests ---------------------------------------------------------------------------------------

Test(backward_random, combinations, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    static const uint64_t seeds[] = {11, 12, 13, 77, 4242};
    for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; ++i) {
        prng r = {seeds[i]};
        for (int k = 0; k < 5; ++k) {
            rcase c = rcase_random(&r);
            check_case(ctx, &c);
        }
    }
    clmha_context_release(ctx);
}

// Shapes across the fused kernels' tiles (1, one less, equal, one more than powers of two),
// causal with L != S, and head dims from 1 to 128.
Test(backward_random, tile_edges, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    static const size_t lens[][2] = {{1, 1},   {1, 70},  {31, 33}, {32, 32}, {33, 65},
                                     {64, 63}, {65, 31}, {97, 129}};
    static const size_t dims[][2] = {{8, 8}, {16, 2}, {64, 1}, {128, 1}, {12, 3}};
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; ++i) {
        rcase c = rcase_base(100 + i);
        c.e = dims[i % 5][0], c.h = dims[i % 5][1];
        c.n = 1 + i % 2, c.l = lens[i][0], c.s = lens[i][1];
        c.need_weights = i % 3 == 0;
        c.is_causal = i % 2 == 1;
        c.kpm = i % 4 == 2 ? CLMHA_MASK_FLOAT : CLMHA_MASK_NONE;
        c.mask_p = 0.1;
        check_case(ctx, &c);
    }
    clmha_context_release(ctx);
}

// Every mask kind and layout with float masks' gradients, fully masked rows and items.
Test(backward_random, masks, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    for (int k = 0; k < 12; ++k) {
        rcase c = rcase_base(200 + (uint64_t)k);
        c.kpm = (clmha_mask_kind)(k % 4);
        c.am = (clmha_mask_kind)((k / 4 + k) % 4);
        c.layout = (attn_layout)(k % 3);
        c.add_bias_kv = k % 2;
        c.add_zero_attn = k % 3 == 0;
        c.is_causal = k % 5 == 0;
        c.per_head = k % 2 == 0;
        if (k == 5) c.am = CLMHA_MASK_BOOL_IGNORE, c.layout = LAYOUT_SHARED, c.mask_row = true;
        if (k == 6) c.kpm = CLMHA_MASK_BOOL_IGNORE, c.mask_batch = true;
        check_case(ctx, &c);
    }
    clmha_context_release(ctx);
}

// Sliding windows with masks (their gradients), is_causal, bias_kv / zero_attn, L != S.
Test(backward_random, sliding_window, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    static const int64_t wins[][2] = {{2, 0}, {0, 1}, {-1, 1}, {3, -1}, {1, 1}};
    for (size_t k = 0; k < sizeof wins / sizeof wins[0]; ++k) {
        rcase c = rcase_base(800 + k);
        c.window = true, c.win_left = wins[k][0], c.win_right = wins[k][1];
        c.l = 4 + k, c.s = 8 - k;
        c.is_causal = k == 3;
        c.am = k % 2 ? CLMHA_MASK_FLOAT : CLMHA_MASK_NONE;
        c.kpm = k == 2 ? CLMHA_MASK_FLOAT : CLMHA_MASK_NONE;
        c.add_bias_kv = k == 4, c.add_zero_attn = k == 1;
        c.need_weights = k % 2 == 0;
        check_case(ctx, &c);
    }
    clmha_context_release(ctx);
}

// Attention sinks through both backward cores: the sinks' gradient (from the log-sum-exp rows
// and dO.O) with every other gradient, with masks, fully masked rows, is_causal, soft-capping
// and ALiBi, the appended keys, dropout, weights, and past the tiles.
Test(backward_random, sinks, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    for (size_t k = 0; k < 6; ++k) {
        rcase c = rcase_base(2000 + k);
        c.sinks = true;
        c.l = 4 + k, c.s = 8 - k;
        c.is_causal = k == 1;
        c.softcap = k == 2 ? 0.9 : 0.0, c.alibi = k == 2;
        c.am = k % 2 ? CLMHA_MASK_FLOAT : CLMHA_MASK_NONE;
        c.kpm = k == 3 ? CLMHA_MASK_BOOL_IGNORE : CLMHA_MASK_NONE;
        if (k == 3) c.mask_batch = true;
        c.add_bias_kv = k == 4, c.add_zero_attn = k == 4;
        c.need_weights = k % 2 == 0;
        if (k == 4) c.dropout = 0.3f, c.training = true;
        if (k == 5) c.l = 140, c.s = 90, c.n = 1, c.need_weights = false;
        check_case(ctx, &c);
    }
    clmha_context_release(ctx);
}

// Soft-capping and ALiBi (geometric and given slopes) through both backward cores: with masks
// (their gradients are those of the final scores), windows, is_causal, the appended keys,
// dropout, weights, and lengths past the tiles.
Test(backward_random, score_variants, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    static const double caps[] = {0.5, 0.0, 2.0, 0.7, 0.0, 1.0};
    for (size_t k = 0; k < sizeof caps / sizeof caps[0]; ++k) {
        rcase c = rcase_base(1800 + k);
        c.softcap = caps[k];
        c.alibi = k % 3 != 0, c.alibi_random = k % 3 == 2;
        c.l = 4 + k, c.s = 8 - k;
        c.is_causal = k == 1;
        c.am = k % 2 ? CLMHA_MASK_FLOAT : CLMHA_MASK_NONE;
        c.kpm = k == 2 ? CLMHA_MASK_FLOAT : CLMHA_MASK_NONE;
        c.add_bias_kv = k == 4, c.add_zero_attn = k == 3;
        c.need_weights = k % 2 == 0;
        if (k == 3) c.window = true, c.win_left = 1, c.win_right = 1;
        if (k == 4) c.dropout = 0.3f, c.training = true;
        if (k == 5) c.l = 140, c.s = 90, c.n = 1, c.need_weights = false;
        check_case(ctx, &c);
    }
    clmha_context_release(ctx);
}

// User functions reproducing soft-capping, ALiBi (clmha_score_mod with its derivative) and
// windows (clmha_mask_mod) against the reference's built-in ones: every gradient, both cores.
Test(backward_random, user_functions, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    static const unsigned users[] = {RC_USER_SCORE, RC_USER_MASK, RC_USER_SCORE | RC_USER_MASK};
    for (size_t k = 0; k < 6; ++k) {
        rcase c = rcase_base(2200 + k);
        c.user = users[k % 3];
        c.softcap = k % 2 ? 0.8 : 0.0;
        c.alibi = k != 3, c.alibi_random = k % 3 == 2;
        c.window = true, c.win_left = (int64_t)(1 + k % 2), c.win_right = k % 3 == 0 ? -1 : 0;
        c.l = 4 + k, c.s = 8 - k;
        c.is_causal = k == 1;
        c.am = k == 2 ? CLMHA_MASK_FLOAT : CLMHA_MASK_NONE;
        c.add_bias_kv = k == 4, c.add_zero_attn = k == 3;
        c.need_weights = k % 2 == 0, c.sinks = k == 2;
        if (k == 4) c.dropout = 0.3f, c.training = true;
        if (k == 5) c.l = 140, c.s = 90, c.n = 1, c.need_weights = false;
        check_case(ctx, &c);
    }
    // Functions that reproduce no built-in variant (support.h), against their host forms in the
    // reference, through the fused backward's kernels and its GEMMs.
    static const char *const modes[] = {"kernels", "gemms"};
    for (size_t mode = 0; mode < 2; ++mode) {
        setenv("CLMHA_FUSED_BACKWARD", modes[mode], 1);
        for (size_t k = 0; k < 3; ++k) {
            rcase c = rcase_base(2250 + k);
            c.user = RC_USER_HOST;
            c.softcap = k == 1 ? 0.8 : 0.0, c.alibi = k != 1, c.sinks = k == 1;
            c.l = 6 + k, c.s = 7 - k;
            c.is_causal = k == 0;
            c.am = k == 1 ? CLMHA_MASK_FLOAT : CLMHA_MASK_NONE;
            c.add_bias_kv = k == 1, c.need_weights = k == 0;
            if (k == 1) c.dropout = 0.3f, c.training = true;
            if (k == 2) c.l = 140, c.s = 90, c.n = 1;
            check_case(ctx, &c);
        }
        // A mask function that allows whole tiles past the first block of rows (every key up
        // to the row's: window (-1, 0) as clmha_mask_mod): those tiles make no per-key call.
        rcase c = rcase_base(2260);
        c.user = RC_USER_MASK, c.window = true, c.win_left = -1, c.win_right = 0;
        c.l = 600, c.s = 600, c.n = 1, c.need_weights = false;
        check_case(ctx, &c);
    }
    unsetenv("CLMHA_FUSED_BACKWARD");
    clmha_context_release(ctx);
}

// The fused backward's window bounds at its tile edges (rows private: 64 keys or query rows a
// work-group, tiles of 16; one row a work-item: 64; the GEMM blocks' key ranges), through the
// tiled kernels and through the products in GEMMs (CLMHA_FUSED_BACKWARD; the layer reads it
// when its fused backward is first built): lengths around the tiles, L != S both ways, windows
// of 0, 1, tile - 1, tile and tile + 1 on either side, with is_causal, masks, dropout, the
// appended keys (never windowed, always visited) and rows whose window holds no key; some as a
// user mask function.
Test(backward_random, sliding_window_tile_edges, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    static const window_edge cases[] = {
        {200, 200, 0, 0, false, 0},  {150, 150, 1, 0, true, 0},   {130, 97, 15, 1, false, 1},
        {97, 130, 16, -1, true, 2},  {129, 129, 17, 0, true, 0},  {150, 130, 63, 64, false, 3},
        {130, 150, 65, 1, false, 0}, {65, 63, 1, 63, false, 0},   {64, 64, -1, 16, false, 2},
        {33, 97, 0, 64, true, 1},    {200, 31, 0, 31, false, 1},  {31, 200, 1, 1, true, 0},
    };
    static const char *const modes[] = {"kernels", "gemms"};
    for (size_t mode = 0; mode < 2; ++mode) {
        setenv("CLMHA_FUSED_BACKWARD", modes[mode], 1);
        fprintf(stderr, "backward random: CLMHA_FUSED_BACKWARD=%s\n", modes[mode]);
        for (size_t k = 0; k < sizeof cases / sizeof cases[0]; ++k) {
            rcase c = rcase_window_edge(&cases[k], k, 950 + k, CLMHA_MASK_FLOAT);
            check_case(ctx, &c);
            // The window as a user clmha_mask_mod: the kernels skip the tiles its block masks
            // forbid at the same edges, the GEMMs the keys outside its tiles.
            if (k % 3 == 1) {
                c.user = RC_USER_MASK;
                check_case(ctx, &c);
            }
        }
    }
    unsetenv("CLMHA_FUSED_BACKWARD");
    clmha_context_release(ctx);
}

// Dropout is replayed from the forward call's rng, in both cores.
Test(backward_random, dropout, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    for (int k = 0; k < 4; ++k) {
        rcase c = rcase_base(300 + (uint64_t)k);
        c.dropout = k == 3 ? 0.75f : 0.3f;
        c.training = true;
        c.l = 9, c.s = 40;
        c.rng_seed = 0xABCDEF0123ull + (uint64_t)k, c.rng_offset = (uint64_t)k * 1000;
        c.is_causal = k == 1;
        c.add_bias_kv = k == 2;
        c.need_weights = k != 1;
        check_case(ctx, &c);
    }
    clmha_context_release(ctx);
}

// Accumulation: the gradient is added to what the destination holds.
Test(backward_random, accumulate, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    rcase c = rcase_base(400);
    c.add_bias_kv = true;
    c.kpm = CLMHA_MASK_FLOAT;
    instance in;
    instance_make(&in, &c);
    clmha_layer *layer = instance_layer(ctx, &in);
    clmha_saved *saved;
    cr_assert_eq(clmha_saved_create(&saved, layer), CLMHA_SUCCESS);
    upstream u = upstream_make(&in, 99);
    for (int impl = CLMHA_IMPL_FUSED; impl <= CLMHA_IMPL_UNFUSED; ++impl) {
        bool masks = impl == CLMHA_IMPL_UNFUSED;
        clmha_forward_args a = forward_args(&in, (clmha_impl)impl);
        ref_grads r = reference(&in, &a, &u, masks);
        dev_grads d = device(layer, saved, &in, &a, &u, masks, (clmha_impl)impl, 0.5f);
        compare(&in, &d, &r, masks, 0.5f, "accumulate");
        dev_grads_free(&d);
        ref_grads_free(&r);
    }
    free(u.gy), free(u.gw);
    clmha_saved_release(saved);
    clmha_layer_release(layer);
    instance_free(&in);
    clmha_context_release(ctx);
}

// The same call twice gives the same bits, in both cores; at a shape whose per-head products
// (8 heads of 130 x 130 x 32) run on several host threads where the GEMMs run in the host BLAS.
Test(backward_random, deterministic, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    rcase c = rcase_base(500);
    c.l = 130, c.s = 130, c.e = 256, c.h = 8, c.is_causal = true, c.need_weights = false;
    c.dropout = 0.2f, c.training = true;
    instance in;
    instance_make(&in, &c);
    clmha_layer *layer = instance_layer(ctx, &in);
    clmha_saved *saved;
    cr_assert_eq(clmha_saved_create(&saved, layer), CLMHA_SUCCESS);
    upstream u = upstream_make(&in, 5);
    for (int impl = CLMHA_IMPL_FUSED; impl <= CLMHA_IMPL_UNFUSED; ++impl) {
        clmha_forward_args a = forward_args(&in, (clmha_impl)impl);
        dev_grads d1 = device(layer, saved, &in, &a, &u, false, (clmha_impl)impl, NAN);
        dev_grads d2 = device(layer, saved, &in, &a, &u, false, (clmha_impl)impl, NAN);
        for (int g = 0; g < G_COUNT; ++g) {
            size_t n = gcount(&in, g, false);
            if (n)
                cr_expect(memcmp(d1.g[g], d2.g[g], n * sizeof(float)) == 0,
                          "impl %s: gradient of %s differs between two runs",
                          clmha_impl_name((clmha_impl)impl), gname[g]);
        }
        dev_grads_free(&d1), dev_grads_free(&d2);
    }
    free(u.gy), free(u.gw);
    clmha_saved_release(saved);
    clmha_layer_release(layer);
    instance_free(&in);
    clmha_context_release(ctx);
}

// 16-bit layers (include/clmha.h, clmha_dtype): random cases on values of the dtype (parameters,
// inputs, masks and upstream gradients rounded to it), both cores, gradients of the dtype and
// float32 ones (CLMHA_GRAD_F32), accumulation, within the stated contract of the float64
// reference on those values.
Test(backward_random, sixteen_bit_layers, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    const clmha_dtype types[2] = {CLMHA_DTYPE_F16, CLMHA_DTYPE_BF16};
    const double rnd[2] = {0x1p-11, 0x1p-8};  // half an ulp of each
    prng pr = {0xb16};
    double worst[2][2] = {{0}};  // [dtype][float32 gradients]
    size_t calls = 0;
    for (size_t k = 0; k < 8; ++k) {
        rcase c = k == 0 ? rcase_base(0x35) : rcase_random(&pr);
        if (k == 1) c.e = 64, c.h = 4, c.l = 33, c.s = 47, c.self_attn = false;  // tile edges
        if (k == 2) c.add_bias_kv = true, c.kpm = CLMHA_MASK_FLOAT, c.dropout = 0.25f,
                    c.training = true;
        for (size_t ti = 0; ti < 2; ++ti) {
            clmha_dtype t = types[ti];
            instance in;
            instance_make(&in, &c);
            instance_as_dtype(&in, t);
            clmha_layer *layer = instance_layer(ctx, &in);
            clmha_saved *saved;
            cr_assert_eq(clmha_saved_create(&saved, layer), CLMHA_SUCCESS);
            upstream u = upstream_make(&in, c.data_seed ^ 0x16);
            for (size_t i = 0; i < in.output_count; ++i) u.gy[i] = clmha__dtype_round(t, u.gy[i]);
            size_t wc = u.gw ? in.n * in.c.h * in.c.l * in.s_padded : 0;
            for (size_t i = 0; i < wc; ++i) u.gw[i] = clmha__dtype_round(t, u.gw[i]);
            char name[300], what[340];
            rcase_describe(&c, name, sizeof name);
            for (int impl = CLMHA_IMPL_FUSED; impl <= CLMHA_IMPL_UNFUSED; ++impl) {
                bool masks = impl == CLMHA_IMPL_UNFUSED;
                clmha_forward_args a = forward_args(&in, (clmha_impl)impl);
                ref_grads r = reference(&in, &a, &u, masks);
                for (int f32 = 0; f32 < 2; ++f32) {
                    // The accumulating run adds to 0.5 (a value of both dtypes).
                    float init = k == 2 && f32 ? 0.5f : NAN;
                    dev_grads d = device_as(layer, saved, &in, &a, &u, masks, (clmha_impl)impl,
                                            init, f32 ? CLMHA_GRAD_F32 : CLMHA_GRAD_LAYER);
                    snprintf(what, sizeof what, "%s %s%s %s", clmha__dtype_name(t),
                             clmha_impl_name((clmha_impl)impl), f32 ? " float32 gradients" : "",
                             name);
                    double w = compare_within(&in, &d, &r, masks, init, what,
                                              f32 ? 0.0 : rnd[ti]);
                    worst[ti][f32] = fmax(worst[ti][f32], w);
                    ++calls;
                    dev_grads_free(&d);
                }
                ref_grads_free(&r);
            }
            free(u.gy), free(u.gw);
            clmha_saved_release(saved);
            clmha_layer_release(layer);
            instance_free(&in);
        }
    }
    fprintf(stderr, "backward 16-bit: %zu calls; worst fraction of the contract: float16 %.2f "
            "(float32 gradients %.2f), bfloat16 %.2f (%.2f)\n",
            calls, worst[0][0], worst[0][1], worst[1][0], worst[1][1]);
    clmha_context_release(ctx);
}

// Rows whose every key carries a huge finite mask value (-1e30; -FLT_MAX, which is
// torch.finfo(torch.float32).min, as Hugging Face masks padding): all their scores round to
// the same float, so their weights are 1/S. The fused backward recomputes them from the saved
// rows, where m + log(S) rounds to m: it must take exp((score - m) - log(S)), not exp(score -
// lse) = 1 (gradients 20% and more off before). attn_mask (row 1 of every plane, each layout)
// and key_padding_mask (batch item 0), both cores, float32, bfloat16 (-1e30 only: -FLT_MAX
// rounds to -inf there) and float64 layers (where the device has it). @p worst: the worst error
// per dtype (relative, as check_instance() gives it).
static void huge_masks_run(clmha_context *ctx, double worst[3]) {
    bool f64 = has_fp64(ctx);
    const float huge[2] = {-1e30f, -FLT_MAX};
    const clmha_dtype types[3] = {CLMHA_DTYPE_F32, CLMHA_DTYPE_BF16, CLMHA_DTYPE_F64};
    for (int k = 0; k < 8; ++k) {
        rcase c = rcase_base(0x1e30 + (uint64_t)k);
        bool kpm = k % 2;
        c.l = 5 + (size_t)k, c.s = 7 + 3 * (size_t)k;  // past a tile for the later ones
        c.am = kpm ? CLMHA_MASK_NONE : CLMHA_MASK_FLOAT;
        c.kpm = kpm ? CLMHA_MASK_FLOAT : CLMHA_MASK_NONE;
        c.layout = (attn_layout)(k / 2 % 3);
        c.is_causal = false, c.mask_p = 0.0, c.add_bias_kv = k == 6, c.add_zero_attn = false;
        for (int v = 0; v < 2; ++v)
            for (int ti = 0; ti < 3; ++ti) {
                if ((ti == 2 && !f64) || (ti == 1 && v == 1)) continue;
                instance in;
                instance_make(&in, &c);
                size_t planes = c.layout == LAYOUT_PER_HEAD    ? in.n * c.h
                                : c.layout == LAYOUT_PER_BATCH ? in.n
                                                               : 1;
                float *m = kpm ? in.kpm : in.am;
                for (size_t p = 0; p < (kpm ? 1 : planes); ++p)  // row 1 / item 0
                    for (size_t j = 0; j < c.s; ++j)
                        m[kpm ? j : (p * c.l + 1) * c.s + j] = huge[v];
                if (ti == 1) instance_as_dtype(&in, types[ti]);
                in.desc.dtype = types[ti];
                char name[300], what[340];
                rcase_describe(&c, name, sizeof name);
                snprintf(what, sizeof what, "%s %s=%g %s", clmha__dtype_name(types[ti]),
                         kpm ? "kpm" : "attn_mask", (double)huge[v], name);
                worst[ti] = fmax(worst[ti], check_instance(ctx, &in, what));
                instance_free(&in);
            }
    }
}

// huge_masks_run() through each form of the fused backward: as chosen here, the host GEMMs
// (fused_backward_block), its kernels with rows private (CPU classes) and one row per
// work-item (the GPU mapping, forced).
Test(backward_random, huge_finite_masks, .timeout = 600) {
    static const char *const forms[4] = {NULL, "gemms", "kernels", "kernels"};
    for (int f = 0; f < 4; ++f) {
        if (forms[f]) setenv("CLMHA_FUSED_BACKWARD", forms[f], 1);
        if (f == 3) cr_assert(clmha__test_force_device_class("gpu"));
        clmha_context *ctx = context_or_skip();
        double worst[3] = {0};
        huge_masks_run(ctx, worst);
        fprintf(stderr, "backward huge finite masks (%s%s): worst float32 %.2e, bfloat16 %.2e "
                "(its contract), float64 %.2e\n", forms[f] ? forms[f] : "chosen",
                f == 3 ? ", GPU mapping" : "", worst[0], worst[1], worst[2]);
        clmha_context_release(ctx);
        unsetenv("CLMHA_FUSED_BACKWARD");
        clmha__test_force_device_class(NULL);
    }
}
