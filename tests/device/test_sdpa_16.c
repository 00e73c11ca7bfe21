// Attention as a function in float16 and bfloat16 (clmha_attention_args::dtype F16, BF16): the
// device form on buffers of 16-bit elements at offsets counted in them (widened to float32,
// computed in float32, the output, log-sum-exp rows and weights rounded once), and the float
// host form on float arrays (rounded to the dtype on the way in, the results once on the way
// out), against the double-precision reference on the rounded inputs, within the 16-bit
// layers' contract (docs/accuracy.md: half an ulp of the dtype around a float32 result within
// 1e-5 (1 + max |y|)): both layouts, GQA, causal, boolean and float masks, D_v ≠ D, through
// both cores. The backward pass likewise (the gradients of query, key, value and a float mask,
// rounded once), within the 16-bit layers' gradient contract (r (|g| + t) + t, t =
// 1e-4 (1 + max |g|)); a case with attention sinks and given ALiBi slopes (16-bit too; the
// sinks' gradient on the device).
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/half.h"
#include "support.h"

// Element offset of every device tensor in its buffer.
#define PAD 5

static const clmha_dtype sixteen[] = {CLMHA_DTYPE_F16, CLMHA_DTYPE_BF16};

// The contract's bound for one value (as tests/device/test_dtype.c's for 16-bit layers).
static double allowed(clmha_dtype t, double want, double max_abs) {
    double f32 = 1e-5 * (1.0 + max_abs);
    double rel = t == CLMHA_DTYPE_F16 ? 0x1p-11 : 0x1p-8;
    return rel * (fabs(want) + f32) + f32;
}

// The gradient contract's bound (docs/accuracy.md, "Training in float16 and bfloat16").
static double allowed_grad(clmha_dtype t, double want, double max_abs) {
    double f32 = 1e-4 * (1.0 + max_abs);
    double rel = t == CLMHA_DTYPE_F16 ? 0x1p-11 : 0x1p-8;
    return rel * (fabs(want) + f32) + f32;
}

static bool grading;  // ratio() against allowed_grad()

// The largest ratio of error to allowed() (at most 1: within the contract).
static double ratio(clmha_dtype t, const float *got, const double *want, size_t count) {
    double max_abs = 0.0, worst = 0.0;
    for (size_t i = 0; i < count; ++i)
        if (isfinite(want[i]) && fabs(want[i]) > max_abs) max_abs = fabs(want[i]);
    for (size_t i = 0; i < count; ++i) {
        if (isinf(want[i]) && got[i] == (float)want[i]) continue;
        double bound = grading ? allowed_grad(t, want[i], max_abs) : allowed(t, want[i], max_abs);
        double r = fabs((double)got[i] - want[i]) / bound;
        if (!(r <= worst)) worst = isnan(r) ? INFINITY : r;
    }
    return worst;
}

static uint16_t bits_of(clmha_dtype t, float v) {
    return t == CLMHA_DTYPE_F16 ? clmha__f32_to_f16(v) : clmha__f32_to_bf16(v);
}

static float value_of(clmha_dtype t, uint16_t b) {
    return t == CLMHA_DTYPE_F16 ? clmha__f16_to_f32(b) : clmha__bf16_to_f32(b);
}

// One case: sizes (hkv 0: h; dv 0: d), layout, mask (ndim 0: none), is_causal.
typedef struct hcase {
    const char *name;
    clmha_attention_layout layout;
    size_t n, h, hkv, l, s, d, dv;
    size_t mask_ndim, mask_shape[4];
    clmha_mask_kind mask_kind;
    bool causal;
    bool sinks_slopes;  // attention sinks and given ALiBi slopes (H each)
} hcase;

static const hcase cases[] = {
    {"nhld plain", CLMHA_LAYOUT_NHLD, 2, 3, 0, 5, 7, 8, 0, 0, {0}, 0, false, false},
    {"nlhd gqa causal", CLMHA_LAYOUT_NLHD, 2, 4, 2, 6, 6, 16, 0, 0, {0}, 0, true, false},
    {"nhld float mask", CLMHA_LAYOUT_NHLD, 2, 2, 0, 4, 9, 8, 0, 4, {2, 2, 4, 9},
     CLMHA_MASK_FLOAT, false, false},
    {"nlhd bool mask (L,S)", CLMHA_LAYOUT_NLHD, 1, 2, 0, 5, 3, 8, 0, 2, {5, 3},
     CLMHA_MASK_BOOL_ATTEND, false, false},
    {"nhld D_v 12", CLMHA_LAYOUT_NHLD, 1, 2, 0, 4, 5, 8, 12, 0, {0}, 0, false, false},
    {"nhld sinks, alibi slopes, causal", CLMHA_LAYOUT_NHLD, 2, 3, 0, 6, 6, 8, 0, 0, {0}, 0,
     true, true},
};

