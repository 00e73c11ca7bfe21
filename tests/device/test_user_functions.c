// User score and mask functions (clmha_layer_desc::mod_source, clmha_attention_args::
// mod_source) beyond the random cases that reproduce the built-in variants (test_random.c,
// test_backward_random.c, test_kv_cache.c): document masking from segment ids in p against the
// reference with the same mask as an explicit attn_mask, through both cores, past the fused
// tiles and after p changes (the block masks evaluated again); the attention function; and
// the refusals (build errors with their log, sources without functions, p's count, the
// backward without clmha_score_mod_grad, positions outside partial attention).
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "support.h"

#define TOLERANCE 1e-4

// Document masking: p holds the segment id of every position of every batch item (N rows of
// `seq` ids, seq = p's last value), and a query attends only the keys of its own segment.
static const char doc_mask_source[] =
    "int clmha_mask_mod(int b, int h, int q, int k, __global const float *p) {\n"
    "    int seq = (int)p[0];\n"
    "    return p[1 + b * seq + q] == p[1 + b * seq + k];\n"
    "}\n";

// ALiBi as a user score function, the slopes in p (one per head).
static const char alibi_source[] =
    "clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k,\n"
    "                           __global const float *p) {\n"
    "    return s - p[h] * fabs((clmha_real)(q - k));\n"
    "}\n"
    "clmha_real clmha_score_mod_grad(clmha_real s, int b, int h, int q, int k,\n"
    "                                __global const float *p) {\n"
    "    return 1.0f;\n"
    "}\n";

// Segment ids for N items of `seq` positions into p (after p[0] = seq): segments of random
// lengths 1 to 3 * seq / 8 (so that whole tiles are forbidden), and the (N, L, S) boolean
// attend mask they make.
static void make_segments(prng *r, size_t n, size_t seq, float *p, unsigned char *mask) {
    p[0] = (float)seq;
    for (size_t b = 0; b < n; ++b) {
        size_t id = 0, left = 0;
        for (size_t i = 0; i < seq; ++i) {
            if (!left) left = prng_range(r, 1, 3 * seq / 8 + 1), ++id;
            p[1 + b * seq + i] = (float)id;
            --left;
        }
        for (size_t i = 0; i < seq; ++i)
            for (size_t j = 0; j < seq; ++j)
                mask[(b * seq + i) * seq + j] = p[1 + b * seq + i] == p[1 + b * seq + j];
    }
}

// Runs self-attention of @p layer on x (batch_first (N, L, E)) through core @p impl.
static float *run_layer(clmha_layer *layer, const float *x, size_t n, size_t l, size_t e,
                        clmha_impl impl) {
    clmha_forward_args a = {.struct_size = sizeof a, .impl = impl};
    a.query = (clmha_tensor){.ndim = 3, .shape = {n, l, e}, .data = x};
    float *out = alloc_floats(n * l * e);
    clmha_status st = clmha_layer_forward_host(layer, &a, out, n * l * e, NULL, 0);
    cr_assert_eq(st, CLMHA_SUCCESS, "forward: %s",
                 clmha_context_last_error(clmha_layer_context(layer)));
    return out;
}

// The reference of the same layer without user functions and with @p mask as its (N, L, S)
// boolean attend mask.
static double *run_reference(const clmha_layer_desc *desc, const clmha_reference_params *params,
                             const float *x, const unsigned char *mask, size_t n, size_t l) {
    clmha_layer_desc d = *desc;
    d.mod_source = NULL, d.mod_params = NULL, d.mod_params_count = 0;
    size_t e = d.embed_dim;
    clmha_forward_args a = {.struct_size = sizeof a};
    a.query = (clmha_tensor){.ndim = 3, .shape = {n, l, e}, .data = x};
    a.attn_mask.kind = CLMHA_MASK_BOOL_ATTEND, a.attn_mask.per_batch = true;
    a.attn_mask.tensor = (clmha_tensor){.ndim = 3, .shape = {n, l, l}, .data = mask};
    double *out = malloc(n * l * e * sizeof *out);
    char msg[256];
    cr_assert_eq(clmha_reference_forward(&d, params, &a, out, n * l * e, NULL, 0, msg,
                                         sizeof msg),
                 CLMHA_SUCCESS, "reference: %s", msg);
    return out;
}

static double max_err(const float *got, const double *want, size_t count) {
    double m = 0.0;
    for (size_t i = 0; i < count; ++i) m = fmax(m, fabs((double)got[i] - want[i]));
    return m;
}

