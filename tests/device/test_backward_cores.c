// The backward pass of the two attention cores at tile level (src/cores/fused_backward.c,
// src/cores/unfused_backward.c): random head tiles Q, K', V' go through the fused forward core
// (which saves the log-sum-exp rows), then through each core's backward hook, and dq, dk, dv
// (and the float masks' gradients, unfused) are compared with a double-precision computation
// written here from the math: P = softmax(scale·QK'ᵀ + masks), Pd = P·keep·keep_scale,
// O = Pd V', dPd = dO V'ᵀ (+ the weights gradient), dP = dPd·keep·keep_scale,
// Drow = Σ P dP, dS = P (dP − Drow), dq = scale dS K', dk = scale dSᵀ Q, dv = Pdᵀ dO.
// Also: the fused backward gives bit-identical results on two runs.
//
// Links libclmha.a: the cores' hooks are internal. CLMHA_BACKWARD_TIMING=1 adds a timing of
// both backward cores on N=1, H=8, L=S=1024, D=64 to the output (not an assertion).
#define _POSIX_C_SOURCE 200809L  // clock_gettime
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/philox.h"
#include "cores/core.h"
#include "cores/fused.h"
#include "cores/kernel_args.h"
#include "layer/layer.h"
#include "layer/shape.h"
#include "support.h"

CLMHA__HIDDEN extern const clmha__core clmha__core_fused, clmha__core_unfused;

// ---- cases --------------------------------------------------------------------------------------

typedef enum gw_mode { GW_NONE, GW_PER_HEAD, GW_AVERAGED } gw_mode;

// The layer's attn_mask forms: (L, S), (N*H, L, S), per_batch (N, L, S).
typedef enum attn_form { ATTN_NONE, ATTN_SHARED, ATTN_PER_HEAD, ATTN_PER_BATCH } attn_form;

typedef struct bcase {
    const char *name;
    size_t n, h, d, l, s;
    bool bias_kv, zero_attn, causal;
    clmha_mask_kind attn_kind;
    attn_form attn_layout;
    clmha_mask_kind kpm_kind;
    float dropout;
    gw_mode gw;
    bool dead_row;    // query row 1 of every plane fully masked (attn_mask, S' == S)
    bool accumulate;  // mask gradients added to what is there
    bool window;      // a sliding window: query i sees key j < S only when i - wl <= j <= i + wr
    int64_t wl, wr;   // (-1: that side unbounded)
} bcase;

// ---- host reference -----------------------------------------------------------------------------

typedef struct host_data {
    size_t planes, sp, attn_count, kpm_count, gw_count;
    float *q, *k, *v, *d_o, *gw;     // inputs
    unsigned char *attn_b, *kpm_b;  // bool masks
    float *attn_f, *kpm_f;          // float masks
    float *attn_g0, *kpm_g0;        // what the mask gradients hold before (accumulate)
    // reference
    double *o, *lse, *dq, *dk, *dv, *attn_g, *kpm_g;
} host_data;

static double mask_of(clmha_mask_kind kind, const unsigned char *b, const float *f, size_t idx) {
    if (kind == CLMHA_MASK_FLOAT) return f[idx];
    if (kind == CLMHA_MASK_BOOL_IGNORE) return b[idx] ? -INFINITY : 0.0;
    if (kind == CLMHA_MASK_BOOL_ATTEND) return b[idx] ? 0.0 : -INFINITY;
    return 0.0;
}

static size_t attn_index(const bcase *c, size_t bh, size_t i, size_t j) {
    size_t n = bh / c->h;
    switch (c->attn_layout) {
    case ATTN_SHARED: return i * c->s + j;
    case ATTN_PER_HEAD: return (bh * c->l + i) * c->s + j;
    case ATTN_PER_BATCH: return (n * c->l + i) * c->s + j;
    default: return 0;
    }
}