// A case's inputs, rounded to @p t, as floats; the reference's arguments on them.
typedef struct hdata {
    clmha_attention_args args;  // dtype float32, data: the rounded floats
    float *x[4];                // query, key, value, float mask
    float *sinks, *slopes;      // (H) each, or NULL
    unsigned char *bmask;
    size_t count[4], nout, nlse, nw;
} hdata;

static clmha_tensor tensor_of(const hcase *c, size_t heads, size_t seq, size_t feat) {
    bool nlhd = c->layout == CLMHA_LAYOUT_NLHD;
    return (clmha_tensor){.ndim = 4,
                          .shape = {c->n, nlhd ? seq : heads, nlhd ? heads : seq, feat}};
}

static void hdata_make(hdata *x, const hcase *c, clmha_dtype t, uint64_t seed) {
    prng r = {seed};
    memset(x, 0, sizeof *x);
    size_t hkv = c->hkv ? c->hkv : c->h, dv = c->dv ? c->dv : c->d;
    x->count[0] = c->n * c->h * c->l * c->d, x->count[1] = c->n * hkv * c->s * c->d;
    x->count[2] = c->n * hkv * c->s * dv;
    x->nout = c->n * c->h * c->l * dv, x->nlse = c->n * c->h * c->l, x->nw = x->nlse * c->s;
    if (c->mask_ndim) {
        x->count[3] = 1;
        for (size_t i = 0; i < c->mask_ndim; ++i) x->count[3] *= c->mask_shape[i];
    }
    for (int i = 0; i < 3; ++i) x->x[i] = normal_floats(&r, x->count[i]);
    clmha_attention_args *a = &x->args;
    *a = (clmha_attention_args){.struct_size = sizeof *a, .layout = c->layout,
                                .is_causal = c->causal, .enable_gqa = hkv != c->h,
                                .query = tensor_of(c, c->h, c->l, c->d),
                                .key = tensor_of(c, hkv, c->s, c->d),
                                .value = tensor_of(c, hkv, c->s, dv)};
    if (c->mask_ndim) {
        a->attn_mask.kind = c->mask_kind;
        a->attn_mask.tensor.ndim = c->mask_ndim;
        memcpy(a->attn_mask.tensor.shape, c->mask_shape, sizeof c->mask_shape);
        if (c->mask_kind == CLMHA_MASK_FLOAT) {
            x->x[3] = alloc_floats(x->count[3]);
            for (size_t i = 0; i < x->count[3]; ++i)
                x->x[3][i] = (i % c->s) && prng_uniform(&r) < 0.2
                                 ? -INFINITY
                                 : (float)(prng_uniform(&r) * 3 - 2);
            a->attn_mask.tensor.data = x->x[3];
        } else {
            x->bmask = malloc(x->count[3]);
            cr_assert(x->bmask);
            for (size_t i = 0; i < x->count[3]; ++i)
                x->bmask[i] = (i % c->s) == 0 || prng_uniform(&r) < 0.7;
            a->attn_mask.tensor.data = x->bmask;
        }
    }
    for (int i = 0; i < 4; ++i)
        for (size_t k = 0; x->x[i] && k < x->count[i]; ++k)
            x->x[i][k] = clmha__dtype_round(t, x->x[i][k]);
    a->query.data = x->x[0], a->key.data = x->x[1], a->value.data = x->x[2];
    if (!c->sinks_slopes) return;
    x->sinks = normal_floats(&r, c->h), x->slopes = alloc_floats(c->h);
    for (size_t h = 0; h < c->h; ++h) {
        x->sinks[h] = clmha__dtype_round(t, x->sinks[h]);
        x->slopes[h] = clmha__dtype_round(t, 0.3f / (float)(h + 1));
    }
    a->sinks = (clmha_tensor){.ndim = 1, .shape = {c->h}, .data = x->sinks};
    a->alibi = true;
    a->alibi_slopes = (clmha_tensor){.ndim = 1, .shape = {c->h}, .data = x->slopes};
}

static void hdata_free(hdata *x) {
    for (int i = 0; i < 4; ++i) free(x->x[i]);
    free(x->sinks), free(x->slopes);
    free(x->bmask);
}

