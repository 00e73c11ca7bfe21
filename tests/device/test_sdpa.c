// Attention as a function (clmha_attention_forward, _forward_host, _output_counts) against the
// double-precision CPU reference (clmha_reference_attention): both layouts, batched and
// unbatched, L ≠ S, is_causal, a custom scale, grouped-query attention, dropout, every
// attn_mask shape and kind the function takes (every (a, b, c, S) broadcast to (N, H, L, S):
// a 1 or N, b 1 or H, c 1 or L, and their shorter forms), each through the fused and the
// unfused core, the log-sum-exp rows and the weights; the device form with the tensors at
// offsets in their buffers. Then the refusals: their statuses and messages, nothing written, *event NULL.
// The reference's own numbers are checked against a hand-computed case.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "support.h"

#define TOLERANCE 1e-4

// One case: sizes (H_kv 0: H), layout, mask (rank 0: none), options.
typedef struct scase {
    const char *name;
    clmha_attention_layout layout;
    bool batched;
    size_t n, h, hkv, l, s, d, dv;  // dv 0: d
    size_t mask_ndim, mask_shape[4];
    clmha_mask_kind mask_kind;
    bool causal, gqa, dead_row;  // dead_row: the mask forbids every key of query row 1
    double scale;
    float dropout;
    bool window;  // a sliding window (wl, wr; -1 unbounded)
    int64_t wl, wr;
    double softcap;  // soft-capping (0: off)
    bool alibi, slopes;  // ALiBi; slopes: given (random in [0.5, 1.5)), else geometric
    bool sinks;          // attention sinks ~ N(0, 1) (their gradient from the device form)
} scase;

// Whether the device keeps the fused core from a call the test asks it for: a driver's loop
// limit (Mesa's llvmpipe, clmha_impl) makes the call CLMHA_UNSUPPORTED, with every core's
// reason in the message. Such a turn is skipped, said on the log.
static bool fused_kept_off(clmha_context *ctx, const scase *c, clmha_status st) {
    if (st != CLMHA_UNSUPPORTED || !strstr(clmha_context_last_error(ctx), "loop limit"))
        return false;
    cr_log_info("%s: fused core skipped on this device: %s", c->name,
                clmha_context_last_error(ctx));
    return true;
}

// The host arrays of a case and its argument struct.
typedef struct sdata {
    clmha_attention_args args;
    float *q, *k, *v, *fmask, *slopes, *sinks;
    unsigned char *bmask;
    size_t nq, nk, nv, nm, nout, nlse, nw;
} sdata;

static size_t prod(const size_t *x, size_t k) {
    size_t p = 1;
    for (size_t i = 0; i < k; ++i) p *= x[i];
    return p;
}

// A tensor's shape in the case's layout: (N,) heads, seq, feat or (N,) seq, heads, feat.
static clmha_tensor tensor_of(const scase *c, size_t heads, size_t seq, size_t feat,
                              const float *data) {
    clmha_tensor t = {.ndim = c->batched ? 4 : 3, .data = data};
    size_t *s = t.shape;
    if (c->batched) *s++ = c->n;
    bool nlhd = c->layout == CLMHA_LAYOUT_NLHD;
    s[0] = nlhd ? seq : heads;
    s[1] = nlhd ? heads : seq;
    s[2] = feat;
    return t;
}

static void sdata_make(sdata *x, const scase *c, uint64_t seed) {
    prng r = {seed};
    size_t n = c->batched ? c->n : 1, hkv = c->hkv ? c->hkv : c->h;
    memset(x, 0, sizeof *x);
    size_t dv = c->dv ? c->dv : c->d;
    x->nq = n * c->h * c->l * c->d, x->nk = n * hkv * c->s * c->d, x->nv = n * hkv * c->s * dv;
    x->nout = n * c->h * c->l * dv, x->nlse = n * c->h * c->l, x->nw = x->nlse * c->s;
    x->q = normal_floats(&r, x->nq);
    x->k = normal_floats(&r, x->nk);
    x->v = normal_floats(&r, x->nv);
    x->args = (clmha_attention_args){.struct_size = sizeof x->args, .layout = c->layout,
                                     .is_causal = c->causal, .scale = c->scale,
                                     .dropout_p = c->dropout, .enable_gqa = c->gqa,
                                     .rng = {.seed = 0x5eed0000u + seed, .offset = 3},
                                     .window = c->window, .window_left = c->wl,
                                     .window_right = c->wr, .softcap = c->softcap,
                                     .alibi = c->alibi};
    if (c->slopes) {
        x->slopes = alloc_floats(c->h);
        for (size_t h = 0; h < c->h; ++h) x->slopes[h] = (float)(0.5 + prng_uniform(&r));
        x->args.alibi_slopes = (clmha_tensor){.ndim = 1, .shape = {c->h}, .data = x->slopes};
    }
    if (c->sinks) {
        x->sinks = normal_floats(&r, c->h);
        x->args.sinks = (clmha_tensor){.ndim = 1, .shape = {c->h}, .data = x->sinks};
    }
    x->args.query = tensor_of(c, c->h, c->l, c->d, x->q);
    x->args.key = tensor_of(c, hkv, c->s, c->d, x->k);
    x->args.value = tensor_of(c, hkv, c->s, dv, x->v);
    if (!c->mask_ndim) return;
    x->nm = prod(c->mask_shape, c->mask_ndim);
    clmha_mask *m = &x->args.attn_mask;
    m->kind = c->mask_kind;
    m->tensor.ndim = c->mask_ndim;
    memcpy(m->tensor.shape, c->mask_shape, sizeof c->mask_shape);
    size_t s = c->s;
    if (c->mask_kind == CLMHA_MASK_FLOAT) {
        x->fmask = alloc_floats(x->nm);
        for (size_t i = 0; i < x->nm; ++i)
            x->fmask[i] = prng_uniform(&r) < 0.2 ? -INFINITY : (float)(prng_uniform(&r) * 3 - 2);
        if (c->dead_row)
            for (size_t j = 0; j < s; ++j) x->fmask[s + j] = -INFINITY;  // row 1 of plane 0
        m->tensor.data = x->fmask;
        return;
    }
    x->bmask = malloc(x->nm);
    cr_assert(x->bmask);
    bool attend = c->mask_kind == CLMHA_MASK_BOOL_ATTEND;
    for (size_t i = 0; i < x->nm; ++i) x->bmask[i] = (prng_uniform(&r) < 0.7) == attend;
    if (c->dead_row)
        for (size_t j = 0; j < s; ++j) x->bmask[s + j] = !attend;
    m->tensor.data = x->bmask;
}

static void sdata_free(sdata *x) {
    free(x->q), free(x->k), free(x->v), free(x->fmask), free(x->bmask), free(x->slopes);
    free(x->sinks);
}

// Largest difference of two log-sum-exp arrays: equal infinities agree.
static double lse_err(const float *got, const double *want, size_t count) {
    double worst = 0.0;
    for (size_t i = 0; i < count; ++i) {
        if (isinf(want[i]) && got[i] == (float)want[i]) continue;
        double e = fabs((double)got[i] - want[i]);
        if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
    }
    return worst;
}

static cl_mem upload_at(clmha_context *ctx, const void *data, size_t bytes, size_t pad) {
    cl_int err;
    cl_mem m = clCreateBuffer(clmha_context_cl_context(ctx), CL_MEM_READ_WRITE, bytes + pad,
                              NULL, &err);
    cr_assert_eq(err, CL_SUCCESS, "clCreateBuffer: %d", (int)err);
    err = clEnqueueWriteBuffer(clmha_context_cl_queue(ctx), m, CL_TRUE, pad, bytes, data, 0, NULL,
                               NULL);
    cr_assert_eq(err, CL_SUCCESS, "clEnqueueWriteBuffer: %d", (int)err);
    return m;
}

static void read_at(clmha_context *ctx, cl_mem m, size_t pad, void *out, size_t bytes) {
    cl_int err = clEnqueueReadBuffer(clmha_context_cl_queue(ctx), m, CL_TRUE, pad, bytes, out, 0,
                                     NULL, NULL);
    cr_assert_eq(err, CL_SUCCESS, "clEnqueueReadBuffer: %d", (int)err);
}

