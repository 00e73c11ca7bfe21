// Partial attention (clmha_layer_attend, clmha_attention_merge, clmha_layer_project_heads):
// the keys of a call split into ranges, each range's attention and log-sum-exp computed on its
// own, merged in any order and projected, give the one-shot forward, checked against the
// double-precision CPU reference of the whole call. Masks are sliced with the keys; the keys of
// add_bias_kv and add_zero_attn go with one range; a range whose keys are all masked for a
// batch item merges to zeros; the ranges' keys (and a block of queries) at their positions in
// the sequence, for is_causal, windows, ALiBi, sinks and user functions. Then the errors.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/half.h"
#include "random_case.h"
#include "support.h"

#define TOL 2e-5

static cl_mem upload(clmha_context *ctx, const void *data, size_t bytes) {
    cl_int err;
    cl_mem m = clCreateBuffer(clmha_context_cl_context(ctx),
                              CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, bytes ? bytes : 4,
                              (void *)data, &err);
    cr_assert_eq(err, CL_SUCCESS, "clCreateBuffer: %d", (int)err);
    return m;
}

static cl_mem device_buffer(clmha_context *ctx, size_t bytes) {
    cl_int err;
    cl_mem m = clCreateBuffer(clmha_context_cl_context(ctx), CL_MEM_READ_WRITE, bytes, NULL,
                              &err);
    cr_assert_eq(err, CL_SUCCESS, "clCreateBuffer: %d", (int)err);
    return m;
}

// Columns j0 .. j1-1 of a (rows, s) array of @p elem bytes per element.
static void *columns(const void *x, size_t rows, size_t s, size_t elem, size_t j0, size_t j1) {
    size_t w = j1 - j0;
    unsigned char *out = malloc(rows * w * elem + 1);
    cr_assert(out);
    for (size_t r = 0; r < rows; ++r)
        memcpy(out + r * w * elem, (const unsigned char *)x + (r * s + j0) * elem, w * elem);
    return out;
}

// @p count floats uploaded as elements of @p t (float32, doubles, or rounded to a 16-bit
// dtype).
static cl_mem upload_as(clmha_context *ctx, clmha_dtype t, const float *x, size_t count) {
    if (t == CLMHA_DTYPE_F32) return upload(ctx, x, count * 4);
    if (t == CLMHA_DTYPE_F64) {
        double *d = malloc(count * 8 + 8);
        cr_assert(d);
        for (size_t i = 0; i < count; ++i) d[i] = x[i];
        cl_mem b = upload(ctx, d, count * 8);
        free(d);
        return b;
    }
    uint16_t *h = malloc(count * 2 + 2);
    cr_assert(h);
    for (size_t i = 0; i < count; ++i)
        h[i] = t == CLMHA_DTYPE_F16 ? clmha__f32_to_f16(x[i]) : clmha__f32_to_bf16(x[i]);
    cl_mem b = upload(ctx, h, count * 2);
    free(h);
    return b;
}

