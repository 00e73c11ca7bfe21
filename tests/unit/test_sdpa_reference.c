// The CPU reference of attention as a function, backward (clmha_reference_attention_backward)
// against central finite differences of its forward (clmha_reference_attention): the gradients
// of the query, key, value and a float attn_mask, in both layouts, with dropout, grouped-query
// attention (a key/value head sums its query heads'), broadcast masks (summed over the
// dimensions they are broadcast along), is_causal, a custom scale, D_v ≠ D, unbatched inputs and
// user functions (their host forms).
// Inputs are multiples of 2^-6 in [-1, 1] and the step 2^-10, so that every perturbed input is
// exact in float32. Needs no device.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "support.h"

#define STEP (1.0 / 1024.0)
#define TOLERANCE 1e-6

typedef struct fcase {
    const char *name;
    clmha_attention_layout layout;
    bool batched, causal, gqa;
    size_t n, h, hkv, l, s, d, dv;
    size_t mask_ndim, mask_shape[4];
    clmha_mask_kind mask_kind;
    double scale;
    float dropout;
    bool user;  // the user functions of support.h (mod_source), in their host forms
} fcase;

typedef struct fdata {
    clmha_attention_args a;
    float *x[4], *g;        // query, key, value, mask; the output's gradient
    size_t count[4], nout;
} fdata;

static float grid(prng *r) { return (float)((double)prng_range(r, 0, 128) / 64.0 - 1.0); }

static float *grid_floats(prng *r, size_t count) {
    float *x = alloc_floats(count);
    for (size_t i = 0; i < count; ++i) x[i] = grid(r);
    return x;
}

static clmha_tensor shaped(const fcase *c, size_t heads, size_t seq, size_t feat, float *data) {
    clmha_tensor t = {.ndim = c->batched ? 4 : 3, .data = data};
    size_t *s = t.shape;
    if (c->batched) *s++ = c->n;
    bool nlhd = c->layout == CLMHA_LAYOUT_NLHD;
    s[0] = nlhd ? seq : heads, s[1] = nlhd ? heads : seq, s[2] = feat;
    return t;
}

static void fdata_make(fdata *f, const fcase *c) {
    prng r = {99};
    size_t n = c->batched ? c->n : 1, hkv = c->hkv ? c->hkv : c->h, dv = c->dv ? c->dv : c->d;
    memset(f, 0, sizeof *f);
    f->count[0] = n * c->h * c->l * c->d;
    f->count[1] = n * hkv * c->s * c->d;
    f->count[2] = n * hkv * c->s * dv;
    f->nout = n * c->h * c->l * dv;
    for (int t = 0; t < 3; ++t) f->x[t] = grid_floats(&r, f->count[t]);
    f->g = grid_floats(&r, f->nout);
    f->a = (clmha_attention_args){.struct_size = sizeof f->a, .layout = c->layout,
                                  .is_causal = c->causal, .enable_gqa = c->gqa,
                                  .scale = c->scale, .dropout_p = c->dropout,
                                  .rng = {.seed = 11, .offset = 2}};
    f->a.query = shaped(c, c->h, c->l, c->d, f->x[0]);
    f->a.key = shaped(c, hkv, c->s, c->d, f->x[1]);
    f->a.value = shaped(c, hkv, c->s, dv, f->x[2]);
    if (c->user) {
        f->a.mod_source = user_test_source;
        f->a.mod_params = (clmha_tensor){.ndim = 1, .shape = {USER_TEST_PARAMS},
                                         .data = (void *)user_test_params};
        f->a.host_score_mod = test_user_score;
        f->a.host_score_mod_grad = test_user_score_grad;
        f->a.host_mask_mod = test_user_mask;
    }
    if (!c->mask_ndim) return;
    size_t m = 1;
    for (size_t i = 0; i < c->mask_ndim; ++i) m *= c->mask_shape[i];
    f->count[3] = m;
    f->x[3] = grid_floats(&r, m);
    if (c->mask_kind != CLMHA_MASK_FLOAT)  // bytes: every third key forbidden
        for (size_t i = 0; i < m; ++i) ((unsigned char *)f->x[3])[i] = i % 3 != 0;
    f->a.attn_mask.kind = c->mask_kind;
    f->a.attn_mask.tensor.ndim = c->mask_ndim;
    memcpy(f->a.attn_mask.tensor.shape, c->mask_shape, sizeof c->mask_shape);
    f->a.attn_mask.tensor.data = f->x[3];
}