// The device form: every tensor at an offset (of 3 elements) in its own buffer.
static void device_forward(clmha_context *ctx, const sdata *x, clmha_impl impl, bool lse,
                           float *out, float *lse_out) {
    enum { PAD = 3 };
    clmha_attention_args a = x->args;
    a.impl = impl;
    cl_mem bq = upload_at(ctx, x->q, x->nq * 4, PAD * 4);
    cl_mem bk = upload_at(ctx, x->k, x->nk * 4, PAD * 4);
    cl_mem bv = upload_at(ctx, x->v, x->nv * 4, PAD * 4);
    a.query.buffer = bq, a.key.buffer = bk, a.value.buffer = bv;
    a.query.offset = a.key.offset = a.value.offset = PAD;
    cl_mem bm = NULL;
    if (x->nm) {
        size_t elem = x->fmask ? 4 : 1;
        bm = upload_at(ctx, x->fmask ? (const void *)x->fmask : x->bmask, x->nm * elem,
                       PAD * elem);
        a.attn_mask.tensor.buffer = bm, a.attn_mask.tensor.offset = PAD;
    }
    cl_mem bs = x->slopes ? upload_at(ctx, x->slopes, a.alibi_slopes.shape[0] * 4, PAD * 4)
                          : NULL;
    if (bs) a.alibi_slopes.buffer = bs, a.alibi_slopes.offset = PAD;
    cl_mem bsk = x->sinks ? upload_at(ctx, x->sinks, a.sinks.shape[0] * 4, PAD * 4) : NULL;
    if (bsk) a.sinks.buffer = bsk, a.sinks.offset = PAD;
    cl_mem bo = upload_at(ctx, out, x->nout * 4, PAD * 4);
    cl_mem bl = lse ? upload_at(ctx, lse_out, x->nlse * 4, PAD * 4) : NULL;
    cl_event done = NULL;
    clmha_status st = clmha_attention_forward(ctx, &a, bo, PAD, bl, PAD, NULL, 0, 0, NULL, &done);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_attention_forward: %s (%s)",
                 clmha_context_last_error(ctx), clmha_status_string(st));
    cr_assert(done != NULL, "no event");
    cr_assert_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    read_at(ctx, bo, PAD * 4, out, x->nout * 4);
    if (lse) read_at(ctx, bl, PAD * 4, lse_out, x->nlse * 4);
    clReleaseMemObject(bq), clReleaseMemObject(bk), clReleaseMemObject(bv);
    clReleaseMemObject(bo);
    if (bm) clReleaseMemObject(bm);
    if (bs) clReleaseMemObject(bs);
    if (bsk) clReleaseMemObject(bsk);
    if (bl) clReleaseMemObject(bl);
}

static size_t cases_run, checks_run;
static double worst_out, worst_lse, worst_w, worst_any;

static void note(const char *name, const char *what, double err) {
    fprintf(stderr, "sdpa: %-34s %-22s max|err| %.2e\n", name, what, err);
    cr_expect(err <= TOLERANCE, "%s, %s: max abs error %g", name, what, err);
    if (!(err <= worst_any)) worst_any = err;
    ++checks_run;
}

