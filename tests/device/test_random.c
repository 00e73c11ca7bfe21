// Randomised comparisons of the OpenCL forward pass (clmha_layer_forward_host) against the
// double-precision CPU reference (clmha_reference_forward): random combinations of options,
// odd shapes, every mask kind and layout, causal masking, fully masked rows and dropout.
// Every case prints one line to stderr with the max abs error and the NMSE (normalised mean
// squared error, sum (gpu - ref)^2 / sum ref^2) of the output and of the weights.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "random_case.h"
#include "support.h"

#define TOLERANCE 1e-4

// ---- cases -----------------------------------------------------------------------------------

// The cases: tests/support/random_case.h.

// ---- running -----------------------------------------------------------------------------------

// Runs the OpenCL forward pass of @p in into freshly allocated arrays.
static void gpu_forward(clmha_layer *layer, const instance *in, float **out, float **weights) {
    size_t oc = 0, wc = 0;
    clmha_context *ctx = clmha_layer_context(layer);
    clmha_status st = clmha_layer_output_counts(layer, &in->args, &oc, &wc);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_layer_output_counts: %s",
                 clmha_context_last_error(ctx));
    cr_assert_eq(oc, in->output_count, "output count %zu, expected %zu", oc, in->output_count);
    cr_assert_eq(wc, in->weights_count, "weights count %zu, expected %zu", wc, in->weights_count);
    *out = alloc_floats(oc);
    *weights = in->weights_count ? alloc_floats(wc) : NULL;
    for (size_t i = 0; i < oc; ++i) (*out)[i] = NAN;  // anything not written shows up
    for (size_t i = 0; i < wc; ++i) (*weights)[i] = NAN;
    st = clmha_layer_forward_host(layer, &in->args, *out, oc, *weights, wc);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_layer_forward_host: %s (%s)",
                 clmha_context_last_error(ctx), clmha_status_string(st));
}

static void ref_forward(const instance *in, double **out, double **weights) {
    char msg[256];
    *out = malloc(in->output_count * sizeof **out);
    *weights = malloc((in->weights_count ? in->weights_count : 1) * sizeof **weights);
    cr_assert(*out && *weights, "out of memory");
    clmha_status st =
        clmha_reference_forward(&in->desc, &in->params, &in->args, *out, in->output_count,
                                in->weights_count ? *weights : NULL, in->weights_count, msg,
                                sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_reference_forward: %s", msg);
}

// Index of row (n, i) of the output in the query's layout.
static size_t output_row(const instance *in, size_t n, size_t i) {
    size_t row = in->c.batch_first && !in->c.unbatched ? n * in->c.l + i : i * in->n + n;
    return row * in->c.e;
}

// Checks that output row (n, i) is out_proj.bias (or zero) and its weights are all zero.
static void check_masked_row(const instance *in, const float *out, const float *weights,
                             size_t n, size_t i) {
    for (size_t f = 0; f < in->c.e; ++f) {
        float want = in->bo ? in->bo[f] : 0.0f;
        cr_assert_float_eq(out[output_row(in, n, i) + f], want, 1e-6,
                           "masked row (%zu, %zu): output[%zu] = %g, out_proj.bias %g", n, i, f,
                           (double)out[output_row(in, n, i) + f], (double)want);
    }
    if (!weights) return;
    const size_t heads = in->c.per_head ? in->c.h : 1, sp = in->s_padded;
    for (size_t h = 0; h < heads; ++h)
        for (size_t j = 0; j < sp; ++j) {
            float w = weights[((n * heads + h) * in->c.l + i) * sp + j];
            cr_assert(w == 0.0f, "masked row (%zu, %zu): weight (head %zu, key %zu) = %g", n, i,
                      h, j, (double)w);
        }
}

// Runs @p in without weights through the built-in core @p impl into a fresh array.
static float *core_forward(clmha_layer *layer, const instance *in, clmha_impl impl) {
    clmha_forward_args a = in->args;
    a.need_weights = false, a.per_head_weights = false, a.impl = impl;
    float *out = alloc_floats(in->output_count);
    for (size_t i = 0; i < in->output_count; ++i) out[i] = NAN;
    clmha_status st = clmha_layer_forward_host(layer, &a, out, in->output_count, NULL, 0);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_layer_forward_host (impl %s): %s (%s)",
                 clmha_impl_name(impl), clmha_context_last_error(clmha_layer_context(layer)),
                 clmha_status_string(st));
    return out;
}