// Σ output · g, the loss whose gradients are checked.
static double loss(const fdata *f) {
    double *out = malloc(f->nout * sizeof *out);
    cr_assert(out);
    char msg[256];
    clmha_status st = clmha_reference_attention(&f->a, out, f->nout, NULL, 0, NULL, 0, msg,
                                                sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "reference: %s", msg);
    double sum = 0.0;
    for (size_t i = 0; i < f->nout; ++i) sum += out[i] * (double)f->g[i];
    free(out);
    return sum;
}

static void check(const fcase *c) {
    fdata f;
    fdata_make(&f, c);
    bool float_mask = c->mask_ndim && c->mask_kind == CLMHA_MASK_FLOAT;
    double *grad[4] = {NULL, NULL, NULL, NULL};
    for (int t = 0; t < 4; ++t) grad[t] = calloc(f.count[t] + 1, sizeof(double));
    clmha_reference_grads g = {.struct_size = sizeof g, .query = grad[0], .key = grad[1],
                               .value = grad[2], .attn_mask = float_mask ? grad[3] : NULL};
    char msg[256];
    clmha_status st = clmha_reference_attention_backward(&f.a, f.g, &g, msg, sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: %s", c->name, msg);
    static const char *const what[4] = {"query", "key", "value", "attn_mask"};
    for (int t = 0; t < (float_mask ? 4 : 3); ++t) {
        double worst = 0.0, largest = 0.0;
        for (size_t i = 0; i < f.count[t]; ++i) {
            float keep = f.x[t][i];
            f.x[t][i] = (float)(keep + STEP);
            double up = loss(&f);
            f.x[t][i] = (float)(keep - STEP);
            double down = loss(&f);
            f.x[t][i] = keep;
            double num = (up - down) / (2 * STEP), e = fabs(num - grad[t][i]);
            if (!(e <= worst)) worst = e;
            if (fabs(num) > largest) largest = fabs(num);
        }
        fprintf(stderr, "sdpa reference: %-30s d%-9s max|err| %.2e (largest %.2f)\n", c->name,
                what[t], worst, largest);
        cr_expect(worst <= TOLERANCE, "%s: d%s differs from finite differences by %g", c->name,
                  what[t], worst);
        cr_expect(largest > 1e-3, "%s: d%s is all zero: the check would pass vacuously",
                  c->name, what[t]);
    }
    for (int t = 0; t < 4; ++t) free(grad[t]), free(f.x[t]);
    free(f.g);
}

#define NHLD CLMHA_LAYOUT_NHLD
#define NLHD CLMHA_LAYOUT_NLHD
#define SZ(n_, h_, kv_, l_, s_, d_) .n = n_, .h = h_, .hkv = kv_, .l = l_, .s = s_, .d = d_
#define MASK(ndim_, kind_, ...) .mask_ndim = ndim_, .mask_kind = kind_, .mask_shape = {__VA_ARGS__}

static const fcase cases[] = {
    {.name = "nhld", .layout = NHLD, .batched = true, SZ(2, 2, 0, 3, 4, 3)},
    {.name = "nlhd mask (N,1,L,S) dropout", .layout = NLHD, .batched = true,
     SZ(2, 2, 0, 3, 4, 3), MASK(4, CLMHA_MASK_FLOAT, 2, 1, 3, 4), .dropout = 0.3f},
    {.name = "gqa 4/2 mask (L,S)", .layout = NHLD, .batched = true, SZ(2, 4, 2, 3, 5, 2),
     .gqa = true, MASK(2, CLMHA_MASK_FLOAT, 3, 5)},
    {.name = "unbatched causal scale D_v 2", .layout = NLHD, .batched = false,
     SZ(1, 2, 0, 4, 3, 3), .dv = 2, .causal = true, .scale = 0.7},
    {.name = "mask (N,1,1,S)", .layout = NHLD, .batched = true, SZ(2, 3, 0, 2, 4, 2),
     MASK(4, CLMHA_MASK_FLOAT, 2, 1, 1, 4)},
    {.name = "bool mask (N,H,L,S)", .layout = NLHD, .batched = true, SZ(2, 2, 0, 3, 4, 2),
     MASK(4, CLMHA_MASK_BOOL_ATTEND, 2, 2, 3, 4)},
    {.name = "mask (1,H,L,S) N 2", .layout = NHLD, .batched = true, SZ(2, 2, 0, 3, 4, 2),
     MASK(4, CLMHA_MASK_FLOAT, 1, 2, 3, 4)},
    // A size-1 L: one row of keys per (item, head), per head, or for every query.
    {.name = "mask (N,H,1,S)", .layout = NLHD, .batched = true, SZ(2, 3, 0, 3, 4, 2),
     MASK(4, CLMHA_MASK_FLOAT, 2, 3, 1, 4)},
    {.name = "mask (1,1,1,S) N 2 gqa", .layout = NHLD, .batched = true, SZ(2, 4, 2, 3, 4, 2),
     .gqa = true, MASK(4, CLMHA_MASK_FLOAT, 1, 1, 1, 4)},
    {.name = "mask (S) N 2 dropout", .layout = NHLD, .batched = true, SZ(2, 2, 0, 3, 5, 2),
     MASK(1, CLMHA_MASK_FLOAT, 5), .dropout = 0.2f},
    {.name = "mask (1,H,1,S) N 2", .layout = NLHD, .batched = true, SZ(2, 2, 0, 3, 4, 3),
     MASK(4, CLMHA_MASK_FLOAT, 1, 2, 1, 4)},
    {.name = "mask (H,1,S) unbatched", .layout = NHLD, .batched = false, SZ(1, 3, 0, 3, 4, 2),
     MASK(3, CLMHA_MASK_FLOAT, 3, 1, 4)},
    // The user functions' host forms: the score function's derivative, the mask function.
    {.name = "user functions gqa mask (N,1,L,S)", .layout = NLHD, .batched = true,
     SZ(2, 4, 2, 5, 6, 2), .gqa = true, MASK(4, CLMHA_MASK_FLOAT, 2, 1, 5, 6), .user = true},
    {.name = "user functions causal dropout", .layout = NHLD, .batched = true,
     SZ(2, 2, 0, 5, 5, 3), .causal = true, .dropout = 0.2f, .user = true},
};

Test(sdpa_reference, backward_matches_finite_differences) {
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) check(&cases[i]);
}

