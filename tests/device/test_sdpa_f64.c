// Attention as a function in float64 (clmha_attention_args::dtype CLMHA_DTYPE_F64): the device
// form on buffers of doubles at offsets counted in doubles, and the host forms
// clmha_attention_forward_host_f64() and clmha_attention_backward_host_f64(), against the
// double-precision CPU reference (clmha_reference_attention() and its backward), within 1e-12
// relative to the largest expected value: both layouts, L ≠ S, grouped-query attention,
// is_causal, boolean and float masks, ALiBi slopes and sinks given as doubles, D_v ≠ D, a
// packed call; through both forward cores and the backward. The inputs are floats widened to
// doubles, so that the reference (which reads floats) computes on exactly the device's values.
// A central finite difference checks one gradient of the float64 device calls themselves.
// Then the refusals: the host forms' dtypes, an unknown dtype, a KV cache made for float32
// calls, buffers sized in floats. Public API only.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "support.h"

// The contract: max |error| / max |expected| of every result and gradient.
#define F64_CONTRACT 1e-12

// Element offset of every device tensor in its buffer, so that an offset counted in bytes or
// floats instead of doubles shows.
#define PAD 3

// One case: sizes (hkv 0: h; dv 0: d), layout, mask (ndim 0: none), options.
typedef struct fcase {
    const char *name;
    clmha_attention_layout layout;
    size_t n, h, hkv, l, s, d, dv;
    size_t mask_ndim, mask_shape[4];
    clmha_mask_kind mask_kind;
    bool causal, slopes, sinks;
} fcase;

// A case's inputs: floats for the reference, the same values as doubles for the device.
typedef struct fdata {
    clmha_attention_args ref;  // dtype float32, data: the floats
    clmha_attention_args dev;  // dtype float64, data: the doubles (the host forms)
    float *f[5];               // q, k, v, float mask, slopes ... as floats
    double *x[5];              // ... and as doubles
    float *sinks;
    double *sinks_d;
    unsigned char *bmask;
    size_t nq, nk, nv, nm, nout, nlse, nw;
} fdata;

enum { Q, K, V, M, SLOPES };

static double *widen(const float *f, size_t count) {
    double *x = malloc((count + 1) * sizeof *x);
    cr_assert(x);
    for (size_t i = 0; i < count; ++i) x[i] = f[i];
    return x;
}

static clmha_tensor tensor_of(const fcase *c, size_t heads, size_t seq, size_t feat) {
    bool nlhd = c->layout == CLMHA_LAYOUT_NLHD;
    return (clmha_tensor){.ndim = 4,
                          .shape = {c->n, nlhd ? seq : heads, nlhd ? heads : seq, feat}};
}