// Runs one case on the device and on the reference, prints the errors and asserts them.
static void check_case(clmha_context *ctx, const rcase *c) {
    char name[256];
    rcase_describe(c, name, sizeof name);
    instance in;
    instance_make(&in, c);
    clmha_layer *layer = instance_layer(ctx, &in);
    float *out, *weights;
    double *ref_out, *ref_weights;
    gpu_forward(layer, &in, &out, &weights);
    ref_forward(&in, &ref_out, &ref_weights);

    error_stats eo = error_stats_of(out, ref_out, in.output_count);
    error_stats ew = error_stats_of(weights, ref_weights, in.weights_count);
    fprintf(stderr, "random: %-78s out max|err| %.2e nmse %.2e", name, eo.max_abs, eo.nmse);
    if (in.weights_count)
        fprintf(stderr, "  weights max|err| %.2e nmse %.2e", ew.max_abs, ew.nmse);
    fputc('\n', stderr);
    cr_expect(eo.max_abs <= TOLERANCE, "%s: output max abs error %g", name, eo.max_abs);
    cr_expect(ew.max_abs <= TOLERANCE, "%s: weights max abs error %g", name, ew.max_abs);

    if (c->mask_row)
        for (size_t n = 0; n < in.n; ++n) check_masked_row(&in, out, weights, n, 1);
    if (c->mask_batch)
        for (size_t i = 0; i < c->l; ++i) check_masked_row(&in, out, weights, 0, i);

    // The same call without weights through each built-in core: both match the reference
    // (so dropout drops the same weights in both) and each other.
    float *fused = core_forward(layer, &in, CLMHA_IMPL_FUSED);
    float *unfused = core_forward(layer, &in, CLMHA_IMPL_UNFUSED);
    error_stats ef = error_stats_of(fused, ref_out, in.output_count);
    error_stats eu = error_stats_of(unfused, ref_out, in.output_count);
    double fu = max_abs_diff(fused, unfused, in.output_count);
    fprintf(stderr, "random: %-78s fused max|err| %.2e unfused %.2e fused-unfused %.2e\n", name,
            ef.max_abs, eu.max_abs, fu);
    cr_expect(ef.max_abs <= TOLERANCE, "%s: fused output max abs error %g", name, ef.max_abs);
    cr_expect(eu.max_abs <= TOLERANCE, "%s: unfused output max abs error %g", name, eu.max_abs);
    cr_expect(fu <= TOLERANCE, "%s: fused and unfused differ by %g", name, fu);
    if (c->mask_row)
        for (size_t n = 0; n < in.n; ++n) check_masked_row(&in, fused, NULL, n, 1);
    if (c->mask_batch)
        for (size_t i = 0; i < c->l; ++i) check_masked_row(&in, fused, NULL, 0, i);
    free(fused);
    free(unfused);

    free(out);
    free(weights);
    free(ref_out);
    free(ref_weights);
    clmha_layer_release(layer);
    instance_free(&in);
}

// ---- tests -------------------------------------------------------------------------------------

Test(random, combinations, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    static const uint64_t seeds[] = {1, 2, 3, 42, 2024, 0xC0FFEE};
    for (size_t i = 0; i < sizeof seeds / sizeof seeds[0]; ++i) {
        prng r = {seeds[i]};
        for (int k = 0; k < 6; ++k) {
            rcase c = rcase_random(&r);
            check_case(ctx, &c);
        }
    }
    clmha_context_release(ctx);
}