static cl_mem upload16(clmha_context *ctx, clmha_dtype t, const float *v, size_t count) {
    uint16_t *b = calloc(count + PAD, sizeof *b);
    cr_assert(b);
    for (size_t i = 0; v && i < count; ++i) b[PAD + i] = bits_of(t, v[i]);
    cl_int err;
    cl_mem m = clCreateBuffer(clmha_context_cl_context(ctx), CL_MEM_READ_WRITE |
                              CL_MEM_COPY_HOST_PTR, (count + PAD) * 2, b, &err);
    cr_assert_eq(err, CL_SUCCESS, "clCreateBuffer: %d", (int)err);
    free(b);
    return m;
}

static float *download16(clmha_context *ctx, clmha_dtype t, cl_mem m, size_t count) {
    uint16_t *b = malloc((count + 1) * sizeof *b);
    float *v = alloc_floats(count + 1);
    cl_int err = clEnqueueReadBuffer(clmha_context_cl_queue(ctx), m, CL_TRUE, PAD * 2, count * 2,
                                     b, 0, NULL, NULL);
    cr_assert_eq(err, CL_SUCCESS, "clEnqueueReadBuffer: %d", (int)err);
    for (size_t i = 0; i < count; ++i) v[i] = value_of(t, b[i]);
    free(b);
    return v;
}

static double worst_seen;

static void check(const hcase *c, clmha_dtype t, const char *what, const float *got,
                  const double *want, size_t count) {
    double r = ratio(t, got, want, count);
    if (r > worst_seen) worst_seen = r;
    cr_log_info("%s (%s): %s: %.3g of the contract", c->name, t == CLMHA_DTYPE_F16 ? "f16" : "bf16",
                what, r);
    cr_expect(r <= 1.0, "%s (%s): %s: %.3g of the contract", c->name,
              t == CLMHA_DTYPE_F16 ? "f16" : "bf16", what, r);
}

// The device form through @p impl (unfused: with the weights) on 16-bit buffers.
static void device_turn(clmha_context *ctx, const hcase *c, clmha_dtype t, const hdata *x,
                        const double *const want[3], clmha_impl impl) {
    clmha_attention_args a = x->args;
    a.dtype = t;
    a.impl = impl;
    clmha_tensor *in[3] = {&a.query, &a.key, &a.value};
    cl_mem b[4] = {NULL};
    for (int i = 0; i < 3; ++i) {
        b[i] = upload16(ctx, t, x->x[i], x->count[i]);
        in[i]->buffer = b[i], in[i]->offset = PAD;
    }
    if (x->x[3]) b[3] = upload16(ctx, t, x->x[3], x->count[3]);
    if (x->bmask) {
        cl_int err;
        b[3] = clCreateBuffer(clmha_context_cl_context(ctx), CL_MEM_READ_WRITE |
                              CL_MEM_COPY_HOST_PTR, x->count[3], x->bmask, &err);
        cr_assert_eq(err, CL_SUCCESS);
    }
    if (b[3]) a.attn_mask.tensor.buffer = b[3], a.attn_mask.tensor.offset = x->bmask ? 0 : PAD;
    cl_mem extra[2] = {NULL};  // the sinks and slopes, 16-bit
    if (x->sinks) {
        extra[0] = upload16(ctx, t, x->sinks, c->h), extra[1] = upload16(ctx, t, x->slopes, c->h);
        a.sinks.buffer = extra[0], a.alibi_slopes.buffer = extra[1];
        a.sinks.offset = a.alibi_slopes.offset = PAD;
    }
    bool unfused = impl == CLMHA_IMPL_UNFUSED;
    cl_mem out = upload16(ctx, t, NULL, x->nout), lse = upload16(ctx, t, NULL, x->nlse),
           w = upload16(ctx, t, NULL, x->nw);
    cl_event ev = NULL;
    clmha_status st = clmha_attention_forward(ctx, &a, out, PAD, lse, PAD, unfused ? w : NULL,
                                              PAD, 0, NULL, &ev);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: %s", c->name, clmha_context_last_error(ctx));
    cr_assert_eq(clWaitForEvents(1, &ev), CL_SUCCESS);
    clReleaseEvent(ev);
    float *got = download16(ctx, t, out, x->nout);
    check(c, t, unfused ? "output (unfused)" : "output (auto)", got, want[0], x->nout);
    free(got);
    got = download16(ctx, t, lse, x->nlse);
    check(c, t, unfused ? "lse (unfused)" : "lse (auto)", got, want[1], x->nlse);
    free(got);
    if (unfused) {
        got = download16(ctx, t, w, x->nw);
        check(c, t, "weights (unfused)", got, want[2], x->nw);
        free(got);
    }
    for (int i = 0; i < 4; ++i)
        if (b[i]) clReleaseMemObject(b[i]);
    for (int i = 0; i < 2; ++i)
        if (extra[i]) clReleaseMemObject(extra[i]);
    clReleaseMemObject(out), clReleaseMemObject(lse), clReleaseMemObject(w);
}