static void fdata_make(fdata *x, const fcase *c, uint64_t seed) {
    prng r = {seed};
    memset(x, 0, sizeof *x);
    size_t hkv = c->hkv ? c->hkv : c->h, dv = c->dv ? c->dv : c->d;
    x->nq = c->n * c->h * c->l * c->d, x->nk = c->n * hkv * c->s * c->d;
    x->nv = c->n * hkv * c->s * dv, x->nout = c->n * c->h * c->l * dv;
    x->nlse = c->n * c->h * c->l, x->nw = x->nlse * c->s;
    size_t count[3] = {x->nq, x->nk, x->nv};
    for (int i = Q; i <= V; ++i) x->f[i] = normal_floats(&r, count[i]);
    clmha_attention_args *a = &x->ref;
    *a = (clmha_attention_args){.struct_size = sizeof *a, .layout = c->layout,
                                .is_causal = c->causal, .enable_gqa = hkv != c->h,
                                .query = tensor_of(c, c->h, c->l, c->d),
                                .key = tensor_of(c, hkv, c->s, c->d),
                                .value = tensor_of(c, hkv, c->s, dv)};
    if (c->slopes) {
        x->f[SLOPES] = alloc_floats(c->h);
        for (size_t h = 0; h < c->h; ++h) x->f[SLOPES][h] = (float)(0.5 + prng_uniform(&r));
        a->alibi = true;
        a->alibi_slopes = (clmha_tensor){.ndim = 1, .shape = {c->h}};
    }
    if (c->sinks) {
        x->sinks = normal_floats(&r, c->h);
        a->sinks = (clmha_tensor){.ndim = 1, .shape = {c->h}};
    }
    if (c->mask_ndim) {
        size_t nm = 1;
        for (size_t i = 0; i < c->mask_ndim; ++i) nm *= c->mask_shape[i];
        x->nm = nm;
        a->attn_mask.kind = c->mask_kind;
        a->attn_mask.tensor.ndim = c->mask_ndim;
        memcpy(a->attn_mask.tensor.shape, c->mask_shape, sizeof c->mask_shape);
        if (c->mask_kind == CLMHA_MASK_FLOAT) {  // no row fully masked: see the lse compare
            x->f[M] = alloc_floats(nm);
            for (size_t i = 0; i < nm; ++i)
                x->f[M][i] = (i % c->s) && prng_uniform(&r) < 0.2
                                 ? -INFINITY
                                 : (float)(prng_uniform(&r) * 3 - 2);
        } else {
            x->bmask = malloc(nm);
            cr_assert(x->bmask);
            bool attend = c->mask_kind == CLMHA_MASK_BOOL_ATTEND;
            for (size_t i = 0; i < nm; ++i)
                x->bmask[i] = ((i % c->s) == 0 || prng_uniform(&r) < 0.7) == attend;
        }
    }
    for (int i = Q; i <= SLOPES; ++i) {
        size_t n = i == M ? x->nm : i == SLOPES ? c->h : count[i];
        if (x->f[i]) x->x[i] = widen(x->f[i], n);
    }
    if (x->sinks) x->sinks_d = widen(x->sinks, c->h);
    x->dev = *a;
    x->dev.dtype = CLMHA_DTYPE_F64;
    clmha_attention_args *t[2] = {&x->ref, &x->dev};
    for (int k = 0; k < 2; ++k) {
        t[k]->query.data = k ? (const void *)x->x[Q] : x->f[Q];
        t[k]->key.data = k ? (const void *)x->x[K] : x->f[K];
        t[k]->value.data = k ? (const void *)x->x[V] : x->f[V];
        t[k]->attn_mask.tensor.data = x->bmask     ? (const void *)x->bmask
                                      : k         ? (const void *)x->x[M]
                                                  : x->f[M];
        t[k]->alibi_slopes.data = k ? (const void *)x->x[SLOPES] : x->f[SLOPES];
        t[k]->sinks.data = k ? (const void *)x->sinks_d : x->sinks;
    }
}

static void fdata_free(fdata *x) {
    for (int i = 0; i < 5; ++i) free(x->f[i]), free(x->x[i]);
    free(x->sinks), free(x->sinks_d), free(x->bmask);
}

// max |got - want| / max |want| (equal infinities agree; a NaN fails).
static double rel_err(const double *got, const double *want, size_t count) {
    double worst = 0.0, scale = 0.0;
    for (size_t i = 0; i < count; ++i)
        if (isfinite(want[i]) && fabs(want[i]) > scale) scale = fabs(want[i]);
    for (size_t i = 0; i < count; ++i) {
        if (isinf(want[i]) && got[i] == want[i]) continue;
        double e = fabs(got[i] - want[i]);
        if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
    }
    return scale > 0.0 ? worst / scale : worst;
}

static double worst_seen;

static void check(const fcase *c, const char *what, const double *got, const double *want,
                  size_t count) {
    double e = rel_err(got, want, count);
    if (e > worst_seen) worst_seen = e;
    cr_log_info("%s: %s: %.3g", c->name, what, e);
    cr_expect(e <= F64_CONTRACT, "%s: %s: relative error %.3g over %g", c->name, what, e,
              F64_CONTRACT);
}