// Document masking at lengths within and past the fused core's tiles, both cores, then new
// segments through clmha_layer_set_mod_params().
Test(user_functions, document_masking, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    static const size_t lengths[] = {9, 200};
    for (size_t t = 0; t < 2; ++t) {
        size_t n = 2, l = lengths[t], e = 16, h = 2;
        prng r = {40 + t};
        size_t count = 1 + n * l;
        float *p = alloc_floats(count);
        unsigned char *mask = malloc(n * l * l);
        make_segments(&r, n, l, p, mask);
        clmha_layer_desc desc = {.struct_size = sizeof desc, .embed_dim = e, .num_heads = h,
                                 .bias = true, .batch_first = true,
                                 .mod_source = doc_mask_source, .mod_params = p,
                                 .mod_params_count = count};
        float *w_in = uniform_floats(&r, 3 * e * e, 0.25), *b_in = uniform_floats(&r, 3 * e, 0.25);
        float *w_out = uniform_floats(&r, e * e, 0.25), *b_out = uniform_floats(&r, e, 0.25);
        clmha_reference_params params = {.struct_size = sizeof params, .in_proj_weight = w_in,
                                         .in_proj_bias = b_in, .out_proj_weight = w_out,
                                         .out_proj_bias = b_out};
        clmha_layer *layer;
        cr_assert_eq(clmha_layer_create(&layer, ctx, &desc), CLMHA_SUCCESS, "create: %s",
                     clmha_context_last_error(ctx));
        cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_weight", w_in, 3 * e * e), 0);
        cr_assert_eq(clmha_layer_set_parameter(layer, "in_proj_bias", b_in, 3 * e), 0);
        cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.weight", w_out, e * e), 0);
        cr_assert_eq(clmha_layer_set_parameter(layer, "out_proj.bias", b_out, e), 0);
        float *x = normal_floats(&r, n * l * e);
        for (int round = 0; round < 2; ++round) {
            if (round) {  // new segments: the fused core's block mask is evaluated again
                make_segments(&r, n, l, p, mask);
                cr_assert_eq(clmha_layer_set_mod_params(layer, p, count), CLMHA_SUCCESS, "%s",
                             clmha_context_last_error(ctx));
            }
            double *want = run_reference(&desc, &params, x, mask, n, l);
            static const clmha_impl impls[] = {CLMHA_IMPL_FUSED, CLMHA_IMPL_UNFUSED};
            for (size_t c = 0; c < 2; ++c) {
                float *got = run_layer(layer, x, n, l, e, impls[c]);
                double err = max_err(got, want, n * l * e);
                fprintf(stderr, "user_functions: document masking L %zu round %d %s: max|err| "
                                "%.2e\n",
                        l, round, clmha_impl_name(impls[c]), err);
                cr_expect(err <= TOLERANCE, "L %zu round %d %s: max abs error %g", l, round,
                          clmha_impl_name(impls[c]), err);
                free(got);
            }
            free(want);
        }
        clmha_layer_release(layer);
        free(p), free(mask), free(w_in), free(b_in), free(w_out), free(b_out), free(x);
    }
    clmha_context_release(ctx);
}