// The reference's output for @p x with its broadcast mask written out in full, (N, H, L, S)
// (unbatched (H, L, S)), each element taken by the test's own index arithmetic: must equal
// @p want, the reference's output on the broadcast mask, exactly (the same terms in the same
// order). Checks the reference's broadcasting, which the device's is checked against.
static void check_expanded_mask(const scase *c, const sdata *x, const double *want) {
    size_t n = c->batched ? c->n : 1, full = n * c->h * c->l * c->s;
    if (!x->nm || x->nm == full) return;
    size_t shape[4] = {1, 1, 1, 1};
    for (size_t i = 0; i < c->mask_ndim; ++i) shape[4 - c->mask_ndim + i] = c->mask_shape[i];
    size_t elem = x->fmask ? 4 : 1;
    unsigned char *m = malloc(full * elem);
    cr_assert(m);
    const unsigned char *src = x->fmask ? (const unsigned char *)x->fmask : x->bmask;
    size_t e = 0;
    for (size_t b = 0; b < n; ++b)
        for (size_t h = 0; h < c->h; ++h)
            for (size_t i = 0; i < c->l; ++i)
                for (size_t j = 0; j < c->s; ++j, ++e) {
                    size_t k = (b % shape[0]) * shape[1] + h % shape[1];
                    k = (k * shape[2] + i % shape[2]) * shape[3] + j;
                    memcpy(m + e * elem, src + k * elem, elem);
                }
    clmha_attention_args a = x->args;
    a.attn_mask.tensor.ndim = c->batched ? 4 : 3;
    size_t full_shape[4] = {n, c->h, c->l, c->s};
    memcpy(a.attn_mask.tensor.shape, full_shape + (c->batched ? 0 : 1),
           a.attn_mask.tensor.ndim * sizeof(size_t));
    a.attn_mask.tensor.data = m;
    double *got = malloc(x->nout * sizeof *got);
    char msg[512];
    clmha_status st = clmha_reference_attention(&a, got, x->nout, NULL, 0, NULL, 0, msg,
                                                sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: reference, expanded mask: %s", c->name, msg);
    for (size_t k = 0; k < x->nout; ++k)
        cr_expect(got[k] == want[k] || (isnan(got[k]) && isnan(want[k])),
                  "%s: reference output[%zu] %.17g with the mask broadcast, %.17g expanded",
                  c->name, k, want[k], got[k]);
    free(got);
    free(m);
}

// Runs @p c: the reference; the host form through each core (output, lse from the fused core,
// weights from the unfused core); the device form at offsets; fully masked rows give zeros.
static void check_case(clmha_context *ctx, const scase *c) {
    sdata x;
    sdata_make(&x, c, 7 + cases_run);
    double *want = malloc(x.nout * sizeof *want), *want_lse = malloc(x.nlse * sizeof *want_lse);
    double *want_w = malloc(x.nw * sizeof *want_w);
    char msg[512];
    clmha_status st = clmha_reference_attention(&x.args, want, x.nout, want_lse, x.nlse, want_w,
                                                x.nw, msg, sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: reference: %s", c->name, msg);
    check_expanded_mask(c, &x, want);
    float *out = alloc_floats(x.nout), *lse = alloc_floats(x.nlse), *w = alloc_floats(x.nw);
    static const clmha_impl impls[2] = {CLMHA_IMPL_FUSED, CLMHA_IMPL_UNFUSED};
    bool fused_off = false;  // the device keeps the fused core (the lse) from this call
    for (int i = 0; i < 2; ++i) {
        clmha_attention_args a = x.args;
        a.impl = impls[i];
        bool fused = impls[i] == CLMHA_IMPL_FUSED;
        for (size_t k = 0; k < x.nout; ++k) out[k] = NAN;
        for (size_t k = 0; k < x.nlse; ++k) lse[k] = NAN;
        // Both cores write the log-sum-exp rows; the unfused one also the weights.
        st = clmha_attention_forward_host(ctx, &a, out, x.nout, lse, x.nlse, fused ? NULL : w,
                                          fused ? 0 : x.nw);
        if (fused && fused_kept_off(ctx, c, st)) {
            fused_off = true;
            continue;
        }
        cr_assert_eq(st, CLMHA_SUCCESS, "%s (%s): %s (%s)", c->name, clmha_impl_name(a.impl),
                     clmha_context_last_error(ctx), clmha_status_string(st));
        double e = max_abs_err(out, want, x.nout);
        note(c->name, fused ? "output (fused)" : "output (unfused)", e);
        if (e > worst_out) worst_out = e;
        double e1 = lse_err(lse, want_lse, x.nlse);
        note(c->name, fused ? "lse (fused)" : "lse (unfused)", e1);
        if (e1 > worst_lse) worst_lse = e1;
        if (!fused) {
            double e2 = max_abs_err(w, want_w, x.nw);
            note(c->name, "weights (unfused)", e2);
            if (e2 > worst_w) worst_w = e2;
        }
        if (c->dead_row)  // query row 1 of (batch 0, head 0) sees no key: zeros
            for (size_t f = 0, dv = c->dv ? c->dv : c->d; f < dv; ++f) {
                size_t k = c->layout == CLMHA_LAYOUT_NLHD ? c->h * dv + f : dv + f;
                cr_expect(out[k] == 0.0f, "%s: masked row output[%zu] = %g", c->name, k,
                          (double)out[k]);
            }
    }
    for (size_t k = 0; k < x.nout; ++k) out[k] = NAN;
    for (size_t k = 0; k < x.nlse; ++k) lse[k] = NAN;
    device_forward(ctx, &x, CLMHA_IMPL_AUTO, !fused_off, out, lse);
    note(c->name, "output (device, AUTO)", max_abs_err(out, want, x.nout));
    if (!fused_off) note(c->name, "lse (device, AUTO)", lse_err(lse, want_lse, x.nlse));
    ++cases_run;
    free(out), free(lse), free(w), free(want), free(want_lse), free(want_w);
    sdata_free(&x);
}

#define NHLD CLMHA_LAYOUT_NHLD
#define CASE(name_, layout_, batched_) .name = name_, .layout = layout_, .batched = batched_
#define MASK(ndim_, kind_, ...) .mask_ndim = ndim_, .mask_kind = kind_, .mask_shape = {__VA_ARGS__}
#define SZ(n_, h_, kv_, l_, s_, d_) .n = n_, .h = h_, .hkv = kv_, .l = l_, .s = s_, .d = d_
#define NLHD CLMHA_LAYOUT_NLHD
#define BA CLMHA_MASK_BOOL_ATTEND
#define BI CLMHA_MASK_BOOL_IGNORE
#define FL CLMHA_MASK_FLOAT

static const scase shapes[] = {
    {CASE("nhld", NHLD, true), SZ(2, 3, 0, 5, 7, 8)},
    {CASE("nlhd", NLHD, true), SZ(2, 3, 0, 5, 7, 8)},
    {CASE("nhld unbatched", NHLD, false), SZ(1, 4, 0, 6, 6, 16)},
    {CASE("nlhd unbatched", NLHD, false), SZ(1, 4, 0, 6, 9, 16)},
    {CASE("nhld causal L7 S5", NHLD, true), SZ(2, 2, 0, 7, 5, 8), .causal = true},
    {CASE("nlhd causal L5 S9", NLHD, true), SZ(1, 3, 0, 5, 9, 32), .causal = true},
    {CASE("nhld scale 0.3", NHLD, true), SZ(2, 2, 0, 4, 6, 8), .scale = 0.3},
    {CASE("nlhd scale 2.5 causal", NLHD, true), SZ(2, 2, 0, 6, 6, 8), .scale = 2.5,
     .causal = true},
    {CASE("nhld gqa 6/2", NHLD, true), SZ(2, 6, 2, 5, 7, 8), .gqa = true},
    {CASE("nlhd mqa 4/1 causal", NLHD, true), SZ(2, 4, 1, 6, 6, 16), .gqa = true,
     .causal = true},
    {CASE("nhld gqa unbatched 4/2", NHLD, false), SZ(1, 4, 2, 3, 8, 8), .gqa = true},
    {CASE("nhld dropout 0.3", NHLD, true), SZ(2, 3, 0, 5, 7, 8), .dropout = 0.3f},
    {CASE("nlhd dropout 0.2 gqa", NLHD, true), SZ(2, 4, 2, 6, 5, 8), .gqa = true,
     .dropout = 0.2f},
    {CASE("nhld edges L33 S65 D64 causal", NHLD, true), SZ(2, 2, 0, 33, 65, 64),
     .causal = true},
    {CASE("nlhd edges L17 S40 D40", NLHD, true), SZ(1, 3, 0, 17, 40, 40)},
    {CASE("nhld D 8 D_v 4", NHLD, true), SZ(2, 3, 0, 5, 7, 8), .dv = 4},
    {CASE("nlhd D 12 D_v 20 causal", NLHD, true), SZ(2, 2, 0, 6, 9, 12), .dv = 20,
     .causal = true},
    {CASE("nhld D 16 D_v 8 gqa unbatched", NHLD, false), SZ(1, 4, 2, 5, 7, 16), .dv = 8,
     .gqa = true},
};

// Masks: N 2, H 3, L 5, S 7 unless said.
static const scase masks[] = {
    {CASE("mask (L, S) bool", NHLD, true), SZ(2, 3, 0, 5, 7, 8), MASK(2, BA, 5, 7),
     .dead_row = true},
    {CASE("mask (1, L, S) float", NLHD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(3, FL, 1, 5, 7)},
    {CASE("mask (1, 1, L, S) bool", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, BA, 1, 1, 5, 7)},
    {CASE("mask (N, 1, L, S) bool", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, BA, 2, 1, 5, 7)},
    {CASE("mask (N, 1, L, S) float", NLHD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, FL, 2, 1, 5, 7), .dead_row = true},
    {CASE("mask (N, H, L, S) bool", NLHD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, BA, 2, 3, 5, 7), .dead_row = true},
    {CASE("mask (N, H, L, S) float", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, FL, 2, 3, 5, 7)},
    {CASE("mask (N, 1, 1, S) bool", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, BA, 2, 1, 1, 7)},
    {CASE("mask (N, 1, 1, S) float", NLHD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, FL, 2, 1, 1, 7)},
    {CASE("mask (N, 1, L, S) ignore", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, BI, 2, 1, 5, 7)},
    {CASE("mask (1, H, L, S) N 1", NHLD, true), SZ(1, 3, 0, 5, 7, 8),
     MASK(4, FL, 1, 3, 5, 7)},
    {CASE("mask (1, H, L, S) N 2 bool", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, BA, 1, 3, 5, 7), .dead_row = true},
    {CASE("mask (1, H, L, S) N 3 float", NLHD, true), SZ(3, 2, 0, 6, 9, 8),
     MASK(4, FL, 1, 2, 6, 9)},
    {CASE("mask (H, L, S) N 2 float gqa", NHLD, true), SZ(2, 4, 2, 5, 7, 8),
     MASK(3, FL, 4, 5, 7), .gqa = true, .dead_row = true},
    {CASE("mask (H, L, S) unbatched", NLHD, false), SZ(1, 3, 0, 5, 7, 8),
     MASK(3, BA, 3, 5, 7)},
    {CASE("mask (S) unbatched", NHLD, false), SZ(1, 3, 0, 5, 7, 8), MASK(1, BA, 7)},
    {CASE("mask (L, S) gqa dropout", NHLD, true), SZ(2, 4, 2, 5, 7, 8),
     MASK(2, FL, 5, 7), .gqa = true, .dropout = 0.25f},
    {CASE("mask (N, H, L, S) scale", NLHD, true), SZ(2, 2, 0, 9, 4, 8),
     MASK(4, BA, 2, 2, 9, 4), .scale = 0.7},
    // A size-1 L: one row of keys per (item, head), per head, or for every query row.
    {CASE("mask (N, H, 1, S) bool", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, BA, 2, 3, 1, 7)},
    {CASE("mask (N, H, 1, S) float", NLHD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, FL, 2, 3, 1, 7)},
    {CASE("mask (N, H, 1, S) ignore gqa", NHLD, true), SZ(2, 4, 2, 6, 9, 8),
     MASK(4, BI, 2, 4, 1, 9), .gqa = true},
    {CASE("mask (1, 1, 1, S) N 2 bool", NLHD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, BA, 1, 1, 1, 7)},
    {CASE("mask (1, 1, 1, S) N 3 float", NHLD, true), SZ(3, 2, 0, 6, 9, 8),
     MASK(4, FL, 1, 1, 1, 9)},
    {CASE("mask (S) N 2 bool", NHLD, true), SZ(2, 3, 0, 5, 7, 8), MASK(1, BA, 7)},
    {CASE("mask (S) N 2 float dropout", NLHD, true), SZ(2, 3, 0, 5, 7, 8), MASK(1, FL, 7),
     .dropout = 0.2f},
    {CASE("mask (1, S) N 2 ignore", NHLD, true), SZ(2, 3, 0, 5, 7, 8), MASK(2, BI, 1, 7)},
    {CASE("mask (1, H, 1, S) N 2 float", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, FL, 1, 3, 1, 7)},
    {CASE("mask (1, H, 1, S) N 2 bool", NLHD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, BA, 1, 3, 1, 7)},
    {CASE("mask (H, 1, S) N 2 ignore", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(3, BI, 3, 1, 7)},
    {CASE("mask (H, 1, S) unbatched float", NHLD, false), SZ(1, 3, 0, 5, 7, 8),
     MASK(3, FL, 3, 1, 7)},
    {CASE("mask (H, 1, S) unbatched bool", NLHD, false), SZ(1, 3, 0, 5, 7, 8),
     MASK(3, BA, 3, 1, 7)},
    {CASE("mask (N, 1, L, S) as (N, 1, 1, S) L 1", NHLD, true), SZ(2, 3, 0, 1, 7, 8),
     MASK(4, FL, 2, 1, 1, 7)},
    {CASE("mask (N, H, 1, S) edges L33 S65 D64", NHLD, true), SZ(2, 2, 0, 33, 65, 64),
     MASK(4, FL, 2, 2, 1, 65)},
    {CASE("mask (1, H, 1, S) edges L17 S40 D40", NLHD, true), SZ(3, 2, 0, 17, 40, 40),
     MASK(4, BA, 1, 2, 1, 40)},
};

Test(sdpa, shapes_layouts_causal_scale_gqa_dropout, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; ++i) check_case(ctx, &shapes[i]);
    fprintf(stderr, "sdpa: %zu cases, %zu checks; worst output %.2e, lse %.2e, weights %.2e\n",
            cases_run, checks_run, worst_out, worst_lse, worst_w);
    clmha_context_release(ctx);
}

Test(sdpa, every_mask_shape_and_kind, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    for (size_t i = 0; i < sizeof masks / sizeof masks[0]; ++i) check_case(ctx, &masks[i]);
    fprintf(stderr, "sdpa: %zu cases, %zu checks; worst output %.2e, lse %.2e, weights %.2e\n",
            cases_run, checks_run, worst_out, worst_lse, worst_w);
    clmha_context_release(ctx);
}

// More (H, H_kv, D) than the context keeps bare layers for (CLMHA__ATTENTION_CACHE_MAX, 8):
// ten head dimensions, then the first ones again (made anew after the least recently used
// went, or found again), each against the reference with both cores.
Test(sdpa, more_shapes_than_the_cache_keeps, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    static const size_t dims[] = {2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 2, 12, 3};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; ++i) {
        char name[32];
        snprintf(name, sizeof name, "cache_d%zu_%zu", dims[i], i);
        scase c = {.name = name, .layout = CLMHA_LAYOUT_NHLD, .batched = true, .n = 1, .h = 2,
                   .l = 3, .s = 5, .d = dims[i], .causal = i % 2 == 1};
        check_case(ctx, &c);
    }
    clmha_context_release(ctx);
}

// The reference on a case small enough to write out: one head, L 1, S 2, D 1, q 1, k (0, 2),
// v (1, 3), scale 0.5: scores (0, 1), weights (1, e)/(1 + e), output (1 + 3e)/(1 + e),
// lse log(1 + e).
Test(sdpa, reference_by_hand) {
    float q[1] = {1}, k[2] = {0, 2}, v[2] = {1, 3};
    clmha_attention_args a = {.struct_size = sizeof a, .scale = 0.5,
                              .query = {.ndim = 3, .shape = {1, 1, 1}, .data = q},
                              .key = {.ndim = 3, .shape = {1, 2, 1}, .data = k},
                              .value = {.ndim = 3, .shape = {1, 2, 1}, .data = v}};
    double out, lse, w[2];
    cr_assert_eq(clmha_reference_attention(&a, &out, 1, &lse, 1, w, 2, NULL, 0), CLMHA_SUCCESS);
    double e = exp(1.0);
    cr_expect(fabs(out - (1 + 3 * e) / (1 + e)) < 1e-15, "output %.17g", out);
    cr_expect(fabs(lse - log(1 + e)) < 1e-15, "lse %.17g", lse);
    cr_expect(fabs(w[1] - e / (1 + e)) < 1e-15, "weight %.17g", w[1]);
}

// ---- refusals -----------------------------------------------------------------------------------

typedef struct small {
    float q[2 * 3 * 4 * 8], k[2 * 3 * 5 * 8], v[2 * 3 * 5 * 8], out[2 * 3 * 4 * 8];
    clmha_attention_args a;
} small;

// N 2, H 3, L 4, S 5, D 8 in NHLD, host data.
static void small_make(small *s) {
    for (size_t i = 0; i < sizeof s->q / 4; ++i) s->q[i] = (float)i * 0.01f;
    for (size_t i = 0; i < sizeof s->k / 4; ++i) s->k[i] = s->v[i] = (float)i * -0.02f;
    for (size_t i = 0; i < sizeof s->out / 4; ++i) s->out[i] = 42.0f;
    s->a = (clmha_attention_args){.struct_size = sizeof s->a,
                                  .query = {.ndim = 4, .shape = {2, 3, 4, 8}, .data = s->q},
                                  .key = {.ndim = 4, .shape = {2, 3, 5, 8}, .data = s->k},
                                  .value = {.ndim = 4, .shape = {2, 3, 5, 8}, .data = s->v}};
}

// The host call of @p s->a fails with @p want, a message holding @p text, and writes nothing.
static void refused(clmha_context *ctx, small *s, clmha_status want, const char *text) {
    clmha_status st = clmha_attention_forward_host(ctx, &s->a, s->out, 2 * 3 * 4 * 8, NULL, 0,
                                                   NULL, 0);
    const char *msg = clmha_context_last_error(ctx);
    cr_expect_eq(st, want, "%s: got %s (%s)", text, clmha_status_string(st), msg);
    cr_expect(strstr(msg, text) != NULL, "message \"%s\" lacks \"%s\"", msg, text);
    for (size_t i = 0; i < sizeof s->out / 4; ++i)
        cr_assert(s->out[i] == 42.0f, "%s: output written", text);
    char ref[512] = "";
    double out[2 * 3 * 4 * 8];
    clmha_status rst = clmha_reference_attention(&s->a, out, 2 * 3 * 4 * 8, NULL, 0, NULL, 0,
                                                 ref, sizeof ref);
    if (want != CLMHA_UNSUPPORTED)  // the reference refuses the same shapes the same way
        cr_expect_eq(rst, want, "reference, %s: got %s (%s)", text, clmha_status_string(rst),
                     ref);
}

Test(sdpa, refusals, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    small s;
    small_make(&s);
    cr_assert_eq(clmha_attention_forward_host(ctx, &s.a, s.out, 2 * 3 * 4 * 8, NULL, 0, NULL, 0),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_expect(s.out[0] != 42.0f, "the valid call wrote its output");
    small_make(&s);
    s.a.key.shape[3] = 4;
    refused(ctx, &s, CLMHA_SHAPE_MISMATCH, "key is (2, 3, 5, 4)");
    small_make(&s);
    s.a.value.shape[2] = 6;
    refused(ctx, &s, CLMHA_SHAPE_MISMATCH, "value is (2, 3, 6, 8)");
    small_make(&s);
    s.a.key.shape[1] = s.a.value.shape[1] = 1;
    refused(ctx, &s, CLMHA_SHAPE_MISMATCH, "set enable_gqa");
    s.a.enable_gqa = true;
    s.a.key.shape[1] = s.a.value.shape[1] = 2;
    refused(ctx, &s, CLMHA_SHAPE_MISMATCH, "must divide the query's 3");
    small_make(&s);
    s.a.query.ndim = 2;
    refused(ctx, &s, CLMHA_SHAPE_MISMATCH, "query has 2 dimensions");
    small_make(&s);
    s.a.key.ndim = 3;
    refused(ctx, &s, CLMHA_SHAPE_MISMATCH, "but the query is 4-D");
    small_make(&s);
    s.a.query.shape[2] = 0;
    refused(ctx, &s, CLMHA_SHAPE_MISMATCH, "every size must be positive");
    unsigned char m[2 * 3 * 4 * 6] = {1};
    small_make(&s);
    s.a.attn_mask = (clmha_mask){.kind = CLMHA_MASK_BOOL_ATTEND,
                                 .tensor = {.ndim = 4, .shape = {2, 3, 4, 6}, .data = m}};
    refused(ctx, &s, CLMHA_INVALID_MASK, "attn_mask is (2, 3, 4, 6)");
    s.a.attn_mask.tensor.shape[0] = 1, s.a.attn_mask.tensor.shape[1] = 2;
    s.a.attn_mask.tensor.shape[3] = 5;
    refused(ctx, &s, CLMHA_INVALID_MASK, "attn_mask is (1, 2, 4, 5)");  // 2 heads of 3
    s.a.attn_mask.tensor.shape[1] = 3, s.a.attn_mask.tensor.shape[2] = 2;
    refused(ctx, &s, CLMHA_INVALID_MASK, "attn_mask is (1, 3, 2, 5)");  // 2 rows of 4
    s.a.attn_mask.tensor.shape[2] = 1, s.a.attn_mask.tensor.shape[3] = 1;
    refused(ctx, &s, CLMHA_INVALID_MASK, "expand it to S");  // (1, 3, 1, 1): over the keys
    s.a.attn_mask.tensor.ndim = 5;
    refused(ctx, &s, CLMHA_INVALID_MASK, "unbatched at most 3-D");  // 5-D
    s.a.attn_mask.tensor.ndim = 4;
    s.a.attn_mask.tensor.shape[2] = 4, s.a.attn_mask.tensor.shape[3] = 5;
    s.a.attn_mask.tensor.shape[1] = 3;
    s.a.attn_mask.tensor.shape[0] = 2;
    s.a.attn_mask.per_batch = true;
    refused(ctx, &s, CLMHA_INVALID_MASK, "per_batch");
    s.a.attn_mask.per_batch = false;
    s.a.attn_mask.kind = (clmha_mask_kind)9;
    refused(ctx, &s, CLMHA_INVALID_MASK, "unknown kind 9");
    s.a.attn_mask.kind = CLMHA_MASK_BOOL_ATTEND;
    s.a.is_causal = true;
    refused(ctx, &s, CLMHA_INVALID_ARGUMENT, "attn_mask and is_causal are both set");
    small_make(&s);
    s.a.scale = NAN;
    refused(ctx, &s, CLMHA_INVALID_ARGUMENT, "scale is nan");
    small_make(&s);
    s.a.dropout_p = 1.0f;
    refused(ctx, &s, CLMHA_INVALID_ARGUMENT, "dropout_p (1) must be in [0, 1)");
    small_make(&s);
    s.a.layout = (clmha_attention_layout)7;
    refused(ctx, &s, CLMHA_INVALID_ARGUMENT, "layout is 7");
    small_make(&s);
    s.a.impl = (clmha_impl)5;
    refused(ctx, &s, CLMHA_INVALID_ARGUMENT, "impl is 5");
    small_make(&s);
    s.a.struct_size = 0;
    refused(ctx, &s, CLMHA_INVALID_ARGUMENT, "struct_size is 0");
    small_make(&s);
    s.a.key.data = NULL;
    refused(ctx, &s, CLMHA_INVALID_ARGUMENT, "key.data is NULL");
    small_make(&s);
    float lse[24], w[2 * 3 * 4 * 5];
    s.a.impl = CLMHA_IMPL_FUSED;  // the fused core returns no weights
    cr_expect_eq(clmha_attention_forward_host(ctx, &s.a, s.out, 2 * 3 * 4 * 8, lse, 24, w, 120),
                 CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "does not return weights"), "%s",
              clmha_context_last_error(ctx));
    s.a.impl = CLMHA_IMPL_AUTO;
    cr_expect_eq(clmha_attention_forward_host(ctx, &s.a, s.out, 2 * 3 * 4 * 8 - 1, NULL, 0,
                                              NULL, 0),
                 CLMHA_SHAPE_MISMATCH);
    cr_expect(strstr(clmha_context_last_error(ctx), "output_count is 191, the output has 192"));
    cr_expect_eq(clmha_attention_forward_host(ctx, &s.a, s.out, 192, lse, 23, NULL, 0),
                 CLMHA_SHAPE_MISMATCH);
    cr_expect_eq(clmha_attention_forward_host(ctx, NULL, s.out, 192, NULL, 0, NULL, 0),
                 CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "args is NULL"));
    cr_expect_eq(clmha_attention_forward_host(NULL, &s.a, s.out, 192, NULL, 0, NULL, 0),
                 CLMHA_INVALID_ARGUMENT);
    for (size_t i = 0; i < sizeof s.out / 4; ++i) cr_assert(s.out[i] == 42.0f, "output written");
    size_t oc = 0, lc = 0, wc = 0;
    cr_expect_eq(clmha_attention_output_counts(ctx, &s.a, &oc, &lc, &wc), CLMHA_SUCCESS);
    cr_expect(oc == 192 && lc == 24 && wc == 120, "counts %zu %zu %zu", oc, lc, wc);
    s.a.key.shape[3] = 4;
    cr_expect_eq(clmha_attention_output_counts(ctx, &s.a, &oc, NULL, NULL),
                 CLMHA_SHAPE_MISMATCH);
    clmha_context_release(ctx);
}

// The device form refuses bad buffers before it enqueues anything: *event NULL, the output
// buffer unchanged.
Test(sdpa, device_refusals, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    small s;
    small_make(&s);
    cl_mem q = upload_at(ctx, s.q, sizeof s.q, 0), k = upload_at(ctx, s.k, sizeof s.k, 0);
    cl_mem v = upload_at(ctx, s.v, sizeof s.v, 0), o = upload_at(ctx, s.out, sizeof s.out, 0);
    s.a.query.buffer = q, s.a.key.buffer = k, s.a.value.buffer = v;
    cl_event ev = (cl_event)(uintptr_t)1;
    clmha_status st = clmha_attention_forward(ctx, &s.a, o, 1, NULL, 0, NULL, 0, 0, NULL, &ev);
    cr_expect_eq(st, CLMHA_INVALID_ARGUMENT, "%s", clmha_context_last_error(ctx));
    cr_expect(strstr(clmha_context_last_error(ctx), "output"), "%s",
              clmha_context_last_error(ctx));
    cr_expect(ev == NULL, "*event set on a refused call");
    st = clmha_attention_forward(ctx, &s.a, q, 0, NULL, 0, NULL, 0, 0, NULL, &ev);
    cr_expect_eq(st, CLMHA_INVALID_ARGUMENT, "output aliasing the query: %s",
                 clmha_context_last_error(ctx));
    s.a.key.buffer = NULL;
    st = clmha_attention_forward(ctx, &s.a, o, 0, NULL, 0, NULL, 0, 0, NULL, &ev);
    cr_expect_eq(st, CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "key buffer is NULL"), "%s",
              clmha_context_last_error(ctx));
    s.a.key.buffer = k;
    st = clmha_attention_forward(ctx, &s.a, o, 0, NULL, 0, NULL, 0, 1, NULL, &ev);
    cr_expect_eq(st, CLMHA_INVALID_ARGUMENT, "a wait list of 1 and NULL");
    float back[2 * 3 * 4 * 8];
    read_at(ctx, o, 0, back, sizeof back);
    for (size_t i = 0; i < sizeof back / 4; ++i) cr_assert(back[i] == 42.0f, "output written");
    // And the valid call: its event completes, the output is the reference's.
    st = clmha_attention_forward(ctx, &s.a, o, 0, NULL, 0, NULL, 0, 0, NULL, &ev);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_assert(ev != NULL);
    cr_assert_eq(clWaitForEvents(1, &ev), CL_SUCCESS);
    clReleaseEvent(ev);
    read_at(ctx, o, 0, back, sizeof back);
    double want[2 * 3 * 4 * 8];
    cr_assert_eq(clmha_reference_attention(&s.a, want, 192, NULL, 0, NULL, 0, NULL, 0),
                 CLMHA_SUCCESS);
    note("device zero-copy", "output", max_abs_err(back, want, 192));
    clReleaseMemObject(q), clReleaseMemObject(k), clReleaseMemObject(v), clReleaseMemObject(o);
    clmha_context_release(ctx);
}