static cl_mem upload(clmha_context *ctx, const void *data, size_t bytes, size_t pad) {
    cl_int err;
    cl_mem m = clCreateBuffer(clmha_context_cl_context(ctx), CL_MEM_READ_WRITE, bytes + pad,
                              NULL, &err);
    cr_assert_eq(err, CL_SUCCESS, "clCreateBuffer: %d", (int)err);
    if (data)
        err = clEnqueueWriteBuffer(clmha_context_cl_queue(ctx), m, CL_TRUE, pad, bytes, data, 0,
                                   NULL, NULL);
    cr_assert_eq(err, CL_SUCCESS, "clEnqueueWriteBuffer: %d", (int)err);
    return m;
}

static double *download(clmha_context *ctx, cl_mem m, size_t count) {
    double *x = malloc((count + 1) * sizeof *x);
    cr_assert(x);
    cl_int err = clEnqueueReadBuffer(clmha_context_cl_queue(ctx), m, CL_TRUE, PAD * 8,
                                     count * 8, x, 0, NULL, NULL);
    cr_assert_eq(err, CL_SUCCESS, "clEnqueueReadBuffer: %d", (int)err);
    return x;
}

// The device buffers of a case: inputs at PAD doubles (a boolean mask at PAD bytes), results
// and gradients made, every one released by devices_free().
typedef struct devices {
    clmha_attention_args a;
    cl_mem in[6], out, lse, w, dout, grad[4], gsinks;
} devices;

static void devices_make(clmha_context *ctx, const fdata *x, const double *g, devices *b) {
    memset(b, 0, sizeof *b);
    b->a = x->dev;
    clmha_tensor *t[6] = {&b->a.query, &b->a.key, &b->a.value, &b->a.attn_mask.tensor,
                          &b->a.alibi_slopes, &b->a.sinks};
    const size_t *qs = x->ref.query.shape;  // (N, H, L, D) or (N, L, H, D)
    size_t h = x->ref.layout == CLMHA_LAYOUT_NLHD ? qs[2] : qs[1];
    size_t count[6] = {x->nq, x->nk, x->nv, x->nm, h, h};
    for (int i = 0; i < 6; ++i) {
        if (!t[i]->data) continue;
        size_t es = i == M && x->bmask ? 1 : 8;
        b->in[i] = upload(ctx, t[i]->data, count[i] * es, PAD * es);
        t[i]->buffer = b->in[i], t[i]->offset = PAD;
    }
    b->out = upload(ctx, NULL, x->nout * 8, PAD * 8);
    b->lse = upload(ctx, NULL, x->nlse * 8, PAD * 8);
    b->w = upload(ctx, NULL, x->nw * 8, PAD * 8);
    b->dout = upload(ctx, g, x->nout * 8, PAD * 8);
    size_t gc[4] = {x->nq, x->nk, x->nv, x->nm};
    for (int i = 0; i < 4; ++i)
        if (gc[i]) b->grad[i] = upload(ctx, NULL, gc[i] * 8, PAD * 8);
    if (x->sinks) b->gsinks = upload(ctx, NULL, h * 8, PAD * 8);
}

static void devices_free(devices *b) {
    cl_mem all[] = {b->in[0],   b->in[1],   b->in[2],   b->in[3], b->in[4], b->in[5],
                    b->out,     b->lse,     b->w,       b->dout,  b->grad[0], b->grad[1],
                    b->grad[2], b->grad[3], b->gsinks};
    for (size_t i = 0; i < sizeof all / sizeof *all; ++i)
        if (all[i]) clReleaseMemObject(all[i]);
}

// The reference's results and gradients of a case.
typedef struct expected {
    double *out, *lse, *w, *grad[5];  // dq, dk, dv, dmask, dsinks
} expected;