Test(sdpa_reference, backward_refusals) {
    fdata f;
    fdata_make(&f, &cases[0]);
    double dq[64];
    clmha_reference_grads g = {.struct_size = sizeof g, .query = dq};
    char msg[256];
    cr_expect_eq(clmha_reference_attention_backward(&f.a, NULL, &g, msg, sizeof msg),
                 CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(msg, "grad_output is NULL"), "%s", msg);
    g.attn_mask = dq;
    cr_expect_eq(clmha_reference_attention_backward(&f.a, f.g, &g, msg, sizeof msg),
                 CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(msg, "not a float mask"), "%s", msg);
    g.attn_mask = NULL;
    f.a.key.shape[3] = 2;
    cr_expect_eq(clmha_reference_attention_backward(&f.a, f.g, &g, msg, sizeof msg),
                 CLMHA_SHAPE_MISMATCH);
    cr_expect(strstr(msg, "key is (2, 2, 4, 2)"), "%s", msg);
    f.a.key.shape[3] = 3;
    // The user functions: host forms for those the source defines, the derivative for the
    // backward pass.
    f.a.mod_source = user_test_source;
    cr_expect_eq(clmha_reference_attention_backward(&f.a, f.g, &g, msg, sizeof msg),
                 CLMHA_UNSUPPORTED);
    cr_expect(strstr(msg, "args->host_score_mod"), "%s", msg);
    f.a.host_score_mod = test_user_score;
    f.a.host_mask_mod = test_user_mask;
    cr_expect_eq(clmha_reference_attention_backward(&f.a, f.g, &g, msg, sizeof msg),
                 CLMHA_UNSUPPORTED);
    cr_expect(strstr(msg, "args->host_score_mod_grad"), "%s", msg);
    f.a.mod_source = NULL;
    cr_expect_eq(clmha_reference_attention_backward(&f.a, f.g, &g, msg, sizeof msg),
                 CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(msg, "does not define"), "%s", msg);
    for (int t = 0; t < 3; ++t) free(f.x[t]);
    free(f.g);
}
