// Float64 layers (clmha_dtype F64, include/clmha.h): PyTorch's float64 golden cases
// (tests/golden/f64_*.txt) and random calls against the double-precision reference, each within
// the contract of 1e-12 through both cores, on device buffers of doubles and through
// clmha_layer_forward_host_f64(); parameters kept as exact doubles, and rounded to the dtype of
// other layers; what float64 layers refuse; and devices without double precision, where they
// cannot be made. Public API only.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden_call.h"
#include "support.h"

// The accuracy contract of a float64 layer: max |error| against float64 results.
#define F64_CONTRACT 1e-12

// Element offset of every device tensor in its buffer (and of the output and weights), so that
// an offset counted in bytes or floats instead of doubles shows.
#define PAD 3

static const char *const param_names[] = {
    "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
    "out_proj.weight", "out_proj.bias", "bias_k", "bias_v",
};
#define NUM_PARAM_NAMES (sizeof param_names / sizeof *param_names)

// ---- devices ------------------------------------------------------------------------------------

static clmha_layer *layer_or_fail(clmha_context *ctx, const clmha_layer_desc *desc) {
    clmha_layer *layer = NULL;
    clmha_status st = clmha_layer_create(&layer, ctx, desc);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_layer_create: %s: %s", clmha_status_string(st),
                 clmha_context_last_error(ctx));
    return layer;
}

// ---- device buffers -----------------------------------------------------------------------------

static size_t tensor_count(const clmha_tensor *t) {
    size_t n = 1;
    for (size_t i = 0; i < t->ndim; ++i) n *= t->shape[i];
    return n;
}

// A read-write buffer of @p pad zero elements of @p elem bytes followed by @p count elements
// copied from @p data (zeros when NULL), written with clEnqueueWriteBuffer.
static cl_mem buffer_of(clmha_context *ctx, const void *data, size_t count, size_t elem,
                        size_t pad) {
    size_t bytes = (pad + count) * elem;
    unsigned char *host = calloc(1, bytes);
    cr_assert_not_null(host, "out of memory");
    if (data) memcpy(host + pad * elem, data, count * elem);
    cl_int err;
    cl_mem b = clCreateBuffer(clmha_context_cl_context(ctx), CL_MEM_READ_WRITE, bytes, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS, "clCreateBuffer: %d", err);
    err = clEnqueueWriteBuffer(clmha_context_cl_queue(ctx), b, CL_TRUE, 0, bytes, host, 0, NULL,
                               NULL);
    cr_assert_eq(err, CL_SUCCESS, "clEnqueueWriteBuffer: %d", err);
    free(host);
    return b;
}

// Moves host tensor @p t (elements of @p elem bytes) into a new buffer at element offset PAD;
// its data pointer is cleared, so that the device call can read only the buffer.
static void to_device(clmha_context *ctx, clmha_tensor *t, size_t elem) {
    if (t->ndim == 0) return;
    t->buffer = buffer_of(ctx, t->data, tensor_count(t), elem, PAD);
    t->offset = PAD;
    t->data = NULL;
}

static size_t mask_elem(clmha_mask_kind kind) {
    return kind == CLMHA_MASK_FLOAT ? sizeof(double) : 1;
}

// Reads @p count doubles at element PAD of @p b into @p dst, and checks that the PAD doubles
// before them are still zero.
static void read_back(clmha_context *ctx, cl_mem b, double *dst, size_t count, const char *what) {
    double *all = malloc((PAD + count) * sizeof *all);
    cr_assert_not_null(all, "out of memory");
    cl_int err = clEnqueueReadBuffer(clmha_context_cl_queue(ctx), b, CL_TRUE, 0,
                                     (PAD + count) * sizeof *all, all, 0, NULL, NULL);
    cr_assert_eq(err, CL_SUCCESS, "clEnqueueReadBuffer: %d", err);
    for (size_t i = 0; i < PAD; ++i)
        cr_expect_eq(all[i], 0.0, "%s: element %zu before the offset was written", what, i);
    memcpy(dst, all + PAD, count * sizeof *dst);
    free(all);
}

// The device call (clmha_layer_forward) of @p host, whose data pointers hold doubles (bytes
// for boolean masks): every tensor, the output and the weights at element offset PAD of a
// buffer of their own; the results read back into @p out and @p w (@p wc doubles, 0 without
// weights).
static void forward_device(clmha_layer *layer, const clmha_forward_args *host, double *out,
                           size_t oc, double *w, size_t wc) {
    clmha_context *ctx = clmha_layer_context(layer);
    clmha_forward_args a = *host;
    to_device(ctx, &a.query, sizeof(double));
    to_device(ctx, &a.key, sizeof(double));
    to_device(ctx, &a.value, sizeof(double));
    to_device(ctx, &a.key_padding_mask.tensor, mask_elem(a.key_padding_mask.kind));
    to_device(ctx, &a.attn_mask.tensor, mask_elem(a.attn_mask.kind));
    cl_mem ob = buffer_of(ctx, NULL, oc, sizeof(double), PAD);
    cl_mem wb = wc ? buffer_of(ctx, NULL, wc, sizeof(double), PAD) : NULL;
    cl_event ev = NULL;
    clmha_status st = clmha_layer_forward(layer, &a, ob, PAD, wb, PAD, 0, NULL, &ev);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_layer_forward: %s: %s", clmha_status_string(st),
                 clmha_context_last_error(ctx));
    cr_assert_not_null(ev);
    cr_assert_eq(clWaitForEvents(1, &ev), CL_SUCCESS);
    clReleaseEvent(ev);
    read_back(ctx, ob, out, oc, "output");
    if (wc) read_back(ctx, wb, w, wc, "weights");
    cl_mem bufs[] = {a.query.buffer, a.key.buffer, a.value.buffer, a.key_padding_mask.tensor.buffer,
                     a.attn_mask.tensor.buffer, ob, wb};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; ++i)
        if (bufs[i]) clReleaseMemObject(bufs[i]);
}

// The host call (clmha_layer_forward_host_f64) of @p a.
static void forward_host(clmha_layer *layer, const clmha_forward_args *a, double *out, size_t oc,
                         double *w, size_t wc) {
    clmha_status st = clmha_layer_forward_host_f64(layer, a, out, oc, wc ? w : NULL, wc);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_layer_forward_host_f64: %s: %s",
                 clmha_status_string(st), clmha_context_last_error(clmha_layer_context(layer)));
}

static void fill_nan(double *x, size_t count) {
    for (size_t i = 0; i < count; ++i) x[i] = NAN;
}

// ---- PyTorch's golden cases ---------------------------------------------------------------------

static const char *const f64_case_names[] = {
#include "golden/f64_cases.inc"
};
#define NUM_F64_CASES (sizeof f64_case_names / sizeof *f64_case_names)

// A float64 layer for golden case @p gc, its parameters the file's doubles.
static clmha_layer *golden_f64_layer(clmha_context *ctx, const golden_case *gc,
                                     const clmha_layer_desc *desc) {
    clmha_layer *layer = layer_or_fail(ctx, desc);
    for (size_t i = 0; i < NUM_PARAM_NAMES; ++i) {
        const golden_tensor *t = golden_find(gc, param_names[i]);
        if (!t) continue;
        cr_assert_eq(t->dtype, GOLDEN_F64, "%s: parameter %s is not f64", gc->name,
                     param_names[i]);
        clmha_status st = clmha_layer_set_parameter_f64(layer, param_names[i], t->f64, t->count);
        cr_assert_eq(st, CLMHA_SUCCESS, "%s: clmha_layer_set_parameter_f64(%s): %s: %s", gc->name,
                     param_names[i], clmha_status_string(st), clmha_context_last_error(ctx));
    }
    return layer;
}