static void expected_make(const fcase *c, const fdata *x, const float *g, expected *e) {
    e->out = malloc(x->nout * 8), e->lse = malloc(x->nlse * 8), e->w = malloc(x->nw * 8);
    size_t gc[5] = {x->nq, x->nk, x->nv, x->nm + 1, c->h};
    for (int i = 0; i < 5; ++i) e->grad[i] = malloc(gc[i] * 8);
    char msg[512];
    bool packed = x->ref.seq_lens != NULL;
    clmha_status st =
        clmha_reference_attention(&x->ref, e->out, x->nout, e->lse, x->nlse,
                                  packed ? NULL : e->w, packed ? 0 : x->nw, msg, sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: reference: %s", c->name, msg);
    clmha_reference_grads grads = {.struct_size = sizeof grads, .query = e->grad[0],
                                   .key = e->grad[1], .value = e->grad[2],
                                   .attn_mask = x->f[M] ? e->grad[3] : NULL,
                                   .sinks = x->sinks ? e->grad[4] : NULL};
    st = clmha_reference_attention_backward(&x->ref, g, &grads, msg, sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: reference backward: %s", c->name, msg);
}

static void expected_free(expected *e) {
    free(e->out), free(e->lse), free(e->w);
    for (int i = 0; i < 5; ++i) free(e->grad[i]);
}

// The device forward through @p impl (the unfused core: with the weights), then its backward
// (from the log-sum-exp rows with the fused forward, the unfused core's recomputation else).
static void device_turn(clmha_context *ctx, const fcase *c, const fdata *x, const expected *e,
                        devices *b, clmha_impl impl) {
    bool unfused = impl == CLMHA_IMPL_UNFUSED;
    b->a.impl = impl;
    cl_event done = NULL;
    clmha_status st = clmha_attention_forward(ctx, &b->a, b->out, PAD, b->lse, PAD,
                                              unfused ? b->w : NULL, PAD, 0, NULL, &done);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s (%s): forward: %s", c->name, clmha_impl_name(impl),
                 clmha_context_last_error(ctx));
    cr_assert_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    char what[64];
    const char *name = clmha_impl_name(impl);
    double *got = download(ctx, b->out, x->nout);
    snprintf(what, sizeof what, "output (%s)", name);
    check(c, what, got, e->out, x->nout);
    free(got);
    got = download(ctx, b->lse, x->nlse);
    snprintf(what, sizeof what, "lse (%s)", name);
    check(c, what, got, e->lse, x->nlse);
    free(got);
    if (unfused) {
        got = download(ctx, b->w, x->nw);
        check(c, "weights (unfused)", got, e->w, x->nw);
        free(got);
    }
    clmha_attention_backward_args ba = {
        .struct_size = sizeof ba, .forward = &b->a, .output = b->out, .output_offset = PAD,
        .lse = unfused && !x->sinks ? NULL : b->lse, .lse_offset = PAD,
        .grad_output = b->dout, .grad_output_offset = PAD, .grad_query = b->grad[0],
        .grad_key = b->grad[1], .grad_value = b->grad[2], .grad_query_offset = PAD,
        .grad_key_offset = PAD, .grad_value_offset = PAD,
        .grad_attn_mask = unfused && x->f[M] ? b->grad[3] : NULL, .grad_attn_mask_offset = PAD,
        .grad_sinks = b->gsinks, .grad_sinks_offset = PAD};
    st = clmha_attention_backward(ctx, &ba, 0, NULL, &done);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s (%s): backward: %s", c->name, name,
                 clmha_context_last_error(ctx));
    cr_assert_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    static const char *const gw[5] = {"dquery", "dkey", "dvalue", "dattn_mask", "dsinks"};
    size_t gc[5] = {x->nq, x->nk, x->nv, x->nm, c->h};
    cl_mem gb[5] = {b->grad[0], b->grad[1], b->grad[2], ba.grad_attn_mask, b->gsinks};
    for (int i = 0; i < 5; ++i) {
        if (!gb[i]) continue;
        got = download(ctx, gb[i], gc[i]);
        snprintf(what, sizeof what, "%s (%s)", gw[i], name);
        check(c, what, got, e->grad[i], gc[i]);
        free(got);
    }
}