// The math of the top of this file, in double precision, one plane and query row at a time.
static void reference(const bcase *c, host_data *hd, clmha_dropout_rng rng) {
    size_t D = c->d, L = c->l, S = c->s, SP = hd->sp;
    double scale = 1.0 / sqrt((double)D);
    bool drop = c->dropout > 0.0f;
    uint32_t threshold = clmha__dropout_threshold(c->dropout);
    double keep_scale = drop ? (float)(1.0 / (1.0 - (double)c->dropout)) : 1.0;
    double *s = calloc(SP, sizeof *s), *p = calloc(SP, sizeof *p), *f = calloc(SP, sizeof *f),
           *ds = calloc(SP, sizeof *ds);
    cr_assert(s && p && f && ds);
    for (size_t bh = 0; bh < hd->planes; ++bh) {
        size_t n = bh / c->h, h = bh % c->h;
        for (size_t i = 0; i < L; ++i) {
            const float *qi = hd->q + (bh * L + i) * D, *doi = hd->d_o + (bh * L + i) * D;
            double m = -INFINITY;
            for (size_t j = 0; j < SP; ++j) {
                const float *kj = hd->k + (bh * SP + j) * D;
                double x = 0;
                for (size_t e = 0; e < D; ++e) x += (double)qi[e] * kj[e];
                x *= scale;
                if (j < S) {
                    if (c->attn_kind)
                        x += mask_of(c->attn_kind, hd->attn_b, hd->attn_f,
                                     attn_index(c, bh, i, j));
                    if (c->kpm_kind) x += mask_of(c->kpm_kind, hd->kpm_b, hd->kpm_f, n * S + j);
                    if (c->causal && j > i) x = -INFINITY;
                    if (c->window && ((c->wl >= 0 && (double)j < (double)i - (double)c->wl) ||
                                      (c->wr >= 0 && (double)j > (double)i + (double)c->wr)))
                        x = -INFINITY;
                }
                s[j] = x;
                if (x > m) m = x;
            }
            double sum = 0;
            for (size_t j = 0; j < SP; ++j) sum += m == -INFINITY ? 0.0 : exp(s[j] - m);
            hd->lse[bh * L + i] = m == -INFINITY ? -INFINITY : m + log(sum);
            for (size_t j = 0; j < SP; ++j) {
                p[j] = m == -INFINITY ? 0.0 : exp(s[j] - m) / sum;
                f[j] = !drop ? 1.0
                             : clmha__dropout_keep(rng, threshold, bh, i, j) ? keep_scale
                                                                              : 0.0;
            }
            double drow = 0;
            for (size_t j = 0; j < SP; ++j) {
                const float *vj = hd->v + (bh * SP + j) * D;
                double dpd = 0;
                for (size_t e = 0; e < D; ++e) dpd += (double)doi[e] * vj[e];
                if (c->gw == GW_PER_HEAD) dpd += hd->gw[(bh * L + i) * SP + j];
                if (c->gw == GW_AVERAGED) dpd += hd->gw[(n * L + i) * SP + j] / (double)c->h;
                ds[j] = dpd * f[j];  // dP for now
                drow += p[j] * ds[j];
            }
            double *o = hd->o + (bh * L + i) * D, *dq = hd->dq + (bh * L + i) * D;
            for (size_t j = 0; j < SP; ++j) {
                ds[j] = p[j] * (ds[j] - drow);
                const float *kj = hd->k + (bh * SP + j) * D, *vj = hd->v + (bh * SP + j) * D;
                double *dk = hd->dk + (bh * SP + j) * D, *dv = hd->dv + (bh * SP + j) * D;
                for (size_t e = 0; e < D; ++e) {
                    o[e] += p[j] * f[j] * vj[e];
                    dq[e] += scale * ds[j] * kj[e];
                    dk[e] += scale * ds[j] * qi[e];
                    dv[e] += p[j] * f[j] * doi[e];
                }
                if (j < S && c->attn_kind == CLMHA_MASK_FLOAT)
                    hd->attn_g[c->attn_layout == ATTN_PER_BATCH
                                   ? (n * L + i) * S + j
                                   : attn_index(c, bh, i, j)] += ds[j];
                if (j < S && c->kpm_kind == CLMHA_MASK_FLOAT) hd->kpm_g[n * S + j] += ds[j];
            }
            (void)h;
        }
    }
    free(s), free(p), free(f), free(ds);
}

// ---- device -------------------------------------------------------------------------------------

typedef struct fixture {
    clmha_context *ctx;
    clmha_layer *layer;
    cl_context cl;
    cl_command_queue queue;
} fixture;

// Asks @p core whether it runs forward call @p c: *yes when it answers CLMHA__CORE_RUNS.
static clmha_status fwd_asks(const clmha__core *core, clmha_layer *l, const clmha__core_call *c,
                             bool *yes) {
    clmha__core_answer a;
    clmha_status st = core->supports(l, c, &a);
    *yes = a.reason == CLMHA__CORE_RUNS;
    return st;
}

// Asks @p core whether it runs backward call @p c: *yes when it answers CLMHA__CORE_RUNS, else
// its reason in *why (kept until the next call).
static clmha_status bwd_asks(const clmha__core *core, clmha_layer *l,
                             const clmha__backward_call *c, bool *yes, const char **why) {
    static clmha__core_answer a;
    clmha_status st = core->backward_supports(l, c, &a);
    *yes = a.reason == CLMHA__CORE_RUNS;
    *why = *yes ? NULL : a.why;
    return st;
}

static cl_mem buffer_of(fixture *fx, size_t bytes, const void *data) {
    cl_int err;
    cl_mem m = clCreateBuffer(fx->cl, CL_MEM_READ_WRITE, bytes ? bytes : 4, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS, "clCreateBuffer: %d", err);
    if (data && bytes)
        cr_assert_eq(clEnqueueWriteBuffer(fx->queue, m, CL_TRUE, 0, bytes, data, 0, NULL, NULL),
                     CL_SUCCESS);
    return m;
}

static void read_floats(fixture *fx, cl_mem m, float *out, size_t count) {
    cr_assert_eq(clEnqueueReadBuffer(fx->queue, m, CL_TRUE, 0, count * sizeof(float), out, 0, NULL,
                                     NULL),
                 CL_SUCCESS);
}

static void fixture_make(fixture *fx, const bcase *c) {
    fx->ctx = context_or_skip();
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = c->h * c->d,
                             .num_heads = c->h, .bias = true, .add_bias_kv = c->bias_kv,
                             .add_zero_attn = c->zero_attn, .dropout = c->dropout,
                             .window = c->window, .window_left = c->wl,
                             .window_right = c->wr};
    clmha_status st = clmha_layer_create(&fx->layer, fx->ctx, &desc);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_layer_create: %s", clmha_context_last_error(fx->ctx));
    fx->cl = fx->ctx->cl_ctx;
    fx->queue = fx->ctx->queue;
}

static void fixture_free(fixture *fx) {
    clmha_layer_release(fx->layer);
    clmha_context_release(fx->ctx);
}

// Relative error of @p got against @p want, scaled as the tolerance is: max |got − want| /
// (1 + max |want|); -inf in want must be -inf in got.
static double rel_err(const float *got, const double *want, size_t count) {
    double worst = 0, big = 0;
    for (size_t i = 0; i < count; ++i) {
        if (isinf(want[i])) {
            if (!(isinf(got[i]) && (got[i] < 0) == (want[i] < 0))) return INFINITY;
            continue;
        }
        double e = fabs((double)got[i] - want[i]);
        if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
        if (fabs(want[i]) > big) big = fabs(want[i]);
    }
    return worst / (1.0 + big);
}

#define TOLERANCE 1e-4

typedef struct device_bufs {
    cl_mem q, k, v, o, lse, d_o, gw, attn, kpm, dq, dk, dv, attn_g, kpm_g, dummy;
} device_bufs;