// Every float64 golden case through both cores (the fused one without weights: its calls drop
// need_weights and check the output), each on device buffers and through the host call.
Test(f64, golden_cases_within_contract) {
    clmha_context *ctx = fp64_context_or_skip();
    cr_assert(NUM_F64_CASES >= 10, "tests/golden/f64_cases.inc lists %zu cases", NUM_F64_CASES);
    const clmha_impl impls[] = {CLMHA_IMPL_UNFUSED, CLMHA_IMPL_FUSED};
    double worst = 0.0;
    char worst_call[160] = "";
    size_t calls = 0;
    for (size_t k = 0; k < NUM_F64_CASES; ++k) {
        golden_case gc;
        golden_load_case(f64_case_names[k], &gc);
        cr_assert_eq(gc.dtype, GOLDEN_LAYER_F64, "%s: dtype %s", gc.name,
                     golden_layer_dtype_name(gc.dtype));
        golden_call call;
        golden_call_of(&gc, &call);
        cr_assert_eq(call.desc.dtype, CLMHA_DTYPE_F64);
        clmha_layer *layer = golden_f64_layer(ctx, &gc, &call.desc);
        const golden_tensor *want = golden_find(&gc, "output"), *ww = golden_find(&gc, "weights");
        size_t oc = want->count, wmax = ww ? ww->count : 0;
        double *out = malloc(oc * sizeof *out), *w = malloc((wmax ? wmax : 1) * sizeof *w);
        cr_assert(out && w, "out of memory");
        for (size_t i = 0; i < 2; ++i) {
            for (int device = 0; device < 2; ++device) {
                clmha_forward_args a = call.args;
                a.impl = impls[i];
                if (a.impl == CLMHA_IMPL_FUSED) a.need_weights = false;
                size_t wc = a.need_weights ? wmax : 0;
                fill_nan(out, oc);
                fill_nan(w, wc);
                if (device)
                    forward_device(layer, &a, out, oc, w, wc);
                else
                    forward_host(layer, &a, out, oc, w, wc);
                double eo = max_abs_err_d(out, want->f64, oc);
                double ew = wc ? max_abs_err_d(w, ww->f64, wc) : 0.0;
                char what[160];
                snprintf(what, sizeof what, "%s %s %s", gc.name, clmha_impl_name(a.impl),
                         device ? "device" : "host");
                fprintf(stderr, "%-48s output %.3g (max |y| %.3g), weights %.3g\n", what, eo,
                        max_abs_of(want->f64, oc), ew);
                cr_expect(eo <= F64_CONTRACT, "%s: output error %.3g beyond %g", what, eo,
                          F64_CONTRACT);
                cr_expect(ew <= F64_CONTRACT, "%s: weights error %.3g beyond %g", what, ew,
                          F64_CONTRACT);
                if (fmax(eo, ew) >= worst) {
                    worst = fmax(eo, ew);
                    snprintf(worst_call, sizeof worst_call, "%s", what);
                }
                ++calls;
            }
        }
        free(out), free(w);
        clmha_layer_release(layer);
        golden_free(&gc);
    }
    fprintf(stderr, "f64 golden: %zu cases, %zu calls, worst error %.3g (%s), contract %g\n",
            NUM_F64_CASES, calls, worst, worst_call, F64_CONTRACT);
    clmha_context_release(ctx);
}

// ---- random calls against the reference ---------------------------------------------------------

// One random float64 call. The values are floats (clmha_reference_forward takes float32
// arrays), given to the layer as the same values widened to double.
typedef struct rand_case {
    size_t e, h, g, kdim, vdim, n, l, s;  // g: key/value heads (grouped-query attention)
    bool bias, bias_kv, zero_attn, batch_first, unbatched, self_attn;
    bool packed;                           // in_proj_weight rather than q/k/v_proj_weight
    clmha_mask_kind kpm, am;
    int am_layout;                         // 0: (L, S), 1: per head, 2: per batch (N, L, S)
    bool is_causal, need_weights, per_head;
    // The reference computes ALiBi (slopes 0.1 (h + 1)) and a window (3, 1), the layer the same
    // through user functions in double (clmha_real).
    bool user;
} rand_case;

// dcase::user's functions; p: the window's bounds, then the slopes.
static const char user_source[] =
    "clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k,\n"
    "                           __global const float *p) {\n"
    "    return s - p[2 + h] * fabs((clmha_real)(q - k));\n"
    "}\n"
    "int clmha_mask_mod(int b, int h, int q, int k, __global const float *p) {\n"
    "    return k >= q - (int)p[0] && k <= q + (int)p[1];\n"
    "}\n";

// Lengths around the fused core's tiles, and head dims from 4 to 64 (5 and 24: 1/sqrt(D) is
// not a power of two).
static const size_t edge_lengths[] = {1, 15, 16, 17, 33, 64, 65};
static const size_t head_dims[] = {4, 5, 8, 16, 24, 32, 64};
#define PICK(r, a) (a)[prng_range((r), 0, sizeof(a) / sizeof *(a) - 1)]

static rand_case draw_case(prng *r) {
    rand_case c = {0};
    c.h = prng_range(r, 1, 4);
    do c.g = prng_range(r, 1, c.h);
    while (c.h % c.g != 0);
    c.e = c.h * PICK(r, head_dims);
    c.unbatched = prng_range(r, 0, 4) == 0;
    c.n = c.unbatched ? 1 : prng_range(r, 1, 3);
    c.batch_first = !c.unbatched && prng_bool(r);
    c.self_attn = prng_range(r, 0, 2) == 0;
    c.l = PICK(r, edge_lengths);
    c.s = c.self_attn ? c.l : PICK(r, edge_lengths);
    c.kdim = c.vdim = c.e;
    if (!c.self_attn && prng_bool(r)) c.kdim = prng_range(r, 1, 40), c.vdim = prng_range(r, 1, 40);
    c.packed = c.g == c.h && c.kdim == c.e && c.vdim == c.e && prng_bool(r);
    c.bias = prng_range(r, 0, 3) != 0;
    c.bias_kv = prng_bool(r);
    c.zero_attn = prng_bool(r);
    c.kpm = (clmha_mask_kind)prng_range(r, 0, 3);
    c.am = (clmha_mask_kind)prng_range(r, 0, 3);
    c.am_layout = (int)prng_range(r, 0, c.unbatched ? 1 : 2);
    c.is_causal = prng_range(r, 0, 2) == 0;
    c.need_weights = prng_range(r, 0, 3) != 0;
    c.per_head = prng_bool(r);
    return c;
}

