// The host fused core (src/cores/host_fused.c, src/device/host_attention.c): plain calls of
// head dimension 64 on the host path run in C on the CPU. Each case checks that the core ran
// (the layer's last core), and its output and that of the fused OpenCL kernel (the same call
// with CLMHA_IMPL_FUSED) against the double-precision reference: query rows that leave a
// partial block of 12 (130, 512 to 530 rows), keys that leave a partial tile of 64 (129, 513,
// 515, 517, 575, 577), the fewest rows and keys it takes (128, or 32 with the AVX2 kernel),
// batch first or not, with and
// without bias, cross-attention with kdim and vdim,
// grouped-query attention; attention as a function (head tiles) with its log-sum-exp rows; and
// a training step, whose forward runs the core and saves the log-sum-exp rows the fused
// backward needs (its gradients against clmha_reference_backward()); each also with is_causal.
// A call with fewer query rows or keys goes on to the fused core.
//
// Where the CPU has AVX-512, the cases with a partial block or tile run again with the AVX2
// kernel.
//
// Links libclmha.a (the layer's last core). Skipped where the core cannot run: no host path
// with oneDNN and its OpenMP runtime, or neither AVX-512 nor AVX2 with FMA.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "context/context.h"
#include "cores/core.h"
#include "cores/host_fused.h"
#include "device/host_attention.h"
#include "device/host_blas.h"
#include "layer/layer.h"
#include "support.h"

CLMHA__HIDDEN extern const clmha__core clmha__core_host_fused;
CLMHA__HIDDEN extern const clmha__core clmha__core_fused;

typedef struct hcase {
    size_t heads, kv_heads, n, l, s, kdim, vdim;
    bool bias, batch_first, cross;
    clmha_mask_kind kpm;  // a boolean key_padding_mask: about a third of each batch's keys
    bool kpm_dead;        // and batch 1's every key (rows of zeros before out_proj)
} hcase;

static clmha_context *context_with_core(void) {
    clmha_context *ctx = context_or_skip();
    if (!ctx->host_blas || !clmha__host_blas_team(ctx->host_blas) ||
        !clmha__host_attention_fits(CLMHA__HOST_ATTENTION_HD)) {
        clmha_context_release(ctx);
        cr_skip_test("no host path with an OpenMP team, or no AVX2: the core does not run");
    }
    return ctx;
}

// Runs @p c with @p impl and returns the largest |output - reference|; *core gets the core
// that ran.
static double run_case(clmha_context *ctx, const hcase *c, clmha_impl impl, bool causal,
                       const void **core) {
    size_t hd = CLMHA__HOST_ATTENTION_HD, e = c->heads * hd, kve = c->kv_heads * hd;
    size_t kdim = c->kdim ? c->kdim : e, vdim = c->vdim ? c->vdim : e;
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = e, .num_heads = c->heads,
                             .num_kv_heads = c->kv_heads, .kdim = kdim, .vdim = vdim,
                             .bias = c->bias, .batch_first = c->batch_first};
    clmha_layer *layer;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    prng r = {11 + c->l * 7 + c->s};
    float *wq = uniform_floats(&r, e * e, 0.15), *wk = uniform_floats(&r, kve * kdim, 0.15);
    float *wv = uniform_floats(&r, kve * vdim, 0.15), *wo = uniform_floats(&r, e * e, 0.15);
    float *bi = uniform_floats(&r, e + 2 * kve, 0.5), *bo = uniform_floats(&r, e, 0.5);
    cr_assert_eq(clmha_layer_set_parameter(layer, "q_proj_weight", wq, e * e), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "k_proj_weight", wk, kve * kdim), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "v_proj_weight", wv, kve * vdim), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.weight", wo, e * e), 0);
    if (c->bias) {
        cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_bias", bi, e + 2 * kve), 0);
        cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.bias", bo, e), 0);
    }
    size_t s = c->cross ? c->s : c->l;
    float *x = uniform_floats(&r, c->n * c->l * e, 1.0);
    float *k = uniform_floats(&r, c->n * s * kdim, 1.0);
    float *v = uniform_floats(&r, c->n * s * vdim, 1.0);
    size_t count = c->n * c->l * e;
    float *y = calloc(count, sizeof *y);
    double *want = calloc(count, sizeof *want);
    cr_assert(y && want);
    clmha_forward_args a = {.struct_size = sizeof a, .impl = impl, .is_causal = causal};
    unsigned char *kpm = calloc(c->n * s, 1);
    cr_assert(kpm);
    for (size_t b = 0; c->kpm && b < c->n; ++b)
        for (size_t j = 0; j < s; ++j) {
            bool masked = (c->kpm_dead && b == 1) || prng_uniform(&r) < 0.35;
            kpm[b * s + j] = c->kpm == CLMHA_MASK_BOOL_ATTEND ? !masked : masked;
        }
    if (c->kpm)
        a.key_padding_mask = (clmha_mask){.kind = c->kpm,
                                          .tensor = {.ndim = 2, .shape = {c->n, s}, .data = kpm}};