// Runs the cross-attention case @p c with its keys split at @p cuts (ranges [cuts[i],
// cuts[i+1])), the appended keys with range @p appended_range, merged from the last range to
// the first, on a layer of dtype @p t (16-bit: its query, key, value, float masks and output
// 16-bit, the partial results float32; float64: everything doubles, merged by
// clmha_attention_merge_f64()); returns the max abs error of the projected result against the
// reference (16-bit: the largest fraction of the dtype's contract, include/clmha.h).
static double split_and_merge_as(const rcase *c, const size_t *cuts, size_t ranges,
                                 size_t appended_range, clmha_dtype t) {
    clmha_context *ctx = context_or_skip();
    instance in;
    instance_make(&in, c);
    if (t == CLMHA_DTYPE_F64) in.desc.dtype = t;
    else if (t != CLMHA_DTYPE_F32) instance_as_dtype(&in, t);
    size_t io = t == CLMHA_DTYPE_F64 ? 8 : t == CLMHA_DTYPE_F32 ? 4 : 2, ps = io == 8 ? 8 : 4;
    size_t n = in.n, l = c->l, s = c->s, e = c->e, h = c->h, d = e / h;
    size_t kd = in.kdim, vd = in.vdim, rows = n * h * l;
    double *want = malloc(in.output_count * sizeof *want);
    char msg[512];
    cr_assert_eq(clmha_reference_forward(&in.desc, &in.params, &in.args, want, in.output_count,
                                         NULL, 0, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    clmha_layer *layer = instance_layer(ctx, &in);
    cl_command_queue q = clmha_context_cl_queue(ctx);
    cl_mem query = upload_as(ctx, t, in.query, n * l * e);
    cl_mem acc = device_buffer(ctx, rows * d * ps), acc_lse = device_buffer(ctx, rows * ps);
    cl_mem part = device_buffer(ctx, rows * d * ps), part_lse = device_buffer(ctx, rows * ps);
    for (size_t k = ranges; k-- > 0;) {
        size_t j0 = cuts[k], j1 = cuts[k + 1], w = j1 - j0;
        // (S, N, F) rows j0 .. j1-1 are contiguous (sequence first).
        cl_mem key = upload_as(ctx, t, in.key + j0 * n * kd, w * n * kd);
        cl_mem value = upload_as(ctx, t, in.value + j0 * n * vd, w * n * vd);
        // The range's keys at their positions in the sequence (is_causal, windows, ALiBi and
        // the user functions see them there).
        clmha_forward_args a = {.struct_size = sizeof a, .is_causal = c->is_causal,
                                .key_position = j0};
        a.query = (clmha_tensor){.ndim = 3, .shape = {l, n, e}, .buffer = query};
        a.key = (clmha_tensor){.ndim = 3, .shape = {w, n, kd}, .buffer = key};
        a.value = (clmha_tensor){.ndim = 3, .shape = {w, n, vd}, .buffer = value};
        void *kpm = NULL, *am = NULL;
        cl_mem kpm_buf = NULL, am_buf = NULL;
        if (c->kpm) {
            size_t el = c->kpm == CLMHA_MASK_FLOAT ? 4 : 1;
            kpm = columns(in.kpm, n, s, el, j0, j1);
            kpm_buf = el == 4 ? upload_as(ctx, t, kpm, n * w) : upload(ctx, kpm, n * w * el);
            a.key_padding_mask = (clmha_mask){
                .kind = c->kpm, .tensor = {.ndim = 2, .shape = {n, w}, .buffer = kpm_buf}};
        }
        if (c->am) {
            size_t el = c->am == CLMHA_MASK_FLOAT ? 4 : 1;
            am = columns(in.am, l, s, el, j0, j1);
            am_buf = el == 4 ? upload_as(ctx, t, am, l * w) : upload(ctx, am, l * w * el);
            a.attn_mask = (clmha_mask){.kind = c->am,
                                       .tensor = {.ndim = 2, .shape = {l, w}, .buffer = am_buf}};
        }
        bool first = k == ranges - 1;
        clmha_status st = clmha_layer_attend(layer, &a, k == appended_range, first ? acc : part,
                                             0, first ? acc_lse : part_lse, 0, 0, NULL, NULL);
        cr_assert_eq(st, CLMHA_SUCCESS, "range %zu: %s", k, clmha_context_last_error(ctx));
        if (!first) {
            st = (ps == 8 ? clmha_attention_merge_f64 : clmha_attention_merge)(
                ctx, rows, d, acc, 0, acc_lse, 0, part, 0, part_lse, 0, 0, NULL, NULL);
            cr_assert_eq(st, CLMHA_SUCCESS, "merge %zu: %s", k, clmha_context_last_error(ctx));
        }
        cr_assert_eq(clFinish(q), CL_SUCCESS);
        clReleaseMemObject(key);
        clReleaseMemObject(value);
        if (kpm_buf) clReleaseMemObject(kpm_buf);
        if (am_buf) clReleaseMemObject(am_buf);
        free(kpm);
        free(am);
    }
    cl_mem out = device_buffer(ctx, n * l * e * io);
    cr_assert_eq(clmha_layer_project_heads(layer, n, l, acc, 0, out, 0, 0, NULL, NULL),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    float *got = alloc_floats(n * l * e);
    uint16_t *got16 = calloc(n * l * e, 2);
    double *got64 = calloc(n * l * e, 8);
    void *dst = io == 8 ? (void *)got64 : io == 4 ? (void *)got : (void *)got16;
    cr_assert_eq(clEnqueueReadBuffer(q, out, CL_TRUE, 0, n * l * e * io, dst, 0, NULL, NULL),
                 CL_SUCCESS);
    double err = 0.0;
    if (io == 8) {
        for (size_t i = 0; i < n * l * e; ++i) err = fmax(err, fabs(got64[i] - want[i]));
    } else if (io == 4) {
        err = max_abs_err(got, want, n * l * e);
    } else {
        double big = 0.0, r = t == CLMHA_DTYPE_F16 ? 0x1p-11 : 0x1p-8;
        for (size_t i = 0; i < n * l * e; ++i) big = fmax(big, fabs(want[i]));
        double tol = 1e-5 * (1 + big);
        for (size_t i = 0; i < n * l * e; ++i) {
            got[i] = t == CLMHA_DTYPE_F16 ? clmha__f16_to_f32(got16[i])
                                          : clmha__bf16_to_f32(got16[i]);
            err = fmax(err, fabs(got[i] - want[i]) / (r * (fabs(want[i]) + tol) + tol));
        }
    }
    free(got16);
    free(got64);
    cl_mem bufs[] = {query, acc, acc_lse, part, part_lse, out};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i) clReleaseMemObject(bufs[i]);
    free(got);
    free(want);
    clmha_layer_release(layer);
    instance_free(&in);
    clmha_context_release(ctx);
    return err;
}

static double split_and_merge(const rcase *c, const size_t *cuts, size_t ranges,
                              size_t appended_range) {
    return split_and_merge_as(c, cuts, ranges, appended_range, CLMHA_DTYPE_F32);
}

static rcase cross_case(uint64_t seed) {
    rcase c = rcase_base(seed);
    c.e = 16, c.h = 4, c.n = 2, c.l = 5, c.s = 11, c.need_weights = false;
    return c;
}

Test(partial, ranges_merge_to_the_whole, .timeout = 300) {
    size_t cuts[] = {0, 4, 5, 11};
    rcase c = cross_case(21);
    double err = split_and_merge(&c, cuts, 3, 1);
    fprintf(stderr, "partial: 3 ranges, no masks: max abs err %.3g\n", err);
    cr_expect(err <= TOL, "max abs err %g", err);

    c = cross_case(22);
    c.kdim = 5, c.vdim = 7, c.add_bias_kv = true, c.add_zero_attn = true;
    c.kpm = CLMHA_MASK_FLOAT, c.am = CLMHA_MASK_BOOL_IGNORE, c.layout = LAYOUT_SHARED;
    for (size_t with = 0; with < 3; ++with) {
        err = split_and_merge(&c, cuts, 3, with);
        fprintf(stderr, "partial: kdim/vdim, bias_kv, zero_attn (with range %zu), masks: max "
                        "abs err %.3g\n",
                with, err);
        cr_expect(err <= TOL, "appended keys with range %zu: max abs err %g", with, err);
    }
}

// float16 and bfloat16 layers: 16-bit query, key, value, float mask and output, float32 partial
// results merged in float32; the projected result within the dtype's forward contract.
Test(partial, sixteen_bit_layers, .timeout = 300) {
    size_t cuts[] = {0, 4, 5, 11};
    const clmha_dtype types[2] = {CLMHA_DTYPE_F16, CLMHA_DTYPE_BF16};
    for (int ti = 0; ti < 2; ++ti) {
        rcase c = cross_case(31);
        c.add_bias_kv = true, c.kpm = CLMHA_MASK_FLOAT, c.is_causal = ti == 1;
        double ratio = split_and_merge_as(&c, cuts, 3, 2, types[ti]);
        fprintf(stderr, "partial: %s layer, 3 ranges: %.2f of the contract\n",
                types[ti] == CLMHA_DTYPE_F16 ? "float16" : "bfloat16", ratio);
        cr_expect(ratio <= 1.0, "dtype %d: %.2f times the contract", (int)types[ti], ratio);
    }
}

// float64 layers: doubles in and out, partial results and log-sum-exp rows in doubles, merged
// by clmha_attention_merge_f64(): within the float64 contract (1e-12) of the reference, with
// masks, the appended keys and causal ranges.
Test(partial, float64_layers, .timeout = 300) {
    clmha_context_release(fp64_context_or_skip());
    size_t cuts[] = {0, 4, 5, 11};
    for (int v = 0; v < 2; ++v) {
        rcase c = cross_case(35 + v);
        c.add_bias_kv = v == 0, c.add_zero_attn = v == 1, c.kdim = v ? 5 : 0;
        c.kpm = CLMHA_MASK_FLOAT, c.am = v ? CLMHA_MASK_BOOL_IGNORE : CLMHA_MASK_NONE;
        c.layout = LAYOUT_SHARED, c.is_causal = v == 0;
        double err = split_and_merge_as(&c, cuts, 3, (size_t)v, CLMHA_DTYPE_F64);
        fprintf(stderr, "partial: float64 layer, 3 ranges (case %d): max abs err %.3g\n", v, err);
        cr_expect(err <= 1e-12, "case %d: max abs err %g", v, err);
    }
}

// Attention sinks: the range that holds the appended keys holds the sinks (the others get
// sinks of -inf), so that the merge counts each row's sink once; with the appended keys in each
// range in turn, and with fully masked rows.
Test(partial, sinks, .timeout = 300) {
    size_t cuts[] = {0, 4, 5, 11};
    rcase c = cross_case(25);
    c.sinks = true, c.add_zero_attn = true, c.kpm = CLMHA_MASK_BOOL_IGNORE, c.mask_p = 0.3;
    for (size_t with = 0; with < 3; ++with) {
        double err = split_and_merge(&c, cuts, 3, with);
        fprintf(stderr, "partial: sinks, zero_attn (with range %zu): max abs err %.3g\n", with,
                err);
        cr_expect(err <= TOL, "sinks with range %zu: max abs err %g", with, err);
    }
    c = cross_case(26);
    c.sinks = true, c.kpm = CLMHA_MASK_BOOL_IGNORE, c.mask_batch = true, c.mask_p = 0.0;
    double err = split_and_merge(&c, cuts, 3, 2);
    fprintf(stderr, "partial: sinks, item 0 fully masked: max abs err %.3g\n", err);
    cr_expect(err <= TOL, "sinks, masked item: max abs err %g", err);
}

// The position terms: each range's keys at their positions (key_position = the range's first
// key), so that is_causal, a sliding window, ALiBi and user functions (rcase::user: ALiBi and the
// window as clmha_score_mod and clmha_mask_mod, with their block masks) see the sequence's
// positions, as the one-shot forward does.
Test(partial, positions, .timeout = 300) {
    size_t cuts[] = {0, 4, 5, 11};
    for (size_t k = 0; k < 6; ++k) {
        rcase c = cross_case(30 + k);
        c.l = 9;
        c.is_causal = k % 2 == 0;
        c.alibi = k >= 2, c.alibi_random = k == 3, c.softcap = k == 5 ? 1.5 : 0.0;
        if (k != 2) c.window = true, c.win_left = 2, c.win_right = k % 3 == 1 ? -1 : 1;
        c.user = k == 4 ? RC_USER_SCORE | RC_USER_MASK : k == 5 ? RC_USER_MASK : 0;
        c.sinks = k == 3, c.add_zero_attn = k == 3;
        char name[256];
        rcase_describe(&c, name, sizeof name);
        double err = split_and_merge(&c, cuts, 3, k % 3);
        fprintf(stderr, "partial: positions, %s: max abs err %.3g\n", name, err);
        cr_expect(err <= TOL, "%s: max abs err %g", name, err);
    }
    // Past the fused tiles: ranges that start inside a tile, a window the tiles skip around,
    // built in and as a user mask function (block masks at the ranges' positions).
    size_t long_cuts[] = {0, 70, 130, 200};
    for (size_t k = 0; k < 2; ++k) {
        rcase c = cross_case(36 + k);
        c.h = 2, c.e = 16, c.n = 1, c.l = 200, c.s = 200, c.is_causal = true, c.alibi = true;
        c.window = true, c.win_left = 20, c.win_right = 0;
        c.user = k ? RC_USER_SCORE | RC_USER_MASK : 0;
        char name[256];
        rcase_describe(&c, name, sizeof name);
        double err = split_and_merge(&c, long_cuts, 3, 1);
        fprintf(stderr, "partial: positions, %s: max abs err %.3g\n", name, err);
        cr_expect(err <= TOL, "%s: max abs err %g", name, err);
    }
}

// Query rows at an offset (query_position): the second half of the rows over every key, as the
// one-shot forward's rows, with is_causal, a window and ALiBi.
Test(partial, query_position, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    rcase c = cross_case(40);
    c.l = 10, c.s = 10, c.is_causal = true, c.alibi = true;
    c.window = true, c.win_left = 3, c.win_right = 0;
    instance in;
    instance_make(&in, &c);
    size_t n = in.n, l = c.l, s = c.s, e = c.e, h = c.h, d = e / h, half = l / 2;
    double *want = malloc(in.output_count * sizeof *want);
    char msg[512];
    cr_assert_eq(clmha_reference_forward(&in.desc, &in.params, &in.args, want, in.output_count,
                                         NULL, 0, msg, sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    clmha_layer *layer = instance_layer(ctx, &in);
    size_t rows = n * h * (l - half);
    // (L, N, E) rows half .. L-1 are contiguous (sequence first).
    cl_mem query = upload(ctx, in.query + half * n * e, (l - half) * n * e * 4);
    cl_mem key = upload(ctx, in.key, s * n * e * 4), value = upload(ctx, in.value, s * n * e * 4);
    cl_mem heads = device_buffer(ctx, rows * d * 4), lse = device_buffer(ctx, rows * 4);
    cl_mem out = device_buffer(ctx, (l - half) * n * e * 4);
    clmha_forward_args a = {.struct_size = sizeof a, .is_causal = true, .query_position = half};
    a.query = (clmha_tensor){.ndim = 3, .shape = {l - half, n, e}, .buffer = query};
    a.key = (clmha_tensor){.ndim = 3, .shape = {s, n, e}, .buffer = key};
    a.value = (clmha_tensor){.ndim = 3, .shape = {s, n, e}, .buffer = value};
    cr_assert_eq(clmha_layer_attend(layer, &a, true, heads, 0, lse, 0, 0, NULL, NULL),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_assert_eq(clmha_layer_project_heads(layer, n, l - half, heads, 0, out, 0, 0, NULL, NULL),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    float *got = alloc_floats((l - half) * n * e);
    cr_assert_eq(clEnqueueReadBuffer(clmha_context_cl_queue(ctx), out, CL_TRUE, 0,
                                     (l - half) * n * e * 4, got, 0, NULL, NULL),
                 CL_SUCCESS);
    double err = max_abs_err(got, want + half * n * e, (l - half) * n * e);
    fprintf(stderr, "partial: query_position %zu, causal, window (3, 0), ALiBi: max abs err "
                    "%.3g\n",
            half, err);
    cr_expect(err <= TOL, "max abs err %g", err);
    cl_mem bufs[] = {query, key, value, heads, lse, out};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i) clReleaseMemObject(bufs[i]);
    free(got);
    free(want);
    clmha_layer_release(layer);
    instance_free(&in);
    clmha_context_release(ctx);
}

// Item 0's keys are all masked (key_padding_mask, boolean): its rows have lse -INFINITY in every
// range, merge to zeros and project to out_proj.bias, as the one-shot forward gives; ranges of
// one key at the end.
Test(partial, masked_range_and_single_keys, .timeout = 300) {
    rcase c = cross_case(23);
    c.kpm = CLMHA_MASK_BOOL_IGNORE, c.mask_batch = true, c.s = 6, c.mask_p = 0.0;
    size_t cuts[] = {0, 3, 4, 5, 6};
    double err = split_and_merge(&c, cuts, 4, 3);
    fprintf(stderr, "partial: item 0 fully masked, single-key ranges: max abs err %.3g\n", err);
    cr_expect(err <= TOL, "max abs err %g", err);
}

// A NaN log-sum-exp (a NaN score in that part) makes the merged row NaN, results and
// log-sum-exp (include/clmha.h); rows of both parts without keys stay zeros and -inf.
Test(partial, merge_nan_lse) {
    clmha_context *ctx = context_or_skip();
    enum { ROWS = 4, D = 2 };
    const float nan = NAN, inf = INFINITY;
    float ha[ROWS * D] = {1, 2, 1, 2, 1, 2, 0, 0}, la[ROWS] = {0, nan, 0, -inf};
    float hb[ROWS * D] = {3, 4, 3, 4, 3, 4, 0, 0}, lb[ROWS] = {nan, 0, 0, -inf};
    cl_mem a = upload(ctx, ha, sizeof ha), al = upload(ctx, la, sizeof la);
    cl_mem b = upload(ctx, hb, sizeof hb), bl = upload(ctx, lb, sizeof lb);
    cr_assert_eq(clmha_attention_merge(ctx, ROWS, D, a, 0, al, 0, b, 0, bl, 0, 0, NULL, NULL),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cl_command_queue q = clmha_context_cl_queue(ctx);
    cr_assert_eq(clEnqueueReadBuffer(q, a, CL_TRUE, 0, sizeof ha, ha, 0, NULL, NULL), CL_SUCCESS);
    cr_assert_eq(clEnqueueReadBuffer(q, al, CL_TRUE, 0, sizeof la, la, 0, NULL, NULL),
                 CL_SUCCESS);
    for (int r = 0; r < 2; ++r)
        cr_expect(isnan(la[r]) && isnan(ha[r * D]) && isnan(ha[r * D + 1]),
                  "row %d: lse %g, results %g %g", r, la[r], ha[r * D], ha[r * D + 1]);
    cr_expect(fabsf(ha[4] - 2.0f) < 1e-6f && fabsf(ha[5] - 3.0f) < 1e-6f &&
                  fabsf(la[2] - logf(2.0f)) < 1e-6f,
              "row 2: %g %g, lse %g", ha[4], ha[5], la[2]);
    cr_expect(ha[6] == 0 && ha[7] == 0 && la[3] == -inf, "row 3: %g %g, lse %g", ha[6], ha[7],
              la[3]);
    clReleaseMemObject(a), clReleaseMemObject(al), clReleaseMemObject(b), clReleaseMemObject(bl);
    clmha_context_release(ctx);
}

// clmha_attention_merge_f64(): doubles merged in float64 (values that float32 would round), a
// row without keys in either, and buffers sized in doubles (one of floats' size is refused).
Test(partial, merge_f64) {
    clmha_context *ctx = context_or_skip();
    if (!has_fp64(ctx)) {
        cr_expect_eq(clmha_attention_merge_f64(ctx, 1, 1, NULL, 0, NULL, 0, NULL, 0, NULL, 0, 0,
                                               NULL, NULL),
                     CLMHA_UNSUPPORTED);
        clmha_context_release(ctx);
        cr_skip_test("the device has no double precision");
    }
    enum { ROWS = 2, D = 2 };
    const double inf = INFINITY, x = 1.0 + 0x1p-40;
    double ha[ROWS * D] = {x, 2, 0, 0}, la[ROWS] = {log(3.0), -inf};
    double hb[ROWS * D] = {3, 4, 0, 0}, lb[ROWS] = {0.0, -inf};
    cl_mem a = upload(ctx, ha, sizeof ha), al = upload(ctx, la, sizeof la);
    cl_mem b = upload(ctx, hb, sizeof hb), bl = upload(ctx, lb, sizeof lb);
    cl_mem small = upload(ctx, hb, sizeof hb / 2);
    cr_expect_eq(clmha_attention_merge_f64(ctx, ROWS, D, a, 0, al, 0, small, 0, bl, 0, 0, NULL,
                                           NULL),
                 CLMHA_INVALID_ARGUMENT);
    cr_assert_eq(clmha_attention_merge_f64(ctx, ROWS, D, a, 0, al, 0, b, 0, bl, 0, 0, NULL,
                                           NULL),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cl_command_queue q = clmha_context_cl_queue(ctx);
    cr_assert_eq(clEnqueueReadBuffer(q, a, CL_TRUE, 0, sizeof ha, ha, 0, NULL, NULL), CL_SUCCESS);
    cr_assert_eq(clEnqueueReadBuffer(q, al, CL_TRUE, 0, sizeof la, la, 0, NULL, NULL),
                 CL_SUCCESS);
    // Weights 3 and 1 of 4: (3x + 3) / 4 and (6 + 4) / 4; lse log 4.
    double w0 = (3.0 * x + 3.0) / 4.0;
    cr_expect(fabs(ha[0] - w0) <= 1e-15 && fabs(ha[1] - 2.5) <= 1e-15 &&
                  fabs(la[0] - log(4.0)) <= 1e-15,
              "row 0: %.17g %.17g (want %.17g 2.5), lse %.17g", ha[0], ha[1], w0, la[0]);
    cr_expect(ha[0] != (double)(float)w0, "the merge rounded to float: %.17g", ha[0]);
    cr_expect(ha[2] == 0 && ha[3] == 0 && la[1] == -inf, "row 1: %g %g, lse %g", ha[2], ha[3],
              la[1]);
    clReleaseMemObject(a), clReleaseMemObject(al), clReleaseMemObject(b), clReleaseMemObject(bl);
    clReleaseMemObject(small);
    clmha_context_release(ctx);
}

Test(partial, errors, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    rcase c = cross_case(24);
    instance in;
    instance_make(&in, &c);
    clmha_layer *layer = instance_layer(ctx, &in);
    size_t n = in.n, l = c.l, e = c.e, h = c.h, d = e / h, rows = n * h * l;
    cl_mem query = upload(ctx, in.query, n * l * e * 4);
    cl_mem key = upload(ctx, in.key, c.s * n * e * 4);
    cl_mem heads = device_buffer(ctx, rows * d * 4), lse = device_buffer(ctx, rows * 4);
    cl_mem heads2 = device_buffer(ctx, rows * d * 4), lse2 = device_buffer(ctx, rows * 4);
    clmha_forward_args a = {.struct_size = sizeof a};
    a.query = (clmha_tensor){.ndim = 3, .shape = {l, n, e}, .buffer = query};
    a.key = (clmha_tensor){.ndim = 3, .shape = {c.s, n, e}, .buffer = key};
    a.need_weights = true;
    cr_expect_eq(clmha_layer_attend(layer, &a, true, heads, 0, lse, 0, 0, NULL, NULL),
                 CLMHA_UNSUPPORTED);
    cr_expect(strstr(clmha_context_last_error(ctx), "need_weights"), "%s",
              clmha_context_last_error(ctx));
    a.need_weights = false;
    a.impl = CLMHA_IMPL_UNFUSED;
    cr_expect_eq(clmha_layer_attend(layer, &a, true, heads, 0, lse, 0, 0, NULL, NULL),
                 CLMHA_UNSUPPORTED);
    a.impl = CLMHA_IMPL_AUTO;
    cr_expect_eq(clmha_layer_attend(NULL, &a, true, heads, 0, lse, 0, 0, NULL, NULL),
                 CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_layer_attend(layer, &a, true, heads, 1, lse, 0, 0, NULL, NULL),
                 CLMHA_INVALID_ARGUMENT, "heads one float short");
    cr_expect_eq(clmha_layer_attend(layer, &a, true, heads, 0, NULL, 0, 0, NULL, NULL),
                 CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_layer_attend(layer, &a, true, heads, 0, heads, 0, 0, NULL, NULL),
                 CLMHA_INVALID_ARGUMENT, "lse overlapping heads");
    cr_expect_eq(clmha_layer_attend(layer, &a, true, heads, 0, lse, 0, 0, NULL, NULL),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    // Merge.
    cr_expect_eq(clmha_attention_merge(NULL, rows, d, heads, 0, lse, 0, heads2, 0, lse2, 0, 0,
                                       NULL, NULL),
                 CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_attention_merge(ctx, 0, d, heads, 0, lse, 0, heads2, 0, lse2, 0, 0, NULL,
                                       NULL),
                 CLMHA_SHAPE_MISMATCH);
    cr_expect_eq(clmha_attention_merge(ctx, rows + 1, d, heads, 0, lse, 0, heads2, 0, lse2, 0, 0,
                                       NULL, NULL),
                 CLMHA_INVALID_ARGUMENT, "rows past the buffers");
    cr_expect_eq(clmha_attention_merge(ctx, rows, d, heads, 0, lse, 0, heads, 0, lse2, 0, 0,
                                       NULL, NULL),
                 CLMHA_INVALID_ARGUMENT, "a merged with itself");
    cr_expect_eq(clmha_attention_merge(ctx, SIZE_MAX / 2, d, heads, 0, lse, 0, heads2, 0, lse2,
                                       0, 0, NULL, NULL),
                 CLMHA_SIZE_OVERFLOW);
    // Project.
    cl_mem out = device_buffer(ctx, n * l * e * 4);
    cr_expect_eq(clmha_layer_project_heads(layer, 0, l, heads, 0, out, 0, 0, NULL, NULL),
                 CLMHA_SHAPE_MISMATCH);
    cr_expect_eq(clmha_layer_project_heads(layer, n, l, heads, 0, heads, 0, 0, NULL, NULL),
                 CLMHA_INVALID_ARGUMENT, "output overlapping heads");
    cr_expect_eq(clmha_layer_project_heads(layer, n, l + 1, heads, 0, out, 0, 0, NULL, NULL),
                 CLMHA_INVALID_ARGUMENT, "too many rows");
    cr_expect_eq(clmha_layer_project_heads(NULL, n, l, heads, 0, out, 0, 0, NULL, NULL),
                 CLMHA_INVALID_ARGUMENT);
    cl_event ev = NULL;
    cr_expect_eq(clmha_layer_project_heads(layer, n, l, heads, 0, out, 0, 0, NULL, &ev),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_expect_eq(clWaitForEvents(1, &ev), CL_SUCCESS);
    clReleaseEvent(ev);
    cl_mem bufs[] = {query, key, heads, lse, heads2, lse2, out};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i) clReleaseMemObject(bufs[i]);
    clmha_layer_release(layer);
    instance_free(&in);
    clmha_context_release(ctx);
}
