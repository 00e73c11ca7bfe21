// Attention as a function against PyTorch: every case of tests/golden/sdpa (written by
// tools/make_sdpa_golden.py: scaled_dot_product_attention's semantics in float64, forward and
// backward by autograd) through
//   - clmha_attention_forward_host() with CLMHA_IMPL_AUTO (output), CLMHA_IMPL_FUSED (output and
//     the log-sum-exp rows) and CLMHA_IMPL_UNFUSED (output and the weights);
//   - clmha_attention_backward_host() (dq, dk, dv and a float mask's gradient);
//   - clmha_attention_forward() + clmha_attention_backward() on device buffers with the
//     forward's lse and CLMHA_IMPL_FUSED (the fused core's backward: dq, dk, dv, and with sinks
//     grad_sinks, from the lse; clmha_attention_backward_host() has no sinks gradient).
// Each result's max abs error against the float64 golden must be at most
// TOLERANCE * (1 + max|golden|) (float32 compute, unit-scale inputs). A device that keeps the
// fused core from a case (Mesa llvmpipe's loop limit: CLMHA_UNSUPPORTED naming it) skips the
// fused turns, said on the log. One line per case and a summary go to stderr:
//   sdpa golden: <case> output ... lse ... weights ... dq ... dk ... dv ... dmask ... dsinks ...
//   sdpa golden: N cases, M checks, worst output ..., lse ..., ...
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "golden.h"
#include "golden_call.h"
#include "support.h"

#define TOLERANCE 2e-5

static const char *const case_names[] = {
#include "golden/sdpa/cases.inc"
};
#define NUM_CASES (sizeof case_names / sizeof *case_names)

// The quantities compared, by the golden tensor that holds each.
enum { Q_OUT, Q_LSE, Q_W, Q_DQ, Q_DK, Q_DV, Q_DMASK, Q_DSINKS, NUM_Q };
static const char *const q_tensor[NUM_Q] = {"output",   "lse",        "weights",
                                            "grad.query", "grad.key", "grad.value",
                                            "grad.attn_mask", "grad.sinks"};
static const char *const q_label[NUM_Q] = {"output", "lse", "weights", "dq",
                                           "dk",     "dv",  "dmask",   "dsinks"};

// The worst error of each quantity in the current case (-1: not checked) and over the run.
static double case_worst[NUM_Q], run_worst[NUM_Q];
static size_t checks_run;

// Largest |x| over the finite values of @p x.
static double finite_max_abs(const double *x, size_t count) {
    double m = 0.0;
    for (size_t i = 0; i < count; ++i)
        if (isfinite(x[i]) && fabs(x[i]) > m) m = fabs(x[i]);
    return m;
}

// Largest |got - want|, where equal infinities (a fully masked row's lse) agree and a NaN or
// any other infinite difference counts as +inf.
static double err_of(const float *got, const double *want, size_t count) {
    double worst = 0.0;
    for (size_t i = 0; i < count; ++i) {
        if (isinf(want[i]) && (double)got[i] == want[i]) continue;
        double e = fabs((double)got[i] - want[i]);
        if (!(e <= worst)) worst = isnan(e) ? INFINITY : e;
    }
    return worst;
}

// Compares @p got with the case's golden quantity @p q; @p how names the path.
static void check(const golden_case *gc, int q, const char *how, const float *got) {
    const golden_tensor *want = golden_find(gc, q_tensor[q]);
    cr_assert(want, "%s: no %s", gc->name, q_tensor[q]);
    double err = err_of(got, want->f64, want->count);
    double bound = TOLERANCE * (1.0 + finite_max_abs(want->f64, want->count));
    cr_expect(err <= bound, "%s, %s (%s): max abs error %.3g > %.3g", gc->name, q_label[q], how,
              err, bound);
    if (!(err <= case_worst[q])) case_worst[q] = err;
    if (!(err <= run_worst[q])) run_worst[q] = err;
    ++checks_run;
}

static float *nan_floats(size_t count) {
    float *x = alloc_floats(count);
    for (size_t i = 0; i < count; ++i) x[i] = NAN;
    return x;
}

static size_t count_of(const golden_case *gc, const char *name) {
    const golden_tensor *t = golden_find(gc, name);
    return t ? t->count : 0;
}