#define SHAPE(t, rows, f) \
    (c->batch_first ? (size_t[3]){c->n, rows, f} : (size_t[3]){rows, c->n, f})
    const size_t *qs = SHAPE(x, c->l, e);
    a.query = (clmha_tensor){.ndim = 3, .shape = {qs[0], qs[1], qs[2]}, .data = x};
    if (c->cross) {
        const size_t *ks = SHAPE(k, s, kdim), *vs = SHAPE(v, s, vdim);
        a.key = (clmha_tensor){.ndim = 3, .shape = {ks[0], ks[1], ks[2]}, .data = k};
        a.value = (clmha_tensor){.ndim = 3, .shape = {vs[0], vs[1], vs[2]}, .data = v};
    }
#undef SHAPE
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, count, NULL, 0), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    *core = layer->last_core;
    clmha_reference_params p = {.struct_size = sizeof p, .q_proj_weight = wq, .k_proj_weight = wk,
                                .v_proj_weight = wv, .out_proj_weight = wo,
                                .in_proj_bias = c->bias ? bi : NULL,
                                .out_proj_bias = c->bias ? bo : NULL};
    char msg[256];
    cr_assert_eq(clmha_reference_forward(&desc, &p, &a, want, count, NULL, 0, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    double worst = 0;
    for (size_t i = 0; i < count; ++i) {
        double err = fabs(y[i] - want[i]);
        worst = isnan(err) ? INFINITY : fmax(worst, err);  // (fmax would drop a NaN)
    }
    free(wq), free(wk), free(wv), free(wo), free(bi), free(bo), free(x), free(k), free(v);
    free(y), free(want), free(kpm);
    clmha_layer_release(layer);
    return worst;
}

// Each of @p cases, plain and with is_causal, by the host core and by the fused OpenCL kernel.
static void host_against_fused(clmha_context *ctx, const hcase *cases, size_t count) {
    const char *isa = clmha__host_attention_isa();
    for (size_t k = 0; k < 2 * count; ++k) {
        size_t i = k / 2;
        bool causal = k % 2;
        const hcase *c = &cases[i];
        const void *host_core, *fused_core;
        double host = run_case(ctx, c, CLMHA_IMPL_AUTO, causal, &host_core);
        double fused = run_case(ctx, c, CLMHA_IMPL_FUSED, causal, &fused_core);
        printf("host_fused (%s): H %zu KVH %zu N %zu L %zu S %zu%s%s%s: max |error| %.2e (fused "
               "kernel %.2e)\n", isa, c->heads, c->kv_heads, c->n, c->l, c->cross ? c->s : c->l,
               c->bias ? ", bias" : "", c->cross ? ", cross" : "", causal ? ", causal" : "",
               host, fused);
        cr_expect_eq(host_core, (const void *)&clmha__core_host_fused,
                     "case %zu%s: not the host core", i, causal ? ", causal" : "");
        cr_expect_eq(fused_core, (const void *)&clmha__core_fused, "case %zu", i);
        cr_expect_leq(host, 2e-6, "case %zu%s: %.2e", i, causal ? ", causal" : "", host);
        cr_expect_leq(fused, 2e-6, "case %zu: %.2e", i, fused);
    }
}

static const hcase cases[] = {
    {.heads = 2, .kv_heads = 2, .n = 1, .l = 512, .bias = true, .batch_first = true},
    {.heads = 2, .kv_heads = 2, .n = 2, .l = 517, .bias = true, .batch_first = true},
    {.heads = 1, .kv_heads = 1, .n = 1, .l = 515, .bias = false, .batch_first = false},
    {.heads = 2, .kv_heads = 2, .n = 1, .l = 520, .s = 577, .kdim = 40, .vdim = 72,
     .bias = true, .batch_first = true, .cross = true},
    {.heads = 4, .kv_heads = 2, .n = 1, .l = 512, .s = 575, .bias = true, .batch_first = true,
     .cross = true},
    {.heads = 4, .kv_heads = 1, .n = 1, .l = 530, .s = 513, .bias = true, .batch_first = false,
     .cross = true},
    {.heads = 4, .kv_heads = 4, .n = 2, .l = 128, .bias = true, .batch_first = true},
    {.heads = 2, .kv_heads = 1, .n = 1, .l = 130, .s = 129, .bias = true, .batch_first = false,
     .cross = true},
};

Test(host_fused, against_reference) {
    clmha_context *ctx = context_with_core();
    host_against_fused(ctx, cases, sizeof cases / sizeof cases[0]);
    // The fewest rows and keys the core takes on this CPU (128 with AVX-512, 32 with AVX2),
    // then one fewer: the fused core's call.
    size_t floor = clmha__host_fused_floor();
    const hcase at_floor = {.heads = 2, .kv_heads = 2, .n = 2, .l = floor, .s = floor + 1,
                            .bias = true, .batch_first = true, .cross = true};
    host_against_fused(ctx, &at_floor, 1);
    const hcase others[] = {
        {.heads = 2, .kv_heads = 2, .n = 1, .l = floor - 1, .bias = true, .batch_first = true},
        {.heads = 2, .kv_heads = 2, .n = 1, .l = 600, .s = floor - 1, .bias = true,
         .batch_first = true, .cross = true},
    };
    for (size_t i = 0; i < 2; ++i) {
        const void *core;
        double err = run_case(ctx, &others[i], CLMHA_IMPL_AUTO, false, &core);
        cr_expect_eq(core, (const void *)&clmha__core_fused, "case %zu ran another core", i);
        cr_expect_leq(err, 2e-6);
    }
    clmha_context_release(ctx);
}

// The AVX2 kernel on a CPU that would run the AVX-512 one (where the CPU runs only the AVX2
// kernel, against_reference tested it): the cases with a partial block or tile.
Test(host_fused, avx2_kernel_where_avx512) {
    clmha_context *ctx = context_with_core();
    const char *isa = clmha__host_attention_isa();
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    bool avx2 = false;
#endif
    if (strcmp(isa, "AVX-512") != 0 || !avx2) {
        clmha_context_release(ctx);
        cr_skip_test("the kernel here is %s: against_reference tested it", isa);
    }
    clmha__host_attention_avx2_only = true;
    cr_assert_str_eq(clmha__host_attention_isa(), "AVX2");
    host_against_fused(ctx, cases + 1, 5);
    host_against_fused(ctx, cases + 7, 1);
    clmha__host_attention_avx2_only = false;
    clmha_context_release(ctx);
}

// A boolean key_padding_mask (either kind; batch 1 fully masked in some cases: zero rows before
// out_proj, as the fused kernel's): the host core without is_causal, the fused kernel with it.
Test(host_fused, key_padding_mask) {
    clmha_context *ctx = context_with_core();
    const char *isa = clmha__host_attention_isa();
    const hcase kcases[] = {
        {.heads = 2, .kv_heads = 2, .n = 3, .l = 130, .bias = true, .batch_first = true,
         .kpm = CLMHA_MASK_BOOL_IGNORE, .kpm_dead = true},
        {.heads = 4, .kv_heads = 2, .n = 2, .l = 140, .s = 515, .kdim = 40, .vdim = 72,
         .bias = true, .batch_first = false, .cross = true, .kpm = CLMHA_MASK_BOOL_ATTEND},
        {.heads = 2, .kv_heads = 1, .n = 2, .l = 200, .s = 129, .bias = false,
         .batch_first = true, .cross = true, .kpm = CLMHA_MASK_BOOL_ATTEND, .kpm_dead = true},
    };
    for (size_t k = 0; k < 2 * sizeof kcases / sizeof kcases[0]; ++k) {
        const hcase *c = &kcases[k / 2];
        bool causal = k % 2;
        const void *host_core, *fused_core;
        double host = run_case(ctx, c, CLMHA_IMPL_AUTO, causal, &host_core);
        double fused = run_case(ctx, c, CLMHA_IMPL_FUSED, causal, &fused_core);
        printf("host_fused (%s): key_padding_mask %s%s, H %zu KVH %zu N %zu L %zu S %zu%s: max "
               "|error| %.2e (fused kernel %.2e)\n", isa,
               c->kpm == CLMHA_MASK_BOOL_ATTEND ? "attend" : "ignore",
               c->kpm_dead ? " (batch 1 fully masked)" : "", c->heads, c->kv_heads, c->n, c->l,
               c->cross ? c->s : c->l, causal ? ", causal" : "", host, fused);
        const void *want = causal ? (const void *)&clmha__core_fused
                                  : (const void *)&clmha__core_host_fused;
        cr_expect_eq(host_core, want, "case %zu%s: another core ran", k / 2,
                     causal ? ", causal" : "");
        cr_expect_leq(host, 2e-6, "case %zu%s: %.2e", k / 2, causal ? ", causal" : "", host);
        cr_expect_leq(fused, 2e-6, "case %zu: %.2e", k / 2, fused);
    }
    clmha_context_release(ctx);
}

// Attention as a function (head tiles, not projected rows): grouped-query heads and a scale of
// the caller's, is_causal or not (top-left aligned: L 515 queries, S 530 keys), against
// clmha_reference_attention().
static void attention_function(bool causal) {
    clmha_context *ctx = context_with_core();
    size_t n = 2, h = 4, hkv = 2, l = 515, s = 530, d = CLMHA__HOST_ATTENTION_HD;
    prng r = {5};
    float *q = uniform_floats(&r, n * h * l * d, 1.0);
    float *k = uniform_floats(&r, n * hkv * s * d, 1.0);
    float *v = uniform_floats(&r, n * hkv * s * d, 1.0), *y = calloc(n * h * l * d, sizeof *y);
    double *want = calloc(n * h * l * d, sizeof *want);
    cr_assert(y && want);
    clmha_attention_args a = {.struct_size = sizeof a, .scale = 0.3, .enable_gqa = true,
                              .is_causal = causal};
    a.query = (clmha_tensor){.ndim = 4, .shape = {n, h, l, d}, .data = q};
    a.key = (clmha_tensor){.ndim = 4, .shape = {n, hkv, s, d}, .data = k};
    a.value = (clmha_tensor){.ndim = 4, .shape = {n, hkv, s, d}, .data = v};
    size_t rows = n * h * l;
    float *lse = malloc(rows * sizeof *lse);
    double *want_lse = malloc(rows * sizeof *want_lse);
    cr_assert(lse && want_lse);
    size_t before = clmha__host_fused_calls();
    cr_assert_eq(clmha_attention_forward_host(ctx, &a, y, n * h * l * d, lse, rows, NULL, 0),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_expect_eq(clmha__host_fused_calls(), before + 1, "the host fused core did not run");
    char msg[256];
    cr_assert_eq(clmha_reference_attention(&a, want, n * h * l * d, want_lse, rows, NULL, 0, msg,
                                           sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    double worst = 0, worst_lse = 0;
    for (size_t i = 0; i < n * h * l * d; ++i) worst = fmax(worst, fabs(y[i] - want[i]));
    for (size_t i = 0; i < rows; ++i) worst_lse = fmax(worst_lse, fabs(lse[i] - want_lse[i]));
    printf("host_fused: attention function, N %zu H %zu H_kv %zu L %zu S %zu, scale 0.3%s: "
           "max |error| %.2e, log-sum-exp %.2e\n", n, h, hkv, l, s, causal ? ", causal" : "",
           worst, worst_lse);
    cr_expect_leq(worst, 2e-6);
    cr_expect_leq(worst_lse, 2e-6);
    free(q), free(k), free(v), free(y), free(want), free(lse), free(want_lse);
    clmha_context_release(ctx);
}

Test(host_fused, attention_function) { attention_function(false); }
Test(host_fused, attention_function_causal) { attention_function(true); }

// A training step: the forward call that saves runs the core, which writes the log-sum-exp rows
// the fused backward reads (CLMHA_IMPL_FUSED: fails the call where they are missing); every
// gradient against clmha_reference_backward(); is_causal, or a key_padding_mask (@p kpm: two
// batches, the second fully masked), or neither.
static void training_step(bool causal, bool kpm) {
    clmha_context *ctx = context_with_core();
    size_t h = 2, hd = CLMHA__HOST_ATTENTION_HD, e = h * hd, n = kpm ? 2 : 1, l = 520;
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = e, .num_heads = h,
                             .bias = true, .batch_first = true};
    clmha_layer *layer;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS);
    prng r = {23};
    float *w = uniform_floats(&r, 3 * e * e, 0.15), *wo = uniform_floats(&r, e * e, 0.15);
    float *bi = uniform_floats(&r, 3 * e, 0.5), *bo = uniform_floats(&r, e, 0.5);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_weight", w, 3 * e * e), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_bias", bi, 3 * e), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.weight", wo, e * e), 0);
    cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.bias", bo, e), 0);
    size_t count = n * l * e;
    float *x = uniform_floats(&r, count, 1.0), *gy = uniform_floats(&r, count, 1.0);
    float *y = calloc(count, sizeof *y), *gx = calloc(count, sizeof *gx);
    float *gw = calloc(3 * e * e, sizeof *gw), *gwo = calloc(e * e, sizeof *gwo);
    double *want_gx = calloc(count, sizeof *want_gx), *want_gw = calloc(3 * e * e, sizeof *want_gw);
    double *want_gwo = calloc(e * e, sizeof *want_gwo);
    cr_assert(y && gx && gw && gwo && want_gx && want_gw && want_gwo);
    clmha_saved *saved;
    cr_assert_eq(clmha_saved_create(&saved, layer), CLMHA_SUCCESS);
    clmha_forward_args a = {.struct_size = sizeof a, .save = saved, .training = true,
                            .is_causal = causal};
    a.query = (clmha_tensor){.ndim = 3, .shape = {n, l, e}, .data = x};
    unsigned char *mask = calloc(n * l, 1);
    cr_assert(mask);
    for (size_t j = 0; kpm && j < n * l; ++j) mask[j] = j >= l || prng_uniform(&r) < 0.35;
    if (kpm)
        a.key_padding_mask = (clmha_mask){.kind = CLMHA_MASK_BOOL_IGNORE,
                                          .tensor = {.ndim = 2, .shape = {n, l}, .data = mask}};
    size_t before = clmha__host_fused_calls();
    cr_assert_eq(clmha_layer_forward_host(layer, &a, y, count, NULL, 0), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cr_expect_eq(clmha__host_fused_calls(), before + 1, "the host fused core did not run");
    clmha_backward_args b = {.struct_size = sizeof b, .forward = &a, .saved = saved,
                             .impl = CLMHA_IMPL_FUSED};
    b.grad_output = (clmha_tensor){.ndim = 3, .shape = {n, l, e}, .data = gy};
    b.query.data = gx;
    b.in_proj_weight.data = gw;
    b.out_proj_weight.data = gwo;
    cr_assert_eq(clmha_layer_backward_host(layer, &b), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    clmha_reference_params p = {.struct_size = sizeof p, .in_proj_weight = w,
                                .in_proj_bias = bi, .out_proj_weight = wo, .out_proj_bias = bo};
    clmha_reference_grads rg = {.struct_size = sizeof rg, .query = want_gx,
                                .in_proj_weight = want_gw, .out_proj_weight = want_gwo};
    char msg[256];
    cr_assert_eq(clmha_reference_backward(&desc, &p, &a, gy, NULL, &rg, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    const float *got[3] = {gx, gw, gwo};
    const double *want[3] = {want_gx, want_gw, want_gwo};
    size_t counts[3] = {count, 3 * e * e, e * e};
    const char *names[3] = {"query", "in_proj_weight", "out_proj.weight"};
    for (int g = 0; g < 3; ++g) {
        double top = 0, worst = 0;
        for (size_t i = 0; i < counts[g]; ++i) top = fmax(top, fabs(want[g][i]));
        for (size_t i = 0; i < counts[g]; ++i) {
            double err = fabs(got[g][i] - want[g][i]);
            worst = isnan(err) ? INFINITY : fmax(worst, err);
        }
        printf("host_fused: training step, N %zu, L %zu%s: gradient of %s max |error| %.2e "
               "(max |g| %.2e)\n", n, l, causal ? ", causal" : kpm ? ", key_padding_mask" : "",
               names[g], worst, top);
        cr_expect_leq(worst, 1e-5 * (1 + top), "%s: %.2e", names[g], worst);
    }
    clmha_saved_release(saved);
    clmha_layer_release(layer);
    free(w), free(wo), free(bi), free(bo), free(x), free(gy), free(y), free(gx), free(gw);
    free(mask), free(gwo), free(want_gx), free(want_gw), free(want_gwo);
    clmha_context_release(ctx);
}

Test(host_fused, training_step) { training_step(false, false); }
Test(host_fused, training_step_causal) { training_step(true, false); }
Test(host_fused, training_step_key_padding_mask) { training_step(false, true); }