static void describe(const rand_case *c, char *buf, size_t size) {
    static const char *const kinds[] = {"none", "ignore", "attend", "float"};
    static const char *const layouts[] = {"(L,S)", "(NH,L,S)", "(N,L,S)"};
    snprintf(buf, size,
             "E%zu H%zu G%zu N%zu L%zu S%zu kdim%zu vdim%zu%s%s%s%s%s%s%s kpm=%s am=%s%s%s%s%s",
             c->e, c->h, c->g, c->n, c->l, c->s, c->kdim, c->vdim, c->bias ? "" : " nobias",
             c->bias_kv ? " bias_kv" : "", c->zero_attn ? " zero_attn" : "",
             c->batch_first ? " batch_first" : "", c->unbatched ? " unbatched" : "",
             c->self_attn ? " self" : "", c->packed ? " packed" : "", kinds[c->kpm],
             kinds[c->am], c->am ? layouts[c->am_layout] : "", c->is_causal ? " causal" : "",
             !c->need_weights ? "" : c->per_head ? " w=per_head" : " w=avg",
             c->user ? " user alibi+window" : "");
}

// What a rand_case becomes: the float arrays (for the reference) and their widened copies
// (for the layer), both calls' arguments, and what owns the memory.
typedef struct rand_call {
    clmha_layer_desc desc;
    clmha_reference_params params;
    clmha_forward_args args32, args64;
    size_t output_count, weights_count;
    void *owned[64];
    size_t num_owned;
} rand_call;

static void *own(rand_call *rc, void *p) {
    cr_assert_not_null(p, "out of memory");
    cr_assert(rc->num_owned < sizeof rc->owned / sizeof *rc->owned);
    rc->owned[rc->num_owned++] = p;
    return p;
}

static double *widened(rand_call *rc, const float *x, size_t count) {
    double *d = own(rc, malloc((count ? count : 1) * sizeof *d));
    for (size_t i = 0; i < count; ++i) d[i] = x[i];
    return d;
}

// A mask of shape @p t, a fraction 0.2 of its elements forbidding: bytes (0/1, in the kind's
// polarity) shared by both calls, or N(0, 1) floats and -inf, widened for the layer.
static void make_mask(rand_call *rc, prng *r, clmha_mask_kind kind, clmha_tensor t,
                      clmha_mask *m32, clmha_mask *m64) {
    size_t count = tensor_count(&t);
    m32->kind = m64->kind = kind;
    m32->tensor = m64->tensor = t;
    if (kind == CLMHA_MASK_FLOAT) {
        float *m = own(rc, alloc_floats(count));
        for (size_t i = 0; i < count; ++i)
            m[i] = prng_uniform(r) < 0.2 ? -INFINITY : (float)prng_normal(r);
        m32->tensor.data = m;
        m64->tensor.data = widened(rc, m, count);
        return;
    }
    unsigned char *m = own(rc, malloc(count));
    for (size_t i = 0; i < count; ++i)
        m[i] = (prng_uniform(r) < 0.2) == (kind == CLMHA_MASK_BOOL_IGNORE);
    m32->tensor.data = m64->tensor.data = m;
}

// An input of @p seq rows of @p feat floats in the case's layout, N(0, 1).
static void make_input(rand_call *rc, prng *r, const rand_case *c, size_t seq, size_t feat,
                       clmha_tensor *t32, clmha_tensor *t64) {
    clmha_tensor t = {.ndim = 3, .shape = {seq, c->n, feat}};
    if (c->unbatched) t = (clmha_tensor){.ndim = 2, .shape = {seq, feat}};
    else if (c->batch_first) t.shape[0] = c->n, t.shape[1] = seq;
    float *x = own(rc, normal_floats(r, seq * c->n * feat));
    *t32 = *t64 = t;
    t32->data = x;
    t64->data = widened(rc, x, seq * c->n * feat);
}

// Draws the values of case @p c (weights ~ U(-1/sqrt(E), 1/sqrt(E)), bias_k/bias_v and inputs
// ~ N(0, 1)) and makes a float64 layer holding its parameters.
static clmha_layer *make_call(clmha_context *ctx, const rand_case *c, uint64_t seed,
                              rand_call *rc) {
    memset(rc, 0, sizeof *rc);
    prng r = {seed};
    const size_t e = c->e, kve = c->g * (c->e / c->h), n = c->n, l = c->l, s = c->s;
    rc->desc = (clmha_layer_desc){.struct_size = sizeof rc->desc, .embed_dim = e,
                                  .num_heads = c->h, .kdim = c->kdim, .vdim = c->vdim,
                                  .bias = c->bias, .add_bias_kv = c->bias_kv,
                                  .add_zero_attn = c->zero_attn, .batch_first = c->batch_first,
                                  .num_kv_heads = c->g, .dtype = CLMHA_DTYPE_F64};
    clmha_layer_desc ldesc = rc->desc;
    if (c->user) {  // the reference's ALiBi and window, the layer's user functions
        float *p = own(rc, alloc_floats(2 + c->h));
        p[0] = 3.0f, p[1] = 1.0f;
        for (size_t h = 0; h < c->h; ++h) p[2 + h] = 0.1f * (float)(h + 1);
        rc->desc.alibi = true, rc->params.alibi_slopes = p + 2;
        rc->desc.window = true, rc->desc.window_left = 3, rc->desc.window_right = 1;
        ldesc.mod_source = user_source, ldesc.mod_params = p, ldesc.mod_params_count = 2 + c->h;
    }
    clmha_layer *layer = layer_or_fail(ctx, &ldesc);
    const double bound = 1.0 / sqrt((double)e);
    struct {
        const char *name;
        const float **field;
        size_t count;
        bool present, uniform;
    } params[] = {
        {"in_proj_weight", &rc->params.in_proj_weight, 3 * e * e, c->packed, true},
        {"q_proj_weight", &rc->params.q_proj_weight, e * e, !c->packed, true},
        {"k_proj_weight", &rc->params.k_proj_weight, kve * c->kdim, !c->packed, true},
        {"v_proj_weight", &rc->params.v_proj_weight, kve * c->vdim, !c->packed, true},
        {"in_proj_bias", &rc->params.in_proj_bias, e + 2 * kve, c->bias, true},
        {"out_proj.weight", &rc->params.out_proj_weight, e * e, true, true},
        {"out_proj.bias", &rc->params.out_proj_bias, e, c->bias, true},
        {"bias_k", &rc->params.bias_k, kve, c->bias_kv, false},
        {"bias_v", &rc->params.bias_v, kve, c->bias_kv, false},
    };
    rc->params.struct_size = sizeof rc->params;
    for (size_t i = 0; i < sizeof params / sizeof *params; ++i) {
        if (!params[i].present) continue;
        size_t count = params[i].count;
        float *p = own(rc, params[i].uniform ? uniform_floats(&r, count, bound)
                                             : normal_floats(&r, count));
        *params[i].field = p;
        clmha_status st = clmha_layer_set_parameter_f64(layer, params[i].name,
                                                        widened(rc, p, count), count);
        cr_assert_eq(st, CLMHA_SUCCESS, "clmha_layer_set_parameter_f64(%s): %s: %s",
                     params[i].name, clmha_status_string(st), clmha_context_last_error(ctx));
    }

    clmha_forward_args *a32 = &rc->args32, *a64 = &rc->args64;
    *a32 = (clmha_forward_args){.struct_size = sizeof *a32, .is_causal = c->is_causal,
                                .need_weights = c->need_weights,
                                .per_head_weights = c->per_head};
    *a64 = *a32;
    make_input(rc, &r, c, l, e, &a32->query, &a64->query);
    if (!c->self_attn) {
        make_input(rc, &r, c, s, c->kdim, &a32->key, &a64->key);
        make_input(rc, &r, c, s, c->vdim, &a32->value, &a64->value);
    }
    if (c->kpm) {
        clmha_tensor t = {.ndim = 2, .shape = {n, s}};
        if (c->unbatched) t = (clmha_tensor){.ndim = 1, .shape = {s}};
        make_mask(rc, &r, c->kpm, t, &a32->key_padding_mask, &a64->key_padding_mask);
    }
    if (c->am) {
        // Per head: (N*H, L, S), (H, L, S) unbatched; per batch: (N, L, S).
        clmha_tensor t = {.ndim = 3, .shape = {c->am_layout == 1 ? n * c->h : n, l, s}};
        if (c->am_layout == 0) t = (clmha_tensor){.ndim = 2, .shape = {l, s}};
        make_mask(rc, &r, c->am, t, &a32->attn_mask, &a64->attn_mask);
        a32->attn_mask.per_batch = a64->attn_mask.per_batch = c->am_layout == 2;
    }
    size_t sp = s + c->bias_kv + c->zero_attn;
    rc->output_count = n * l * e;
    rc->weights_count = c->need_weights ? n * (c->per_head ? c->h : 1) * l * sp : 0;
    return layer;
}