// The forward arguments and dims of case @p c on buffers @p b.
static void forward_args_of(const bcase *c, const device_bufs *b, fixture *fx,
                            clmha_forward_args *fa, clmha__dims *dims) {
    size_t e = c->h * c->d;
    *fa = (clmha_forward_args){.struct_size = sizeof *fa,
                               .query = {.ndim = 3, .shape = {c->l, c->n, e}, .buffer = b->dummy},
                               .key = {.ndim = 3, .shape = {c->s, c->n, e}, .buffer = b->dummy},
                               .value = {.ndim = 3, .shape = {c->s, c->n, e}, .buffer = b->dummy},
                               .is_causal = c->causal,
                               .training = c->dropout > 0.0f,
                               .rng = {.seed = 0x1234567890abcdefull, .offset = 77},
                               .need_weights = c->gw != GW_NONE,
                               .per_head_weights = c->gw == GW_PER_HEAD,
                               .impl = CLMHA_IMPL_FUSED};
    if (c->attn_kind) {
        fa->attn_mask.kind = c->attn_kind;
        fa->attn_mask.per_batch = c->attn_layout == ATTN_PER_BATCH;
        fa->attn_mask.tensor.buffer = b->attn;
        if (c->attn_layout == ATTN_SHARED)
            fa->attn_mask.tensor = (clmha_tensor){.ndim = 2, .shape = {c->l, c->s}, .buffer = b->attn};
        else
            fa->attn_mask.tensor = (clmha_tensor){
                .ndim = 3,
                .shape = {c->attn_layout == ATTN_PER_HEAD ? c->n * c->h : c->n, c->l, c->s},
                .buffer = b->attn};
    }
    if (c->kpm_kind)
        fa->key_padding_mask = (clmha_mask){
            .kind = c->kpm_kind, .tensor = {.ndim = 2, .shape = {c->n, c->s}, .buffer = b->kpm}};
    char msg[512] = "";
    clmha_status st = clmha__dims_resolve(&fx->layer->desc, fa, dims, msg, sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "dims: %s", msg);
    (void)fx;
}

typedef struct case_result {
    double fwd_o, fwd_lse, err[2][5];  // [core][dq, dk, dv, attn grad, kpm grad]
} case_result;

