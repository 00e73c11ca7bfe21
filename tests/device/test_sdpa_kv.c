// Attention as a function with a KV cache (clmha_attention_args::kv_cache,
// clmha_kv_cache_create_for()): a sequence fed through the cache in a prefix chunk and then
// token by token gives the rows of the one-shot causal call, checked against the float64
// reference on the whole sequence, in both layouts, through the host and the device forms;
// the same with sliding windows (bottom-right with a cache: token t at position t, as in the
// one-shot call); ragged appends (kv_append) and the lengths; what the cache form refuses.
#define _POSIX_C_SOURCE 200809L  // setenv
#include <criterion/criterion.h>

#include <clmha.h>

#include "base/half.h"
#include "support.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOLERANCE 1e-4

enum { N = 2, H = 4, HKV = 2, D = 16, T = 13, PREFIX = 5, CAP = 20 };

// What a call masks: is_causal and a sliding window (clmha_attention_args::window).
typedef struct masking {
    bool causal, window;
    int64_t left, right;
} masking;

static const masking causal_only = {.causal = true};

static void set_masking(clmha_attention_args *a, const masking *m) {
    a->is_causal = m->causal;
    a->window = m->window, a->window_left = m->left, a->window_right = m->right;
}

// Element (n, h, t, c) of a tensor of @p heads heads and @p seq tokens in @p layout.
static size_t at(clmha_attention_layout layout, size_t heads, size_t seq, size_t n, size_t h,
                 size_t t, size_t c) {
    return layout == CLMHA_LAYOUT_NHLD ? ((n * heads + h) * seq + t) * D + c
                                       : ((n * seq + t) * heads + h) * D + c;
}

// Tokens [t0, t0 + len) of a (N, heads, T, D) NHLD tensor, in @p layout.
static float *slice(const float *full, size_t heads, size_t t0, size_t len,
                    clmha_attention_layout layout) {
    float *out = alloc_floats(N * heads * len * D);
    for (size_t n = 0; n < N; ++n)
        for (size_t h = 0; h < heads; ++h)
            for (size_t t = 0; t < len; ++t)
                for (size_t c = 0; c < D; ++c)
                    out[at(layout, heads, len, n, h, t, c)] =
                        full[at(CLMHA_LAYOUT_NHLD, heads, T, n, h, t0 + t, c)];
    return out;
}

static clmha_tensor tensor(clmha_attention_layout layout, size_t heads, size_t seq,
                           const float *data) {
    clmha_tensor t = {.ndim = 4, .data = data};
    size_t shape[4] = {N, layout == CLMHA_LAYOUT_NHLD ? heads : seq,
                       layout == CLMHA_LAYOUT_NHLD ? seq : heads, D};
    memcpy(t.shape, shape, sizeof shape);
    return t;
}