static void free_call(rand_call *rc) {
    for (size_t i = 0; i < rc->num_owned; ++i) free(rc->owned[i]);
}

// Runs rand_case @p c (its values from @p seed) through both cores (the fused one without
// weights) and clmha_reference_forward() on the same values, expects each within F64_CONTRACT
// and keeps the largest error so far in @p worst (its call in @p worst_case).
static void check_rand_case(clmha_context *ctx, const rand_case *c, uint64_t seed, double *worst,
                            char *worst_case, size_t worst_size) {
    rand_call rc;
    clmha_layer *layer = make_call(ctx, c, seed, &rc);
    char name[320];
    describe(c, name, sizeof name);
    size_t oc = rc.output_count, wc = rc.weights_count;
    double *ro = malloc(oc * sizeof *ro), *rw = malloc((wc ? wc : 1) * sizeof *rw);
    double *out = malloc(oc * sizeof *out), *w = malloc((wc ? wc : 1) * sizeof *w);
    cr_assert(ro && rw && out && w, "out of memory");
    char msg[256];
    clmha_status st = clmha_reference_forward(&rc.desc, &rc.params, &rc.args32, ro, oc,
                                              wc ? rw : NULL, wc, msg, sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: reference: %s", name, msg);
    const clmha_impl impls[] = {CLMHA_IMPL_UNFUSED, CLMHA_IMPL_FUSED};
    for (size_t i = 0; i < 2; ++i) {
        clmha_forward_args a = rc.args64;
        a.impl = impls[i];
        if (a.impl == CLMHA_IMPL_FUSED) a.need_weights = false;
        size_t cwc = a.need_weights ? wc : 0;
        fill_nan(out, oc);
        fill_nan(w, cwc);
        forward_host(layer, &a, out, oc, w, cwc);
        double eo = max_abs_err_d(out, ro, oc), ew = cwc ? max_abs_err_d(w, rw, cwc) : 0.0;
        fprintf(stderr, "%-7s %s: output %.3g, weights %.3g\n", clmha_impl_name(a.impl), name,
                eo, ew);
        cr_expect(eo <= F64_CONTRACT && ew <= F64_CONTRACT,
                  "%s %s: output error %.3g, weights %.3g, beyond %g",
                  clmha_impl_name(a.impl), name, eo, ew, F64_CONTRACT);
        if (fmax(eo, ew) >= *worst) {
            *worst = fmax(eo, ew);
            snprintf(worst_case, worst_size, "%s %s", clmha_impl_name(a.impl), name);
        }
    }
    free(ro), free(rw), free(out), free(w);
    clmha_layer_release(layer);
    free_call(&rc);
}

// Random calls (seeded) of every option, grouped-query attention included, at lengths around
// the fused core's tiles, through both cores (the fused one without weights) against
// clmha_reference_forward() on the same values.
Test(f64, random_vs_reference) {
    clmha_context *ctx = fp64_context_or_skip();
    enum { CASES = 20 };
    prng r = {0xf64f66};
    double worst = 0.0;
    char worst_case[400] = "";
    // Which options the draws covered, checked at the end so that a changed seed or draw
    // still covers every one.
    bool gqa = false, kdim = false, packed = false, bias_kv = false, zero_attn = false;
    bool batch_first = false, unbatched = false, self = false, causal = false, per_head = false;
    bool averaged = false, ignore = false, attend = false, float_mask = false;
    bool per_head_mask = false, per_batch_mask = false, length_1 = false, length_65 = false;
    bool dim_64 = false;
    for (size_t k = 0; k < CASES; ++k) {
        rand_case c = draw_case(&r);
        c.user = k % 5 == 4;
        check_rand_case(ctx, &c, prng_next(&r), &worst, worst_case, sizeof worst_case);
        gqa |= c.g < c.h, kdim |= c.kdim != c.e || c.vdim != c.e, packed |= c.packed;
        bias_kv |= c.bias_kv, zero_attn |= c.zero_attn, batch_first |= c.batch_first;
        unbatched |= c.unbatched, self |= c.self_attn, causal |= c.is_causal;
        per_head |= c.need_weights && c.per_head, averaged |= c.need_weights && !c.per_head;
        ignore |= c.kpm == CLMHA_MASK_BOOL_IGNORE || c.am == CLMHA_MASK_BOOL_IGNORE;
        attend |= c.kpm == CLMHA_MASK_BOOL_ATTEND || c.am == CLMHA_MASK_BOOL_ATTEND;
        float_mask |= c.kpm == CLMHA_MASK_FLOAT || c.am == CLMHA_MASK_FLOAT;
        per_head_mask |= c.am && c.am_layout == 1, per_batch_mask |= c.am && c.am_layout == 2;
        length_1 |= c.l == 1 || c.s == 1, length_65 |= c.l == 65 || c.s == 65;
        dim_64 |= c.e / c.h == 64;
    }
    fprintf(stderr, "f64 random: %d cases, worst error %.3g (%s), contract %g\n", CASES, worst,
            worst_case, F64_CONTRACT);
    cr_expect(gqa && kdim && packed && bias_kv && zero_attn && batch_first && unbatched && self &&
                  causal && per_head && averaged && ignore && attend && float_mask &&
                  per_head_mask && per_batch_mask && length_1 && length_65 && dim_64,
              "the draws missed an option: gqa %d kdim %d packed %d bias_kv %d zero_attn %d "
              "batch_first %d unbatched %d self %d causal %d per_head %d averaged %d ignore %d "
              "attend %d float %d per_head_mask %d per_batch_mask %d L/S 1 %d L/S 65 %d D 64 %d",
              gqa, kdim, packed, bias_kv, zero_attn, batch_first, unbatched, self, causal,
              per_head, averaged, ignore, attend, float_mask, per_head_mask, per_batch_mask,
              length_1, length_65, dim_64);
    clmha_context_release(ctx);
}

// The fused core reading float64 projected rows 4 KiB apart, which the projections pad by one
// cache line (clmha__rows_pitch() in src/layer/layer.h): one packed QKV GEMM 256 + 2 x 64
// doubles wide (2 key/value heads of 4: 512 doubles, 4 KiB), and three GEMMs 512 wide each.
Test(f64, padded_row_pitch) {
    clmha_context *ctx = fp64_context_or_skip();
    double worst = 0.0;
    char worst_case[400] = "";
    rand_case c = {.e = 256, .h = 4, .g = 2, .kdim = 256, .vdim = 256, .n = 2, .l = 33, .s = 33,
                   .bias = true, .self_attn = true, .batch_first = true, .is_causal = true};
    check_rand_case(ctx, &c, 71, &worst, worst_case, sizeof worst_case);
    c = (rand_case){.e = 512, .h = 4, .g = 4, .kdim = 512, .vdim = 512, .n = 1, .l = 3, .s = 40,
                    .bias = true, .kpm = CLMHA_MASK_BOOL_IGNORE};
    check_rand_case(ctx, &c, 72, &worst, worst_case, sizeof worst_case);
    fprintf(stderr, "f64 padded rows: worst error %.3g (%s)\n", worst, worst_case);
    clmha_context_release(ctx);
}

// ---- the backward pass -------------------------------------------------------------------------

// The gradients of a rand_call, by clmha_backward_args field and clmha_reference_grads field.
enum { BG_QUERY, BG_KEY, BG_VALUE, BG_IN_W, BG_Q_W, BG_K_W, BG_V_W, BG_IN_B, BG_OUT_W, BG_OUT_B,
       BG_BIAS_K, BG_BIAS_V, BG_ATTN, BG_KPM, BG_COUNT };
static const char *const bg_name[BG_COUNT] = {
    "query", "key", "value", "in_proj_weight", "q_proj_weight", "k_proj_weight",
    "v_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias", "bias_k", "bias_v",
    "attn_mask", "key_padding_mask"};

static clmha_grad *bg_slot(clmha_backward_args *b, int g) {
    clmha_grad *all[BG_COUNT] = {&b->query, &b->key, &b->value, &b->in_proj_weight,
                                 &b->q_proj_weight, &b->k_proj_weight, &b->v_proj_weight,
                                 &b->in_proj_bias, &b->out_proj_weight, &b->out_proj_bias,
                                 &b->bias_k, &b->bias_v, &b->attn_mask, &b->key_padding_mask};
    return all[g];
}

static double **bg_ref(clmha_reference_grads *r, int g) {
    double **all[BG_COUNT] = {&r->query, &r->key, &r->value, &r->in_proj_weight,
                              &r->q_proj_weight, &r->k_proj_weight, &r->v_proj_weight,
                              &r->in_proj_bias, &r->out_proj_weight, &r->out_proj_bias,
                              &r->bias_k, &r->bias_v, &r->attn_mask, &r->key_padding_mask};
    return all[g];
}

// Elements of gradient @p g of case @p c (0: none).
static size_t bg_count(const rand_case *c, const rand_call *rc, int g) {
    size_t e = c->e, kve = c->g * (c->e / c->h);
    const clmha_forward_args *a = &rc->args32;
    switch (g) {
    case BG_QUERY: return tensor_count(&a->query);
    case BG_KEY: return a->key.ndim ? tensor_count(&a->key) : 0;
    case BG_VALUE: return a->value.ndim ? tensor_count(&a->value) : 0;
    case BG_IN_W: return c->packed ? 3 * e * e : 0;
    case BG_Q_W: return c->packed ? 0 : e * e;
    case BG_K_W: return c->packed ? 0 : kve * c->kdim;
    case BG_V_W: return c->packed ? 0 : kve * c->vdim;
    case BG_IN_B: return c->bias ? e + 2 * kve : 0;
    case BG_OUT_W: return e * e;
    case BG_OUT_B: return c->bias ? e : 0;
    case BG_BIAS_K:
    case BG_BIAS_V: return c->bias_kv ? kve : 0;
    case BG_ATTN:
        return a->attn_mask.kind == CLMHA_MASK_FLOAT ? tensor_count(&a->attn_mask.tensor) : 0;
    case BG_KPM:
        return a->key_padding_mask.kind == CLMHA_MASK_FLOAT
                   ? tensor_count(&a->key_padding_mask.tensor)
                   : 0;
    default: return 0;
    }
}

// sum(gy * y) of the layer's forward call @p a (the scalar whose gradients the backward gives).
static double loss_of(clmha_layer *layer, const clmha_forward_args *a, const double *gy,
                      double *y, size_t oc) {
    clmha_status st = clmha_layer_forward_host_f64(layer, a, y, oc, NULL, 0);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(clmha_layer_context(layer)));
    double sum = 0.0;
    for (size_t i = 0; i < oc; ++i) sum += gy[i] * y[i];
    return sum;
}