// Runs case @p c: fills the inputs, runs the fused forward (lse saved) and the backward of
// @p cores (bit 0 fused, bit 1 unfused), checks against the reference.
static case_result run_case(const bcase *c, unsigned cores) {
    fixture fx;
    fixture_make(&fx, c);
    size_t planes = c->n * c->h, sp = c->s + c->bias_kv + c->zero_attn, D = c->d, L = c->l;
    size_t qn = planes * L * D, kn = planes * sp * D;
    host_data hd = {.planes = planes, .sp = sp};
    prng r = {.state = 0x9e3779b97f4a7c15ull ^ (c->n * 131 + c->d * 17 + L * 7 + c->s)};
    hd.q = uniform_floats(&r, qn, 1.5);
    hd.k = uniform_floats(&r, kn, 1.5);
    hd.v = uniform_floats(&r, kn, 1.0);
    hd.d_o = uniform_floats(&r, qn, 1.0);
    hd.attn_count = !c->attn_kind                             ? 0
                    : c->attn_layout == ATTN_SHARED    ? L * c->s
                    : c->attn_layout == ATTN_PER_BATCH ? c->n * L * c->s
                                                              : planes * L * c->s;
    hd.kpm_count = c->kpm_kind ? c->n * c->s : 0;
    hd.attn_b = calloc(hd.attn_count + 1, 1);
    hd.kpm_b = calloc(hd.kpm_count + 1, 1);
    hd.attn_f = alloc_floats(hd.attn_count);
    hd.kpm_f = alloc_floats(hd.kpm_count);
    hd.attn_g0 = uniform_floats(&r, hd.attn_count + 1, 1.0);
    hd.kpm_g0 = uniform_floats(&r, hd.kpm_count + 1, 1.0);
    for (size_t i = 0; i < hd.attn_count; ++i) {
        bool masked = prng_uniform(&r) < 0.2;
        hd.attn_b[i] = c->attn_kind == CLMHA_MASK_BOOL_ATTEND ? !masked : masked;
        hd.attn_f[i] = masked ? -INFINITY : (float)prng_normal(&r);
    }
    if (c->dead_row)  // row 1 of every plane: every key masked
        for (size_t i = 0; i < hd.attn_count; ++i)
            if ((i / c->s) % L == 1) {
                hd.attn_b[i] = c->attn_kind == CLMHA_MASK_BOOL_ATTEND ? 0 : 1;
                hd.attn_f[i] = -INFINITY;
            }
    for (size_t i = 0; i < hd.kpm_count; ++i) {
        bool masked = prng_uniform(&r) < 0.15;
        hd.kpm_b[i] = masked;
        hd.kpm_f[i] = masked ? -INFINITY : (float)prng_normal(&r);
    }
    hd.gw_count = c->gw == GW_PER_HEAD ? planes * L * sp : c->gw == GW_AVERAGED ? c->n * L * sp : 0;
    hd.gw = uniform_floats(&r, hd.gw_count + 1, 1.0);
    hd.o = calloc(qn, sizeof(double));
    hd.lse = calloc(planes * L, sizeof(double));
    hd.dq = calloc(qn, sizeof(double));
    hd.dk = calloc(kn, sizeof(double));
    hd.dv = calloc(kn, sizeof(double));
    hd.attn_g = calloc(hd.attn_count + 1, sizeof(double));
    hd.kpm_g = calloc(hd.kpm_count + 1, sizeof(double));
    cr_assert(hd.o && hd.lse && hd.dq && hd.dk && hd.dv && hd.attn_g && hd.kpm_g);
    if (c->accumulate) {
        for (size_t i = 0; i < hd.attn_count; ++i) hd.attn_g[i] = hd.attn_g0[i];
        for (size_t i = 0; i < hd.kpm_count; ++i) hd.kpm_g[i] = hd.kpm_g0[i];
    }

    device_bufs b = {0};
    b.dummy = buffer_of(&fx, 16, NULL);
    bool attn_float = c->attn_kind == CLMHA_MASK_FLOAT, kpm_float = c->kpm_kind == CLMHA_MASK_FLOAT;
    b.attn = c->attn_kind ? buffer_of(&fx, hd.attn_count * (attn_float ? 4 : 1),
                                      attn_float ? (void *)hd.attn_f : (void *)hd.attn_b)
                          : NULL;
    b.kpm = c->kpm_kind ? buffer_of(&fx, hd.kpm_count * (kpm_float ? 4 : 1),
                                    kpm_float ? (void *)hd.kpm_f : (void *)hd.kpm_b)
                        : NULL;
    clmha_forward_args fa;
    clmha__dims dims;
    forward_args_of(c, &b, &fx, &fa, &dims);
    cr_assert_eq(dims.s_padded, sp);

    // The fused forward on the layer's tiles, saving lse.
    clmha_layer *layer = fx.layer;
    cr_assert_eq(clmha__layer_reserve(layer, &dims, false, false), CLMHA_SUCCESS);
    cl_mem *t = layer->tiles;
    cr_assert_eq(clEnqueueWriteBuffer(fx.queue, t[CLMHA__TILE_Q], CL_TRUE, 0, qn * 4, hd.q, 0,
                                      NULL, NULL), CL_SUCCESS);
    cr_assert_eq(clEnqueueWriteBuffer(fx.queue, t[CLMHA__TILE_K], CL_TRUE, 0, kn * 4, hd.k, 0,
                                      NULL, NULL), CL_SUCCESS);
    cr_assert_eq(clEnqueueWriteBuffer(fx.queue, t[CLMHA__TILE_V], CL_TRUE, 0, kn * 4, hd.v, 0,
                                      NULL, NULL), CL_SUCCESS);
    b.lse = buffer_of(&fx, planes * L * 4, NULL);
    clmha__core_call call = {.args = &fa, .dims = &dims, .lse = b.lse};
    bool yes = false;
    cr_assert_eq(fwd_asks(&clmha__core_fused, layer, &call, &yes), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(fx.ctx));
    if (!yes && clmha__fused_loop_limit(layer)) {
        // A driver whose loops end early (Mesa's llvmpipe): the fused forward does not run
        // this case, and this test needs its O and lse. The layer-level tests cover the
        // backward there (test_backward, test_backward_random).
        fprintf(stderr, "%-28s skipped: the fused core does not run it on this driver (loop "
                "limit %zu)\n", c->name, clmha__fused_loop_limit(layer));
        goto release;
    }
    cr_assert(yes, "the fused forward core must run %s", c->name);
    cr_assert_eq(clmha__core_fused.run(layer, &call), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(fx.ctx));
    cr_assert(call.lse_written);

    // What a saved object would hold: copies of the tiles at offset 0.
    b.q = buffer_of(&fx, qn * 4, hd.q);
    b.k = buffer_of(&fx, kn * 4, hd.k);
    b.v = buffer_of(&fx, kn * 4, hd.v);
    b.o = buffer_of(&fx, qn * 4, NULL);
    cr_assert_eq(clEnqueueCopyBuffer(fx.queue, t[CLMHA__TILE_OUT], b.o, 0, 0, qn * 4, 0, NULL,
                                     NULL), CL_SUCCESS);
    b.d_o = buffer_of(&fx, qn * 4, hd.d_o);
    b.gw = c->gw ? buffer_of(&fx, hd.gw_count * 4, hd.gw) : NULL;
    b.dq = buffer_of(&fx, qn * 4, NULL);
    b.dk = buffer_of(&fx, kn * 4, NULL);
    b.dv = buffer_of(&fx, kn * 4, NULL);

    reference(c, &hd, fa.rng);
    case_result res = {0};
    float *got = alloc_floats(qn > kn ? qn : kn);
    read_floats(&fx, b.o, got, qn);
    res.fwd_o = rel_err(got, hd.o, qn);
    read_floats(&fx, b.lse, got, planes * L);
    res.fwd_lse = rel_err(got, hd.lse, planes * L);
    cr_expect(res.fwd_o <= TOLERANCE && res.fwd_lse <= TOLERANCE,
              "%s: forward o %.3g lse %.3g", c->name, res.fwd_o, res.fwd_lse);

    const clmha__core *core_list[2] = {&clmha__core_fused, &clmha__core_unfused};
    for (int ci = 0; ci < 2; ++ci) {
        if (!(cores & (1u << ci))) continue;
        bool unfused = ci == 1;
        bool want_attn_g = unfused && attn_float, want_kpm_g = unfused && kpm_float;
        b.attn_g = want_attn_g ? buffer_of(&fx, hd.attn_count * 4, hd.attn_g0) : NULL;
        b.kpm_g = want_kpm_g ? buffer_of(&fx, hd.kpm_count * 4, hd.kpm_g0) : NULL;
        clmha__backward_call bc = {.args = &fa, .dims = &dims, .q = b.q, .k = b.k, .v = b.v,
                                   .o = b.o, .lse = b.lse, .d_o = b.d_o,
                                   .grad_weights = b.gw, .dq = b.dq, .dk = b.dk, .dv = b.dv,
                                   .grad_attn_mask = b.attn_g, .grad_kpm = b.kpm_g,
                                   .grad_attn_accumulate = c->accumulate,
                                   .grad_kpm_accumulate = c->accumulate};
        const clmha__core *core = core_list[ci];
        const char *why = NULL;
        yes = false;
        cr_assert_eq(bwd_asks(core, layer, &bc, &yes, &why), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(fx.ctx));
        cr_assert(yes, "%s: the %s backward must run it (%s)", c->name, core->name,
                  why ? why : "");
        cr_assert_eq(core->backward(layer, &bc), CLMHA_SUCCESS, "%s: %s", c->name,
                     clmha_context_last_error(fx.ctx));
        read_floats(&fx, b.dq, got, qn);
        res.err[ci][0] = rel_err(got, hd.dq, qn);
        read_floats(&fx, b.dk, got, kn);
        res.err[ci][1] = rel_err(got, hd.dk, kn);
        read_floats(&fx, b.dv, got, kn);
        res.err[ci][2] = rel_err(got, hd.dv, kn);
        if (want_attn_g) {
            float *g = alloc_floats(hd.attn_count);
            read_floats(&fx, b.attn_g, g, hd.attn_count);
            res.err[ci][3] = rel_err(g, hd.attn_g, hd.attn_count);
            free(g);
        }
        if (want_kpm_g) {
            float *g = alloc_floats(hd.kpm_count);
            read_floats(&fx, b.kpm_g, g, hd.kpm_count);
            res.err[ci][4] = rel_err(g, hd.kpm_g, hd.kpm_count);
            free(g);
        }
        fprintf(stderr,
                "%-28s %-7s dq %.2e dk %.2e dv %.2e attn_g %.2e kpm_g %.2e (forward o %.2e lse "
                "%.2e)\n",
                c->name, core->name, res.err[ci][0], res.err[ci][1], res.err[ci][2],
                res.err[ci][3], res.err[ci][4], res.fwd_o, res.fwd_lse);
        for (int k = 0; k < 5; ++k)
            cr_expect(res.err[ci][k] <= TOLERANCE, "%s: %s backward, gradient %d: error %.3g",
                      c->name, core->name, k, res.err[ci][k]);
        if (b.attn_g) clReleaseMemObject(b.attn_g);
        if (b.kpm_g) clReleaseMemObject(b.kpm_g);
    }
    free(got);
release:;
    cl_mem all[] = {b.q, b.k, b.v, b.o, b.lse, b.d_o, b.gw, b.attn, b.kpm, b.dq, b.dk, b.dv,
                    b.dummy};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i)
        if (all[i]) clReleaseMemObject(all[i]);
    free(hd.q), free(hd.k), free(hd.v), free(hd.d_o), free(hd.gw), free(hd.attn_b),
        free(hd.kpm_b), free(hd.attn_f), free(hd.kpm_f), free(hd.attn_g0), free(hd.kpm_g0);
    free(hd.o), free(hd.lse), free(hd.dq), free(hd.dk), free(hd.dv), free(hd.attn_g),
        free(hd.kpm_g);
    fixture_free(&fx);
    return res;
}