static clmha_mask_kind mask_kind(golden_mask_kind k) {
    switch (k) {
    case GOLDEN_MASK_BOOL_IGNORE: return CLMHA_MASK_BOOL_IGNORE;
    case GOLDEN_MASK_BOOL_ATTEND: return CLMHA_MASK_BOOL_ATTEND;
    case GOLDEN_MASK_FLOAT: return CLMHA_MASK_FLOAT;
    default: return CLMHA_MASK_NONE;
    }
}

// The call the case describes, on its host arrays.
static clmha_attention_args args_of(const golden_case *gc) {
    clmha_attention_args a = {.struct_size = sizeof a};
    a.query = golden_host_tensor(golden_find(gc, "query"));
    a.key = golden_host_tensor(golden_find(gc, "key"));
    a.value = golden_host_tensor(golden_find(gc, "value"));
    a.layout = gc->sdpa_nlhd ? CLMHA_LAYOUT_NLHD : CLMHA_LAYOUT_NHLD;
    a.attn_mask.kind = mask_kind(gc->attn);
    a.attn_mask.tensor = golden_host_tensor(golden_find(gc, "attn_mask"));
    a.is_causal = gc->is_causal;
    a.scale = gc->scale;
    a.enable_gqa = gc->enable_gqa;
    a.window = gc->window;
    a.window_left = gc->window_left;
    a.window_right = gc->window_right;
    a.softcap = gc->softcap;
    a.alibi = gc->alibi;
    a.alibi_slopes = golden_host_tensor(golden_find(gc, "alibi_slopes"));  // ndim 0: geometric
    a.sinks = golden_host_tensor(golden_find(gc, "sinks"));                // ndim 0: none
    return a;
}

// Whether the device keeps the fused core from this call (test_sdpa.c's rule): the driver's
// loop limit makes it CLMHA_UNSUPPORTED, naming the limit. Said on the log.
static bool fused_kept_off(clmha_context *ctx, const golden_case *gc, clmha_status st) {
    if (st != CLMHA_UNSUPPORTED || !strstr(clmha_context_last_error(ctx), "loop limit"))
        return false;
    cr_log_info("%s: fused core skipped on this device: %s", gc->name,
                clmha_context_last_error(ctx));
    fprintf(stderr, "sdpa golden: %s: fused core skipped on this device\n", gc->name);
    return true;
}

// The host forward through each core; returns false when the device keeps the fused core off.
static bool forward_host(clmha_context *ctx, const golden_case *gc) {
    clmha_attention_args a = args_of(gc);
    size_t n_out = count_of(gc, "output"), n_lse = count_of(gc, "lse");
    size_t n_w = count_of(gc, "weights");
    static const clmha_impl impls[3] = {CLMHA_IMPL_AUTO, CLMHA_IMPL_FUSED, CLMHA_IMPL_UNFUSED};
    bool fused_on = true;
    for (int i = 0; i < 3; ++i) {
        a.impl = impls[i];
        bool fused = a.impl == CLMHA_IMPL_FUSED, unfused = a.impl == CLMHA_IMPL_UNFUSED;
        if (fused && !fused_on) continue;
        // The log-sum-exp rows from the fused core, and from the unfused one (which writes them
        // too) for a case with a window.
        bool with_lse = fused || (unfused && gc->window);
        float *out = nan_floats(n_out), *lse = nan_floats(n_lse), *w = nan_floats(n_w);
        clmha_status st = clmha_attention_forward_host(ctx, &a, out, n_out, with_lse ? lse : NULL,
                                                       with_lse ? n_lse : 0, unfused ? w : NULL,
                                                       unfused ? n_w : 0);
        if (fused && fused_kept_off(ctx, gc, st)) {
            fused_on = false;
        } else {
            cr_assert_eq(st, CLMHA_SUCCESS, "%s: forward_host (%s): %s (%s)", gc->name,
                         clmha_impl_name(a.impl), clmha_context_last_error(ctx),
                         clmha_status_string(st));
            char how[64];
            snprintf(how, sizeof how, "forward_host %s", clmha_impl_name(a.impl));
            check(gc, Q_OUT, how, out);
            if (with_lse) check(gc, Q_LSE, how, lse);
            if (unfused) check(gc, Q_W, how, w);
        }
        free(out), free(lse), free(w);
    }
    return fused_on;
}