// Central differences of the loss at @p count elements of @p x (spread over it), moved by
// +-h; @p set re-applies a parameter (NULL for an input). Returns the largest
// |fd - grad| / (1 + |grad|).
static double finite_differences(clmha_layer *layer, const clmha_forward_args *a,
                                 const double *gy, double *y, size_t oc, double *x, size_t n,
                                 const double *grad, const char *param) {
    const double h = 1e-6;
    double worst = 0.0;
    for (size_t k = 0; k < 4 && k < n; ++k) {
        size_t i = k * (n - 1) / 3;
        double keep = x[i], lp, lm;
        x[i] = keep + h;
        if (param) clmha_layer_set_parameter_f64(layer, param, x, n);
        lp = loss_of(layer, a, gy, y, oc);
        x[i] = keep - h;
        if (param) clmha_layer_set_parameter_f64(layer, param, x, n);
        lm = loss_of(layer, a, gy, y, oc);
        x[i] = keep;
        if (param) clmha_layer_set_parameter_f64(layer, param, x, n);
        double fd = (lp - lm) / (2 * h);
        worst = fmax(worst, fabs(fd - grad[i]) / (1 + fabs(grad[i])));
    }
    return worst;
}

// Random calls (the forward's draws, without user functions: these have no derivative) through
// clmha_layer_backward_host_f64() against clmha_reference_backward() within the float64
// contract, every gradient; and, as torch.autograd.gradcheck does, against central finite
// differences of the public forward (h = 1e-6) at four elements of the query and of every
// weight.
Test(f64, backward_vs_reference_and_finite_differences, .timeout = 300) {
    clmha_context *ctx = fp64_context_or_skip();
    enum { CASES = 8 };
    prng r = {0xbac64};
    double worst = 0.0, worst_fd = 0.0;
    for (size_t k = 0; k < CASES; ++k) {
        rand_case c = draw_case(&r);
        if (c.l > 33) c.l = 33;
        if (c.s > 33) c.s = c.self_attn ? c.l : 33;
        c.need_weights = k % 2 == 1, c.per_head = k % 4 == 1;
        rand_call rc;
        clmha_layer *layer = make_call(ctx, &c, prng_next(&r), &rc);
        char name[320];
        describe(&c, name, sizeof name);
        size_t oc = rc.output_count, wc = rc.weights_count;
        float *gy32 = normal_floats(&r, oc), *gw32 = wc ? normal_floats(&r, wc) : NULL;
        double *gy = widened(&rc, gy32, oc), *gw = wc ? widened(&rc, gw32, wc) : NULL;
        double *y = malloc(oc * sizeof *y), *w = malloc((wc ? wc : 1) * sizeof *w);
        cr_assert(y && w);
        clmha_reference_grads rg = {.struct_size = sizeof rg};
        clmha_saved *saved;
        cr_assert_eq(clmha_saved_create(&saved, layer), CLMHA_SUCCESS);
        clmha_forward_args a = rc.args64;
        a.save = saved;
        cr_assert_eq(clmha_layer_forward_host_f64(layer, &a, y, oc, w, wc), CLMHA_SUCCESS,
                     "%s: %s", name, clmha_context_last_error(ctx));
        clmha_backward_args b = CLMHA_STRUCT_INIT(clmha_backward_args);
        b.forward = &a, b.saved = saved;
        b.grad_output = a.query;
        b.grad_output.data = gy;
        if (wc) {
            clmha_tensor t = {.data = gw};
            if (!c.unbatched) t.shape[t.ndim++] = c.n;
            if (c.per_head) t.shape[t.ndim++] = c.h;
            t.shape[t.ndim++] = c.l;
            t.shape[t.ndim++] = c.s + c.bias_kv + c.zero_attn;
            b.grad_weights = t;
        }
        double *got[BG_COUNT] = {NULL};
        for (int g = 0; g < BG_COUNT; ++g) {
            size_t n = bg_count(&c, &rc, g);
            if (!n) continue;
            got[g] = malloc(n * sizeof(double));
            *bg_ref(&rg, g) = own(&rc, malloc(n * sizeof(double)));
            bg_slot(&b, g)->data = (float *)got[g];  // doubles (clmha_layer_backward_host_f64)
        }
        clmha_status st = clmha_layer_backward_host_f64(layer, &b);
        cr_assert_eq(st, CLMHA_SUCCESS, "%s: backward: %s", name, clmha_context_last_error(ctx));
        char msg[256];
        st = clmha_reference_backward(&rc.desc, &rc.params, &rc.args32, gy32, gw32, &rg, msg,
                                      sizeof msg);
        cr_assert_eq(st, CLMHA_SUCCESS, "%s: reference: %s", name, msg);
        double e_case = 0.0;
        for (int g = 0; g < BG_COUNT; ++g) {
            size_t n = bg_count(&c, &rc, g);
            if (!n) continue;
            const double *want = *bg_ref(&rg, g);
            double scale = 0.0, err = 0.0;
            for (size_t i = 0; i < n; ++i) {
                scale = fmax(scale, fabs(want[i]));
                double e = fabs(got[g][i] - want[i]);
                err = isnan(e) ? INFINITY : fmax(err, e);
            }
            double rel = err / (1 + scale);
            cr_expect(rel <= F64_CONTRACT, "%s: gradient of %s: %.3g (scale %.3g)", name,
                      bg_name[g], err, scale);
            e_case = fmax(e_case, rel);
        }
        // Finite differences of sum(gy * y) (the calls without weights, whose gradient is
        // that alone): the query, then each weight (its float64 values, set back after).
        a.save = NULL;
        double fd = wc ? 0.0
                       : finite_differences(layer, &a, gy, y, oc, (double *)a.query.data,
                                            tensor_count(&a.query), got[BG_QUERY], NULL);
        const int weights[] = {BG_IN_W, BG_Q_W, BG_K_W, BG_V_W, BG_OUT_W};
        const float *values[] = {rc.params.in_proj_weight, rc.params.q_proj_weight,
                                 rc.params.k_proj_weight, rc.params.v_proj_weight,
                                 rc.params.out_proj_weight};
        for (size_t i = 0; i < 5 && !wc; ++i) {
            size_t n = bg_count(&c, &rc, weights[i]);
            if (!n) continue;
            double *p = widened(&rc, values[i], n);
            fd = fmax(fd, finite_differences(layer, &a, gy, y, oc, p, n, got[weights[i]],
                                             bg_name[weights[i]]));
        }
        cr_expect(fd <= 1e-7, "%s: finite differences differ by %.3g", name, fd);
        fprintf(stderr, "f64 backward %s: max error %.3g of the reference, %.3g of finite "
                "differences\n", name, e_case, fd);
        worst = fmax(worst, e_case), worst_fd = fmax(worst_fd, fd);
        for (int g = 0; g < BG_COUNT; ++g) free(got[g]);
        free(gy32), free(gw32), free(y), free(w);
        clmha_saved_release(saved);
        clmha_layer_release(layer);
        free_call(&rc);
    }
    fprintf(stderr, "f64 backward: %d cases, worst %.3g (contract %g), finite differences "
            "%.3g\n", CASES, worst, F64_CONTRACT, worst_fd);
    clmha_context_release(ctx);
}