#define BOTH 3u
#define UNFUSED_ONLY 2u

// ---- tests --------------------------------------------------------------------------------------

Test(backward_cores, head_dims_and_ragged_lengths) {
    // S' = 51 + bias_k + zero row = 53, L = 37: neither a multiple of any tile.
    static const size_t dims[] = {8, 16, 64};
    for (size_t i = 0; i < 3; ++i) {
        char name[64];
        snprintf(name, sizeof name, "D=%zu L=37 S'=53", dims[i]);
        bcase c = {.name = name, .n = 2, .h = 2, .d = dims[i], .l = 37, .s = 51,
                   .bias_kv = true, .zero_attn = true};
        run_case(&c, BOTH);
    }
}

Test(backward_cores, length_one) {
    bcase a = {.name = "L=1 S'=1", .n = 2, .h = 3, .d = 16, .l = 1, .s = 1};
    run_case(&a, BOTH);
    bcase b = {.name = "L=1 S'=53", .n = 1, .h = 2, .d = 8, .l = 1, .s = 52, .zero_attn = true};
    run_case(&b, BOTH);
    bcase c = {.name = "L=37 S'=1", .n = 1, .h = 2, .d = 8, .l = 37, .s = 1};
    run_case(&c, BOTH);
}

Test(backward_cores, causal) {
    bcase a = {.name = "causal L=37 S=83", .n = 2, .h = 2, .d = 16, .l = 37, .s = 83,
               .causal = true};
    run_case(&a, BOTH);
    bcase b = {.name = "causal L=150 S=37 +kv", .n = 1, .h = 2, .d = 16, .l = 150, .s = 37,
               .causal = true, .bias_kv = true};
    run_case(&b, BOTH);
    bcase c = {.name = "causal L=S=200", .n = 1, .h = 2, .d = 8, .l = 200, .s = 200,
               .causal = true};
    run_case(&c, BOTH);
}

Test(backward_cores, masks) {
    static const struct {
        const char *name;
        clmha_mask_kind kind;
        attn_form layout;
    } m[] = {{"bool-ignore shared", CLMHA_MASK_BOOL_IGNORE, ATTN_SHARED},
             {"bool-attend per head", CLMHA_MASK_BOOL_ATTEND, ATTN_PER_HEAD},
             {"bool-ignore per batch", CLMHA_MASK_BOOL_IGNORE, ATTN_PER_BATCH},
             {"float shared", CLMHA_MASK_FLOAT, ATTN_SHARED},
             {"float per head", CLMHA_MASK_FLOAT, ATTN_PER_HEAD},
             {"float per batch", CLMHA_MASK_FLOAT, ATTN_PER_BATCH}};
    for (size_t i = 0; i < sizeof m / sizeof m[0]; ++i) {
        bcase c = {.name = m[i].name, .n = 2, .h = 3, .d = 16, .l = 37, .s = 45,
                   .bias_kv = true, .attn_kind = m[i].kind, .attn_layout = m[i].layout};
        run_case(&c, BOTH);
    }
    bcase k1 = {.name = "kpm bool", .n = 2, .h = 2, .d = 16, .l = 37, .s = 45,
                .kpm_kind = CLMHA_MASK_BOOL_IGNORE};
    run_case(&k1, BOTH);
    bcase k2 = {.name = "kpm float + attn float", .n = 3, .h = 2, .d = 8, .l = 21, .s = 45,
                .kpm_kind = CLMHA_MASK_FLOAT, .attn_kind = CLMHA_MASK_FLOAT,
                .attn_layout = ATTN_SHARED, .zero_attn = true, .causal = true};
    run_case(&k2, BOTH);
    bcase k3 = {.name = "mask grads accumulate", .n = 2, .h = 2, .d = 8, .l = 19, .s = 23,
                .kpm_kind = CLMHA_MASK_FLOAT, .attn_kind = CLMHA_MASK_FLOAT,
                .attn_layout = ATTN_PER_BATCH, .accumulate = true};
    run_case(&k3, UNFUSED_ONLY);
}