// The host forms: the forward's results and the gradients, as doubles.
static void host_turn(clmha_context *ctx, const fcase *c, const fdata *x, const expected *e,
                      const double *g) {
    bool packed = x->ref.seq_lens != NULL;
    double *out = malloc(x->nout * 8), *lse = malloc(x->nlse * 8), *w = malloc(x->nw * 8);
    clmha_status st = clmha_attention_forward_host_f64(
        ctx, &x->dev, out, x->nout, lse, x->nlse, packed ? NULL : w, packed ? 0 : x->nw);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: forward_host_f64: %s", c->name,
                 clmha_context_last_error(ctx));
    check(c, "output (host)", out, e->out, x->nout);
    check(c, "lse (host)", lse, e->lse, x->nlse);
    if (!packed) check(c, "weights (host)", w, e->w, x->nw);
    free(out), free(lse), free(w);
    size_t gc[4] = {x->nq, x->nk, x->nv, x->nm};
    double *got[4];
    for (int i = 0; i < 4; ++i) got[i] = malloc((gc[i] + 1) * 8);
    st = clmha_attention_backward_host_f64(ctx, &x->dev, g, x->nout, got[0], got[1], got[2],
                                           x->f[M] ? got[3] : NULL);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: backward_host_f64: %s", c->name,
                 clmha_context_last_error(ctx));
    static const char *const gw[4] = {"dquery (host)", "dkey (host)", "dvalue (host)",
                                      "dattn_mask (host)"};
    for (int i = 0; i < (x->f[M] ? 4 : 3); ++i) check(c, gw[i], got[i], e->grad[i], gc[i]);
    for (int i = 0; i < 4; ++i) free(got[i]);
}

static void run_case(clmha_context *ctx, const fcase *c, uint64_t seed) {
    fdata x;
    fdata_make(&x, c, seed);
    prng r = {seed + 100};
    float *gf = normal_floats(&r, x.nout);
    double *g = widen(gf, x.nout);
    expected e;
    expected_make(c, &x, gf, &e);
    devices b;
    devices_make(ctx, &x, g, &b);
    device_turn(ctx, c, &x, &e, &b, CLMHA_IMPL_AUTO);
    device_turn(ctx, c, &x, &e, &b, CLMHA_IMPL_UNFUSED);
    devices_free(&b);
    host_turn(ctx, c, &x, &e, g);
    expected_free(&e);
    free(gf), free(g);
    fdata_free(&x);
}

static const fcase cases[] = {
    {"nhld plain", CLMHA_LAYOUT_NHLD, 2, 3, 0, 5, 7, 8, 0, 0, {0}, 0, false, false, false},
    {"nlhd gqa causal", CLMHA_LAYOUT_NLHD, 2, 4, 2, 6, 6, 16, 0, 0, {0}, 0, true, false, false},
    {"nhld float mask (N,H,L,S)", CLMHA_LAYOUT_NHLD, 2, 2, 0, 4, 9, 8, 0, 4, {2, 2, 4, 9},
     CLMHA_MASK_FLOAT, false, false, false},
    {"nlhd float mask (L,S) gqa", CLMHA_LAYOUT_NLHD, 1, 4, 1, 5, 3, 4, 0, 2, {5, 3},
     CLMHA_MASK_FLOAT, false, false, false},
    {"nhld bool mask (N,1,1,S)", CLMHA_LAYOUT_NHLD, 2, 2, 0, 3, 11, 8, 0, 4, {2, 1, 1, 11},
     CLMHA_MASK_BOOL_ATTEND, false, false, false},
    {"nlhd ignore mask (H,L,S)", CLMHA_LAYOUT_NLHD, 1, 3, 0, 4, 5, 8, 0, 3, {3, 4, 5},
     CLMHA_MASK_BOOL_IGNORE, false, false, false},
    {"nhld alibi slopes, sinks", CLMHA_LAYOUT_NHLD, 1, 2, 0, 6, 6, 8, 0, 0, {0}, 0, true, true,
     true},
    {"nhld D_v 12 > D 8", CLMHA_LAYOUT_NHLD, 1, 2, 0, 4, 5, 8, 12, 0, {0}, 0, false, false,
     false},
    {"nlhd D_v 4 < D 8 gqa", CLMHA_LAYOUT_NLHD, 2, 4, 2, 3, 4, 8, 4, 0, {0}, 0, true, false,
     false},
};