// One call through the cache, masked by @p m: tokens [t0, t0 + len) of q, k, v; its output
// checked against rows [t0, t0 + len) of @p want (NHLD, @p want_len tokens). @p device: the
// device-buffer form, at an element offset.
static double step(clmha_context *ctx, clmha_kv_cache *cache, clmha_attention_layout layout,
                   const float *q, const float *k, const float *v, size_t t0, size_t len,
                   const double *want, size_t want_len, bool device, const masking *m) {
    float *qs = slice(q, H, t0, len, layout), *ks = slice(k, HKV, t0, len, layout),
          *vs = slice(v, HKV, t0, len, layout), *out = alloc_floats(N * H * len * D);
    clmha_attention_args a = {.struct_size = sizeof a, .layout = layout, .enable_gqa = true,
                              .kv_cache = cache, .query = tensor(layout, H, len, qs),
                              .key = tensor(layout, HKV, len, ks),
                              .value = tensor(layout, HKV, len, vs)};
    set_masking(&a, m);
    size_t nq = N * H * len * D, nk = N * HKV * len * D, pad = 5;
    if (!device) {
        cr_assert_eq(clmha_attention_forward_host(ctx, &a, out, nq, NULL, 0, NULL, 0),
                     CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    } else {
        cl_context cl = clmha_context_cl_context(ctx);
        cl_command_queue queue = clmha_context_cl_queue(ctx);
        cl_int err;
        size_t counts[3] = {nq, nk, nk};
        const float *host[3] = {qs, ks, vs};
        clmha_tensor *t[3] = {&a.query, &a.key, &a.value};
        cl_mem b[4];
        for (int i = 0; i < 3; ++i) {
            b[i] = clCreateBuffer(cl, CL_MEM_READ_WRITE, (counts[i] + pad) * 4, NULL, &err);
            cr_assert_eq(err, CL_SUCCESS);
            clEnqueueWriteBuffer(queue, b[i], CL_TRUE, pad * 4, counts[i] * 4, host[i], 0, NULL,
                                 NULL);
            t[i]->buffer = b[i], t[i]->offset = pad;
        }
        b[3] = clCreateBuffer(cl, CL_MEM_READ_WRITE, (nq + pad) * 4, NULL, &err);
        cl_event ev = NULL;
        cr_assert_eq(clmha_attention_forward(ctx, &a, b[3], pad, NULL, 0, NULL, 0, 0, NULL, &ev),
                     CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
        cr_assert_eq(clWaitForEvents(1, &ev), CL_SUCCESS);
        clReleaseEvent(ev);
        clEnqueueReadBuffer(queue, b[3], CL_TRUE, pad * 4, nq * 4, out, 0, NULL, NULL);
        for (int i = 0; i < 4; ++i) clReleaseMemObject(b[i]);
    }
    double worst = 0;
    for (size_t n = 0; n < N; ++n)
        for (size_t h = 0; h < H; ++h)
            for (size_t t = 0; t < len; ++t)
                for (size_t c = 0; c < D; ++c) {
                    double e = fabs(out[at(layout, H, len, n, h, t, c)] -
                                    want[at(CLMHA_LAYOUT_NHLD, H, want_len, n, h, t0 + t, c)]);
                    if (!(e <= worst)) worst = e;  // NaN wins
                }
    free(qs), free(ks), free(vs), free(out);
    return worst;
}

// The one-shot output of the first @p len tokens (NHLD), masked by @p m, by the float64
// reference (top-left: token t at position t).
static double *one_shot(const float *q, const float *k, const float *v, size_t len,
                        const masking *m) {
    float *qs = slice(q, H, 0, len, CLMHA_LAYOUT_NHLD), *ks = slice(k, HKV, 0, len,
                                                                     CLMHA_LAYOUT_NHLD),
          *vs = slice(v, HKV, 0, len, CLMHA_LAYOUT_NHLD);
    clmha_attention_args a = {.struct_size = sizeof a, .enable_gqa = true,
                              .query = tensor(CLMHA_LAYOUT_NHLD, H, len, qs),
                              .key = tensor(CLMHA_LAYOUT_NHLD, HKV, len, ks),
                              .value = tensor(CLMHA_LAYOUT_NHLD, HKV, len, vs)};
    set_masking(&a, m);
    double *want = malloc(N * H * len * D * sizeof *want);
    char msg[256];
    cr_assert_eq(clmha_reference_attention(&a, want, N * H * len * D, NULL, 0, NULL, 0, msg,
                                           sizeof msg),
                 CLMHA_SUCCESS, "%s", msg);
    free(qs), free(ks), free(vs);
    return want;
}

static void decode_matches_one_shot(clmha_attention_layout layout, bool device) {
    clmha_context *ctx = context_or_skip();
    prng r = {layout * 10 + device + 1};
    float *q = normal_floats(&r, N * H * T * D), *k = normal_floats(&r, N * HKV * T * D),
          *v = normal_floats(&r, N * HKV * T * D);
    double *want = one_shot(q, k, v, T, &causal_only);
    clmha_kv_cache *cache = NULL;
    cr_assert_eq(clmha_kv_cache_create_for(&cache, ctx, N, HKV, D, CAP), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    double worst = step(ctx, cache, layout, q, k, v, 0, PREFIX, want, T, device, &causal_only);
    for (size_t t = PREFIX; t < T; ++t) {
        double e = step(ctx, cache, layout, q, k, v, t, 1, want, T, device, &causal_only);
        if (!(e <= worst)) worst = e;
    }
    size_t lengths[N];
    cr_assert_eq(clmha_kv_cache_lengths(cache, lengths, N), CLMHA_SUCCESS);
    cr_expect(lengths[0] == T && lengths[1] == T, "lengths %zu, %zu, expected %d", lengths[0],
              lengths[1], T);
    printf("sdpa kv %s %s: prefix %d + %d steps, max|err| %.2e\n",
           layout == CLMHA_LAYOUT_NHLD ? "nhld" : "nlhd", device ? "device" : "host", PREFIX,
           T - PREFIX, worst);
    cr_expect_leq(worst, TOLERANCE, "max |output - one-shot reference| %.3g", worst);
    clmha_kv_cache_release(cache);
    free(q), free(k), free(v), free(want);
    clmha_context_release(ctx);
}

Test(sdpa_kv, nhld_host_decode_matches_one_shot) {
    decode_matches_one_shot(CLMHA_LAYOUT_NHLD, false);
}

Test(sdpa_kv, nlhd_host_decode_matches_one_shot) {
    decode_matches_one_shot(CLMHA_LAYOUT_NLHD, false);
}

Test(sdpa_kv, nhld_device_decode_matches_one_shot) {
    decode_matches_one_shot(CLMHA_LAYOUT_NHLD, true);
}

Test(sdpa_kv, nlhd_device_decode_matches_one_shot) {
    decode_matches_one_shot(CLMHA_LAYOUT_NLHD, true);
}

// step() in another dtype: float64 through double arrays (host) or buffers of doubles, float16
// and bfloat16 through float arrays (host, the values already the dtype's) or 16-bit buffers;
// returns the output's largest error against @p want as a fraction of the dtype's contract
// (float64: 1e-12; 16-bit: r·(|y| + t) + t, r half an ulp, t = 1e-5·(1 + max |y|)).
static double step_as(clmha_context *ctx, clmha_kv_cache *cache, clmha_attention_layout layout,
                      clmha_dtype dt, const float *q, const float *k, const float *v, size_t t0,
                      size_t len, const double *want, size_t want_len, bool device) {
    float *src[3] = {slice(q, H, t0, len, layout), slice(k, HKV, t0, len, layout),
                     slice(v, HKV, t0, len, layout)};
    size_t nq = N * H * len * D, nk = N * HKV * len * D, count[4] = {nq, nk, nk, nq}, pad = 3;
    size_t es = dt == CLMHA_DTYPE_F64 ? 8 : 2;
    clmha_attention_args a = {.struct_size = sizeof a, .layout = layout, .enable_gqa = true,
                              .kv_cache = cache, .dtype = dt, .is_causal = true,
                              .query = tensor(layout, H, len, NULL),
                              .key = tensor(layout, HKV, len, NULL),
                              .value = tensor(layout, HKV, len, NULL)};
    clmha_tensor *t[3] = {&a.query, &a.key, &a.value};
    double *out = malloc(nq * sizeof *out);
    void *host[4];
    for (int i = 0; i < 4; ++i) {  // the inputs and the output in the dtype's elements
        host[i] = calloc(count[i] + 1, es);
        for (size_t j = 0; i < 3 && j < count[i]; ++j) {
            if (es == 8) ((double *)host[i])[j] = src[i][j];
            else ((uint16_t *)host[i])[j] = dt == CLMHA_DTYPE_F16 ? clmha__f32_to_f16(src[i][j])
                                                                  : clmha__f32_to_bf16(src[i][j]);
        }
    }
    if (!device) {
        for (int i = 0; i < 3; ++i) t[i]->data = es == 8 ? host[i] : (void *)src[i];
        float *o32 = alloc_floats(nq);
        clmha_status st =
            es == 8 ? clmha_attention_forward_host_f64(ctx, &a, out, nq, NULL, 0, NULL, 0)
                    : clmha_attention_forward_host(ctx, &a, o32, nq, NULL, 0, NULL, 0);
        cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
        for (size_t j = 0; es == 2 && j < nq; ++j) out[j] = o32[j];
        free(o32);
    } else {
        cl_context cl = clmha_context_cl_context(ctx);
        cl_command_queue queue = clmha_context_cl_queue(ctx);
        cl_mem b[4];
        cl_int err;
        for (int i = 0; i < 4; ++i) {
            b[i] = clCreateBuffer(cl, CL_MEM_READ_WRITE, (count[i] + pad) * es, NULL, &err);
            cr_assert_eq(err, CL_SUCCESS);
            if (i < 3) {
                clEnqueueWriteBuffer(queue, b[i], CL_TRUE, pad * es, count[i] * es, host[i], 0,
                                     NULL, NULL);
                t[i]->buffer = b[i], t[i]->offset = pad;
            }
        }
        cr_assert_eq(clmha_attention_forward(ctx, &a, b[3], pad, NULL, 0, NULL, 0, 0, NULL, NULL),
                     CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
        clEnqueueReadBuffer(queue, b[3], CL_TRUE, pad * es, nq * es, host[3], 0, NULL, NULL);
        for (size_t j = 0; j < nq; ++j)
            out[j] = es == 8 ? ((double *)host[3])[j]
                     : dt == CLMHA_DTYPE_F16 ? clmha__f16_to_f32(((uint16_t *)host[3])[j])
                                             : clmha__bf16_to_f32(((uint16_t *)host[3])[j]);
        for (int i = 0; i < 4; ++i) clReleaseMemObject(b[i]);
    }
    double big = 0, worst = 0, r = dt == CLMHA_DTYPE_F16 ? 0x1p-11 : 0x1p-8;
    for (size_t j = 0; j < N * H * want_len * D; ++j) big = fmax(big, fabs(want[j]));
    double tol = 1e-5 * (1 + big);
    for (size_t n = 0; n < N; ++n)
        for (size_t h = 0; h < H; ++h)
            for (size_t tt = 0; tt < len; ++tt)
                for (size_t c = 0; c < D; ++c) {
                    double w = want[at(CLMHA_LAYOUT_NHLD, H, want_len, n, h, t0 + tt, c)];
                    double e = fabs(out[at(layout, H, len, n, h, tt, c)] - w);
                    e /= es == 8 ? 1e-12 : r * (fabs(w) + tol) + tol;
                    if (!(e <= worst)) worst = e;  // NaN wins
                }
    for (int i = 0; i < 4; ++i) free(host[i]);
    for (int i = 0; i < 3; ++i) free(src[i]);
    free(out);
    return worst;
}

// Decoding in float64 and in 16-bit dtypes: the cache of a float64 call holds doubles
// (clmha_kv_cache_options::dtype), a 16-bit call's floats (its tensors widened); a prefix then
// single tokens, both layouts, host and device forms, within each dtype's contract of the
// reference on the dtype's values; a float64 call refuses a float32 cache and the other way.
Test(sdpa_kv, other_dtypes, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    bool fp = has_fp64(ctx);
    const clmha_dtype dts[3] = {CLMHA_DTYPE_F64, CLMHA_DTYPE_F16, CLMHA_DTYPE_BF16};
    for (int di = fp ? 0 : 1; di < 3; ++di)
        for (int form = 0; form < 4; ++form) {
            clmha_attention_layout layout = form & 1 ? CLMHA_LAYOUT_NLHD : CLMHA_LAYOUT_NHLD;
            bool device = form & 2;
            prng r = {(uint64_t)(di * 4 + form + 40)};
            float *x[3] = {normal_floats(&r, N * H * T * D), normal_floats(&r, N * HKV * T * D),
                           normal_floats(&r, N * HKV * T * D)};
            size_t cnt[3] = {N * H * T * D, N * HKV * T * D, N * HKV * T * D};
            for (int i = 0; di > 0 && i < 3; ++i)  // the 16-bit dtype's values
                for (size_t j = 0; j < cnt[i]; ++j) x[i][j] = clmha__dtype_round(dts[di], x[i][j]);
            double *want = one_shot(x[0], x[1], x[2], T, &causal_only);
            clmha_kv_cache_options o = {.struct_size = sizeof o, .capacity = CAP,
                                        .dtype = dts[di]};
            clmha_kv_cache *cache = NULL;
            cr_assert_eq(clmha_kv_cache_create_for_with(&cache, ctx, N, HKV, D, &o),
                         CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
            double worst = step_as(ctx, cache, layout, dts[di], x[0], x[1], x[2], 0, PREFIX,
                                   want, T, device);
            for (size_t t = PREFIX; t < T; ++t)
                worst = fmax(worst, step_as(ctx, cache, layout, dts[di], x[0], x[1], x[2], t, 1,
                                            want, T, device));
            printf("sdpa kv %s %s %s: %.3g of the contract\n", clmha__dtype_name(dts[di]),
                   form & 1 ? "nlhd" : "nhld", device ? "device" : "host", worst);
            cr_expect_leq(worst, 1.0, "dtype %d, form %d: %.3g of the contract", (int)dts[di],
                          form, worst);
            clmha_kv_cache_release(cache);
            free(want);
            for (int i = 0; i < 3; ++i) free(x[i]);
        }
    if (fp) {  // a float64 call with a float32 cache, and a float32 call with a float64 one
        for (int k = 0; k < 2; ++k) {
            clmha_kv_cache_options o = {.struct_size = sizeof o, .capacity = CAP,
                                        .dtype = k ? CLMHA_DTYPE_F64 : CLMHA_DTYPE_F32};
            clmha_kv_cache *cache = NULL;
            cr_assert_eq(clmha_kv_cache_create_for_with(&cache, ctx, N, HKV, D, &o),
                         CLMHA_SUCCESS);
            double q[N * H * D] = {0}, kv[N * HKV * D] = {0}, y[N * H * D];
            clmha_attention_args a = {.struct_size = sizeof a, .enable_gqa = true,
                                      .kv_cache = cache, .dtype = k ? CLMHA_DTYPE_F32
                                                                    : CLMHA_DTYPE_F64,
                                      .query = tensor(CLMHA_LAYOUT_NHLD, H, 1, NULL),
                                      .key = tensor(CLMHA_LAYOUT_NHLD, HKV, 1, NULL),
                                      .value = tensor(CLMHA_LAYOUT_NHLD, HKV, 1, NULL)};
            a.query.data = q, a.key.data = a.value.data = kv;
            clmha_status st =
                k ? clmha_attention_forward_host(ctx, &a, (float *)y, N * H * D, NULL, 0, NULL, 0)
                  : clmha_attention_forward_host_f64(ctx, &a, y, N * H * D, NULL, 0, NULL, 0);
            cr_expect_eq(st, CLMHA_INVALID_ARGUMENT, "case %d: %s", k,
                         clmha_context_last_error(ctx));
            cr_expect(strstr(clmha_context_last_error(ctx), "kv_cache was made for") != NULL,
                      "%s", clmha_context_last_error(ctx));
            clmha_kv_cache_release(cache);
        }
    }
    clmha_context_release(ctx);
}

// A sequence through the cache, masked by @p m: a prefix of PREFIX tokens, then calls of
// @p chunk tokens (@p parts ranges of keys a row, 0: the core's choice). Each call's rows are
// checked against the one-shot reference of the whole sequence with the same masking, or,
// where a query sees keys after its own (no is_causal, a window's right bound other than 0),
// of the tokens the cache holds after the call. Returns the worst max abs error.
static double windowed_feed(clmha_context *ctx, clmha_attention_layout layout, bool device,
                            const masking *m, size_t chunk, size_t parts) {
    prng r = {layout * 10 + device + 100 + (uint64_t)m->left};
    float *q = normal_floats(&r, N * H * T * D), *k = normal_floats(&r, N * HKV * T * D),
          *v = normal_floats(&r, N * HKV * T * D);
    bool ahead = !m->causal && m->right != 0;
    double *whole = one_shot(q, k, v, T, m);
    clmha_kv_cache *cache = NULL;
    cr_assert_eq(clmha_kv_cache_create_for(&cache, ctx, N, HKV, D, CAP), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    char count[16];
    snprintf(count, sizeof count, "%zu", parts);
    if (parts) setenv("CLMHA_DECODE_PARTS", count, 1);
    double worst = 0;
    for (size_t t0 = 0, len; t0 < T; t0 += len) {
        len = t0 == 0 ? PREFIX : chunk < T - t0 ? chunk : T - t0;
        double *want = ahead ? one_shot(q, k, v, t0 + len, m) : whole;
        double e = step(ctx, cache, layout, q, k, v, t0, len, want, ahead ? t0 + len : T,
                        device, m);
        if (!(e <= worst)) worst = e;
        if (ahead) free(want);
    }
    unsetenv("CLMHA_DECODE_PARTS");
    clmha_kv_cache_release(cache);
    free(q), free(k), free(v), free(whole);
    return worst;
}

// Sliding windows: one key (0, 0), 4 keys (3, 0), (4, -1), one wider than the cache (50, -1),
// all with is_causal; without it (2, 0), and (2, 3) and (-1, 1), whose queries see the call's
// later tokens; token by token and in chunks of 3, with the core's ranges and 3 a row (some
// empty), both layouts, the host and the device forms, 2 query heads per key/value head.
Test(sdpa_kv, sliding_window_decode_matches_one_shot, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    const masking ms[] = {
        {.causal = true, .window = true, .left = 0, .right = 0},
        {.causal = true, .window = true, .left = 3, .right = 0},
        {.causal = true, .window = true, .left = 4, .right = -1},
        {.causal = true, .window = true, .left = 50, .right = -1},
        {.window = true, .left = 2, .right = 0},
        {.window = true, .left = 2, .right = 3},
        {.window = true, .left = -1, .right = 1},
    };
    double worst = 0;
    for (size_t i = 0; i < sizeof ms / sizeof ms[0]; ++i)
        for (int layout = 0; layout < 2; ++layout)
            for (size_t chunk = 1; chunk <= 3; chunk += 2) {
                clmha_attention_layout lay = layout ? CLMHA_LAYOUT_NLHD : CLMHA_LAYOUT_NHLD;
                bool device = chunk == 3;
                size_t parts = layout ? 3 : 0;
                double e = windowed_feed(ctx, lay, device, &ms[i], chunk, parts);
                cr_expect_leq(e, TOLERANCE,
                              "window (%lld, %lld)%s, %s %s, chunk %zu, parts %zu: max|err| %.3g",
                              (long long)ms[i].left, (long long)ms[i].right,
                              ms[i].causal ? " causal" : "", layout ? "nlhd" : "nhld",
                              device ? "device" : "host", chunk, parts, e);
                if (!(e <= worst)) worst = e;
            }
    printf("sdpa kv sliding windows: %zu windows x 2 layouts x 2 chunkings, max|err| %.2e\n",
           sizeof ms / sizeof ms[0], worst);
    clmha_context_release(ctx);
}

// Ragged: sequence 1 appends 2 of the call's 3 new tokens; masked by @p m (without is_causal
// each query sees every token of its sequence). Sequence 1's queries are checked against the
// reference on its 2 tokens alone (with a window, a row may see none of them: zeros).
static void ragged_append(const masking *m) {
    clmha_context *ctx = context_or_skip();
    enum { S3 = 3 };
    prng r = {77};
    float *q = normal_floats(&r, N * H * S3 * D), *k = normal_floats(&r, N * HKV * S3 * D),
          *v = normal_floats(&r, N * HKV * S3 * D), *out = alloc_floats(N * H * S3 * D);
    clmha_kv_cache *cache = NULL;
    cr_assert_eq(clmha_kv_cache_create_for(&cache, ctx, N, HKV, D, CAP), CLMHA_SUCCESS);
    size_t append[N] = {3, 2};
    clmha_attention_args a = {.struct_size = sizeof a, .enable_gqa = true, .kv_cache = cache,
                              .kv_append = append,
                              .query = {.ndim = 4, .shape = {N, H, S3, D}, .data = q},
                              .key = {.ndim = 4, .shape = {N, HKV, S3, D}, .data = k},
                              .value = {.ndim = 4, .shape = {N, HKV, S3, D}, .data = v}};
    set_masking(&a, m);
    cr_assert_eq(clmha_attention_forward_host(ctx, &a, out, N * H * S3 * D, NULL, 0, NULL, 0),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    size_t lengths[N];
    cr_assert_eq(clmha_kv_cache_lengths(cache, lengths, N), CLMHA_SUCCESS);
    cr_expect(lengths[0] == 3 && lengths[1] == 2, "lengths %zu, %zu", lengths[0], lengths[1]);
    // The reference per sequence: batch item n alone, its appended tokens as key and value.
    for (size_t n = 0; n < N; ++n) {
        size_t s = append[n];
        float *kn = alloc_floats(HKV * s * D), *vn = alloc_floats(HKV * s * D);
        for (size_t h = 0; h < HKV; ++h)
            for (size_t t = 0; t < s; ++t)
                for (size_t c = 0; c < D; ++c) {
                    kn[(h * s + t) * D + c] = k[((n * HKV + h) * S3 + t) * D + c];
                    vn[(h * s + t) * D + c] = v[((n * HKV + h) * S3 + t) * D + c];
                }
        clmha_attention_args one = {.struct_size = sizeof one, .enable_gqa = true,
                                    .query = {.ndim = 3, .shape = {H, S3, D},
                                              .data = q + n * H * S3 * D},
                                    .key = {.ndim = 3, .shape = {HKV, s, D}, .data = kn},
                                    .value = {.ndim = 3, .shape = {HKV, s, D}, .data = vn}};
        set_masking(&one, m);
        double want[H * S3 * D];
        char msg[256];
        cr_assert_eq(clmha_reference_attention(&one, want, H * S3 * D, NULL, 0, NULL, 0, msg,
                                               sizeof msg),
                     CLMHA_SUCCESS, "%s", msg);
        double e = max_abs_err(out + n * H * S3 * D, want, H * S3 * D);
        printf("sdpa kv ragged%s%s: sequence %zu (%zu tokens) max|err| %.2e\n",
               m->causal ? ", causal" : "", m->window ? ", window" : "", n, s, e);
        cr_expect_leq(e, TOLERANCE, "sequence %zu: max|err| %.3g", n, e);
        free(kn), free(vn);
    }
    clmha_kv_cache_release(cache);
    free(q), free(k), free(v), free(out);
    clmha_context_release(ctx);
}

Test(sdpa_kv, ragged_append) {
    ragged_append(&(masking){0});
}

Test(sdpa_kv, ragged_append_sliding_window) {
    ragged_append(&(masking){.window = true, .left = 0, .right = 1});
    ragged_append(&(masking){.causal = true, .window = true, .left = 1, .right = 0});
}

static void refused(clmha_context *ctx, clmha_status got, clmha_status want, const char *text) {
    cr_expect_eq(got, want, "%s: %s, expected %s (%s)", text, clmha_status_string(got),
                 clmha_status_string(want), clmha_context_last_error(ctx));
    cr_expect(strstr(clmha_context_last_error(ctx), text) != NULL, "message \"%s\" lacks \"%s\"",
              clmha_context_last_error(ctx), text);
}

Test(sdpa_kv, refusals) {
    clmha_context *ctx = context_or_skip();
    prng r = {5};
    float *q = normal_floats(&r, N * H * D), *k = normal_floats(&r, N * HKV * D),
          *v = normal_floats(&r, N * HKV * D), out[N * H * D], lse[N * H];
    clmha_kv_cache *cache = NULL;
    cr_assert_eq(clmha_kv_cache_create_for(&cache, ctx, N, HKV, D, 2), CLMHA_SUCCESS);
    clmha_attention_args a = {.struct_size = sizeof a, .enable_gqa = true, .kv_cache = cache,
                              .query = {.ndim = 4, .shape = {N, H, 1, D}, .data = q},
                              .key = {.ndim = 4, .shape = {N, HKV, 1, D}, .data = k},
                              .value = {.ndim = 4, .shape = {N, HKV, 1, D}, .data = v}};
    size_t nq = N * H * D, lengths[N];
    refused(ctx, clmha_attention_forward_host(ctx, &a, out, nq, lse, N * H, NULL, 0),
            CLMHA_UNSUPPORTED, "returns or takes no log-sum-exp rows");
    unsigned char m[N] = {1, 1};
    a.attn_mask = (clmha_mask){.kind = CLMHA_MASK_BOOL_ATTEND,
                               .tensor = {.ndim = 4, .shape = {N, 1, 1, 1}, .data = m}};
    cr_expect_eq(clmha_attention_forward_host(ctx, &a, out, nq, NULL, 0, NULL, 0),
                 CLMHA_UNSUPPORTED, "a mask with a cache: %s", clmha_context_last_error(ctx));
    a.attn_mask = (clmha_mask){0};
    a.dropout_p = 0.5f;
    cr_expect_eq(clmha_attention_forward_host(ctx, &a, out, nq, NULL, 0, NULL, 0),
                 CLMHA_UNSUPPORTED, "dropout with a cache: %s", clmha_context_last_error(ctx));
    a.dropout_p = 0;
    cr_assert_eq(clmha_kv_cache_lengths(cache, lengths, N), CLMHA_SUCCESS);
    cr_expect(lengths[0] == 0 && lengths[1] == 0, "a refused call appended");
    // Capacity 2: two calls fit, the third is refused and changes nothing.
    for (int i = 0; i < 2; ++i)
        cr_assert_eq(clmha_attention_forward_host(ctx, &a, out, nq, NULL, 0, NULL, 0),
                     CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_expect_eq(clmha_attention_forward_host(ctx, &a, out, nq, NULL, 0, NULL, 0),
                 CLMHA_SHAPE_MISMATCH, "past the capacity: %s", clmha_context_last_error(ctx));
    cr_assert_eq(clmha_kv_cache_lengths(cache, lengths, N), CLMHA_SUCCESS);
    cr_expect(lengths[0] == 2 && lengths[1] == 2, "lengths %zu, %zu", lengths[0], lengths[1]);
    // The backward and the reference take no cache.
    float g[N * H * D] = {0}, dq[N * H * D];
    refused(ctx, clmha_attention_backward_host(ctx, &a, g, nq, dq, NULL, NULL, NULL),
            CLMHA_UNSUPPORTED, "no backward");
    double want[N * H * D];
    char msg[256];
    cr_expect_eq(clmha_reference_attention(&a, want, nq, NULL, 0, NULL, 0, msg, sizeof msg),
                 CLMHA_UNSUPPORTED);
    cr_expect(strstr(msg, "reads no KV cache"), "%s", msg);
    // A cache of other heads; a layer's cache; kv_append without a cache.
    clmha_kv_cache *other = NULL;
    cr_assert_eq(clmha_kv_cache_create_for(&other, ctx, N, H, D, 4), CLMHA_SUCCESS);
    a.kv_cache = other;
    refused(ctx, clmha_attention_forward_host(ctx, &a, out, nq, NULL, 0, NULL, 0),
            CLMHA_SHAPE_MISMATCH, "kv_cache holds 4 key/value heads of 16 floats");
    clmha_kv_cache_release(other);
    other = NULL;
    clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = H * D, .num_heads = H};
    clmha_layer *layer = NULL;
    clmha_kv_cache *layers = NULL;
    cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS);
    cr_assert_eq(clmha_kv_cache_create(&layers, layer, N, 4), CLMHA_SUCCESS);
    a.kv_cache = layers;
    refused(ctx, clmha_attention_forward_host(ctx, &a, out, nq, NULL, 0, NULL, 0),
            CLMHA_INVALID_ARGUMENT, "made for a layer");
    size_t append[N] = {1, 1};
    a.kv_cache = NULL, a.kv_append = append;
    refused(ctx, clmha_attention_forward_host(ctx, &a, out, nq, NULL, 0, NULL, 0),
            CLMHA_INVALID_ARGUMENT, "kv_append is set but kv_cache is NULL");
    cr_expect_eq(clmha_kv_cache_create_for(&other, ctx, 0, HKV, D, 4), CLMHA_INVALID_ARGUMENT);
    cr_expect_null(other);
    cr_expect_eq(clmha_kv_cache_create_for(&other, ctx, N, 0, D, 4), CLMHA_INVALID_ARGUMENT);
    clmha_kv_cache_release(layers);
    clmha_layer_release(layer);
    clmha_kv_cache_release(cache);
    free(q), free(k), free(v);
    clmha_context_release(ctx);
}