Test(backward_cores, fully_masked_row) {
    bcase a = {.name = "dead row bool", .n = 1, .h = 2, .d = 16, .l = 37, .s = 53,
               .attn_kind = CLMHA_MASK_BOOL_IGNORE, .attn_layout = ATTN_SHARED,
               .dead_row = true};
    run_case(&a, BOTH);
    bcase b = {.name = "dead row float", .n = 2, .h = 2, .d = 8, .l = 5, .s = 9,
               .attn_kind = CLMHA_MASK_FLOAT, .attn_layout = ATTN_PER_HEAD,
               .dead_row = true};
    run_case(&b, BOTH);
}

Test(backward_cores, dropout) {
    bcase a = {.name = "dropout 0.3", .n = 2, .h = 2, .d = 16, .l = 37, .s = 51,
               .bias_kv = true, .zero_attn = true, .dropout = 0.3f};
    run_case(&a, BOTH);
    bcase b = {.name = "dropout 0.3 causal kpm", .n = 2, .h = 2, .d = 64, .l = 70, .s = 70,
               .dropout = 0.3f, .causal = true, .kpm_kind = CLMHA_MASK_FLOAT};
    run_case(&b, BOTH);
}

Test(backward_cores, grad_weights) {
    bcase a = {.name = "grad_weights per head", .n = 2, .h = 3, .d = 8, .l = 37, .s = 51,
               .bias_kv = true, .gw = GW_PER_HEAD, .dropout = 0.3f};
    run_case(&a, UNFUSED_ONLY);
    bcase b = {.name = "grad_weights averaged", .n = 2, .h = 3, .d = 16, .l = 37, .s = 51,
               .zero_attn = true, .gw = GW_AVERAGED, .causal = true};
    run_case(&b, UNFUSED_ONLY);
}

// The fused backward's products in GEMMs (the default where the GEMMs run in the host BLAS),
// with blocks so small that every shape runs in several blocks of query rows (the later ones
// adding into dk and dv, with is_causal over fewer keys) or of planes (groups of 3 of 4).
Test(backward_cores, fused_gemms_in_blocks) {
    setenv("CLMHA_FUSED_BACKWARD", "gemms", 1);
    bcase a = {.name = "gemms: causal L=S=200 rows", .n = 1, .h = 2, .d = 8, .l = 200,
               .s = 200, .causal = true};
    clmha__test_set_fused_backward_block(48 * 200);  // blocks of 48 rows, the last of 8
    run_case(&a, BOTH);
    bcase b = {.name = "gemms: causal L=37 S=83 rows", .n = 2, .h = 2, .d = 16, .l = 37,
               .s = 83, .causal = true, .kpm_kind = CLMHA_MASK_FLOAT};
    clmha__test_set_fused_backward_block(10 * 83);
    run_case(&b, BOTH);
    bcase c = {.name = "gemms: masks +kv +zero planes", .n = 2, .h = 2, .d = 16, .l = 37,
               .s = 45, .bias_kv = true, .zero_attn = true, .attn_kind = CLMHA_MASK_FLOAT,
               .attn_layout = ATTN_PER_BATCH};
    clmha__test_set_fused_backward_block(3 * 37 * 47);  // 3 planes per block, then 1
    run_case(&c, BOTH);
    bcase d = {.name = "gemms: dropout causal rows", .n = 2, .h = 2, .d = 64, .l = 70,
               .s = 70, .dropout = 0.3f, .causal = true, .attn_kind = CLMHA_MASK_BOOL_IGNORE,
               .attn_layout = ATTN_SHARED, .dead_row = true};
    clmha__test_set_fused_backward_block(16 * 70);
    run_case(&d, BOTH);
    bcase e = {.name = "gemms: causal L=150 S=37 +kv", .n = 1, .h = 2, .d = 16, .l = 150,
               .s = 37, .causal = true, .bias_kv = true};
    clmha__test_set_fused_backward_block(1);  // one row per block
    run_case(&e, BOTH);
    clmha__test_set_fused_backward_block(0);
    // Whole planes in one block: batched products of 8 items of ~1 M multiply-adds, 8.7 M in
    // all, which oneDNN's OpenMP team shares out item by item (clmha__host_blas_sgemm_batch()).
    bcase f = {.name = "gemms: 8 planes shared", .n = 2, .h = 4, .d = 64, .l = 130, .s = 129,
               .causal = true, .zero_attn = true};
    run_case(&f, BOTH);
}