// ---- what float64 layers refuse -----------------------------------------------------------------

// A user core on the host, in double precision: it reads the tiles as doubles (refusing
// anything else), no masks or dropout (the test's calls have none). *user counts the calls.
static clmha_status double_core(const clmha_core_args *c, void *user) {
    if (c->dtype != CLMHA_DTYPE_F64) return CLMHA_UNSUPPORTED;
    ++*(int *)user;
    size_t bh = c->batch * c->num_heads, l = c->tgt_len, s = c->src_len_padded, d = c->head_dim;
    double *q = malloc(bh * l * d * 8), *k = malloc(bh * s * d * 8), *v = malloc(bh * s * d * 8);
    double *o = malloc(bh * l * d * 8), *p = malloc(bh * l * s * 8);
    if (!q || !k || !v || !o || !p) return CLMHA_OUT_OF_MEMORY;
    clEnqueueReadBuffer(c->queue, c->q, CL_TRUE, 0, bh * l * d * 8, q, 0, NULL, NULL);
    clEnqueueReadBuffer(c->queue, c->k, CL_TRUE, 0, bh * s * d * 8, k, 0, NULL, NULL);
    clEnqueueReadBuffer(c->queue, c->v, CL_TRUE, 0, bh * s * d * 8, v, 0, NULL, NULL);
    for (size_t b = 0; b < bh; ++b)
        for (size_t i = 0; i < l; ++i) {
            double *row = p + (b * l + i) * s, m = -INFINITY, sum = 0.0;
            for (size_t j = 0; j < s; ++j) {
                double dot = 0.0;
                for (size_t t = 0; t < d; ++t)
                    dot += q[(b * l + i) * d + t] * k[(b * s + j) * d + t];
                row[j] = dot * c->scale_f64;
                m = fmax(m, row[j]);
            }
            for (size_t j = 0; j < s; ++j) sum += row[j] = exp(row[j] - m);
            for (size_t j = 0; j < s; ++j) row[j] /= sum;
            for (size_t t = 0; t < d; ++t) {
                double acc = 0.0;
                for (size_t j = 0; j < s; ++j) acc += row[j] * v[(b * s + j) * d + t];
                o[(b * l + i) * d + t] = acc;
            }
        }
    clEnqueueWriteBuffer(c->queue, c->out, CL_TRUE, 0, bh * l * d * 8, o, 0, NULL, NULL);
    if (c->weights)
        clEnqueueWriteBuffer(c->queue, c->weights, CL_TRUE, 0, bh * l * s * 8, p, 0, NULL, NULL);
    free(q), free(k), free(v), free(o), free(p);
    return CLMHA_SUCCESS;
}