Test(random, odd_shapes, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    rcase c;
    // head_dim 1
    c = rcase_base(11), c.e = 4, c.h = 4, c.per_head = true;
    check_case(ctx, &c);
    // E 60 with 5 heads (head_dim 12)
    c = rcase_base(12), c.e = 60, c.h = 5, c.l = 7, c.s = 9;
    check_case(ctx, &c);
    // L 1, S 1, and both at once
    c = rcase_base(13), c.l = 1, c.s = 6;
    check_case(ctx, &c);
    c = rcase_base(14), c.l = 6, c.s = 1, c.per_head = true;
    check_case(ctx, &c);
    c = rcase_base(15), c.l = 1, c.s = 1, c.n = 1;
    check_case(ctx, &c);
    // L != S both ways, with kdim / vdim
    c = rcase_base(16), c.l = 9, c.s = 2, c.kdim = 3, c.vdim = 11;
    check_case(ctx, &c);
    c = rcase_base(17), c.l = 2, c.s = 13, c.kdim = 5, c.vdim = 5, c.value_is_key = true;
    check_case(ctx, &c);
    // self-attention, batch_first, unbatched, no bias, no weights
    c = rcase_base(18), c.self_attn = true, c.batch_first = true, c.l = 5;
    check_case(ctx, &c);
    c = rcase_base(19), c.unbatched = true, c.batch_first = true, c.per_head = true;
    check_case(ctx, &c);
    c = rcase_base(20), c.bias = false, c.need_weights = false, c.add_bias_kv = true;
    check_case(ctx, &c);
    // a single head, a wide head
    c = rcase_base(21), c.e = 24, c.h = 1, c.l = 5, c.s = 4;
    check_case(ctx, &c);
    c = rcase_base(22), c.e = 130, c.h = 2, c.l = 3, c.s = 3, c.n = 1;
    check_case(ctx, &c);
    clmha_context_release(ctx);
}

Test(random, long_sequences, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    // Longer than any kernel tile: L = S = 300.
    rcase c = rcase_base(31);
    c.e = 32, c.h = 4, c.n = 1, c.l = 300, c.s = 300;
    check_case(ctx, &c);
    c = rcase_base(32);
    c.e = 32, c.h = 4, c.n = 2, c.l = 300, c.s = 300, c.batch_first = true, c.per_head = true;
    c.kpm = CLMHA_MASK_BOOL_IGNORE, c.mask_p = 0.1, c.add_zero_attn = true;
    check_case(ctx, &c);
    c = rcase_base(33);
    c.e = 32, c.h = 4, c.n = 1, c.l = 257, c.s = 300, c.is_causal = true;
    c.am = CLMHA_MASK_FLOAT, c.mask_p = 0.05;
    check_case(ctx, &c);
    // Regression: at E = 512, H = 1, L = S = 1216 CLBlast takes the indirect path of
    // GemmStridedBatched for weights·V, which ignores buffer offsets; clmha's head tiles were
    // sub-regions of one buffer and the output was wrong (max error 0.1). Each tile now has its
    // own buffer at offset 0.
    c = rcase_base(34);
    c.e = 512, c.h = 1, c.n = 1, c.l = 1216, c.s = 1216;
    check_case(ctx, &c);
    clmha_context_release(ctx);
}

Test(random, many_batch_heads, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    // N*H = 1200, more than one work-group dimension.
    rcase c = rcase_base(41);
    c.e = 16, c.h = 8, c.n = 150, c.l = 3, c.s = 5, c.per_head = true;
    check_case(ctx, &c);
    c = rcase_base(42);
    c.e = 16, c.h = 8, c.n = 150, c.l = 3, c.s = 5, c.batch_first = true;
    c.am = CLMHA_MASK_BOOL_IGNORE, c.layout = LAYOUT_PER_HEAD;
    c.kpm = CLMHA_MASK_FLOAT, c.add_bias_kv = true;
    check_case(ctx, &c);
    c = rcase_base(43);
    c.e = 16, c.h = 8, c.n = 150, c.l = 3, c.s = 5, c.training = true, c.dropout = 0.2f;
    c.am = CLMHA_MASK_BOOL_ATTEND, c.layout = LAYOUT_PER_BATCH, c.per_head = true;
    check_case(ctx, &c);
    clmha_context_release(ctx);
}