// ---- the backward pass --------------------------------------------------------------------------

// The forward call of @p x on the device at element offset @p pad of fresh buffers, then its
// backward through @p impl (the fused backward gets the forward's lse, the unfused one none):
// the gradients against the reference's.
static void check_backward_once(clmha_context *ctx, const scase *c, const sdata *x,
                                const float *g, double *const want[5], clmha_impl impl,
                                size_t pad) {
    clmha_attention_args a = x->args;
    size_t count[3] = {x->nq, x->nk, x->nv};
    float *in[3] = {x->q, x->k, x->v};
    cl_mem b[3], grad[3];
    clmha_tensor *t[3] = {&a.query, &a.key, &a.value};
    for (int i = 0; i < 3; ++i) {
        b[i] = upload_at(ctx, in[i], count[i] * 4, pad * 4);
        t[i]->buffer = b[i], t[i]->offset = pad;
        float *nan = alloc_floats(count[i]);
        for (size_t k = 0; k < count[i]; ++k) nan[k] = NAN;
        grad[i] = upload_at(ctx, nan, count[i] * 4, pad * 4);
        free(nan);
    }
    cl_mem bm = NULL;
    if (x->nm) {
        size_t elem = x->fmask ? 4 : 1;
        bm = upload_at(ctx, x->fmask ? (const void *)x->fmask : x->bmask, x->nm * elem,
                       pad * elem);
        a.attn_mask.tensor.buffer = bm, a.attn_mask.tensor.offset = pad;
    }
    cl_mem bs = x->slopes ? upload_at(ctx, x->slopes, a.alibi_slopes.shape[0] * 4, pad * 4)
                          : NULL;
    if (bs) a.alibi_slopes.buffer = bs, a.alibi_slopes.offset = pad;
    cl_mem bsk = x->sinks ? upload_at(ctx, x->sinks, a.sinks.shape[0] * 4, pad * 4) : NULL;
    if (bsk) a.sinks.buffer = bsk, a.sinks.offset = pad;
    cl_mem gsk = NULL;  // the sinks' gradient (needs the forward's lse)
    if (bsk) {
        float nan[64];
        for (size_t k = 0; k < 64; ++k) nan[k] = NAN;
        gsk = upload_at(ctx, nan, a.sinks.shape[0] * 4, pad * 4);
    }
    float *zeros = calloc(x->nout + 1, sizeof(float));
    cl_mem out = upload_at(ctx, zeros, x->nout * 4, pad * 4);
    cl_mem lse = upload_at(ctx, zeros, x->nlse * 4, pad * 4);
    cl_mem dout = upload_at(ctx, g, x->nout * 4, pad * 4);
    free(zeros);
    bool fused = impl == CLMHA_IMPL_FUSED;
    cl_mem gm = NULL;  // a float mask's gradient, of the unfused core
    if (x->fmask && !fused) {
        float *nan = alloc_floats(x->nm);
        for (size_t k = 0; k < x->nm; ++k) nan[k] = NAN;
        gm = upload_at(ctx, nan, x->nm * 4, pad * 4);
        free(nan);
    }
    bool with_lse = fused || x->sinks;
    clmha_status st = clmha_attention_forward(ctx, &a, out, pad, with_lse ? lse : NULL, pad,
                                              NULL, 0, 0, NULL, NULL);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: forward: %s", c->name, clmha_context_last_error(ctx));
    clmha_attention_backward_args ba = {
        .struct_size = sizeof ba, .forward = &a, .output = out, .output_offset = pad,
        .lse = with_lse ? lse : NULL, .lse_offset = pad, .grad_output = dout,
        .grad_output_offset = pad, .grad_query = grad[0], .grad_key = grad[1],
        .grad_value = grad[2], .grad_query_offset = pad, .grad_key_offset = pad,
        .grad_value_offset = pad, .impl = impl, .grad_attn_mask = gm,
        .grad_attn_mask_offset = pad, .grad_sinks = gsk, .grad_sinks_offset = pad};
    cl_event done = NULL;
    st = clmha_attention_backward(ctx, &ba, 0, NULL, &done);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s (%s): backward: %s", c->name, clmha_impl_name(impl),
                 clmha_context_last_error(ctx));
    cr_assert_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    static const char *const what[3] = {"dquery", "dkey", "dvalue"};
    for (int i = 0; i < 3; ++i) {
        float *got = alloc_floats(count[i]);
        read_at(ctx, grad[i], pad * 4, got, count[i] * 4);
        char label[64];
        snprintf(label, sizeof label, "%s (%s%s)", what[i], fused ? "fused" : "unfused",
                 pad ? ", offsets" : "");
        note(c->name, label, max_abs_err(got, want[i], count[i]));
        free(got);
        clReleaseMemObject(b[i]), clReleaseMemObject(grad[i]);
    }
    if (gm) {
        float *got = alloc_floats(x->nm);
        read_at(ctx, gm, pad * 4, got, x->nm * 4);
        note(c->name, "dattn_mask (unfused)", max_abs_err(got, want[3], x->nm));
        free(got);
        clReleaseMemObject(gm);
    }
    if (gsk) {
        float got[64];
        read_at(ctx, gsk, pad * 4, got, a.sinks.shape[0] * 4);
        note(c->name, fused ? "dsinks (fused)" : "dsinks (unfused)",
             max_abs_err(got, want[4], a.sinks.shape[0]));
        clReleaseMemObject(gsk);
    }
    clReleaseMemObject(out), clReleaseMemObject(lse), clReleaseMemObject(dout);
    if (bm) clReleaseMemObject(bm);
    if (bs) clReleaseMemObject(bs);
    if (bsk) clReleaseMemObject(bsk);
}