// The float host form: float arrays holding the dtype's values, results rounded to it.
static void host_turn(clmha_context *ctx, const hcase *c, clmha_dtype t, const hdata *x,
                      const double *const want[3]) {
    clmha_attention_args a = x->args;
    a.dtype = t;
    float *out = alloc_floats(x->nout), *lse = alloc_floats(x->nlse), *w = alloc_floats(x->nw);
    clmha_status st =
        clmha_attention_forward_host(ctx, &a, out, x->nout, lse, x->nlse, w, x->nw);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: %s", c->name, clmha_context_last_error(ctx));
    for (size_t i = 0; i < x->nout; ++i)
        cr_assert_eq(out[i], clmha__dtype_round(t, out[i]), "output %zu is not rounded", i);
    check(c, t, "output (host)", out, want[0], x->nout);
    check(c, t, "lse (host)", lse, want[1], x->nlse);
    check(c, t, "weights (host)", w, want[2], x->nw);
    free(out), free(lse), free(w);
}

Test(sdpa_16, against_the_reference, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    for (size_t k = 0; k < 2; ++k)
        for (size_t i = 0; i < sizeof cases / sizeof *cases; ++i) {
            const hcase *c = &cases[i];
            hdata x;
            hdata_make(&x, c, sixteen[k], 60 + i);
            double *want[3] = {malloc(x.nout * 8), malloc(x.nlse * 8), malloc(x.nw * 8)};
            char msg[512];
            cr_assert_eq(clmha_reference_attention(&x.args, want[0], x.nout, want[1], x.nlse,
                                                   want[2], x.nw, msg, sizeof msg),
                         CLMHA_SUCCESS, "%s", msg);
            device_turn(ctx, c, sixteen[k], &x, (const double *const *)want, CLMHA_IMPL_AUTO);
            device_turn(ctx, c, sixteen[k], &x, (const double *const *)want, CLMHA_IMPL_UNFUSED);
            host_turn(ctx, c, sixteen[k], &x, (const double *const *)want);
            for (int j = 0; j < 3; ++j) free(want[j]);
            hdata_free(&x);
        }
    cr_log_info("worst: %.3g of the contract", worst_seen);
    clmha_context_release(ctx);
}