// Sliding windows through the fused backward: the products in GEMMs in blocks of query rows
// (each block over the real keys its rows may see, the appended keys apart, onto dq, dk and dv
// zeroed first) and of planes, then the tiled kernels (query and key tiles outside every window
// skipped); rows whose window holds no key (dq 0) and keys no row sees (dk, dv 0). The unfused
// backward (masked_softmax's window) alongside.
Test(backward_cores, fused_window) {
    setenv("CLMHA_FUSED_BACKWARD", "gemms", 1);
    bcase a = {.name = "gemms: window (17, 0) causal L=S=200, blocks of 48 rows", .n = 1,
               .h = 2, .d = 8, .l = 200, .s = 200, .causal = true, .window = true, .wl = 17,
               .wr = 0};
    clmha__test_set_fused_backward_block(48 * 200);
    run_case(&a, BOTH);
    bcase b = {.name = "gemms: window (5, 7) L=150 S=83 +kv +zero kpm, blocks of 10 rows",
               .n = 2, .h = 2, .d = 16, .l = 150, .s = 83, .bias_kv = true, .zero_attn = true,
               .kpm_kind = CLMHA_MASK_FLOAT, .window = true, .wl = 5, .wr = 7};
    clmha__test_set_fused_backward_block(10 * 85);
    run_case(&b, BOTH);
    bcase c = {.name = "gemms: window (0, 0) L=37 S=83 +zero, one row a block", .n = 1, .h = 2,
               .d = 16, .l = 37, .s = 83, .zero_attn = true, .window = true, .wl = 0, .wr = 0};
    clmha__test_set_fused_backward_block(84);  // S' floats: one row a block
    run_case(&c, BOTH);
    bcase d = {.name = "gemms: window (-1, 3) dropout attn float, 3 planes a block", .n = 2,
               .h = 2, .d = 16, .l = 37, .s = 45, .dropout = 0.3f, .attn_kind = CLMHA_MASK_FLOAT,
               .attn_layout = ATTN_PER_BATCH, .window = true, .wl = -1, .wr = 3};
    clmha__test_set_fused_backward_block(3 * 37 * 45);
    run_case(&d, BOTH);
    bcase e = {.name = "gemms: window (2, 2) L=100 S=20, rows past every key, blocks of 16",
               .n = 1, .h = 2, .d = 8, .l = 100, .s = 20, .window = true, .wl = 2, .wr = 2};
    clmha__test_set_fused_backward_block(16 * 20);
    run_case(&e, BOTH);
    // Blocks sized by the window (about span / 4 rows, a power of two, over at most rows + span
    // keys) rather than by S': 16 rows where S' takes 10 (9).
    bcase g = {.name = "gemms: window (100, 0) causal L=S=200, blocks of 16 rows by the window",
               .n = 1, .h = 2, .d = 8, .l = 200, .s = 200, .causal = true, .window = true,
               .wl = 100, .wr = 0};
    clmha__test_set_fused_backward_block(10 * 200);
    run_case(&g, BOTH);
    bcase h = {.name = "gemms: window (40, 24) L=S=150 +zero, blocks of 16 rows by the window",
               .n = 2, .h = 2, .d = 16, .l = 150, .s = 150, .zero_attn = true, .window = true,
               .wl = 40, .wr = 24};
    clmha__test_set_fused_backward_block(9 * 151);
    run_case(&h, BOTH);
    clmha__test_set_fused_backward_block(0);
    setenv("CLMHA_FUSED_BACKWARD", "kernels", 1);
    a.name = "kernels: window (17, 0) causal L=S=200";
    run_case(&a, BOTH);
    b.name = "kernels: window (5, 7) L=150 S=83 +kv +zero kpm";
    run_case(&b, BOTH);
    e.name = "kernels: window (2, 2) L=100 S=20, rows past every key";
    run_case(&e, BOTH);
    bcase f = {.name = "kernels: window (70, 1) L=37 S=200 dropout", .n = 2, .h = 2, .d = 64,
               .l = 37, .s = 200, .dropout = 0.3f, .window = true, .wl = 70, .wr = 1};
    run_case(&f, BOTH);
    unsetenv("CLMHA_FUSED_BACKWARD");
}

// The tiled kernels of the fused backward, also where the GEMMs run in the host BLAS (there
// the products run in GEMMs by default).
Test(backward_cores, fused_tiled_kernels) {
    setenv("CLMHA_FUSED_BACKWARD", "kernels", 1);
    bcase a = {.name = "kernels: causal +kv +zero", .n = 2, .h = 2, .d = 16, .l = 37, .s = 51,
               .bias_kv = true, .zero_attn = true, .causal = true,
               .kpm_kind = CLMHA_MASK_BOOL_IGNORE};
    run_case(&a, BOTH);
    bcase b = {.name = "kernels: dropout masks", .n = 2, .h = 2, .d = 64, .l = 70, .s = 70,
               .dropout = 0.3f, .attn_kind = CLMHA_MASK_FLOAT,
               .attn_layout = ATTN_PER_HEAD, .dead_row = true};
    run_case(&b, BOTH);
}

// The fused backward refuses what it cannot do, with a reason (the loop limit only matters to
// the tiled kernels: they are asked for).
Test(backward_cores, fused_refusals) {
    setenv("CLMHA_FUSED_BACKWARD", "kernels", 1);
    bcase c = {.name = "refusals", .n = 1, .h = 1, .d = 8, .l = 4, .s = 4};
    fixture fx;
    fixture_make(&fx, &c);
    device_bufs b = {.dummy = buffer_of(&fx, 16, NULL)};
    clmha_forward_args fa;
    clmha__dims dims;
    forward_args_of(&c, &b, &fx, &fa, &dims);
    clmha__backward_call bc = {.args = &fa, .dims = &dims};
    bool yes = true;
    const char *why = NULL;
    cr_assert_eq(bwd_asks(&clmha__core_fused, fx.layer, &bc, &yes, &why), CLMHA_SUCCESS);
    cr_assert(!yes && why, "no lse: refused");
    bc.lse = b.dummy;
    bc.grad_weights = b.dummy;
    cr_assert_eq(bwd_asks(&clmha__core_fused, fx.layer, &bc, &yes, &why), CLMHA_SUCCESS);
    cr_assert(!yes && why, "grad_weights: refused");
    bc.grad_weights = NULL;
    bc.grad_kpm = b.dummy;
    cr_assert_eq(bwd_asks(&clmha__core_fused, fx.layer, &bc, &yes, &why), CLMHA_SUCCESS);
    cr_assert(!yes && why, "mask gradient: refused");
    bc.grad_kpm = NULL;
    clmha__test_set_loop_limit(2);
    cr_assert_eq(bwd_asks(&clmha__core_fused, fx.layer, &bc, &yes, &why), CLMHA_SUCCESS);
    clmha__test_set_loop_limit(0);
    cr_assert(!yes && why, "past the loop limit: refused");
    cr_assert_eq(bwd_asks(&clmha__core_fused, fx.layer, &bc, &yes, &why), CLMHA_SUCCESS);
    cr_assert(yes, "%s", why ? why : "");
    clReleaseMemObject(b.dummy);
    fixture_free(&fx);
}