static void check_backward(clmha_context *ctx, const scase *c) {
    sdata x;
    sdata_make(&x, c, 21 + cases_run);
    prng r = {5 + cases_run};
    float *g = normal_floats(&r, x.nout);
    double *want[5] = {malloc(x.nq * sizeof(double)), malloc(x.nk * sizeof(double)),
                       malloc(x.nv * sizeof(double)), malloc((x.nm + 1) * sizeof(double)),
                       malloc(c->h * sizeof(double))};
    clmha_reference_grads grads = {.struct_size = sizeof grads, .query = want[0],
                                   .key = want[1], .value = want[2],
                                   .attn_mask = x.fmask ? want[3] : NULL,
                                   .sinks = x.sinks ? want[4] : NULL};
    char msg[512];
    cr_assert_eq(clmha_reference_attention_backward(&x.args, g, &grads, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s: %s", c->name, msg);
    // The fused turn where the device runs the fused core at this shape (a host forward with
    // the log-sum-exp rows asks it).
    clmha_attention_args probe = x.args;
    probe.impl = CLMHA_IMPL_FUSED;
    float *pout = alloc_floats(x.nout), *plse = alloc_floats(x.nlse);
    clmha_status pst =
        clmha_attention_forward_host(ctx, &probe, pout, x.nout, plse, x.nlse, NULL, 0);
    free(pout);
    free(plse);
    if (!fused_kept_off(ctx, c, pst)) {
        cr_assert_eq(pst, CLMHA_SUCCESS, "%s: fused forward: %s", c->name,
                     clmha_context_last_error(ctx));
        check_backward_once(ctx, c, &x, g, want, CLMHA_IMPL_FUSED, 3);
    }
    check_backward_once(ctx, c, &x, g, want, CLMHA_IMPL_UNFUSED, 0);
    // The host form.
    size_t count[4] = {x.nq, x.nk, x.nv, x.nm};
    float *got[4];
    for (int i = 0; i < 4; ++i) {
        got[i] = alloc_floats(count[i]);
        for (size_t k = 0; k < count[i]; ++k) got[i][k] = NAN;
    }
    clmha_status st = clmha_attention_backward_host(ctx, &x.args, g, x.nout, got[0], got[1],
                                                    got[2], x.fmask ? got[3] : NULL);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: backward_host: %s", c->name,
                 clmha_context_last_error(ctx));
    static const char *const what[4] = {"dquery (host)", "dkey (host)", "dvalue (host)",
                                        "dattn_mask (host)"};
    for (int i = 0; i < (x.fmask ? 4 : 3); ++i)
        note(c->name, what[i], max_abs_err(got[i], want[i], count[i]));
    for (int i = 0; i < 4; ++i) free(got[i]);
    ++cases_run;
    for (int i = 0; i < 5; ++i) free(want[i]);
    free(g);
    sdata_free(&x);
}

static const scase backward_cases[] = {
    {CASE("bw nhld", NHLD, true), SZ(2, 3, 0, 5, 7, 8)},
    {CASE("bw nlhd causal L7 S5", NLHD, true), SZ(2, 2, 0, 7, 5, 8), .causal = true},
    {CASE("bw nhld unbatched scale", NHLD, false), SZ(1, 4, 0, 6, 9, 16), .scale = 0.4},
    {CASE("bw nlhd dropout", NLHD, true), SZ(2, 3, 0, 5, 7, 8), .dropout = 0.25f},
    {CASE("bw mask (N, 1, L, S) float", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, FL, 2, 1, 5, 7), .dead_row = true},
    {CASE("bw mask (N, 1, 1, S) bool", NLHD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, BA, 2, 1, 1, 7)},
    {CASE("bw edges L33 S65 D64 causal", NHLD, true), SZ(1, 2, 0, 33, 65, 64),
     .causal = true},
    {CASE("bw nhld gqa 6/2", NHLD, true), SZ(2, 6, 2, 5, 7, 8), .gqa = true},
    {CASE("bw nlhd mqa 4/1 causal", NLHD, true), SZ(2, 4, 1, 6, 6, 16), .gqa = true,
     .causal = true},
    {CASE("bw gqa 4/2 unbatched mask dropout", NHLD, false), SZ(1, 4, 2, 5, 7, 8),
     MASK(2, FL, 5, 7), .gqa = true, .dropout = 0.2f},
    {CASE("bw nlhd gqa 6/3 mask (N, H, L, S)", NLHD, true), SZ(2, 6, 3, 4, 9, 8),
     MASK(4, BA, 2, 6, 4, 9), .gqa = true},
    {CASE("bw mask (L, S) float", NLHD, true), SZ(2, 3, 0, 5, 7, 8), MASK(2, FL, 5, 7)},
    {CASE("bw nhld D 8 D_v 4 mask float", NHLD, true), SZ(2, 3, 0, 5, 7, 8), .dv = 4,
     MASK(4, FL, 2, 1, 5, 7)},
    {CASE("bw nlhd D 12 D_v 20 gqa causal", NLHD, true), SZ(2, 4, 2, 6, 6, 12), .dv = 20,
     .gqa = true, .causal = true},
    {CASE("bw unbatched D 16 D_v 8 dropout", NHLD, false), SZ(1, 3, 0, 5, 7, 16), .dv = 8,
     .dropout = 0.2f},
    {CASE("bw mask (1, H, L, S) float N 2", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, FL, 1, 3, 5, 7), .dead_row = true},
    {CASE("bw mask (H, L, S) float N 3 gqa", NLHD, true), SZ(3, 4, 2, 4, 6, 8),
     MASK(3, FL, 4, 4, 6), .gqa = true},
    {CASE("bw mask (N, H, L, S) float", NHLD, true), SZ(2, 2, 0, 4, 6, 8),
     MASK(4, FL, 2, 2, 4, 6), .dropout = 0.3f},
    {CASE("bw mask (N, 1, 1, S) float", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, FL, 2, 1, 1, 7)},
    {CASE("bw mask (N, H, 1, S) float", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, FL, 2, 3, 1, 7)},
    {CASE("bw mask (N, H, 1, S) float gqa nlhd", NLHD, true), SZ(2, 4, 2, 6, 9, 8),
     MASK(4, FL, 2, 4, 1, 9), .gqa = true},
    {CASE("bw mask (1, 1, 1, S) float N 2", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, FL, 1, 1, 1, 7)},
    {CASE("bw mask (S) float N 3 dropout", NLHD, true), SZ(3, 2, 0, 6, 5, 8),
     MASK(1, FL, 5), .dropout = 0.2f},
    {CASE("bw mask (1, H, 1, S) float N 2", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, FL, 1, 3, 1, 7)},
    {CASE("bw mask (H, 1, S) float unbatched", NLHD, false), SZ(1, 3, 0, 5, 7, 8),
     MASK(3, FL, 3, 1, 7)},
    {CASE("bw mask (N, H, 1, S) bool", NHLD, true), SZ(2, 3, 0, 5, 7, 8),
     MASK(4, BA, 2, 3, 1, 7)},
};

Test(sdpa, backward_against_the_reference, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    for (size_t i = 0; i < sizeof backward_cases / sizeof backward_cases[0]; ++i)
        check_backward(ctx, &backward_cases[i]);
    fprintf(stderr, "sdpa: backward %zu cases, %zu checks; worst %.2e\n", cases_run, checks_run,
            worst_any);
    clmha_context_release(ctx);
}

// Sliding windows (left, right; -1 unbounded), top-left positions (query row i at position
// i), with is_causal, masks, GQA, L != S, D_v != D, dropout, unbatched: forward and backward
// through both cores against the reference.
#define WIN(l_, r_) .window = true, .wl = l_, .wr = r_
static const scase windows[] = {
    {CASE("window (2, 0)", NHLD, true), SZ(2, 3, 0, 7, 7, 8), WIN(2, 0)},
    {CASE("window (0, 0) L5 S9", NLHD, true), SZ(1, 2, 0, 5, 9, 8), WIN(0, 0)},
    {CASE("window (3, 1) causal", NHLD, true), SZ(2, 2, 0, 8, 6, 16), WIN(3, 1), .causal = true},
    {CASE("window (-1, 2) mask float", NLHD, true), SZ(2, 3, 0, 6, 8, 8),
     MASK(4, FL, 2, 1, 6, 8), WIN(-1, 2)},
    {CASE("window (1, -1) gqa bool", NHLD, true), SZ(2, 4, 2, 6, 6, 8),
     MASK(2, BA, 6, 6), WIN(1, -1), .gqa = true},
    {CASE("window (2, 2) dv dropout", NHLD, true), SZ(1, 2, 0, 9, 9, 8), WIN(2, 2), .dv = 4,
     .dropout = 0.2f},
    {CASE("window (0, 3) unbatched", NLHD, false), SZ(1, 3, 0, 4, 10, 8), WIN(0, 3)},
};

Test(sdpa, sliding_window, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    for (size_t i = 0; i < sizeof windows / sizeof windows[0]; ++i) {
        check_case(ctx, &windows[i]);
        check_backward(ctx, &windows[i]);
    }
    fprintf(stderr, "sdpa: window %zu cases, %zu checks; worst output %.2e, backward %.2e\n",
            cases_run, checks_run, worst_out, worst_any);
    clmha_context_release(ctx);
}

// Soft-capping and ALiBi (geometric and given slopes) through both cores, forward (output,
// lse, weights) and backward (dq, dk, dv, a float mask's gradient), host and device forms.
static const scase variants[] = {
    {CASE("softcap 0.7", NHLD, true), SZ(2, 3, 0, 7, 7, 8), .softcap = 0.7},
    {CASE("alibi geometric L5 S9", NLHD, true), SZ(1, 2, 0, 5, 9, 8), .alibi = true},
    {CASE("softcap 2 alibi given causal", NHLD, true), SZ(2, 2, 0, 8, 6, 16), .softcap = 2.0,
     .alibi = true, .slopes = true, .causal = true},
    {CASE("alibi given mask float", NLHD, true), SZ(2, 3, 0, 6, 8, 8), MASK(4, FL, 2, 1, 6, 8),
     .alibi = true, .slopes = true},
    {CASE("softcap 1 gqa bool window (1, -1)", NHLD, true), SZ(2, 4, 2, 6, 6, 8),
     MASK(2, BA, 6, 6), WIN(1, -1), .gqa = true, .softcap = 1.0},
    {CASE("softcap 0.5 alibi dv dropout scale", NHLD, true), SZ(1, 5, 0, 9, 9, 8), .dv = 4,
     .dropout = 0.2f, .softcap = 0.5, .alibi = true, .scale = 0.7},
    {CASE("softcap 3 alibi unbatched L70 S90", NLHD, false), SZ(1, 3, 0, 70, 90, 8),
     .softcap = 3.0, .alibi = true, .slopes = true},
    {CASE("sinks", NHLD, true), SZ(2, 3, 0, 7, 7, 8), .sinks = true},
    {CASE("sinks causal gqa mask float dead row", NLHD, true), SZ(2, 4, 2, 6, 6, 8),
     MASK(4, FL, 2, 1, 6, 6), .gqa = true, .sinks = true, .dead_row = true},
    {CASE("sinks softcap alibi dropout dv", NHLD, true), SZ(1, 2, 0, 9, 9, 8), .dv = 4,
     .dropout = 0.2f, .softcap = 1.0, .alibi = true, .sinks = true},
    {CASE("sinks window unbatched L70 S90", NLHD, false), SZ(1, 3, 0, 70, 90, 8), WIN(5, 0),
     .sinks = true},
};

Test(sdpa, score_variants, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    for (size_t i = 0; i < sizeof variants / sizeof variants[0]; ++i) {
        check_case(ctx, &variants[i]);
        check_backward(ctx, &variants[i]);
    }
    fprintf(stderr, "sdpa: variants %zu cases, %zu checks; worst output %.2e, backward %.2e\n",
            cases_run, checks_run, worst_out, worst_any);
    clmha_context_release(ctx);
}

// Bad soft-capping values and ALiBi slopes, for the function and for a layer; the
// alibi_slopes parameter exists only on an ALiBi layer, of H values; clmha_alibi_slopes().
Test(sdpa, variant_refusals, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    small s;
    small_make(&s);
    const double bad[] = {-1.0, NAN, INFINITY};
    for (size_t i = 0; i < 3; ++i) {
        s.a.softcap = bad[i];
        refused(ctx, &s, CLMHA_INVALID_ARGUMENT, "args.softcap");
    }
    s.a.softcap = 0.0;
    float slopes[3] = {0.5f, 0.25f, 0.125f};
    s.a.alibi_slopes = (clmha_tensor){.ndim = 1, .shape = {3}, .data = slopes};
    refused(ctx, &s, CLMHA_SHAPE_MISMATCH, "alibi_slopes is given");
    s.a.alibi = true, s.a.alibi_slopes.shape[0] = 2;
    refused(ctx, &s, CLMHA_SHAPE_MISMATCH, "alibi_slopes must be (H) = (3)");
    s.a.alibi_slopes.ndim = 2, s.a.alibi_slopes.shape[0] = 3, s.a.alibi_slopes.shape[1] = 1;
    refused(ctx, &s, CLMHA_SHAPE_MISMATCH, "alibi_slopes must be (H) = (3)");
    s.a.alibi = false, s.a.alibi_slopes.ndim = 0;
    float sinks[4] = {0};
    s.a.sinks = (clmha_tensor){.ndim = 1, .shape = {4}, .data = sinks};
    refused(ctx, &s, CLMHA_SHAPE_MISMATCH, "sinks must be (H) = (3)");
    s.a.sinks.shape[0] = 3, s.a.sinks.data = NULL;
    refused(ctx, &s, CLMHA_INVALID_ARGUMENT, "sinks.data is NULL");
    s.a.sinks.ndim = 0;

    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = 8, .num_heads = 2,
                             .softcap = -0.5};
    clmha_layer *layer = NULL;
    cr_expect_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "desc.softcap (-0.5)"), "%s",
              clmha_context_last_error(ctx));
    cr_expect_null(layer);
    desc.softcap = 0.0;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS);
    float got[8];
    cr_expect_eq(clmha_layer_get_parameter(layer, "alibi_slopes", got, 2),
                 CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "alibi = false"), "%s",
              clmha_context_last_error(ctx));
    cr_expect_eq(clmha_layer_parameter_count(layer, "alibi_slopes"), 0);
    cr_expect_eq(clmha_layer_parameter_count(layer, "sinks"), 0);
    cr_expect_eq(clmha_layer_set_parameter(layer, "sinks", got, 2), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "sinks = false"), "%s",
              clmha_context_last_error(ctx));
    clmha_layer_release(layer);
    // A layer with sinks: the parameter (zero at creation), and partial attention.
    desc.sinks = true;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS);
    cr_expect_eq(clmha_layer_parameter_count(layer, "sinks"), 2);
    cr_assert_eq(clmha_layer_get_parameter(layer, "sinks", got, 2), CLMHA_SUCCESS);
    cr_expect(got[0] == 0.0f && got[1] == 0.0f, "sinks start at zero: %g %g", (double)got[0],
              (double)got[1]);
    float q[8 * 3] = {0}, heads[2 * 3 * 4], lse_rows[2 * 3];
    cl_int err;
    cl_mem hb = clCreateBuffer(clmha_context_cl_context(ctx), CL_MEM_READ_WRITE, sizeof heads,
                               NULL, &err);
    cl_mem lb = clCreateBuffer(clmha_context_cl_context(ctx), CL_MEM_READ_WRITE, sizeof lse_rows,
                               NULL, &err);
    cl_mem qb = clCreateBuffer(clmha_context_cl_context(ctx),
                               CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof q, q, &err);
    clmha_forward_args fa = {.struct_size = sizeof fa,
                             .query = {.ndim = 2, .shape = {3, 8}, .buffer = qb}};
    // Partial attention takes it (test_partial.c, sinks, checks the merged values).
    cr_expect_eq(clmha_layer_attend(layer, &fa, false, hb, 0, lb, 0, 0, NULL, NULL),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_expect_eq(clFinish(clmha_context_cl_queue(ctx)), CL_SUCCESS);
    clReleaseMemObject(hb), clReleaseMemObject(lb), clReleaseMemObject(qb);
    clmha_layer_release(layer);
    desc.sinks = false;
    desc.alibi = true, desc.num_heads = 8;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS);
    cr_expect_eq(clmha_layer_parameter_count(layer, "alibi_slopes"), 8);
    cr_assert_eq(clmha_layer_get_parameter(layer, "alibi_slopes", got, 8), CLMHA_SUCCESS);
    for (size_t h = 0; h < 8; ++h)  // 2^-(h+1) for 8 heads
        cr_expect_float_eq(got[h], ldexpf(1.0f, -(int)h - 1), 0, "slope %zu: %g", h,
                           (double)got[h]);
    cr_expect_eq(clmha_layer_set_parameter(layer, "alibi_slopes", got, 7), CLMHA_SHAPE_MISMATCH);
    clmha_layer_release(layer);
    // The paper's extension for 6 heads: the 4-head slopes, then slopes 1 and 3 of 8 heads.
    float six[6];
    cr_assert_eq(clmha_alibi_slopes(6, six), CLMHA_SUCCESS);
    const double want[6] = {0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125};
    for (size_t h = 0; h < 6; ++h)
        cr_expect_float_eq(six[h], want[h], 0, "6 heads, slope %zu: %g", h, (double)six[h]);
    cr_expect_eq(clmha_alibi_slopes(0, six), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_alibi_slopes(4, NULL), CLMHA_INVALID_ARGUMENT);
    clmha_context_release(ctx);
}