Test(random, masks, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    static const clmha_mask_kind kinds[] = {CLMHA_MASK_BOOL_IGNORE, CLMHA_MASK_BOOL_ATTEND,
                                            CLMHA_MASK_FLOAT};
    uint64_t seed = 100;
    // key_padding_mask alone, batched and unbatched.
    for (size_t k = 0; k < 3; ++k) {
        rcase c = rcase_base(seed++);
        c.kpm = kinds[k];
        check_case(ctx, &c);
        c = rcase_base(seed++);
        c.kpm = kinds[k], c.unbatched = true, c.per_head = true;
        check_case(ctx, &c);
    }
    // Every attn_mask kind and layout, with every key_padding_mask kind, and the appended keys
    // (add_bias_kv / add_zero_attn) in turn.
    for (size_t a = 0; a < 3; ++a)
        for (int layout = LAYOUT_SHARED; layout <= LAYOUT_PER_BATCH; ++layout)
            for (size_t k = 0; k < 4; ++k) {
                rcase c = rcase_base(seed++);
                c.am = kinds[a], c.layout = (attn_layout)layout;
                c.kpm = k == 0 ? CLMHA_MASK_NONE : kinds[k - 1];
                c.add_bias_kv = k & 1, c.add_zero_attn = (k >> 1) & 1;
                c.per_head = (k + a) & 1, c.batch_first = layout == LAYOUT_PER_HEAD;
                check_case(ctx, &c);
            }
    // Unbatched attn_mask: (L, S) and (H, L, S).
    for (size_t a = 0; a < 3; ++a)
        for (int layout = LAYOUT_SHARED; layout <= LAYOUT_PER_HEAD; ++layout) {
            rcase c = rcase_base(seed++);
            c.unbatched = true, c.am = kinds[a], c.layout = (attn_layout)layout;
            c.kpm = kinds[(a + 1) % 3], c.add_zero_attn = true, c.per_head = true;
            check_case(ctx, &c);
        }
    clmha_context_release(ctx);
}

Test(random, causal, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    rcase c = rcase_base(200);
    c.is_causal = true, c.l = 6, c.s = 3, c.per_head = true;  // L > S
    check_case(ctx, &c);
    c = rcase_base(201);
    c.is_causal = true, c.l = 3, c.s = 7;  // L < S
    check_case(ctx, &c);
    c = rcase_base(202);
    c.is_causal = true, c.self_attn = true, c.l = 8, c.batch_first = true;
    check_case(ctx, &c);
    c = rcase_base(203);
    c.is_causal = true, c.l = 7, c.s = 4, c.add_bias_kv = true, c.add_zero_attn = true;
    c.am = CLMHA_MASK_FLOAT, c.kpm = CLMHA_MASK_BOOL_ATTEND, c.per_head = true;
    check_case(ctx, &c);
    c = rcase_base(204);
    c.is_causal = true, c.l = 4, c.s = 9, c.unbatched = true;
    c.am = CLMHA_MASK_BOOL_IGNORE, c.layout = LAYOUT_PER_HEAD;
    check_case(ctx, &c);
    clmha_context_release(ctx);
}

// Sliding windows (left, right; -1 unbounded) alone and with is_causal, masks, bias_kv /
// zero_attn (never windowed), L != S, unbatched, weights, dropout.
Test(random, sliding_window, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    static const int64_t wins[][2] = {{2, 0}, {0, 0}, {3, 1}, {-1, 2}, {1, -1}, {0, 5}, {4, 4}};
    for (size_t k = 0; k < sizeof wins / sizeof wins[0]; ++k) {
        rcase c = rcase_base(700 + k);
        c.window = true, c.win_left = wins[k][0], c.win_right = wins[k][1];
        c.l = 3 + k, c.s = 9 - k;
        c.is_causal = k % 3 == 1;
        c.need_weights = k % 2 == 0, c.per_head = k % 4 == 0;
        c.am = k == 2 ? CLMHA_MASK_FLOAT : k == 5 ? CLMHA_MASK_BOOL_IGNORE : CLMHA_MASK_NONE;
        c.kpm = k == 3 ? CLMHA_MASK_BOOL_ATTEND : CLMHA_MASK_NONE;
        c.add_bias_kv = k == 4, c.add_zero_attn = k == 4 || k == 6;
        c.unbatched = k == 1;
        if (k == 6) c.dropout = 0.3f, c.training = true;
        check_case(ctx, &c);
    }
    clmha_context_release(ctx);
}