// Runs @p core's backward on @p bc @p reps times; returns the mean seconds per run.
static double time_backward(fixture *fx, const clmha__core *core, clmha__backward_call *bc,
                            int reps) {
    cr_assert_eq(core->backward(fx->layer, bc), CLMHA_SUCCESS);  // warm-up (builds, allocates)
    clFinish(fx->queue);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < reps; ++i) cr_assert_eq(core->backward(fx->layer, bc), CLMHA_SUCCESS);
    clFinish(fx->queue);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return ((double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec)) / reps;
}

// Same data, two runs of the fused backward: bit-identical gradients. With
// CLMHA_BACKWARD_TIMING set, the larger shape N=1, H=8, L=S=1024, D=64 and a timing of both
// cores on it.
Test(backward_cores, fused_deterministic) {
    bool timing = getenv("CLMHA_BACKWARD_TIMING") != NULL;
    bcase c = timing ? (bcase){.name = "timing", .n = 1, .h = 8, .d = 64, .l = 1024, .s = 1024}
                     : (bcase){.name = "determinism", .n = 2, .h = 2, .d = 16, .l = 77, .s = 61,
                               .dropout = 0.3f, .causal = true, .zero_attn = true};
    fixture fx;
    fixture_make(&fx, &c);
    size_t planes = c.n * c.h, sp = c.s + c.zero_attn, qn = planes * c.l * c.d,
           kn = planes * sp * c.d;
    prng r = {.state = 42};
    float *q = uniform_floats(&r, qn, 1.0), *k = uniform_floats(&r, kn, 1.0),
          *v = uniform_floats(&r, kn, 1.0), *d_o = uniform_floats(&r, qn, 1.0);
    device_bufs b = {.dummy = buffer_of(&fx, 16, NULL)};
    clmha_forward_args fa;
    clmha__dims dims;
    forward_args_of(&c, &b, &fx, &fa, &dims);
    clmha_layer *layer = fx.layer;
    cr_assert_eq(clmha__layer_reserve(layer, &dims, false, false), CLMHA_SUCCESS);
    cr_assert_eq(clEnqueueWriteBuffer(fx.queue, layer->tiles[CLMHA__TILE_Q], CL_TRUE, 0, qn * 4,
                                      q, 0, NULL, NULL), CL_SUCCESS);
    cr_assert_eq(clEnqueueWriteBuffer(fx.queue, layer->tiles[CLMHA__TILE_K], CL_TRUE, 0, kn * 4,
                                      k, 0, NULL, NULL), CL_SUCCESS);
    cr_assert_eq(clEnqueueWriteBuffer(fx.queue, layer->tiles[CLMHA__TILE_V], CL_TRUE, 0, kn * 4,
                                      v, 0, NULL, NULL), CL_SUCCESS);
    b.lse = buffer_of(&fx, planes * c.l * 4, NULL);
    clmha__core_call call = {.args = &fa, .dims = &dims, .lse = b.lse};
    bool yes = false;
    cr_assert_eq(fwd_asks(&clmha__core_fused, layer, &call, &yes), CLMHA_SUCCESS);
    cr_assert(yes);
    cr_assert_eq(clmha__core_fused.run(layer, &call), CLMHA_SUCCESS);
    b.q = buffer_of(&fx, qn * 4, q);
    b.k = buffer_of(&fx, kn * 4, k);
    b.v = buffer_of(&fx, kn * 4, v);
    b.o = buffer_of(&fx, qn * 4, NULL);
    cr_assert_eq(clEnqueueCopyBuffer(fx.queue, layer->tiles[CLMHA__TILE_OUT], b.o, 0, 0, qn * 4,
                                     0, NULL, NULL), CL_SUCCESS);
    b.d_o = buffer_of(&fx, qn * 4, d_o);
    b.dq = buffer_of(&fx, qn * 4, NULL);
    b.dk = buffer_of(&fx, kn * 4, NULL);
    b.dv = buffer_of(&fx, kn * 4, NULL);
    clmha__backward_call bc = {.args = &fa, .dims = &dims, .q = b.q, .k = b.k, .v = b.v,
                               .o = b.o, .lse = b.lse, .d_o = b.d_o, .dq = b.dq, .dk = b.dk,
                               .dv = b.dv};
    const char *why = NULL;
    cr_assert_eq(bwd_asks(&clmha__core_fused, layer, &bc, &yes, &why), CLMHA_SUCCESS);
    cr_assert(yes, "%s", why ? why : "");
    float *first[3], *second[3];
    size_t counts[3] = {qn, kn, kn};
    cl_mem outs[3] = {b.dq, b.dk, b.dv};
    for (int run = 0; run < 2; ++run) {
        cr_assert_eq(clmha__core_fused.backward(layer, &bc), CLMHA_SUCCESS);
        for (int i = 0; i < 3; ++i) {
            float *dst = alloc_floats(counts[i]);
            read_floats(&fx, outs[i], dst, counts[i]);
            (run ? second : first)[i] = dst;
        }
    }
    for (int i = 0; i < 3; ++i) {
        cr_expect(memcmp(first[i], second[i], counts[i] * sizeof(float)) == 0,
                  "gradient %d differs between two runs", i);
        free(first[i]), free(second[i]);
    }
    if (timing) {
        double tf = time_backward(&fx, &clmha__core_fused, &bc, 3);
        cr_assert_eq(bwd_asks(&clmha__core_unfused, layer, &bc, &yes, &why),
                     CLMHA_SUCCESS);
        cr_assert(yes);
        double tu = time_backward(&fx, &clmha__core_unfused, &bc, 3);
        fprintf(stderr,
                "timing N=1 H=8 L=S=1024 D=64: fused backward %.1f ms (tile %zu), unfused "
                "backward %.1f ms\n",
                tf * 1e3, clmha__fused_backward_tile(layer), tu * 1e3);
    }
    cl_mem all[] = {b.q, b.k, b.v, b.o, b.lse, b.d_o, b.dq, b.dk, b.dv, b.dummy};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) clReleaseMemObject(all[i]);
    free(q), free(k), free(v), free(d_o);
    fixture_free(&fx);
}