// The attention function with a user ALiBi, p at an offset in its buffer, against the
// reference's built-in ALiBi with the same slopes.
Test(user_functions, attention_function, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    size_t n = 2, h = 4, l = 70, s = 50, dh = 8;
    prng r = {77};
    float *q = normal_floats(&r, n * h * l * dh), *k = normal_floats(&r, n * h * s * dh),
          *v = normal_floats(&r, n * h * s * dh);
    float slopes[1 + 4];
    slopes[0] = 123.0f;  // p starts after it
    for (size_t i = 0; i < h; ++i) slopes[1 + i] = 0.1f * (float)(i + 1);
    clmha_attention_args a = {.struct_size = sizeof a, .is_causal = true};
    a.query = (clmha_tensor){.ndim = 4, .shape = {n, h, l, dh}, .data = q};
    a.key = (clmha_tensor){.ndim = 4, .shape = {n, h, s, dh}, .data = k};
    a.value = (clmha_tensor){.ndim = 4, .shape = {n, h, s, dh}, .data = v};
    clmha_attention_args ref = a;
    ref.alibi = true;
    ref.alibi_slopes = (clmha_tensor){.ndim = 1, .shape = {h}, .data = slopes + 1};
    a.mod_source = alibi_source;
    a.mod_params = (clmha_tensor){.ndim = 1, .shape = {h}, .data = slopes + 1};
    size_t count = n * h * l * dh;
    double *want = malloc(count * sizeof *want);
    char msg[256];
    cr_assert_eq(clmha_reference_attention(&ref, want, count, NULL, 0, NULL, 0, msg, sizeof msg),
                 CLMHA_SUCCESS, "reference: %s", msg);
    static const clmha_impl impls[] = {CLMHA_IMPL_FUSED, CLMHA_IMPL_UNFUSED};
    for (size_t c = 0; c < 2; ++c) {
        a.impl = impls[c];
        float *got = alloc_floats(count);
        cr_assert_eq(clmha_attention_forward_host(ctx, &a, got, count, NULL, 0, NULL, 0),
                     CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
        double err = max_err(got, want, count);
        fprintf(stderr, "user_functions: attention function, user ALiBi, %s: max|err| %.2e\n",
                clmha_impl_name(impls[c]), err);
        cr_expect(err <= TOLERANCE, "%s: max abs error %g", clmha_impl_name(impls[c]), err);
        free(got);
    }
    free(want), free(q), free(k), free(v);
    clmha_context_release(ctx);
}

// The attention function's backward through a user ALiBi and its derivative (the host form),
// against the reference's gradients of the built-in ALiBi, both cores.
Test(user_functions, attention_function_backward, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    size_t n = 2, h = 2, l = 40, s = 33, dh = 8;
    prng r = {78};
    float *q = normal_floats(&r, n * h * l * dh), *k = normal_floats(&r, n * h * s * dh),
          *v = normal_floats(&r, n * h * s * dh), *gy = normal_floats(&r, n * h * l * dh);
    float slopes[2] = {0.25f, 0.0625f};
    clmha_attention_args a = {.struct_size = sizeof a};
    a.query = (clmha_tensor){.ndim = 4, .shape = {n, h, l, dh}, .data = q};
    a.key = (clmha_tensor){.ndim = 4, .shape = {n, h, s, dh}, .data = k};
    a.value = (clmha_tensor){.ndim = 4, .shape = {n, h, s, dh}, .data = v};
    clmha_attention_args ref = a;
    ref.alibi = true;
    ref.alibi_slopes = (clmha_tensor){.ndim = 1, .shape = {h}, .data = slopes};
    a.mod_source = alibi_source;
    a.mod_params = (clmha_tensor){.ndim = 1, .shape = {h}, .data = slopes};
    size_t qc = n * h * l * dh, kc = n * h * s * dh;
    double *wq = malloc(qc * sizeof *wq), *wk = malloc(kc * sizeof *wk),
           *wv = malloc(kc * sizeof *wv);
    clmha_reference_grads rg = {.struct_size = sizeof rg, .query = wq, .key = wk, .value = wv};
    char msg[256];
    cr_assert_eq(clmha_reference_attention_backward(&ref, gy, &rg, msg, sizeof msg),
                 CLMHA_SUCCESS, "reference: %s", msg);
    static const clmha_impl impls[] = {CLMHA_IMPL_FUSED, CLMHA_IMPL_UNFUSED};
    for (size_t c = 0; c < 2; ++c) {
        a.impl = impls[c];
        float *gq = alloc_floats(qc), *gk = alloc_floats(kc), *gv = alloc_floats(kc);
        cr_assert_eq(clmha_attention_backward_host(ctx, &a, gy, qc, gq, gk, gv, NULL),
                     CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
        double err = fmax(max_err(gq, wq, qc), fmax(max_err(gk, wk, kc), max_err(gv, wv, kc)));
        fprintf(stderr, "user_functions: attention function backward, user ALiBi, %s: "
                        "max|err| %.2e\n",
                clmha_impl_name(impls[c]), err);
        cr_expect(err <= TOLERANCE, "%s: max abs error %g", clmha_impl_name(impls[c]), err);
        free(gq), free(gk), free(gv);
    }
    // Without the derivative: refused.
    a.mod_source = "clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k, "
                   "__global const float *p) { return s; }\n";
    float *gq = alloc_floats(qc), *gk = alloc_floats(kc), *gv = alloc_floats(kc);
    cr_expect_eq(clmha_attention_backward_host(ctx, &a, gy, qc, gq, gk, gv, NULL),
                 CLMHA_UNSUPPORTED, "%s", clmha_context_last_error(ctx));
    free(gq), free(gk), free(gv), free(wq), free(wk), free(wv), free(q), free(k), free(v),
        free(gy);
    clmha_context_release(ctx);
}

// Creates a layer of E 8, H 2 with @p source and @p count parameters; returns its status.
static clmha_status create_with(clmha_context *ctx, const char *source, const float *p,
                                size_t count, clmha_layer **out) {
    clmha_layer_desc d = {.struct_size = sizeof d, .embed_dim = 8, .num_heads = 2,
                          .mod_source = source, .mod_params = p, .mod_params_count = count};
    *out = NULL;
    return clmha_layer_create(out, ctx, &d);
}

Test(user_functions, refusals, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    clmha_layer *layer;
    // A syntax error: the build log in the message.
    clmha_status st = create_with(
        ctx, "int clmha_mask_mod(int b, int h, int q, int k, __global const float *p) "
             "{ return k <= q }\n",
        NULL, 0, &layer);
    cr_expect_eq(st, CLMHA_BUILD_FAILED, "syntax error: %s", clmha_status_string(st));
    cr_expect(strstr(clmha_context_last_error(ctx), "mod_source") &&
                  strstr(clmha_context_last_error(ctx), "error"),
              "the message names mod_source and holds the build log: %s",
              clmha_context_last_error(ctx));
    cr_expect_null(layer);
    // None of the three functions (a comment naming one does not count), or only the grad.
    st = create_with(ctx, "// clmha_mask_mod\nint helper(int x) { return x; }\n", NULL, 0,
                     &layer);
    cr_expect_eq(st, CLMHA_INVALID_ARGUMENT, "no function: %s", clmha_status_string(st));
    st = create_with(ctx,
                     "float clmha_score_mod_grad(float s, int b, int h, int q, int k, "
                     "__global const float *p) { return 1; }\n",
                     NULL, 0, &layer);
    cr_expect_eq(st, CLMHA_INVALID_ARGUMENT, "grad alone: %s", clmha_status_string(st));
    // p without a source.
    float p[2] = {1.0f, 2.0f};
    st = create_with(ctx, NULL, p, 2, &layer);
    cr_expect_eq(st, CLMHA_INVALID_ARGUMENT, "p without a source: %s", clmha_status_string(st));
    // A score function without its derivative: the forward runs, the backward is refused.
    st = create_with(ctx,
                     "clmha_real clmha_score_mod(clmha_real s, int b, int h, int q, int k, "
                     "__global const float *p) { return s * p[0]; }\n",
                     p, 2, &layer);
    cr_assert_eq(st, CLMHA_SUCCESS, "%s", clmha_context_last_error(ctx));
    cr_expect_eq(clmha_layer_set_mod_params(layer, p, 1), CLMHA_SHAPE_MISMATCH);
    cr_expect_eq(clmha_layer_set_mod_params(layer, NULL, 2), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_layer_set_mod_params(NULL, p, 2), CLMHA_INVALID_ARGUMENT);
    clmha_backward_args b = {.struct_size = sizeof b};
    st = clmha_layer_backward_host(layer, &b);
    cr_expect_eq(st, CLMHA_UNSUPPORTED, "backward without clmha_score_mod_grad: %s",
                 clmha_status_string(st));
    cr_expect(strstr(clmha_context_last_error(ctx), "clmha_score_mod_grad"), "%s",
              clmha_context_last_error(ctx));
    // Positions are partial attention's (clmha_layer_attend()) alone.
    float x[8 * 3] = {0}, y[8 * 3];
    clmha_forward_args fa = {.struct_size = sizeof fa, .key_position = 4};
    fa.query = (clmha_tensor){.ndim = 2, .shape = {3, 8}, .data = x};
    cr_expect_eq(clmha_layer_forward_host(layer, &fa, y, 24, NULL, 0), CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "key_position"), "%s",
              clmha_context_last_error(ctx));
    clmha_layer_release(layer);
    // A layer without user functions has no p to set.
    cr_assert_eq(create_with(ctx, NULL, NULL, 0, &layer), CLMHA_SUCCESS);
    cr_expect_eq(clmha_layer_set_mod_params(layer, p, 2), CLMHA_INVALID_ARGUMENT);
    clmha_layer_release(layer);
    clmha_context_release(ctx);
}