// Attention sinks (a logit per head in each row's denominator, no value): alone, with
// soft-capping and ALiBi, fully masked rows and items (zero results), masks, is_causal,
// windows, the appended keys, dropout, weights (rows summing below 1), and past a tile.
Test(random, sinks, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    for (size_t k = 0; k < 7; ++k) {
        rcase c = rcase_base(1900 + k);
        c.sinks = true;
        c.h = 1 + k % 3, c.e = c.h * 4;
        c.l = 3 + k, c.s = 8 - k;
        c.softcap = k == 2 ? 1.5 : 0.0, c.alibi = k == 2 || k == 5;
        c.is_causal = k == 1;
        c.need_weights = k % 2 == 0, c.per_head = k == 4;
        c.am = k == 3 ? CLMHA_MASK_BOOL_IGNORE : k == 5 ? CLMHA_MASK_FLOAT : CLMHA_MASK_NONE;
        c.kpm = k == 3 ? CLMHA_MASK_BOOL_IGNORE : CLMHA_MASK_NONE;
        if (k == 3) c.mask_row = true, c.mask_batch = true;
        c.add_bias_kv = k == 4, c.add_zero_attn = k == 4;
        if (k == 5) c.window = true, c.win_left = 1, c.win_right = 0;
        if (k == 4) c.dropout = 0.3f, c.training = true;
        if (k == 6) c.l = 140, c.s = 150, c.n = 1, c.need_weights = false, c.is_causal = true;
        check_case(ctx, &c);
    }
    clmha_context_release(ctx);
}

// Soft-capping and ALiBi (geometric and given slopes), alone and together, with windows,
// is_causal, masks, the appended keys (soft-capped, no ALiBi term), dropout, weights, unbatched
// calls, and lengths past a tile (both cores).
Test(random, score_variants, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    static const double caps[] = {0.5, 0.0, 2.0, 0.7, 0.0, 30.0, 1.0, 0.0};
    for (size_t k = 0; k < sizeof caps / sizeof caps[0]; ++k) {
        rcase c = rcase_base(1700 + k);
        c.softcap = caps[k];
        c.alibi = k % 3 != 0, c.alibi_random = k % 3 == 2;
        c.h = 1 + k % 4, c.e = c.h * 4;
        c.l = 3 + k, c.s = 9 - k;
        c.is_causal = k % 3 == 1;
        c.need_weights = k % 2 == 0, c.per_head = k % 4 == 0;
        c.am = k == 2 ? CLMHA_MASK_FLOAT : k == 5 ? CLMHA_MASK_BOOL_IGNORE : CLMHA_MASK_NONE;
        c.kpm = k == 3 ? CLMHA_MASK_BOOL_ATTEND : CLMHA_MASK_NONE;
        c.add_bias_kv = k == 4 || k == 7, c.add_zero_attn = k == 4 || k == 6;
        c.unbatched = k == 1;
        if (k == 3 || k == 6) c.window = true, c.win_left = 2, c.win_right = k == 3 ? 0 : 1;
        if (k == 6) c.dropout = 0.3f, c.training = true;
        if (k == 7) c.l = 150, c.s = 130, c.n = 1, c.need_weights = false;
        check_case(ctx, &c);
    }
    clmha_context_release(ctx);
}

