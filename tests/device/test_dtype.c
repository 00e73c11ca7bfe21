// 16-bit layers (clmha_dtype F16 and BF16, include/clmha.h): the conversions on the host and on
// the device against an independent rounding oracle, the forward pass through both cores
// against the float64 reference within the stated accuracy contract, PyTorch's golden cases
// (tests/golden/dtype_*.txt: clmha's error at most twice PyTorch's own in that dtype), device
// buffers of 16-bit elements with offsets, events and wait lists, decoding through a KV cache,
// parameter rounding, layer files loaded into a dtype, and what 16-bit layers refuse.
#include <criterion/criterion.h>
#include <criterion/parameterized.h>

#include <clmha.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/half.h"
#include "context/context.h"
#include "context/programs.h"
#include "golden_call.h"
#include "random_case.h"
#include "support.h"

// ---- the rounding oracle ---------------------------------------------------------------------

// @p x rounded to a binary format with @p mant explicit mantissa bits, smallest normal exponent
// @p emin and largest finite value @p max, in double arithmetic: the value's ulp at its binade
// (or the subnormal ulp), then rint (ties to even in the default rounding mode).
static double oracle_round(double x, int mant, int emin, double max) {
    if (isnan(x) || isinf(x) || x == 0.0) return x;
    double a = fabs(x);
    int e = ilogb(a);
    if (e < emin) e = emin;
    double ulp = ldexp(1.0, e - mant);
    double r = rint(a / ulp) * ulp;
    // Beyond the largest finite value by half an ulp or more: infinity.
    if (r > max) r = INFINITY;
    return x < 0 ? -r : r;
}

static double oracle_f16(float x) { return oracle_round(x, 10, -14, 65504.0); }
static double oracle_bf16(float x) { return oracle_round(x, 7, -126, (double)0x1.fep127); }

// Floats spread over every binade and the edges: random bit patterns, and values near float16's
// range ends and ties.
static float *probe_floats(size_t *count) {
    size_t n = 1u << 18, k = 0;
    float *x = alloc_floats(n + 64);
    prng r = {0x5eed};
    for (size_t i = 0; i < n; ++i) x[k++] = clmha__f32_of_bits((uint32_t)prng_next(&r));
    const float edges[] = {0.0f,       -0.0f,       1.0f,          65504.0f,   65519.99f,
                           65520.0f,   -65520.0f,   65536.0f,      0x1p-14f,   0x1p-24f,
                           0x1p-25f,   0x1.0p-25f + 0x1p-40f,     0x1.8p-24f, 0x1p-26f,
                           1.0f + 0x1p-11f, 1.0f + 0x1p-10f + 0x1p-11f, 1.0f + 0x1p-8f,
                           1.0f + 0x1p-8f + 0x1p-7f, FLT_MAX,  -FLT_MAX,   FLT_MIN,
                           0x1p-149f, INFINITY,   -INFINITY,     NAN};
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; ++i) x[k++] = edges[i];
    *count = k;
    return x;
}

// Checks @p got (the narrowed values read back as floats) against the oracle for @p x.
static void check_rounded(const char *what, bool half, const float *x, const float *got,
                          size_t count) {
    size_t bad = 0;
    for (size_t i = 0; i < count; ++i) {
        double want = half ? oracle_f16(x[i]) : oracle_bf16(x[i]);
        bool ok = isnan(want) ? isnan(got[i])
                              : (double)got[i] == want && !signbit(got[i]) == !signbit(want);
        if (!ok && bad++ < 5)
            cr_log_error("%s: %a rounds to %a, expected %a", what, (double)x[i], (double)got[i],
                         want);
    }
    cr_expect_eq(bad, 0, "%s: %zu of %zu values rounded wrongly", what, bad, count);
}

Test(dtype, host_conversions_round_to_nearest_even) {
    for (uint32_t h = 0; h < 65536; ++h) {  // every 16-bit value survives the round trip
        float f = clmha__f16_to_f32((uint16_t)h), b = clmha__bf16_to_f32((uint16_t)h);
        if (isnan(f)) cr_assert(isnan(clmha__f16_to_f32(clmha__f32_to_f16(f))), "f16 %x", h);
        else cr_assert_eq(clmha__f32_to_f16(f), h, "f16 %#x: %a", h, (double)f);
        if (isnan(b)) cr_assert(isnan(clmha__bf16_to_f32(clmha__f32_to_bf16(b))), "bf16 %x", h);
        else cr_assert_eq(clmha__f32_to_bf16(b), h, "bf16 %#x: %a", h, (double)b);
    }
    size_t n;
    float *x = probe_floats(&n), *h = alloc_floats(n), *b = alloc_floats(n);
    for (size_t i = 0; i < n; ++i) {
        h[i] = clmha__f16_to_f32(clmha__f32_to_f16(x[i]));
        b[i] = clmha__bf16_to_f32(clmha__f32_to_bf16(x[i]));
    }
    check_rounded("host float16", true, x, h, n);
    check_rounded("host bfloat16", false, x, b, n);
    free(x), free(h), free(b);
}