Test(sdpa_f64, against_the_reference, .timeout = 600) {
    clmha_context *ctx = fp64_context_or_skip();
    for (size_t i = 0; i < sizeof cases / sizeof *cases; ++i) run_case(ctx, &cases[i], 40 + i);
    cr_log_info("worst relative error of %zu cases: %.3g", sizeof cases / sizeof *cases,
                worst_seen);
    clmha_context_release(ctx);
}

// A packed call (seq_lens) through the host forms: its rows at offsets counted in doubles.
Test(sdpa_f64, packed, .timeout = 300) {
    clmha_context *ctx = fp64_context_or_skip();
    static const size_t lens[3] = {3, 0, 5}, kv_lens[3] = {4, 2, 5};
    fcase c = {"packed", CLMHA_LAYOUT_NLHD, 1, 2, 0, 8, 11, 8, 0, 0, {0}, 0, true, false,
               false};
    fdata x;
    fdata_make(&x, &c, 7);
    clmha_attention_args *t[2] = {&x.ref, &x.dev};
    for (int k = 0; k < 2; ++k) {
        t[k]->seq_lens = lens, t[k]->kv_seq_lens = kv_lens, t[k]->num_seqs = 3;
        for (clmha_tensor *y = &t[k]->query; y; y = y == &t[k]->query ? &t[k]->key
                                                   : y == &t[k]->key  ? &t[k]->value
                                                                      : NULL) {
            y->ndim = 3;  // (T, H, D)
            memmove(y->shape, y->shape + 1, 3 * sizeof *y->shape);
        }
    }
    prng r = {8};
    float *gf = normal_floats(&r, x.nout);
    double *g = widen(gf, x.nout);
    expected e;
    expected_make(&c, &x, gf, &e);
    host_turn(ctx, &c, &x, &e, g);
    expected_free(&e);
    free(gf), free(g);
    fdata_free(&x);
    clmha_context_release(ctx);
}