// User functions (clmha_layer_desc::mod_source) reproducing soft-capping, ALiBi and windows,
// against the reference's built-in ones: alone and together, with the built-in variants they
// leave (soft-capping where keys are appended), is_causal, masks, sinks, dropout, weights,
// unbatched calls and lengths past a tile (both cores).
Test(random, user_functions, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    static const unsigned users[] = {RC_USER_SCORE, RC_USER_MASK, RC_USER_SCORE | RC_USER_MASK};
    for (size_t k = 0; k < 9; ++k) {
        rcase c = rcase_base(2100 + k);
        c.user = users[k % 3];
        c.softcap = k % 4 == 1 ? 1.5 : 0.0;
        c.alibi = k % 4 != 1, c.alibi_random = k % 2 == 1;
        c.window = true, c.win_left = (int64_t)(k % 3), c.win_right = k % 4 == 0 ? -1 : 1;
        c.h = 1 + k % 3, c.e = c.h * 4;
        c.l = 3 + k, c.s = 9 - k / 2;
        c.is_causal = k % 3 == 2;
        c.need_weights = k % 2 == 0, c.per_head = k % 4 == 0;
        c.am = k == 3 ? CLMHA_MASK_FLOAT : CLMHA_MASK_NONE;
        c.kpm = k == 4 ? CLMHA_MASK_BOOL_IGNORE : CLMHA_MASK_NONE;
        c.add_bias_kv = k == 5, c.add_zero_attn = k == 5 || k == 7;
        c.unbatched = k == 6, c.sinks = k == 7;
        if (k == 4) c.dropout = 0.3f, c.training = true;
        if (k == 8) c.l = 150, c.s = 140, c.n = 1, c.need_weights = false;
        check_case(ctx, &c);
    }
    // Functions that reproduce no built-in variant (support.h), against their host forms in the
    // reference: over built-in soft-capping, ALiBi and windows, with masks, sinks, dropout,
    // appended keys, and past a tile.
    for (size_t k = 0; k < 4; ++k) {
        rcase c = rcase_base(2150 + k);
        c.user = RC_USER_HOST;
        c.softcap = k == 1 ? 1.5 : 0.0, c.alibi = k == 0 || k == 3;
        c.window = k == 2, c.win_left = 3, c.win_right = 1;
        c.h = 2, c.e = 8, c.l = 7 + k, c.s = 9 - k;
        c.is_causal = k == 3;
        c.am = k == 0 ? CLMHA_MASK_FLOAT : CLMHA_MASK_NONE;
        c.kpm = k == 1 ? CLMHA_MASK_BOOL_IGNORE : CLMHA_MASK_NONE;
        c.add_bias_kv = k == 1, c.add_zero_attn = k == 2, c.sinks = k == 2;
        c.need_weights = k < 2, c.per_head = k == 0;
        if (k == 1) c.dropout = 0.3f, c.training = true;
        if (k == 3) c.l = 150, c.s = 140, c.n = 1, c.need_weights = false;
        check_case(ctx, &c);
    }
    clmha_context_release(ctx);
}

// The fused kernels' window bounds at their tile edges (lanes mapping: 32 query rows a
// work-item, 64 keys a tile; tiled: 128 rows a group, 32 keys a tile): lengths around the
// tiles, L != S both ways, windows of 0, 1, tile - 1, tile and tile + 1 on either side (and one
// side unbounded), with is_causal, masks, dropout and the appended keys (never windowed, so
// always visited), rows whose window holds no key (zeros), need_weights off so that the call
// takes the fused core under CLMHA_IMPL_AUTO too.
Test(random, sliding_window_tile_edges, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    static const window_edge cases[] = {
        {200, 200, 0, 0, false, 0},  {200, 200, 1, 0, true, 0},   {130, 130, 31, 0, true, 0},
        {130, 97, 32, 1, false, 1},  {97, 130, 33, -1, true, 2},  {129, 129, 63, 0, true, 0},
        {200, 150, 64, 64, false, 3}, {150, 200, 65, 1, false, 0}, {65, 63, 1, 63, false, 0},
        {64, 64, -1, 32, false, 2},  {33, 97, 0, 64, true, 1},    {160, 160, 0, 65, false, 3},
        {300, 257, 64, 0, true, 0},  {200, 31, 0, 31, false, 1},  {31, 200, 1, 1, true, 0},
        {257, 300, 127, 128, false, 0},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; ++k) {
        rcase c = rcase_window_edge(&cases[k], k, 900 + k, CLMHA_MASK_BOOL_IGNORE);
        check_case(ctx, &c);
        // The window as a user clmha_mask_mod: the fused kernels skip the tiles its block
        // mask forbids (src/cores/block_mask.c) at the same edges.
        if (k % 2 == 0) {
            c.user = RC_USER_MASK;
            check_case(ctx, &c);
        }
    }
    clmha_context_release(ctx);
}