// A float64 layer's user core gets doubles (clmha_core_args::dtype, scale_f64): its output and
// weights within the float64 contract of the reference.
Test(f64, user_core_gets_doubles) {
    clmha_context *ctx = fp64_context_or_skip();
    rand_case c = {.e = 16, .h = 2, .g = 2, .n = 2, .l = 5, .s = 7, .kdim = 16, .vdim = 16,
                   .bias = true, .packed = true, .need_weights = true};
    rand_call rc;
    clmha_layer *layer = make_call(ctx, &c, 77, &rc);
    int calls = 0;
    cr_assert_eq(clmha_layer_set_attention(layer, double_core, &calls), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    size_t oc = rc.output_count, wc = rc.weights_count;
    double *ro = malloc(oc * 8), *rw = malloc(wc * 8), *out = malloc(oc * 8), *w = malloc(wc * 8);
    char msg[256];
    cr_assert_eq(clmha_reference_forward(&rc.desc, &rc.params, &rc.args32, ro, oc, rw, wc, msg,
                                         sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    forward_host(layer, &rc.args64, out, oc, w, wc);
    cr_expect_eq(calls, 1);
    double eo = max_abs_err_d(out, ro, oc), ew = max_abs_err_d(w, rw, wc);
    fprintf(stderr, "f64 user core: output %.3g, weights %.3g\n", eo, ew);
    cr_expect(eo <= F64_CONTRACT && ew <= F64_CONTRACT, "output %.3g, weights %.3g", eo, ew);
    free(ro), free(rw), free(out), free(w);
    clmha_layer_release(layer);
    free_call(&rc);
    clmha_context_release(ctx);
}

// On a device without double precision, float64 layers cannot be made: clmha_layer_create() and
// clmha_layer_load_as() refuse them, saying why.
Test(f64, no_fp64_device) {
    clmha_context *ctx = context_or_skip();
    if (has_fp64(ctx)) {
        clmha_context_release(ctx);
        cr_skip_test("the device has double precision: float64 layers are not refused here");
    }
    clmha_layer_desc d = CLMHA_STRUCT_INIT(clmha_layer_desc);
    d.embed_dim = 4, d.num_heads = 2, d.bias = true, d.dtype = CLMHA_DTYPE_F64;
    clmha_layer *l = NULL;
    cr_expect_eq(clmha_layer_create(&l, ctx, &d), CLMHA_UNSUPPORTED);
    cr_expect_null(l);
    const char *msg = clmha_context_last_error(ctx);
    cr_expect(strstr(msg, "float64") || strstr(msg, "double"), "message: %s", msg);

    char dir[64], path[128];
    tmpdir_make(dir, sizeof dir, "clmha_f64");
    snprintf(path, sizeof path, "%s/layer.safetensors", dir);
    d.dtype = CLMHA_DTYPE_F32;
    clmha_layer *f32 = layer_or_fail(ctx, &d);
    cr_assert_eq(clmha_layer_save(f32, path), CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_expect_eq(clmha_layer_load_as(&l, ctx, path, CLMHA_DTYPE_F64), CLMHA_UNSUPPORTED);
    cr_expect_null(l);
    clmha_layer_release(f32);
    tmpdir_remove(dir);
    clmha_context_release(ctx);
}

// ---- parameters ---------------------------------------------------------------------------------

// @p count doubles of unit scale that float32 cannot hold.
static void unit_doubles(double *x, size_t count, double salt) {
    for (size_t i = 0; i < count; ++i) {
        x[i] = sin(1.0 + salt + 0.7 * (double)i) / 3.0;
        cr_assert_neq((double)(float)x[i], x[i], "%a is a float", x[i]);
    }
}

// A float64 layer keeps every parameter's doubles bit for bit, for the packed in_proj_weight
// (whose row blocks are q/k/v_proj_weight) and for separate projections with kdim, vdim and
// grouped-query attention.
Test(f64, parameters_round_trip_exact) {
    clmha_context *ctx = fp64_context_or_skip();
    clmha_layer_desc descs[2] = {CLMHA_STRUCT_INIT(clmha_layer_desc),
                                 CLMHA_STRUCT_INIT(clmha_layer_desc)};
    descs[0].embed_dim = 4, descs[0].num_heads = 2, descs[0].bias = true;
    descs[0].add_bias_kv = true;
    descs[1] = descs[0];
    descs[1].kdim = 3, descs[1].vdim = 5, descs[1].num_kv_heads = 1;
    for (size_t k = 0; k < 2; ++k) {
        descs[k].dtype = CLMHA_DTYPE_F64;
        clmha_layer *l = layer_or_fail(ctx, &descs[k]);
        size_t set = 0;
        for (size_t i = 0; i < NUM_PARAM_NAMES; ++i) {
            size_t n = clmha_layer_parameter_count(l, param_names[i]);
            if (n == 0) continue;
            double *x = malloc(n * sizeof *x), *got = malloc(n * sizeof *got);
            cr_assert(x && got, "out of memory");
            unit_doubles(x, n, (double)(k * NUM_PARAM_NAMES + i));
            cr_assert_eq(clmha_layer_set_parameter_f64(l, param_names[i], x, n), CLMHA_SUCCESS,
                         "%s: %s", param_names[i], clmha_context_last_error(ctx));
            cr_assert_eq(clmha_layer_get_parameter_f64(l, param_names[i], got, n), CLMHA_SUCCESS,
                         "%s: %s", param_names[i], clmha_context_last_error(ctx));
            for (size_t j = 0; j < n; ++j)
                cr_expect(got[j] == x[j], "layer %zu %s[%zu]: %a, set %a", k, param_names[i], j,
                          got[j], x[j]);
            free(x), free(got);
            ++set;
        }
        // Layer 0 has all 9 (q/k/v_proj_weight: in_proj_weight's row blocks), layer 1 all but
        // in_proj_weight.
        cr_expect_eq(set, k == 0 ? 9 : 8, "layer %zu: %zu parameters", k, set);
        if (k == 0) {  // k_proj_weight is rows E .. 2E of in_proj_weight
            double w[3 * 4 * 4], kw[4 * 4];
            cr_assert_eq(clmha_layer_get_parameter_f64(l, "in_proj_weight", w, 48),
                         CLMHA_SUCCESS);
            cr_assert_eq(clmha_layer_get_parameter_f64(l, "k_proj_weight", kw, 16),
                         CLMHA_SUCCESS);
            cr_expect(memcmp(kw, w + 16, sizeof kw) == 0, "k_proj_weight is not its row block");
        }
        clmha_layer_release(l);
    }
    clmha_context_release(ctx);
}

// clmha_layer_set_parameter() on a float64 layer widens the floats exactly, and
// clmha_layer_get_parameter() gives them back.
Test(f64, parameters_via_float_api) {
    clmha_context *ctx = fp64_context_or_skip();
    clmha_layer_desc d = CLMHA_STRUCT_INIT(clmha_layer_desc);
    d.embed_dim = 4, d.num_heads = 2, d.bias = true, d.dtype = CLMHA_DTYPE_F64;
    clmha_layer *l = layer_or_fail(ctx, &d);
    float w[48], back[48];
    double got[48];
    for (size_t i = 0; i < 48; ++i) w[i] = (float)sin(0.9 * (double)i + 0.2);
    cr_assert_eq(clmha_layer_set_parameter(l, "in_proj_weight", w, 48), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cr_assert_eq(clmha_layer_get_parameter_f64(l, "in_proj_weight", got, 48), CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_get_parameter(l, "in_proj_weight", back, 48), CLMHA_SUCCESS);
    for (size_t i = 0; i < 48; ++i) {
        cr_expect(got[i] == (double)w[i], "weight %zu: %a, set %a", i, got[i], (double)w[i]);
        cr_expect(back[i] == w[i], "weight %zu read as float: %a, set %a", i, (double)back[i],
                  (double)w[i]);
    }
    clmha_layer_release(l);
    clmha_context_release(ctx);
}

// clmha_layer_set_parameter_f64() on a layer of another dtype rounds the doubles to it through
// float32: the value that clmha_layer_set_parameter() of the doubles rounded to floats gives,
// which clmha_layer_get_parameter_f64() returns widened (for float32: (double)(float)x). Also
// the setters' refusals. Needs no double precision on the device.
Test(f64, set_parameter_f64_rounds_to_the_layer_dtype) {
    clmha_context *ctx = context_or_skip();
    const clmha_dtype dtypes[] = {CLMHA_DTYPE_F32, CLMHA_DTYPE_F16, CLMHA_DTYPE_BF16};
    double x[12], got[13];  // room for the refused count of 13
    float xf[12], via_float[12], zeros[12] = {0};
    unit_doubles(x, 12, 0.5);
    for (size_t i = 0; i < 12; ++i) xf[i] = (float)x[i];
    for (size_t t = 0; t < 3; ++t) {
        clmha_layer_desc d = CLMHA_STRUCT_INIT(clmha_layer_desc);
        d.embed_dim = 4, d.num_heads = 2, d.bias = true, d.dtype = dtypes[t];
        clmha_layer *l = layer_or_fail(ctx, &d);
        cr_assert_eq(clmha_layer_set_parameter(l, "in_proj_bias", xf, 12), CLMHA_SUCCESS);
        cr_assert_eq(clmha_layer_get_parameter(l, "in_proj_bias", via_float, 12), CLMHA_SUCCESS);
        // Zeros in between, so that a call that wrote nothing shows.
        cr_assert_eq(clmha_layer_set_parameter(l, "in_proj_bias", zeros, 12), CLMHA_SUCCESS);
        cr_assert_eq(clmha_layer_set_parameter_f64(l, "in_proj_bias", x, 12), CLMHA_SUCCESS,
                     "%s", clmha_context_last_error(ctx));
        cr_assert_eq(clmha_layer_get_parameter_f64(l, "in_proj_bias", got, 12), CLMHA_SUCCESS,
                     "%s", clmha_context_last_error(ctx));
        for (size_t i = 0; i < 12; ++i) {
            cr_expect(got[i] == (double)via_float[i], "dtype %d bias %zu: %a, expected %a",
                      (int)dtypes[t], i, got[i], (double)via_float[i]);
            if (dtypes[t] == CLMHA_DTYPE_F32)
                cr_expect(got[i] == (double)xf[i], "float32 bias %zu: %a, expected %a", i, got[i],
                          (double)xf[i]);
        }
        cr_expect_eq(clmha_layer_set_parameter_f64(l, "in_proj_bias", x, 11),
                     CLMHA_SHAPE_MISMATCH);
        cr_expect_eq(clmha_layer_get_parameter_f64(l, "in_proj_bias", got, 13),
                     CLMHA_SHAPE_MISMATCH);
        cr_expect_eq(clmha_layer_set_parameter_f64(l, "no_such_weight", x, 12),
                     CLMHA_INVALID_ARGUMENT);
        cr_expect_eq(clmha_layer_set_parameter_f64(l, "bias_k", x, 4), CLMHA_INVALID_ARGUMENT);
        cr_expect_eq(clmha_layer_set_parameter_f64(l, "in_proj_bias", NULL, 12),
                     CLMHA_INVALID_ARGUMENT);
        cr_expect_eq(clmha_layer_get_parameter_f64(l, "in_proj_bias", NULL, 12),
                     CLMHA_INVALID_ARGUMENT);
        clmha_layer_release(l);
    }
    clmha_context_release(ctx);
}

// clmha_layer_forward_host_f64() on a float32 layer: the inputs rounded to floats, the results
// widened exactly, i.e. clmha_layer_forward_host() on the rounded inputs, bit for bit. Needs no
// double precision on the device.
Test(f64, host_f64_on_a_float32_layer) {
    clmha_context *ctx = context_or_skip();
    enum { E = 8, H = 2, N = 2, L = 5, S = 7 };
    clmha_layer_desc d = CLMHA_STRUCT_INIT(clmha_layer_desc);
    d.embed_dim = E, d.num_heads = H, d.bias = true;
    clmha_layer *l = layer_or_fail(ctx, &d);
    double pw[3 * E * E];
    unit_doubles(pw, 3 * E * E, 2.0);
    cr_assert_eq(clmha_layer_set_parameter_f64(l, "in_proj_weight", pw, 3 * E * E),
                 CLMHA_SUCCESS);
    unit_doubles(pw, E * E, 3.0);
    cr_assert_eq(clmha_layer_set_parameter_f64(l, "out_proj.weight", pw, E * E), CLMHA_SUCCESS);
    double q[L * N * E], kv[S * N * E], m[L * S];
    float qf[L * N * E], kvf[S * N * E], mf[L * S];
    unit_doubles(q, L * N * E, 4.0);
    unit_doubles(kv, S * N * E, 5.0);
    unit_doubles(m, L * S, 6.0);
    for (size_t i = 0; i < L * N * E; ++i) qf[i] = (float)q[i];
    for (size_t i = 0; i < S * N * E; ++i) kvf[i] = (float)kv[i];
    for (size_t i = 0; i < L * S; ++i) mf[i] = (float)m[i];
    clmha_forward_args a = CLMHA_STRUCT_INIT(clmha_forward_args);
    a.query = (clmha_tensor){.ndim = 3, .shape = {L, N, E}, .data = qf};
    a.key = (clmha_tensor){.ndim = 3, .shape = {S, N, E}, .data = kvf};
    a.attn_mask = (clmha_mask){.kind = CLMHA_MASK_FLOAT,
                               .tensor = {.ndim = 2, .shape = {L, S}, .data = mf}};
    a.need_weights = true, a.per_head_weights = true;
    float out32[N * L * E], w32[N * H * L * S];
    double out64[N * L * E], w64[N * H * L * S];
    cr_assert_eq(clmha_layer_forward_host(l, &a, out32, N * L * E, w32, N * H * L * S),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    a.query.data = q, a.key.data = kv, a.attn_mask.tensor.data = m;
    fill_nan(out64, N * L * E);
    fill_nan(w64, N * H * L * S);
    cr_assert_eq(clmha_layer_forward_host_f64(l, &a, out64, N * L * E, w64, N * H * L * S),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    for (size_t i = 0; i < N * L * E; ++i)
        cr_expect(out64[i] == (double)out32[i], "output %zu: %a, the float call's %a", i,
                  out64[i], (double)out32[i]);
    for (size_t i = 0; i < N * H * L * S; ++i)
        cr_expect(w64[i] == (double)w32[i], "weight %zu: %a, the float call's %a", i, w64[i],
                  (double)w32[i]);
    clmha_layer_release(l);
    clmha_context_release(ctx);
}