// The host backward (AUTO: the unfused core's, with a float mask's gradient).
static void backward_host(clmha_context *ctx, const golden_case *gc) {
    clmha_attention_args a = args_of(gc);
    const golden_tensor *g = golden_find(gc, "grad_output");
    bool fmask = gc->attn == GOLDEN_MASK_FLOAT;
    float *d[4];
    for (int i = 0; i < 4; ++i) d[i] = nan_floats(count_of(gc, q_tensor[Q_DQ + i]));
    clmha_status st = clmha_attention_backward_host(ctx, &a, g->f32, g->count, d[0], d[1], d[2],
                                                    fmask ? d[3] : NULL);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: backward_host: %s (%s)", gc->name,
                 clmha_context_last_error(ctx), clmha_status_string(st));
    for (int i = 0; i < (fmask ? 4 : 3); ++i) check(gc, Q_DQ + i, "backward_host", d[i]);
    for (int i = 0; i < 4; ++i) free(d[i]);
}

static cl_mem upload(clmha_context *ctx, const void *data, size_t bytes) {
    cl_int err;
    cl_mem m = clCreateBuffer(clmha_context_cl_context(ctx),
                              CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, bytes, (void *)data, &err);
    cr_assert_eq(err, CL_SUCCESS, "clCreateBuffer: %d", (int)err);
    return m;
}

// The buffers of a device call: query, key, value, mask, ALiBi slopes, sinks, output, lse,
// grad_output, dq, dk, dv, dsinks.
enum {
    B_Q, B_K, B_V, B_MASK, B_SLOPES, B_SINKS, B_OUT, B_LSE, B_DOUT, B_DQ, B_DK, B_DV, B_DSINKS,
    NUM_B
};

// The device forward with lse and the fused backward with it.
static void backward_device_fused(clmha_context *ctx, const golden_case *gc) {
    clmha_attention_args a = args_of(gc);
    a.impl = CLMHA_IMPL_FUSED;
    cl_mem b[NUM_B] = {NULL};
    clmha_tensor *in[3] = {&a.query, &a.key, &a.value};
    for (int i = 0; i < 3; ++i) {
        size_t n = count_of(gc, q_tensor[Q_DQ + i]);
        b[B_Q + i] = upload(ctx, in[i]->data, n * sizeof(float));
        in[i]->buffer = b[B_Q + i];
        float *nan = nan_floats(n);
        b[B_DQ + i] = upload(ctx, nan, n * sizeof(float));
        free(nan);
    }
    const golden_tensor *m = golden_find(gc, "attn_mask");
    if (m) {
        b[B_MASK] = upload(ctx, m->f32 ? (const void *)m->f32 : m->u8,
                           m->count * (m->f32 ? sizeof(float) : 1));
        a.attn_mask.tensor.buffer = b[B_MASK];
    }
    const golden_tensor *slopes = golden_find(gc, "alibi_slopes");
    if (slopes) {
        b[B_SLOPES] = upload(ctx, slopes->f32, slopes->count * sizeof(float));
        a.alibi_slopes.buffer = b[B_SLOPES];
    }
    const golden_tensor *sinks = golden_find(gc, "sinks");
    if (sinks) {  // and its gradient, from the forward's lse
        b[B_SINKS] = upload(ctx, sinks->f32, sinks->count * sizeof(float));
        a.sinks.buffer = b[B_SINKS];
        float *nan = nan_floats(sinks->count);
        b[B_DSINKS] = upload(ctx, nan, sinks->count * sizeof(float));
        free(nan);
    }
    const golden_tensor *g = golden_find(gc, "grad_output");
    float *zeros = calloc(g->count + count_of(gc, "lse"), sizeof(float));
    cr_assert(zeros);
    b[B_OUT] = upload(ctx, zeros, g->count * sizeof(float));
    b[B_LSE] = upload(ctx, zeros, count_of(gc, "lse") * sizeof(float));
    b[B_DOUT] = upload(ctx, g->f32, g->count * sizeof(float));
    free(zeros);
    clmha_status st = clmha_attention_forward(ctx, &a, b[B_OUT], 0, b[B_LSE], 0, NULL, 0, 0,
                                              NULL, NULL);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: forward (fused, lse): %s", gc->name,
                 clmha_context_last_error(ctx));
    clmha_attention_backward_args ba = {
        .struct_size = sizeof ba, .forward = &a, .output = b[B_OUT], .lse = b[B_LSE],
        .grad_output = b[B_DOUT], .grad_query = b[B_DQ], .grad_key = b[B_DK],
        .grad_value = b[B_DV], .grad_sinks = b[B_DSINKS], .impl = CLMHA_IMPL_FUSED};
    cl_event done = NULL;
    st = clmha_attention_backward(ctx, &ba, 0, NULL, &done);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: backward (fused): %s", gc->name,
                 clmha_context_last_error(ctx));
    cr_assert_eq(clWaitForEvents(1, &done), CL_SUCCESS);
    clReleaseEvent(done);
    for (int i = 0; i < 4; ++i) {
        int q = i < 3 ? Q_DQ + i : Q_DSINKS;
        cl_mem from = i < 3 ? b[B_DQ + i] : b[B_DSINKS];
        if (!from) continue;  // no sinks
        size_t n = count_of(gc, q_tensor[q]);
        float *got = alloc_floats(n);
        cl_int err = clEnqueueReadBuffer(clmha_context_cl_queue(ctx), from, CL_TRUE, 0,
                                         n * sizeof(float), got, 0, NULL, NULL);
        cr_assert_eq(err, CL_SUCCESS, "clEnqueueReadBuffer: %d", (int)err);
        check(gc, q, "device backward FUSED with lse", got);
        free(got);
    }
    for (int i = 0; i < NUM_B; ++i)
        if (b[i]) clReleaseMemObject(b[i]);
}