Test(random, fully_masked_rows, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    // attn_mask (L, S) forbids every key of row 1: output row 1 = out_proj.bias, weights 0.
    rcase c = rcase_base(300);
    c.am = CLMHA_MASK_BOOL_IGNORE, c.mask_p = 0.0, c.mask_row = true, c.per_head = true;
    check_case(ctx, &c);
    c.data_seed = 301, c.per_head = false, c.batch_first = true;
    check_case(ctx, &c);
    // key_padding_mask forbids every key of batch item 0.
    c = rcase_base(302);
    c.kpm = CLMHA_MASK_BOOL_IGNORE, c.mask_p = 0.2, c.mask_batch = true;
    check_case(ctx, &c);
    c = rcase_base(303);
    c.kpm = CLMHA_MASK_BOOL_IGNORE, c.mask_p = 0.0, c.mask_batch = true, c.per_head = true;
    c.am = CLMHA_MASK_FLOAT, c.is_causal = true;
    check_case(ctx, &c);
    // Heavy random masking (rows fully masked in some heads only).
    c = rcase_base(304);
    c.am = CLMHA_MASK_BOOL_ATTEND, c.layout = LAYOUT_PER_HEAD, c.mask_p = 0.8, c.per_head = true;
    check_case(ctx, &c);
    clmha_context_release(ctx);
}

// Fraction of exact zeros among @p count weights.
static double zero_fraction(const float *w, size_t count) {
    size_t zeros = 0;
    for (size_t i = 0; i < count; ++i) zeros += w[i] == 0.0f;
    return (double)zeros / (double)count;
}

Test(random, dropout, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    // Equal to the reference with the same seed and offset.
    rcase c = rcase_base(400);
    c.training = true, c.dropout = 0.3f, c.per_head = true;
    check_case(ctx, &c);
    c = rcase_base(401);
    c.training = true, c.dropout = 0.5f, c.add_bias_kv = true, c.add_zero_attn = true;
    c.kpm = CLMHA_MASK_FLOAT, c.rng_seed = 0xFFFFFFFF00000001ull, c.rng_offset = 0x500000003ull;
    check_case(ctx, &c);

    // 64 x 64 weights per head, p = 0.3.
    c = rcase_base(402);
    c.e = 16, c.h = 2, c.n = 1, c.l = 64, c.s = 64, c.training = true, c.dropout = 0.3f;
    c.per_head = true;
    check_case(ctx, &c);

    instance in;
    instance_make(&in, &c);
    clmha_layer *layer = instance_layer(ctx, &in);
    float *out1, *w1, *out2, *w2, *out3, *w3;
    gpu_forward(layer, &in, &out1, &w1);
    gpu_forward(layer, &in, &out2, &w2);
    // Same seed and offset twice: bit-identical.
    cr_expect(memcmp(out1, out2, in.output_count * sizeof *out1) == 0,
              "same seed/offset: outputs differ");
    cr_expect(memcmp(w1, w2, in.weights_count * sizeof *w1) == 0,
              "same seed/offset: weights differ");
    // Another offset: different.
    in.args.rng.offset += 1;
    gpu_forward(layer, &in, &out3, &w3);
    cr_expect(memcmp(out1, out3, in.output_count * sizeof *out1) != 0,
              "different offset: same output");
    double f1 = zero_fraction(w1, in.weights_count), f3 = zero_fraction(w3, in.weights_count);
    fprintf(stderr, "random: dropout p=0.3 on 2 heads x 64 x 64: zero fraction %.4f (offset 7), "
                    "%.4f (offset 8)\n", f1, f3);
    cr_expect(fabs(f1 - 0.3) <= 0.03, "zero fraction %g, expected 0.3 +- 0.03", f1);
    cr_expect(fabs(f3 - 0.3) <= 0.03, "zero fraction %g, expected 0.3 +- 0.03", f3);
    free(out1), free(w1), free(out2), free(w2), free(out3), free(w3);

    // training = false with dropout > 0: the no-dropout result.
    in.args.training = false;
    float *out_eval, *w_eval, *out_plain, *w_plain;
    gpu_forward(layer, &in, &out_eval, &w_eval);
    instance plain;
    rcase pc = c;
    pc.dropout = 0.0f, pc.training = false;
    instance_make(&plain, &pc);  // same data seed: same parameters and inputs
    clmha_layer *plain_layer = instance_layer(ctx, &plain);
    gpu_forward(plain_layer, &plain, &out_plain, &w_plain);
    double max_o = max_abs_diff(out_eval, out_plain, in.output_count);
    double max_w = max_abs_diff(w_eval, w_plain, in.weights_count);
    fprintf(stderr, "random: dropout p=0.3 eval vs p=0: out max|diff| %.2e, weights max|diff| "
                    "%.2e, weights zero fraction %.4f\n",
            max_o, max_w, zero_fraction(w_eval, in.weights_count));
    cr_expect(max_o <= 1e-6 && max_w <= 1e-6, "eval mode with dropout differs from p = 0");
    cr_expect(zero_fraction(w_eval, in.weights_count) == 0.0, "eval mode dropped weights");
    free(out_eval), free(w_eval), free(out_plain), free(w_plain);
    clmha_layer_release(plain_layer);
    instance_free(&plain);
    clmha_layer_release(layer);
    instance_free(&in);

    // And eval mode against the reference.
    c.training = false, c.data_seed = 403;
    check_case(ctx, &c);
    clmha_context_release(ctx);
}