// A window's bounds must be -1 or at least 0, for the function and for a layer (every core
// takes a window: test_sdpa_kv for the KV-cache form).
Test(sdpa, window_refusals, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    small s;
    small_make(&s);
    s.a.window = true, s.a.window_left = -2, s.a.window_right = 0;
    refused(ctx, &s, CLMHA_INVALID_ARGUMENT, "args.window_left (-2)");
    s.a.window_left = 1, s.a.window_right = -5;
    refused(ctx, &s, CLMHA_INVALID_ARGUMENT, "must each be -1 (unbounded) or at least 0");
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = 8, .num_heads = 2,
                             .window = true, .window_left = -3, .window_right = 1};
    clmha_layer *layer = NULL;
    cr_expect_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "desc.window_left (-3)"), "%s",
              clmha_context_last_error(ctx));
    cr_expect_null(layer);
    clmha_context_release(ctx);
}

Test(sdpa, backward_refusals, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    small s;
    small_make(&s);
    cl_mem q = upload_at(ctx, s.q, sizeof s.q, 0), k = upload_at(ctx, s.k, sizeof s.k, 0);
    cl_mem v = upload_at(ctx, s.v, sizeof s.v, 0), o = upload_at(ctx, s.out, sizeof s.out, 0);
    cl_mem go = upload_at(ctx, s.out, sizeof s.out, 0), dq = upload_at(ctx, s.q, sizeof s.q, 0);
    cl_mem dk = upload_at(ctx, s.k, sizeof s.k, 0), dv = upload_at(ctx, s.v, sizeof s.v, 0);
    s.a.query.buffer = q, s.a.key.buffer = k, s.a.value.buffer = v;
    clmha_attention_backward_args b = {.struct_size = sizeof b, .forward = &s.a, .output = o,
                                       .grad_output = go, .grad_query = dq, .grad_key = dk,
                                       .grad_value = dv};
    cl_event ev = (cl_event)(uintptr_t)1;
    b.grad_key = dq;  // two gradients in the same bytes
    cr_expect_eq(clmha_attention_backward(ctx, &b, 0, NULL, &ev), CLMHA_INVALID_ARGUMENT);
    cr_expect(ev == NULL, "*event set on a refused call");
    b.grad_key = dk;
    b.forward = NULL;
    cr_expect_eq(clmha_attention_backward(ctx, &b, 0, NULL, &ev), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "args->forward is NULL"));
    b.forward = &s.a;
    b.impl = CLMHA_IMPL_FUSED;  // the fused backward needs the forward's lse
    cr_expect_neq(clmha_attention_backward(ctx, &b, 0, NULL, &ev), CLMHA_SUCCESS);
    cr_expect(strstr(clmha_context_last_error(ctx), "log-sum-exp"), "%s",
              clmha_context_last_error(ctx));
    b.impl = CLMHA_IMPL_AUTO;
    b.grad_attn_mask = go;  // without a float mask
    cr_expect_eq(clmha_attention_backward(ctx, &b, 0, NULL, &ev), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "not a float mask"), "%s",
              clmha_context_last_error(ctx));
    b.grad_attn_mask = NULL;
    float back[2 * 3 * 4 * 8];
    read_at(ctx, dq, 0, back, sizeof back);
    cr_expect(memcmp(back, s.q, sizeof back) == 0, "grad_query written by refused calls");
    cl_mem all[8] = {q, k, v, o, go, dq, dk, dv};
    for (int i = 0; i < 8; ++i) clReleaseMemObject(all[i]);
    clmha_context_release(ctx);
}