// Runs cl/convert.cl's narrowing kernel for @p half then its widening one over @p x.
static float *device_round_trip(clmha_context *ctx, bool half, const float *x, size_t n) {
    cl_program prog;
    cl_int err;
    cr_assert_eq(clmha__program_get(ctx, "convert", "", &prog), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cl_kernel narrow = clCreateKernel(prog, half ? "f32_to_f16" : "f32_to_bf16", &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_kernel widen = clCreateKernel(prog, half ? "f16_to_f32" : "bf16_to_f32", &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_context c = clmha_context_cl_context(ctx);
    cl_command_queue q = clmha_context_cl_queue(ctx);
    const size_t off = 3;  // the 16-bit side at an element offset
    cl_mem in = clCreateBuffer(c, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, n * 4, (void *)x, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_mem mid = clCreateBuffer(c, CL_MEM_READ_WRITE, (n + off) * 2, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_mem out = clCreateBuffer(c, CL_MEM_WRITE_ONLY, n * 4, NULL, &err);
    cr_assert_eq(err, CL_SUCCESS);
    cl_ulong o = off, count = n;
    size_t global = n;
    err = clSetKernelArg(narrow, 0, sizeof in, &in) | clSetKernelArg(narrow, 1, sizeof mid, &mid) |
          clSetKernelArg(narrow, 2, sizeof o, &o) | clSetKernelArg(narrow, 3, sizeof count, &count);
    cr_assert_eq(err, CL_SUCCESS);
    err = clSetKernelArg(widen, 0, sizeof mid, &mid) | clSetKernelArg(widen, 1, sizeof o, &o) |
          clSetKernelArg(widen, 2, sizeof out, &out) | clSetKernelArg(widen, 3, sizeof count, &count);
    cr_assert_eq(err, CL_SUCCESS);
    cr_assert_eq(clEnqueueNDRangeKernel(q, narrow, 1, NULL, &global, NULL, 0, NULL, NULL),
                 CL_SUCCESS);
    cr_assert_eq(clEnqueueNDRangeKernel(q, widen, 1, NULL, &global, NULL, 0, NULL, NULL),
                 CL_SUCCESS);
    float *got = alloc_floats(n);
    cr_assert_eq(clEnqueueReadBuffer(q, out, CL_TRUE, 0, n * 4, got, 0, NULL, NULL), CL_SUCCESS);
    clReleaseMemObject(in), clReleaseMemObject(mid), clReleaseMemObject(out);
    clReleaseKernel(narrow), clReleaseKernel(widen);
    return got;
}

Test(dtype, device_conversions_round_to_nearest_even) {
    clmha_context *ctx = context_or_skip();
    size_t n;
    float *x = probe_floats(&n);
    for (int half = 1; half >= 0; --half) {
        float *got = device_round_trip(ctx, half, x, n);
        check_rounded(half ? "device float16" : "device bfloat16", half, x, got, n);
        free(got);
    }
    free(x);
    clmha_context_release(ctx);
}

// ---- the accuracy contract -------------------------------------------------------------------

// The bound of the contract for one value: the final rounding (half an ulp of the dtype: 2^-11
// or 2^-8 relative) of a float32 result within 1e-5 (1 + max |output|) of the exact one.
static double allowed(clmha_dtype t, double want, double max_abs) {
    double f32 = 1e-5 * (1.0 + max_abs);
    double rel = t == CLMHA_DTYPE_F16 ? 0x1p-11 : 0x1p-8;
    return rel * (fabs(want) + f32) + f32;
}

// The largest ratio of error to allowed() over @p count values (at most 1: within contract);
// *max_err receives the largest error.
static double contract_ratio(clmha_dtype t, const float *got, const double *want, size_t count,
                             double *max_err) {
    double max_abs = max_abs_of(want, count), worst = 0.0;
    *max_err = 0.0;
    for (size_t i = 0; i < count; ++i) {
        double err = fabs((double)got[i] - want[i]);
        if (isnan(err)) err = INFINITY;
        if (err > *max_err) *max_err = err;
        double r = err / allowed(t, want[i], max_abs);
        if (r > worst) worst = r;
    }
    return worst;
}

static const clmha_dtype sixteen[] = {CLMHA_DTYPE_F16, CLMHA_DTYPE_BF16};

// One random case in @p t through @p impl: host forward against the reference.
static void check_random_case(clmha_context *ctx, const rcase *c, clmha_dtype t, clmha_impl impl,
                              double *worst) {
    instance in;
    instance_make(&in, c);
    instance_as_dtype(&in, t);
    clmha_layer *layer = instance_layer(ctx, &in);
    clmha_forward_args a = in.args;
    a.impl = impl;
    if (impl == CLMHA_IMPL_FUSED) a.need_weights = false;
    size_t wc = a.need_weights ? in.weights_count : 0;
    float *out = alloc_floats(in.output_count), *w = alloc_floats(wc ? wc : 1);
    clmha_status st = clmha_layer_forward_host(layer, &a, out, in.output_count, wc ? w : NULL, wc);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s: %s", clmha__dtype_name(t),
                 clmha_context_last_error(ctx));
    double *ro = malloc(in.output_count * sizeof *ro), *rw = malloc((wc ? wc : 1) * sizeof *rw);
    char msg[256];
    clmha_layer_desc d32 = in.desc;
    d32.dtype = CLMHA_DTYPE_F32;
    st = clmha_reference_forward(&d32, &in.params, &a, ro, in.output_count, wc ? rw : NULL, wc,
                                 msg, sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "reference: %s", msg);
    char name[256];
    rcase_describe(c, name, sizeof name);
    double eo, ew = 0.0;
    double ratio = contract_ratio(t, out, ro, in.output_count, &eo);
    if (wc) {
        double rw_ratio = contract_ratio(t, w, rw, wc, &ew);
        if (rw_ratio > ratio) ratio = rw_ratio;
    }
    fprintf(stderr, "%s %s %s: output max error %.3g (max |y| %.3g), weights %.3g, %.2f of the "
            "contract\n",
            clmha__dtype_name(t), clmha_impl_name(impl), name, eo,
            max_abs_of(ro, in.output_count), ew, ratio);
    cr_expect(ratio <= 1.0, "%s %s %s: error %.3g (weights %.3g) is %.2f times the contract",
              clmha__dtype_name(t), clmha_impl_name(impl), name, eo, ew, ratio);
    if (ratio > *worst) *worst = ratio;
    free(out), free(w), free(ro), free(rw);
    clmha_layer_release(layer);
    instance_free(&in);
}

Test(dtype, forward_within_contract_through_both_cores) {
    clmha_context *ctx = context_or_skip();
    const clmha_impl impls[] = {CLMHA_IMPL_AUTO, CLMHA_IMPL_FUSED, CLMHA_IMPL_UNFUSED};
    prng r = {0xd7e1};
    size_t cases = 0;
    for (size_t k = 0; k < 12; ++k) {
        rcase c = k == 0 ? rcase_base(0x16) : rcase_random(&r);
        // A shape across the fused core's tile edges.
        if (k == 1) c.e = 64, c.h = 4, c.l = 33, c.s = 47, c.self_attn = false;
        // ALiBi and a window as user functions (computed in float32, as the rest).
        if (k == 2) {
            c.user = RC_USER_SCORE | RC_USER_MASK, c.alibi = true;
            c.window = true, c.win_left = 2, c.win_right = 0;
        }
        for (size_t t = 0; t < 2; ++t) {
            double worst = 0.0;
            for (size_t i = 0; i < 3; ++i) {
                check_random_case(ctx, &c, sixteen[t], impls[i], &worst);
                ++cases;
            }
        }
    }
    fprintf(stderr, "dtype: %zu calls within the contract\n", cases);
    clmha_context_release(ctx);
}

// ---- PyTorch's golden cases ------------------------------------------------------------------

static const char *const dtype_case_names[] = {
#include "golden/dtype_cases.inc"
};

Test(dtype, golden_cases_at_most_twice_pytorchs_error) {
    clmha_context *ctx = context_or_skip();
    size_t n = sizeof dtype_case_names / sizeof dtype_case_names[0];
    cr_assert(n >= 2, "tests/golden/dtype_cases.inc lists %zu cases", n);
    for (size_t k = 0; k < n; ++k) {
        golden_case gc;
        golden_load_case(dtype_case_names[k], &gc);
        cr_assert(gc.dtype == GOLDEN_LAYER_F16 || gc.dtype == GOLDEN_LAYER_BF16, "%s: dtype %d",
                  gc.name, gc.dtype);
        clmha_dtype t = gc.dtype == GOLDEN_LAYER_F16 ? CLMHA_DTYPE_F16 : CLMHA_DTYPE_BF16;
        golden_call call;
        golden_call_of(&gc, &call);
        call.desc.dtype = t;
        clmha_layer *layer = golden_layer_create(ctx, &gc, &call.desc);
        const golden_tensor *want = golden_find(&gc, "output"), *ww = golden_find(&gc, "weights");
        const golden_tensor *pt = golden_find(&gc, "torch.output");
        const golden_tensor *ptw = golden_find(&gc, "torch.weights");
        cr_assert(want && want->f64 && pt && pt->f32, "%s: output or torch.output missing",
                  gc.name);
        size_t wc = call.args.need_weights ? ww->count : 0;
        float *out = alloc_floats(want->count), *w = alloc_floats(wc ? wc : 1);
        clmha_status st =
            clmha_layer_forward_host(layer, &call.args, out, want->count, wc ? w : NULL, wc);
        cr_assert_eq(st, CLMHA_SUCCESS, "%s: %s", gc.name, clmha_context_last_error(ctx));
        double ours = max_abs_err(out, want->f64, want->count),
               theirs = max_abs_err(pt->f32, want->f64, want->count);
        double e, ratio_c = contract_ratio(t, out, want->f64, want->count, &e);
        fprintf(stderr, "%-28s output: clmha %.3g, PyTorch %.3g, max |y| %.3g\n", gc.name, ours,
                theirs, max_abs_of(want->f64, want->count));
        cr_expect(ours <= 2.0 * theirs + 1e-7, "%s: output error %.3g, PyTorch's %.3g", gc.name,
                  ours, theirs);
        cr_expect(ratio_c <= 1.0, "%s: output error %.3g is %.2f times the contract", gc.name,
                  ours, ratio_c);
        if (wc) {
            cr_assert(ptw && ptw->f32, "%s: torch.weights missing", gc.name);
            double wo = max_abs_err(w, ww->f64, wc), wt = max_abs_err(ptw->f32, ww->f64, wc);
            fprintf(stderr, "%-28s weights: clmha %.3g, PyTorch %.3g\n", gc.name, wo, wt);
            cr_expect(wo <= 2.0 * wt + 1e-7, "%s: weights error %.3g, PyTorch's %.3g", gc.name,
                      wo, wt);
            cr_expect(contract_ratio(t, w, ww->f64, wc, &e) <= 1.0,
                      "%s: weights error %.3g beyond the contract", gc.name, wo);
        }
        free(out), free(w);
        clmha_layer_release(layer);
        golden_free(&gc);
    }
    clmha_context_release(ctx);
}

// ---- device buffers ----------------------------------------------------------------------------

// A read-write buffer holding @p data (NULL: zeros).
static cl_mem buffer_of(clmha_context *ctx, const void *data, size_t bytes) {
    cl_int err;
    void *zeros = data ? NULL : calloc(1, bytes);
    cl_mem b = clCreateBuffer(clmha_context_cl_context(ctx),
                              CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, bytes,
                              data ? (void *)data : zeros, &err);
    free(zeros);
    cr_assert_eq(err, CL_SUCCESS, "clCreateBuffer: %d", err);
    return b;
}

static uint16_t *narrow_all(clmha_dtype t, const float *x, size_t n, size_t pad) {
    uint16_t *h = calloc(n + pad, sizeof *h);
    cr_assert(h);
    for (size_t i = 0; i < n; ++i)
        h[pad + i] = t == CLMHA_DTYPE_F16 ? clmha__f32_to_f16(x[i]) : clmha__f32_to_bf16(x[i]);
    return h;
}

// The device call on 16-bit buffers at element offsets, after a user event, gives the host
// call's values; buffers one element too short are refused before anything runs.
Test(dtype, device_buffers_hold_16_bit_elements) {
    clmha_context *ctx = context_or_skip();
    for (size_t ti = 0; ti < 2; ++ti) {
        clmha_dtype t = sixteen[ti];
        rcase c = rcase_base(0x77);
        c.self_attn = false, c.value_is_key = false, c.am = CLMHA_MASK_FLOAT;
        c.layout = LAYOUT_SHARED, c.need_weights = true;
        instance in;
        instance_make(&in, &c);
        instance_as_dtype(&in, t);
        clmha_layer *layer = instance_layer(ctx, &in);
        float *host = alloc_floats(in.output_count), *hw = alloc_floats(in.weights_count);
        cr_assert_eq(clmha_layer_forward_host(layer, &in.args, host, in.output_count, hw,
                                              in.weights_count),
                     CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
        size_t qn = in.args.query.shape[0] * in.args.query.shape[1] * in.args.query.shape[2];
        size_t kn = in.args.key.shape[0] * in.args.key.shape[1] * in.args.key.shape[2];
        size_t vn = in.args.value.shape[0] * in.args.value.shape[1] * in.args.value.shape[2];
        size_t an = in.args.attn_mask.tensor.shape[0] * in.args.attn_mask.tensor.shape[1];
        const size_t pad = 5;
        uint16_t *q = narrow_all(t, in.query, qn, pad), *k = narrow_all(t, in.key, kn, pad),
                 *v = narrow_all(t, in.value, vn, pad), *am = narrow_all(t, in.am, an, pad);
        clmha_forward_args a = in.args;
        a.query.buffer = buffer_of(ctx, q, (qn + pad) * 2), a.query.offset = pad;
        a.key.buffer = buffer_of(ctx, k, (kn + pad) * 2), a.key.offset = pad;
        a.value.buffer = buffer_of(ctx, v, (vn + pad) * 2), a.value.offset = pad;
        a.attn_mask.tensor.buffer = buffer_of(ctx, am, (an + pad) * 2);
        a.attn_mask.tensor.offset = pad;
        cl_mem out = buffer_of(ctx, NULL, (in.output_count + pad) * 2);
        cl_mem wts = buffer_of(ctx, NULL, (in.weights_count + pad) * 2);
        // One element short: refused, nothing enqueued.
        cl_mem short_out = buffer_of(ctx, NULL, (in.output_count + pad) * 2 - 2);
        cl_event ev = NULL;
        clmha_status st = clmha_layer_forward(layer, &a, short_out, pad, wts, pad, 0, NULL, &ev);
        cr_expect_eq(st, CLMHA_INVALID_ARGUMENT, "short output: %s", clmha_status_string(st));
        cr_expect(ev == NULL);
        cl_int err;
        cl_event gate = clCreateUserEvent(clmha_context_cl_context(ctx), &err);
        cr_assert_eq(err, CL_SUCCESS);
        st = clmha_layer_forward(layer, &a, out, pad, wts, pad, 1, &gate, &ev);
        cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
        cr_assert(ev != NULL);
        clSetUserEventStatus(gate, CL_COMPLETE);
        cr_assert_eq(clWaitForEvents(1, &ev), CL_SUCCESS);
        uint16_t *ob = calloc(in.output_count + pad, 2), *wb = calloc(in.weights_count + pad, 2);
        cl_command_queue cq = clmha_context_cl_queue(ctx);
        cr_assert_eq(clEnqueueReadBuffer(cq, out, CL_TRUE, 0, (in.output_count + pad) * 2, ob, 0,
                                         NULL, NULL),
                     CL_SUCCESS);
        cr_assert_eq(clEnqueueReadBuffer(cq, wts, CL_TRUE, 0, (in.weights_count + pad) * 2, wb,
                                         0, NULL, NULL),
                     CL_SUCCESS);
        for (size_t i = 0; i < pad; ++i)
            cr_expect(ob[i] == 0 && wb[i] == 0, "element %zu before the offset was written", i);
        size_t diff = 0;
        for (size_t i = 0; i < in.output_count; ++i)
            diff += (t == CLMHA_DTYPE_F16 ? clmha__f32_to_f16(host[i])
                                          : clmha__f32_to_bf16(host[i])) != ob[pad + i];
        for (size_t i = 0; i < in.weights_count; ++i)
            diff += (t == CLMHA_DTYPE_F16 ? clmha__f32_to_f16(hw[i]) : clmha__f32_to_bf16(hw[i])) !=
                    wb[pad + i];
        cr_expect_eq(diff, 0, "%s: %zu values differ between the device and host calls",
                     clmha__dtype_name(t), diff);
        clReleaseEvent(ev), clReleaseEvent(gate);
        cl_mem bufs[] = {a.query.buffer, a.key.buffer, a.value.buffer, a.attn_mask.tensor.buffer,
                         out, wts, short_out};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i) clReleaseMemObject(bufs[i]);
        free(q), free(k), free(v), free(am), free(ob), free(wb), free(host), free(hw);
        clmha_layer_release(layer);
        instance_free(&in);
    }
    clmha_context_release(ctx);
}

// The backward pass on 16-bit device buffers at element offsets (inputs, mask, grad_output and
// the gradients; the query's gradient accumulating onto 16-bit values) writes the host call's
// gradients rounded to the dtype, bit for bit, and nothing before the offsets; with
// CLMHA_GRAD_F32 it writes float32 gradients into float32 buffers.
Test(dtype, backward_on_16_bit_device_buffers) {
    clmha_context *ctx = context_or_skip();
    cl_command_queue cq = clmha_context_cl_queue(ctx);
    for (size_t ti = 0; ti < 2; ++ti) {
        clmha_dtype t = sixteen[ti];
        rcase c = rcase_base(0x78);
        c.self_attn = false, c.value_is_key = false, c.am = CLMHA_MASK_FLOAT;
        c.layout = LAYOUT_SHARED, c.need_weights = false;
        instance in;
        instance_make(&in, &c);
        instance_as_dtype(&in, t);
        clmha_layer *layer = instance_layer(ctx, &in);
        clmha_saved *saved;
        cr_assert_eq(clmha_saved_create(&saved, layer), CLMHA_SUCCESS);
        size_t qn = in.output_count, kn = in.n * c.s * in.kdim, vn = in.n * c.s * in.vdim;
        size_t an = c.l * c.s, e = c.e;
        prng r = {0x9e};
        float *gy = normal_floats(&r, qn), *y = alloc_floats(qn);
        for (size_t i = 0; i < qn; ++i) gy[i] = clmha__dtype_round(t, gy[i]);
        // The host call: query (accumulating onto 0.5), key, value, out_proj.weight.
        enum { GQ, GK, GV, GW, NG };
        size_t count[NG] = {qn, kn, vn, e * e};
        float *host[NG];
        for (int g = 0; g < NG; ++g) host[g] = alloc_floats(count[g]);
        for (size_t i = 0; i < qn; ++i) host[GQ][i] = 0.5f;
        clmha_forward_args a = in.args;
        a.save = saved;
        cr_assert_eq(clmha_layer_forward_host(layer, &a, y, qn, NULL, 0), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(ctx));
        clmha_backward_args b = CLMHA_STRUCT_INIT(clmha_backward_args);
        b.forward = &a, b.saved = saved;
        b.grad_output = a.query;
        b.grad_output.data = gy;
        b.query = (clmha_grad){.data = host[GQ], .accumulate = true};
        b.key.data = host[GK], b.value.data = host[GV], b.out_proj_weight.data = host[GW];
        cr_assert_eq(clmha_layer_backward_host(layer, &b), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(ctx));
        // The device call.
        const size_t pad = 3;
        uint16_t *q = narrow_all(t, in.query, qn, pad), *k = narrow_all(t, in.key, kn, pad),
                 *v = narrow_all(t, in.value, vn, pad), *am = narrow_all(t, in.am, an, pad),
                 *dy = narrow_all(t, gy, qn, pad);
        clmha_forward_args da = in.args;
        da.query.buffer = buffer_of(ctx, q, (qn + pad) * 2), da.query.offset = pad;
        da.key.buffer = buffer_of(ctx, k, (kn + pad) * 2), da.key.offset = pad;
        da.value.buffer = buffer_of(ctx, v, (vn + pad) * 2), da.value.offset = pad;
        da.attn_mask.tensor.buffer = buffer_of(ctx, am, (an + pad) * 2);
        da.attn_mask.tensor.offset = pad;
        da.save = saved;
        cl_mem out = buffer_of(ctx, NULL, qn * 2);
        cr_assert_eq(clmha_layer_forward(layer, &da, out, 0, NULL, 0, 0, NULL, NULL),
                     CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
        clmha_backward_args db = CLMHA_STRUCT_INIT(clmha_backward_args);
        db.forward = &da, db.saved = saved;
        db.grad_output = da.query;
        db.grad_output.buffer = buffer_of(ctx, dy, (qn + pad) * 2);
        cl_mem gb[NG];
        clmha_grad *dg[NG] = {&db.query, &db.key, &db.value, &db.out_proj_weight};
        for (int g = 0; g < NG; ++g) {
            float *init = alloc_floats(count[g]);
            for (size_t i = 0; i < count[g]; ++i) init[i] = g == GQ ? 0.5f : 0.0f;
            uint16_t *h = narrow_all(t, init, count[g], pad);
            gb[g] = buffer_of(ctx, h, (count[g] + pad) * 2);
            *dg[g] = (clmha_grad){.buffer = gb[g], .offset = pad, .accumulate = g == GQ};
            free(init), free(h);
        }
        cl_event ev = NULL;
        cr_assert_eq(clmha_layer_backward(layer, &db, 0, NULL, &ev), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(ctx));
        cr_assert_eq(clWaitForEvents(1, &ev), CL_SUCCESS);
        clReleaseEvent(ev);
        size_t diff = 0;
        for (int g = 0; g < NG; ++g) {
            uint16_t *got = calloc(count[g] + pad, 2);
            cr_assert_eq(clEnqueueReadBuffer(cq, gb[g], CL_TRUE, 0, (count[g] + pad) * 2, got, 0,
                                             NULL, NULL),
                         CL_SUCCESS);
            for (size_t i = 0; i < pad; ++i)
                cr_expect(got[i] == 0, "gradient %d: element %zu before the offset written", g, i);
            for (size_t i = 0; i < count[g]; ++i)
                diff += (t == CLMHA_DTYPE_F16 ? clmha__f32_to_f16(host[g][i])
                                              : clmha__f32_to_bf16(host[g][i])) != got[pad + i];
            free(got);
        }
        cr_expect_eq(diff, 0, "%s: %zu gradient values differ between the device and host calls",
                     clmha__dtype_name(t), diff);
        // float32 gradients into float32 buffers: one element short is refused.
        cl_mem f32 = buffer_of(ctx, NULL, kn * 4), short32 = buffer_of(ctx, NULL, kn * 4 - 4);
        clmha_backward_args fb = CLMHA_STRUCT_INIT(clmha_backward_args);
        fb.forward = &da, fb.saved = saved, fb.grad_output = db.grad_output;
        fb.grad_dtype = CLMHA_GRAD_F32;
        fb.key.buffer = short32;
        cr_expect_eq(clmha_layer_backward(layer, &fb, 0, NULL, NULL), CLMHA_INVALID_ARGUMENT);
        fb.key.buffer = f32;
        cr_assert_eq(clmha_layer_backward(layer, &fb, 0, NULL, NULL), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(ctx));
        float *k32 = alloc_floats(kn);
        cr_assert_eq(clEnqueueReadBuffer(cq, f32, CL_TRUE, 0, kn * 4, k32, 0, NULL, NULL),
                     CL_SUCCESS);
        size_t unrounded = 0;
        for (size_t i = 0; i < kn; ++i) {
            float r16 = clmha__dtype_round(t, k32[i]);
            cr_expect(r16 == host[GK][i], "key gradient %zu: float32 %a rounds to %a, not %a", i,
                      (double)k32[i], (double)r16, (double)host[GK][i]);
            unrounded += r16 != k32[i];
        }
        cr_expect(unrounded > kn / 2, "float32 gradients hold values of the dtype: %zu of %zu",
                  unrounded, kn);
        cl_mem bufs[] = {da.query.buffer, da.key.buffer, da.value.buffer,
                         da.attn_mask.tensor.buffer, out, db.grad_output.buffer, f32, short32,
                         gb[0], gb[1], gb[2], gb[3]};
        for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i) clReleaseMemObject(bufs[i]);
        for (int g = 0; g < NG; ++g) free(host[g]);
        free(q), free(k), free(v), free(am), free(dy), free(gy), free(y), free(k32);
        clmha_saved_release(saved);
        clmha_layer_release(layer);
        instance_free(&in);
    }
    clmha_context_release(ctx);
}

// ---- incremental decoding -----------------------------------------------------------------------

// A 16-bit layer's causal self-attention fed through a KV cache 3 tokens a call (queries and
// outputs 16-bit, the cache float32): every call's output within the contract of the float64
// one-shot forward on the layer's values.
Test(dtype, kv_cache_decoding_within_contract) {
    clmha_context *ctx = context_or_skip();
    for (size_t ti = 0; ti < 2; ++ti) {
        clmha_dtype t = sixteen[ti];
        rcase c = rcase_base(0x5eed + ti);
        c.e = 16, c.h = 4, c.l = c.s = 11;
        c.self_attn = true, c.is_causal = true, c.need_weights = false;
        instance in;
        instance_make(&in, &c);
        instance_as_dtype(&in, t);
        clmha_layer *layer = instance_layer(ctx, &in);
        const size_t n = in.n, len = c.l, e = c.e, chunk = 3;
        double *want = malloc(in.output_count * sizeof *want);
        char msg[256];
        clmha_layer_desc d32 = in.desc;
        d32.dtype = CLMHA_DTYPE_F32;
        cr_assert_eq(clmha_reference_forward(&d32, &in.params, &in.args, want, in.output_count,
                                             NULL, 0, msg, sizeof msg),
                     CLMHA_SUCCESS, "%s", msg);
        clmha_kv_cache *cache = NULL;
        cr_assert_eq(clmha_kv_cache_create(&cache, layer, n, len), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(ctx));
        // Sequence-first rows: tokens t0 .. t1 - 1 of every sequence are contiguous.
        float *out = alloc_floats(in.output_count);
        for (size_t t0 = 0; t0 < len; t0 += chunk) {
            size_t t1 = t0 + chunk < len ? t0 + chunk : len;
            clmha_forward_args a = {.struct_size = sizeof a, .is_causal = true, .kv_cache = cache};
            a.query = (clmha_tensor){.ndim = 3, .shape = {t1 - t0, n, e},
                                     .data = in.query + t0 * n * e};
            cr_assert_eq(clmha_layer_forward_host(layer, &a, out + t0 * n * e, (t1 - t0) * n * e,
                                                  NULL, 0),
                         CLMHA_SUCCESS, "%s: tokens %zu..%zu: %s", clmha__dtype_name(t), t0, t1,
                         clmha_context_last_error(ctx));
        }
        double err, ratio = contract_ratio(t, out, want, in.output_count, &err);
        fprintf(stderr, "%s decoding 3 tokens a call: max error %.3g, %.2f of the contract\n",
                clmha__dtype_name(t), err, ratio);
        cr_expect(ratio <= 1.0, "%s: decoding error %.3g is %.2f times the contract",
                  clmha__dtype_name(t), err, ratio);
        free(out), free(want);
        clmha_kv_cache_release(cache);
        clmha_layer_release(layer);
        instance_free(&in);
    }
    clmha_context_release(ctx);
}

// ---- parameters, files, refusals -----------------------------------------------------------------

Test(dtype, parameters_and_files_hold_values_of_the_dtype) {
    clmha_context *ctx = context_or_skip();
    char dir[256], path[300];
    tmpdir_make(dir, sizeof dir, "clmha_dtype");
    snprintf(path, sizeof path, "%s/layer.safetensors", dir);
    clmha_layer_desc d = CLMHA_STRUCT_INIT(clmha_layer_desc);
    d.embed_dim = 4, d.num_heads = 2, d.bias = true;
    clmha_layer *f32 = NULL;
    cr_assert_eq(clmha_layer_create(&f32, ctx, &d), CLMHA_SUCCESS);
    float w[48], b[12], got[48];
    for (size_t i = 0; i < 48; ++i) w[i] = (float)(i + 1) / 3.0f;
    for (size_t i = 0; i < 12; ++i) b[i] = -(float)(i + 1) / 7.0f;
    cr_assert_eq(clmha_layer_set_parameter(f32, "in_proj_weight", w, 48), CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_set_parameter(f32, "in_proj_bias", b, 12), CLMHA_SUCCESS);
    cr_assert_eq(clmha_layer_save(f32, path), CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    for (size_t ti = 0; ti < 2; ++ti) {
        clmha_dtype t = sixteen[ti];
        d.dtype = t;
        clmha_layer *l = NULL;
        cr_assert_eq(clmha_layer_create(&l, ctx, &d), CLMHA_SUCCESS);
        cr_assert_eq(clmha_layer_set_parameter(l, "in_proj_weight", w, 48), CLMHA_SUCCESS);
        cr_assert_eq(clmha_layer_get_parameter(l, "in_proj_weight", got, 48), CLMHA_SUCCESS);
        for (size_t i = 0; i < 48; ++i)
            cr_expect_eq(got[i], clmha__dtype_round(t, w[i]), "%s: weight %zu is %a, not %a",
                         clmha__dtype_name(t), i, (double)got[i],
                         (double)clmha__dtype_round(t, w[i]));
        clmha_layer_desc back = CLMHA_STRUCT_INIT(clmha_layer_desc);
        cr_assert_eq(clmha_layer_get_desc(l, &back), CLMHA_SUCCESS);
        cr_expect_eq(back.dtype, t);
        clmha_layer_release(l);
        l = NULL;
        cr_assert_eq(clmha_layer_load_as(&l, ctx, path, t), CLMHA_SUCCESS, "%s",
                     clmha_context_last_error(ctx));
        cr_assert_eq(clmha_layer_get_parameter(l, "in_proj_bias", got, 12), CLMHA_SUCCESS);
        for (size_t i = 0; i < 12; ++i)
            cr_expect_eq(got[i], clmha__dtype_round(t, b[i]), "%s: loaded bias %zu",
                         clmha__dtype_name(t), i);
        clmha_layer_release(l);
    }
    clmha_layer *l = NULL;
    cr_expect_eq(clmha_layer_load_as(&l, ctx, path, (clmha_dtype)9), CLMHA_INVALID_ARGUMENT);
    cr_expect(l == NULL);
    clmha_layer_release(f32);
    tmpdir_remove(dir);
    clmha_context_release(ctx);
}

static clmha_status no_core(const clmha_core_args *args, void *user_data) {
    (void)args, (void)user_data;
    return CLMHA_SUCCESS;
}

Test(dtype, what_16_bit_layers_take_and_refuse) {
    clmha_context *ctx = context_or_skip();
    clmha_layer_desc d = CLMHA_STRUCT_INIT(clmha_layer_desc);
    d.embed_dim = 8, d.num_heads = 2;
    clmha_layer *l = NULL;
    d.dtype = CLMHA_DTYPE_F64;
    {  // the reference computes in float64 whatever the dtype: it takes F64
        float w_in[3 * 8 * 8] = {0}, w_out[8 * 8] = {0}, x[2 * 8] = {0};
        double y[2 * 8];
        char msg[256];
        clmha_reference_params p = {.struct_size = sizeof p, .in_proj_weight = w_in,
                                    .out_proj_weight = w_out};
        clmha_forward_args a = CLMHA_STRUCT_INIT(clmha_forward_args);
        a.query = (clmha_tensor){.ndim = 2, .shape = {2, 8}, .data = x};
        cr_expect_eq(clmha_reference_forward(&d, &p, &a, y, 16, NULL, 0, msg, sizeof msg),
                     CLMHA_SUCCESS, "%s", msg);
    }
    d.dtype = (clmha_dtype)4;
    cr_expect_eq(clmha_layer_create(&l, ctx, &d), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "dtype") != NULL);
    d.dtype = CLMHA_DTYPE_BF16;
    cr_assert_eq(clmha_layer_create(&l, ctx, &d), CLMHA_SUCCESS);
    // A user core sees the float32 pass (tests/device/test_interop.c runs one).
    cr_expect_eq(clmha_layer_set_attention(l, no_core, NULL), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    cr_expect_eq(clmha_layer_set_attention(l, NULL, NULL), CLMHA_SUCCESS);
    float x[3 * 8] = {0}, y[3 * 8];
    clmha_forward_args a = CLMHA_STRUCT_INIT(clmha_forward_args);
    a.query = (clmha_tensor){.ndim = 2, .shape = {3, 8}, .data = x};
    clmha_saved *saved = NULL;
    cr_assert_eq(clmha_saved_create(&saved, l), CLMHA_SUCCESS);
    a.save = saved;
    cr_expect_eq(clmha_layer_forward_host(l, &a, y, 24, NULL, 0), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    float gy[3 * 8] = {0}, gx[3 * 8];
    clmha_backward_args b = CLMHA_STRUCT_INIT(clmha_backward_args);
    b.forward = &a, b.saved = saved;
    b.grad_output = (clmha_tensor){.ndim = 2, .shape = {3, 8}, .data = gy};
    b.query.data = gx;
    b.grad_dtype = (clmha_grad_dtype)2;  // neither the layer's dtype nor float32
    cr_expect_eq(clmha_layer_backward_host(l, &b), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "grad_dtype") != NULL, "%s",
              clmha_context_last_error(ctx));
    b.grad_dtype = CLMHA_GRAD_LAYER;
    cr_expect_eq(clmha_layer_backward_host(l, &b), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    clmha_saved_release(saved);
    clmha_layer_release(l);
    clmha_context_release(ctx);
}