// The fused core's tile edges: lengths around its tiles (64 query rows, 32 keys by default),
// L = 1, L != S, head dims that are not a multiple of any vector width, causal with L != S
// (whole key tiles skipped), masks, appended keys and dropout.
Test(random, fused_tile_edges, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    static const size_t lens[][2] = {{1, 1},   {1, 70},  {31, 33}, {64, 32}, {65, 31},
                                     {33, 97}, {130, 7}, {97, 129}};
    static const size_t dims[][2] = {{1, 1}, {3, 1}, {13, 1}, {16, 2}, {21, 3}, {128, 2}};
    uint64_t seed = 500;
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; ++li)
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; ++di) {
            rcase c = rcase_base(seed++);
            c.l = lens[li][0], c.s = lens[li][1];
            c.e = dims[di][0] * dims[di][1], c.h = dims[di][1];
            c.n = 1 + seed % 2, c.need_weights = false;
            switch (seed % 5) {
            case 0: c.is_causal = true; break;
            case 1: c.is_causal = true, c.kpm = CLMHA_MASK_BOOL_IGNORE; break;
            case 2: c.am = CLMHA_MASK_FLOAT, c.layout = LAYOUT_PER_HEAD; break;
            case 3: c.add_bias_kv = true, c.add_zero_attn = true, c.is_causal = true; break;
            default:
                c.am = CLMHA_MASK_BOOL_ATTEND, c.mask_p = 0.5, c.training = true;
                c.dropout = 0.2f;
                break;
            }
            check_case(ctx, &c);
        }
    clmha_context_release(ctx);
}

// The fused core reading the projected rows where the projections wrote them, with rows 4 KiB
// apart (a multiple of a 4 KiB L1 way), which the projections pad by one cache line
// (clmha__rows_pitch() in src/layer/layer.h): one key/value GEMM 2 x 512 floats wide
// (key = value), one packed QKV GEMM 512 + 2 x 256 wide (grouped-query attention, 4 key/value
// heads), and three GEMMs 1024 wide each (kdim != vdim); each also through the unfused core
// (head tiles, no padding) and against the reference.
Test(random, padded_row_pitch, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    rcase c = rcase_base(900);
    c.e = 512, c.h = 8, c.l = 5, c.s = 70, c.value_is_key = true, c.need_weights = false;
    c.kpm = CLMHA_MASK_BOOL_IGNORE;
    check_case(ctx, &c);
    c = rcase_base(901);
    c.e = 512, c.h = 8, c.kv_heads = 4, c.l = 37, c.self_attn = true, c.batch_first = true;
    c.is_causal = true, c.need_weights = false;
    check_case(ctx, &c);
    c = rcase_base(902);
    c.e = 1024, c.h = 8, c.kdim = 24, c.vdim = 40, c.l = 3, c.s = 40, c.n = 1;
    c.am = CLMHA_MASK_FLOAT, c.need_weights = false;
    check_case(ctx, &c);
    clmha_context_release(ctx);
}