// The backward pass's gradients of @p x (output gradient @p g) on the device (through @p impl;
// the unfused one with a float mask's gradient) and through the host form, against @p want
// (dq, dk, dv, dmask; the sinks' on the device, which takes the forward's lse for it).
static void backward_turns(clmha_context *ctx, const hcase *c, clmha_dtype t, const hdata *x,
                           const float *g, double *const want[5]) {
    static const char *const names[4] = {"dquery", "dkey", "dvalue", "dattn_mask"};
    for (int turn = 0; turn < 2; ++turn) {
        clmha_attention_args a = x->args;
        a.dtype = t;
        a.impl = turn ? CLMHA_IMPL_UNFUSED : CLMHA_IMPL_AUTO;
        clmha_tensor *in[4] = {&a.query, &a.key, &a.value, &a.attn_mask.tensor};
        cl_mem b[4] = {NULL}, gr[4] = {NULL};
        for (int i = 0; i < 4; ++i) {
            if (!x->x[i] && !(i == 3 && x->bmask)) continue;
            if (i == 3 && x->bmask) {
                cl_int err;
                b[3] = clCreateBuffer(clmha_context_cl_context(ctx),
                                      CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, x->count[3],
                                      x->bmask, &err);
                cr_assert_eq(err, CL_SUCCESS);
                in[3]->buffer = b[3], in[3]->offset = 0;
                continue;
            }
            b[i] = upload16(ctx, t, x->x[i], x->count[i]);
            in[i]->buffer = b[i], in[i]->offset = PAD;
            if (i < 3 || turn) gr[i] = upload16(ctx, t, NULL, x->count[i]);
        }
        cl_mem out = upload16(ctx, t, NULL, x->nout), dout = upload16(ctx, t, g, x->nout);
        cl_mem lse = upload16(ctx, t, NULL, x->nlse), extra[3] = {NULL};
        if (x->sinks) {  // the sinks, the slopes, the sinks' gradient
            extra[0] = upload16(ctx, t, x->sinks, c->h);
            extra[1] = upload16(ctx, t, x->slopes, c->h);
            extra[2] = upload16(ctx, t, NULL, c->h);
            a.sinks.buffer = extra[0], a.alibi_slopes.buffer = extra[1];
            a.sinks.offset = a.alibi_slopes.offset = PAD;
        }
        clmha_attention_backward_args ba = {
            .struct_size = sizeof ba, .forward = &a, .output = out, .output_offset = PAD,
            .grad_output = dout, .grad_output_offset = PAD, .grad_query = gr[0],
            .grad_key = gr[1], .grad_value = gr[2], .grad_attn_mask = gr[3],
            .grad_query_offset = PAD, .grad_key_offset = PAD, .grad_value_offset = PAD,
            .grad_attn_mask_offset = PAD, .impl = a.impl, .lse = lse, .lse_offset = PAD,
            .grad_sinks = extra[2], .grad_sinks_offset = PAD};
        cl_event ev = NULL;
        clmha_status st = clmha_attention_forward(ctx, &a, out, PAD, lse, PAD, NULL, 0, 0, NULL,
                                                  NULL);
        cr_assert_eq(st, CLMHA_SUCCESS, "%s: %s", c->name, clmha_context_last_error(ctx));
        st = clmha_attention_backward(ctx, &ba, 0, NULL, &ev);
        cr_assert_eq(st, CLMHA_SUCCESS, "%s: backward: %s", c->name,
                     clmha_context_last_error(ctx));
        cr_assert_eq(clWaitForEvents(1, &ev), CL_SUCCESS);
        clReleaseEvent(ev);
        for (int i = 0; i < 4; ++i) {
            if (!gr[i]) continue;
            float *got = download16(ctx, t, gr[i], x->count[i]);
            char what[64];
            snprintf(what, sizeof what, "%s (%s)", names[i], turn ? "unfused" : "auto");
            check(c, t, what, got, want[i], x->count[i]);
            free(got);
            clReleaseMemObject(gr[i]);
        }
        if (extra[2]) {
            float *got = download16(ctx, t, extra[2], c->h);
            check(c, t, turn ? "dsinks (unfused)" : "dsinks (auto)", got, want[4], c->h);
            free(got);
        }
        for (int i = 0; i < 4; ++i)
            if (b[i]) clReleaseMemObject(b[i]);
        for (int i = 0; i < 3; ++i)
            if (extra[i]) clReleaseMemObject(extra[i]);
        clReleaseMemObject(out), clReleaseMemObject(dout), clReleaseMemObject(lse);
    }
    clmha_attention_args a = x->args;
    a.dtype = t;
    float *got[4];
    for (int i = 0; i < 4; ++i) got[i] = alloc_floats(x->count[i] + 1);
    clmha_status st = clmha_attention_backward_host(ctx, &a, g, x->nout, got[0], got[1], got[2],
                                                    x->x[3] ? got[3] : NULL);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: backward_host: %s", c->name,
                 clmha_context_last_error(ctx));
    for (int i = 0; i < (x->x[3] ? 4 : 3); ++i) {
        char what[64];
        snprintf(what, sizeof what, "%s (host)", names[i]);
        check(c, t, what, got[i], want[i], x->count[i]);
    }
    for (int i = 0; i < 4; ++i) free(got[i]);
}

Test(sdpa_16, backward_against_the_reference, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    grading = true;
    for (size_t k = 0; k < 2; ++k)
        for (size_t i = 0; i < sizeof cases / sizeof *cases; ++i) {
            const hcase *c = &cases[i];
            clmha_dtype t = sixteen[k];
            hdata x;
            hdata_make(&x, c, t, 80 + i);
            prng r = {90 + i};
            float *g = normal_floats(&r, x.nout);
            for (size_t j = 0; j < x.nout; ++j) g[j] = clmha__dtype_round(t, g[j]);
            double *want[5];
            for (int j = 0; j < 4; ++j) want[j] = malloc((x.count[j] + 1) * 8);
            want[4] = malloc((c->h + 1) * 8);
            clmha_reference_grads grads = {.struct_size = sizeof grads, .query = want[0],
                                           .key = want[1], .value = want[2],
                                           .attn_mask = x.x[3] ? want[3] : NULL,
                                           .sinks = x.sinks ? want[4] : NULL};
            char msg[512];
            cr_assert_eq(clmha_reference_attention_backward(&x.args, g, &grads, msg, sizeof msg),
                         CLMHA_SUCCESS, "%s", msg);
            backward_turns(ctx, c, t, &x, g, want);
            for (int j = 0; j < 5; ++j) free(want[j]);
            free(g);
            hdata_free(&x);
        }
    cr_log_info("worst: %.3g of the gradient contract", worst_seen);
    clmha_context_release(ctx);
}