// sum(g ⊙ output) of the float64 host forward at query @p q.
static double loss(clmha_context *ctx, const fdata *x, const double *q, const double *g) {
    clmha_attention_args a = x->dev;
    a.query.data = q;
    double *out = malloc(x->nout * 8), sum = 0.0;
    cr_assert_eq(clmha_attention_forward_host_f64(ctx, &a, out, x->nout, NULL, 0, NULL, 0),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    for (size_t i = 0; i < x->nout; ++i) sum += g[i] * out[i];
    free(out);
    return sum;
}

// The float64 backward's query gradient against central differences of the float64 forward:
// in float64 a step of 1e-5 leaves an error of about 1e-10 (truncation h², rounding 1e-16/h).
Test(sdpa_f64, finite_differences, .timeout = 300) {
    clmha_context *ctx = fp64_context_or_skip();
    fcase c = {"fd", CLMHA_LAYOUT_NHLD, 1, 2, 1, 4, 5, 8, 0, 2, {4, 5}, CLMHA_MASK_FLOAT, false,
               false, false};
    fdata x;
    fdata_make(&x, &c, 11);
    prng r = {12};
    float *gf = normal_floats(&r, x.nout);
    double *g = widen(gf, x.nout), *dq = malloc(x.nq * 8), *q = widen(x.f[Q], x.nq);
    cr_assert_eq(clmha_attention_backward_host_f64(ctx, &x.dev, g, x.nout, dq, NULL, NULL, NULL),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    double step = 1e-5, worst = 0.0;
    for (size_t i = 0; i < x.nq; i += 3) {
        double keep = q[i];
        q[i] = keep + step;
        double up = loss(ctx, &x, q, g);
        q[i] = keep - step;
        double down = loss(ctx, &x, q, g);
        q[i] = keep;
        double e = fabs((up - down) / (2 * step) - dq[i]);
        if (e > worst) worst = e;
    }
    cr_log_info("finite differences: max |error| %.3g", worst);
    cr_expect(worst < 1e-8, "dquery against central differences: %.3g", worst);
    free(gf), free(g), free(dq), free(q);
    fdata_free(&x);
    clmha_context_release(ctx);
}

static void refused(clmha_context *ctx, clmha_status st, clmha_status want, const char *text) {
    cr_expect_eq(st, want, "want %s, got %s: %s", clmha_status_string(want),
                 clmha_status_string(st), clmha_context_last_error(ctx));
    cr_expect(strstr(clmha_context_last_error(ctx), text), "message \"%s\" lacks \"%s\"",
              clmha_context_last_error(ctx), text);
}

Test(sdpa_f64, refusals, .timeout = 300) {
    clmha_context *ctx = fp64_context_or_skip();
    fcase c = {"r", CLMHA_LAYOUT_NHLD, 1, 2, 0, 3, 4, 8, 0, 0, {0}, 0, false, false, false};
    fdata x;
    fdata_make(&x, &c, 3);
    float fout[64];
    double dout[64], g[64] = {0};
    // The host forms take the dtype of their arrays only.
    refused(ctx, clmha_attention_forward_host(ctx, &x.dev, fout, x.nout, NULL, 0, NULL, 0),
            CLMHA_INVALID_ARGUMENT, "float64 calls: its _f64 form");
    refused(ctx, clmha_attention_forward_host_f64(ctx, &x.ref, dout, x.nout, NULL, 0, NULL, 0),
            CLMHA_INVALID_ARGUMENT, "takes double arrays");
    refused(ctx,
            clmha_attention_backward_host(ctx, &x.dev, fout, x.nout, fout, NULL, NULL, NULL),
            CLMHA_INVALID_ARGUMENT, "float64 calls: its _f64 form");
    refused(ctx, clmha_attention_backward_host_f64(ctx, &x.ref, g, x.nout, dout, NULL, NULL,
                                                   NULL),
            CLMHA_INVALID_ARGUMENT, "takes double arrays");
    // An unknown dtype (16-bit calls: test_sdpa_16.c).
    clmha_attention_args a = x.dev;
    a.dtype = (clmha_dtype)9;
    refused(ctx, clmha_attention_output_counts(ctx, &a, NULL, NULL, NULL),
            CLMHA_INVALID_ARGUMENT, "dtype is 9");
    // A KV cache made for float32 calls (clmha_kv_cache_options::dtype 0): a float64 call
    // takes one made for float64 (test_sdpa_kv.c).
    clmha_kv_cache *cache = NULL;
    cr_assert_eq(clmha_kv_cache_create_for(&cache, ctx, 1, 2, 8, 16), CLMHA_SUCCESS);
    a = x.dev;
    a.kv_cache = cache;
    refused(ctx, clmha_attention_forward_host_f64(ctx, &a, dout, x.nout, NULL, 0, NULL, 0),
            CLMHA_INVALID_ARGUMENT, "kv_cache was made for float32");
    clmha_kv_cache_release(cache);
    // Device buffers sized for floats are too small for doubles; nothing is written.
    double big[64];
    for (size_t i = 0; i < 64; ++i) big[i] = 1.0;
    a = x.dev;
    cl_mem q = upload(ctx, x.x[Q], x.nq * 4, 0), k = upload(ctx, x.x[K], x.nk * 8, 0),
           v = upload(ctx, x.x[V], x.nv * 8, 0), out = upload(ctx, big, x.nout * 8, 0);
    a.query.buffer = q, a.key.buffer = k, a.value.buffer = v;
    cl_event ev = (cl_event)&big;
    refused(ctx, clmha_attention_forward(ctx, &a, out, 0, NULL, 0, NULL, 0, 0, NULL, &ev),
            CLMHA_INVALID_ARGUMENT, "query");
    cr_expect_null(ev);
    clReleaseMemObject(q), clReleaseMemObject(k), clReleaseMemObject(v);
    clReleaseMemObject(out);
    fdata_free(&x);
    clmha_context_release(ctx);
}