static void run_case(clmha_context *ctx, const char *name) {
    char path[1024];
    snprintf(path, sizeof path, "%s/sdpa/%s.txt", CLMHA_GOLDEN_DIR, name);
    golden_case gc;
    const char *err = golden_load(path, &gc);
    cr_assert_null(err, "%s", err ? err : "");
    cr_assert(gc.sdpa, "%s: not an SDPA case", path);
    cr_assert_str_eq(gc.name, name, "%s: the file names case '%s'", path, gc.name);
    for (int q = 0; q < NUM_Q; ++q) case_worst[q] = -1.0;
    bool fused_on = forward_host(ctx, &gc);
    backward_host(ctx, &gc);
    if (fused_on) backward_device_fused(ctx, &gc);
    char line[512];
    int at = snprintf(line, sizeof line, "sdpa golden: %-20s", gc.name);
    for (int q = 0; q < NUM_Q && at > 0 && (size_t)at < sizeof line; ++q)
        at += case_worst[q] < 0
                  ? snprintf(line + at, sizeof line - (size_t)at, " %s -", q_label[q])
                  : snprintf(line + at, sizeof line - (size_t)at, " %s %.1e", q_label[q],
                             case_worst[q]);
    fprintf(stderr, "%s\n", line);
    golden_free(&gc);
}

Test(sdpa_golden, pytorch_float64, .timeout = 900) {
    clmha_context *ctx = context_or_skip();
    cr_assert(NUM_CASES >= 10, "tests/golden/sdpa/cases.inc lists %zu cases", NUM_CASES);
    case_stride stride = case_stride_get("sdpa_golden", NUM_CASES);
    size_t cases = 0;
    for (size_t i = 0; i < NUM_CASES; ++i) {
        if (!case_stride_keeps(stride, i)) continue;
        run_case(ctx, case_names[i]);
        ++cases;
    }
    fprintf(stderr,
            "sdpa golden: %zu cases, %zu checks, worst output %.1e, lse %.1e, weights %.1e, "
            "dq %.1e, dk %.1e, dv %.1e, dmask %.1e, dsinks %.1e (bound %.0e * (1 + "
            "max|golden|))\n",
            cases, checks_run, run_worst[Q_OUT], run_worst[Q_LSE], run_worst[Q_W],
            run_worst[Q_DQ], run_worst[Q_DK], run_worst[Q_DV], run_worst[Q_DMASK],
            run_worst[Q_DSINKS], TOLERANCE);
    clmha_context_release(ctx);
}
