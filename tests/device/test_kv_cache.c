// Incremental decoding through a KV cache (clmha_kv_cache, the decode core): feeding a sequence
// chunk by chunk or token by token gives the one-shot forward's output, checked against the
// double-precision CPU reference of the whole sequence (clmha_reference_forward): causal
// self-attention, add_bias_kv and add_zero_attn, cross-attention with a fixed key/value
// (kv_attend_only), ragged batches (kv_append), truncate and re-append, several key ranges per
// sequence (split-K) merged, sliding windows (bottom-right: token t at position t, as in the
// one-shot forward); and the errors: capacity, batch, layer, options the decode core
// does not take, truncate past a length. Every case prints its max abs error to stderr.
#include <criterion/criterion.h>

#include <clmha.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cores/decode.h"
#include "golden_call.h"
#include "random_case.h"
#include "support.h"

// Tolerance against the double reference for unit-scale inputs (float32 accumulation).
#define TOL 2e-5

// The reference output of the whole call of @p in (N*L*E floats, the query's layout).
static double *reference_output(const instance *in) {
    double *out = malloc(in->output_count * sizeof *out);
    cr_assert(out, "out of memory");
    char msg[512];
    clmha_status st = clmha_reference_forward(&in->desc, &in->params, &in->args, out,
                                              in->output_count, NULL, 0, msg, sizeof msg);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_reference_forward: %s", msg);
    return out;
}

// Rows t0 .. t1-1 of every sequence of a (T, N, F) or batch-first (N, T, F) tensor, in the same
// layout with T = t1 - t0.
static float *slice(const float *x, size_t n, size_t t, size_t f, bool batch_first, size_t t0,
                    size_t t1) {
    size_t c = t1 - t0;
    float *out = malloc((n * c * f + 1) * sizeof *out);
    cr_assert(out, "out of memory");
    for (size_t b = 0; b < n; ++b)
        for (size_t i = 0; i < c; ++i) {
            size_t src = batch_first ? b * t + t0 + i : (t0 + i) * n + b;
            size_t dst = batch_first ? b * c + i : i * n + b;
            memcpy(out + dst * f, x + src * f, f * sizeof *out);
        }
    return out;
}

// Max abs error of rows t0 .. t1-1 of sequence b (@p got: the chunk's output, (c, N, E) or
// batch first; floats, or doubles where @p got64 is not NULL) against the reference of the
// whole call.
static double chunk_err_of(const float *got, const double *got64, const double *want, size_t n,
                           size_t t, size_t e, bool batch_first, size_t t0, size_t t1,
                           size_t b) {
    size_t c = t1 - t0;
    double err = 0.0;
    for (size_t i = 0; i < c; ++i) {
        size_t g = batch_first ? b * c + i : i * n + b;
        size_t w = batch_first ? b * t + t0 + i : (t0 + i) * n + b;
        for (size_t k = 0; k < e; ++k) {
            double x = got64 ? got64[g * e + k] : (double)got[g * e + k];
            double d = fabs(x - want[w * e + k]);
            if (!(d <= err)) err = d;  // NaN wins
        }
    }
    return err;
}

static double chunk_err(const float *got, const double *want, size_t n, size_t t, size_t e,
                        bool batch_first, size_t t0, size_t t1, size_t b) {
    return chunk_err_of(got, NULL, want, n, t, e, batch_first, t0, t1, b);
}

// The cache that feed_self() makes: of kv_dtype feed_kind, paged with pages of feed_page_size
// tokens (0: contiguous), set by the float64 tests.
static clmha_kv_dtype feed_kind;
static size_t feed_page_size;

static clmha_kv_cache *feed_cache(clmha_layer *layer, size_t n, size_t t) {
    clmha_kv_cache_options o = {.struct_size = sizeof o, .kv_dtype = feed_kind};
    if (feed_page_size) {
        o.page_size = feed_page_size;
        o.num_pages = n * ((t + feed_page_size - 1) / feed_page_size);
    } else {
        o.capacity = t;
    }
    clmha_kv_cache *cache = NULL;
    clmha_status st = clmha_kv_cache_create_with(&cache, layer, n, &o);
    cr_assert_eq(st, CLMHA_SUCCESS, "clmha_kv_cache_create_with: %s",
                 clmha_context_last_error(clmha_layer_context(layer)));
    return cache;
}

// One call of feed_self(): the @p rows query rows @p q through @p layer; a float64 layer
// (@p out64 not NULL) takes them as doubles and writes doubles.
static clmha_status feed_call(clmha_layer *layer, clmha_forward_args *a, const float *q,
                              size_t rows, float *out, double *out64) {
    if (!out64) return clmha_layer_forward_host(layer, a, out, rows, NULL, 0);
    double *q64 = malloc(rows * sizeof *q64 + 1);
    cr_assert(q64, "out of memory");
    for (size_t i = 0; i < rows; ++i) q64[i] = q[i];
    a->query.data = q64;
    clmha_status st = clmha_layer_forward_host_f64(layer, a, out64, rows, NULL, 0);
    free(q64);
    return st;
}

// Feeds the self-attention case @p in through a cache @p chunk tokens at a time (each call's
// queries are its new tokens) and returns the max abs error against the one-shot forward (a
// float64 layer's, in.desc.dtype: in doubles).
static double feed_self(clmha_context *ctx, const instance *in, size_t chunk) {
    const rcase *c = &in->c;
    size_t n = in->n, t = c->l, e = c->e;
    bool f64 = in->desc.dtype == CLMHA_DTYPE_F64;
    clmha_layer *layer = instance_layer(ctx, in);
    clmha_kv_cache *cache = feed_cache(layer, n, t);
    clmha_status st;
    double *want = reference_output(in);
    double err = 0.0;
    for (size_t t0 = 0; t0 < t; t0 += chunk) {
        size_t t1 = t0 + chunk < t ? t0 + chunk : t;
        float *q = slice(in->query, n, t, e, c->batch_first, t0, t1);
        float *out = alloc_floats(n * (t1 - t0) * e);
        double *out64 = f64 ? malloc(n * (t1 - t0) * e * sizeof *out64) : NULL;
        clmha_forward_args a = {.struct_size = sizeof a, .is_causal = c->is_causal,
                                .kv_cache = cache};
        a.query = (clmha_tensor){.ndim = c->unbatched ? 2 : 3, .data = q};
        if (c->unbatched) {
            a.query.shape[0] = t1 - t0, a.query.shape[1] = e;
        } else if (c->batch_first) {
            a.query.shape[0] = n, a.query.shape[1] = t1 - t0, a.query.shape[2] = e;
        } else {
            a.query.shape[0] = t1 - t0, a.query.shape[1] = n, a.query.shape[2] = e;
        }
        st = feed_call(layer, &a, q, n * (t1 - t0) * e, out, out64);
        cr_assert_eq(st, CLMHA_SUCCESS, "forward with cache (tokens %zu..%zu): %s", t0, t1,
                     clmha_context_last_error(ctx));
        for (size_t b = 0; b < n; ++b) {
            double x = chunk_err_of(out, out64, want, n, t, e, c->batch_first && !c->unbatched,
                                    t0, t1, b);
            if (!(x <= err)) err = x;
        }
        free(q);
        free(out);
        free(out64);
    }
    size_t lens[8];
    cr_assert_eq(clmha_kv_cache_lengths(cache, lens, n), CLMHA_SUCCESS);
    for (size_t b = 0; b < n; ++b) cr_expect_eq(lens[b], t, "sequence %zu holds %zu", b, lens[b]);
    free(want);
    clmha_kv_cache_release(cache);
    clmha_layer_release(layer);
    return err;
}

// A causal self-attention case: E 16, 4 heads, N 2, L = S = @p len.
static rcase self_case(uint64_t seed, size_t len) {
    rcase c = rcase_base(seed);
    c.e = 16, c.h = 4, c.l = c.s = len;
    c.self_attn = true, c.is_causal = true, c.need_weights = false;
    return c;
}

static void check_self(const rcase *c, size_t chunk, size_t parts, const char *what) {
    clmha_context *ctx = context_or_skip();
    instance in;
    instance_make(&in, c);
    clmha__test_set_decode_parts(parts);
    double err = feed_self(ctx, &in, chunk);
    clmha__test_set_decode_parts(0);
    fprintf(stderr, "kv_cache %s: chunk %zu, parts %zu: max abs err %.3g\n", what, chunk, parts,
            err);
    cr_expect(err <= TOL, "%s, chunk %zu, parts %zu: max abs err %g", what, chunk, parts, err);
    instance_free(&in);
    clmha_context_release(ctx);
}

Test(kv_cache, causal_token_by_token_and_chunks, .timeout = 300) {
    rcase c = self_case(11, 13);
    check_self(&c, 1, 0, "causal self-attention");
    check_self(&c, 4, 0, "causal self-attention");
    check_self(&c, 13, 0, "causal self-attention");
    check_self(&c, 1, 3, "causal self-attention");   // several ranges, some empty
    check_self(&c, 5, 16, "causal self-attention");  // more ranges than keys
    c.batch_first = true;
    check_self(&c, 3, 2, "causal, batch_first");
    c.batch_first = false;
    c.unbatched = true;
    c.n = 1;
    check_self(&c, 2, 0, "causal, unbatched");
}

Test(kv_cache, appended_keys, .timeout = 300) {
    rcase c = self_case(12, 9);
    c.add_bias_kv = true;
    check_self(&c, 1, 0, "add_bias_kv");
    c.add_zero_attn = true;
    check_self(&c, 2, 3, "add_bias_kv and add_zero_attn");
    c.add_bias_kv = false;
    check_self(&c, 4, 0, "add_zero_attn");
    c.bias = false;
    check_self(&c, 3, 0, "add_zero_attn, no bias");
}

Test(kv_cache, not_causal, .timeout = 300) {
    // Without is_causal every query sees the whole cache as it stands after its call: the
    // last chunk's queries then see every key, as in the one-shot forward.
    rcase c = self_case(13, 8);
    c.is_causal = false;
    clmha_context *ctx = context_or_skip();
    instance in;
    instance_make(&in, &c);
    double err = feed_self(ctx, &in, 8);
    fprintf(stderr, "kv_cache not causal, one chunk: max abs err %.3g\n", err);
    cr_expect(err <= TOL, "max abs err %g", err);
    instance_free(&in);
    clmha_context_release(ctx);
}

Test(kv_cache, long_cache_split_k, .timeout = 300) {
    // 300 tokens, 8 heads of 8 (then 4 of 16 and of 32): the default ranges (several per
    // sequence on every device) and a forced 7, token by token over the last tokens.
    rcase c = self_case(14, 300);
    c.e = 64, c.h = 8, c.n = 1;
    check_self(&c, 100, 0, "long cache");
    check_self(&c, 60, 7, "long cache");
    // Heads of 16 and 32 (on a device with 16-float vectors one and two vectors a row: the
    // kernel's 16-key lane sums), ranges that end inside a block of 16 keys.
    c.h = 4;
    check_self(&c, 100, 7, "long cache, heads of 16");
    c.e = 128;
    check_self(&c, 150, 0, "long cache, heads of 32");
}

Test(kv_cache, groups_and_odd_head_dims, .timeout = 300) {
    // On CPUs the decode core keeps SPLIT sums per query head in a block's scores (4 for groups
    // of 1 to 3 query heads per key/value head, 2 for 4 to 7, 1 from 8): head dims that are not
    // a multiple of it (the last dimensions go to the first sum), groups of 1, 3, 4 and 8, and
    // ranges that end inside a block of 16 keys; 70 tokens, 2 sequences.
    rcase c = self_case(16, 70);
    c.n = 2;
    c.e = 15, c.h = 3;  // D 5, G 1
    check_self(&c, 9, 0, "heads of 5");
    c.e = 30, c.h = 6, c.kv_heads = 2;  // D 5, G 3
    check_self(&c, 9, 3, "3 query heads per key/value head, heads of 5");
    c.e = 56, c.h = 8, c.add_bias_kv = true;  // D 7, G 4
    check_self(&c, 1, 5, "4 query heads per key/value head, heads of 7, add_bias_kv");
    c.kv_heads = 1, c.add_bias_kv = false;  // D 7, G 8: multi-query
    check_self(&c, 70, 0, "8 query heads per key/value head, heads of 7");
}

// Cross-attention: the fixed key/value (S tokens, kdim/vdim features) goes into the cache with
// the first query chunk; the later chunks attend only (kv_attend_only).
Test(kv_cache, cross_attention_attend_only, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    rcase c = rcase_base(15);
    c.e = 16, c.h = 2, c.n = 3, c.l = 7, c.s = 10, c.kdim = 5, c.vdim = 6;
    c.need_weights = false, c.add_bias_kv = true;
    instance in;
    instance_make(&in, &c);
    size_t n = in.n, e = c.e;
    double *want = reference_output(&in);
    clmha_layer *layer = instance_layer(ctx, &in);
    clmha_kv_cache *cache;
    cr_assert_eq(clmha_kv_cache_create(&cache, layer, n, 16), CLMHA_SUCCESS);
    double err = 0.0;
    size_t chunks[][2] = {{0, 2}, {2, 3}, {3, 7}};
    for (size_t k = 0; k < 3; ++k) {
        size_t t0 = chunks[k][0], t1 = chunks[k][1];
        float *q = slice(in.query, n, c.l, e, false, t0, t1);
        float *out = alloc_floats(n * (t1 - t0) * e);
        clmha_forward_args a = {.struct_size = sizeof a, .kv_cache = cache,
                                .query = {.ndim = 3, .shape = {t1 - t0, n, e}, .data = q}};
        if (k == 0) {
            a.key = in.args.key;
            a.value = in.args.value;
        } else {
            a.kv_attend_only = true;
        }
        clmha_status st = clmha_layer_forward_host(layer, &a, out, n * (t1 - t0) * e, NULL, 0);
        cr_assert_eq(st, CLMHA_SUCCESS, "chunk %zu: %s", k, clmha_context_last_error(ctx));
        for (size_t b = 0; b < n; ++b) {
            double x = chunk_err(out, want, n, c.l, e, false, t0, t1, b);
            if (!(x <= err)) err = x;
        }
        free(q);
        free(out);
    }
    size_t lens[3];
    clmha_kv_cache_lengths(cache, lens, 3);
    cr_expect(lens[0] == 10 && lens[1] == 10 && lens[2] == 10, "lengths %zu %zu %zu", lens[0],
              lens[1], lens[2]);
    fprintf(stderr, "kv_cache cross-attention, attend only: max abs err %.3g\n", err);
    cr_expect(err <= TOL, "max abs err %g", err);
    free(want);
    clmha_kv_cache_release(cache);
    clmha_layer_release(layer);
    instance_free(&in);
    clmha_context_release(ctx);
}

// Ragged batch: three sequences of lengths 5, 9 and 2 fed together in calls of up to 3 tokens,
// each call appending what remains of each sequence (kv_append; the padded query rows are
// ignored). Each sequence must match its own one-shot causal forward (with the layer's sliding
// window, when @p c has one: a sequence's token t is at position t in both). Returns the max abs
// error.
static double ragged(rcase c) {
    clmha_context *ctx = context_or_skip();
    const size_t n = 3, lens[3] = {5, 9, 2}, t = 9, e = 16, step = 3;
    c.n = n;
    instance in;
    instance_make(&in, &c);
    clmha_layer *layer = instance_layer(ctx, &in);
    // The reference of each sequence alone: batch 1, its own length, its own rows.
    double *want[3];
    for (size_t b = 0; b < n; ++b) {
        float *seq = alloc_floats(lens[b] * e);
        for (size_t i = 0; i < lens[b]; ++i)
            memcpy(seq + i * e, in.query + (i * n + b) * e, e * sizeof *seq);
        clmha_forward_args ra = in.args;
        ra.query = (clmha_tensor){.ndim = 3, .shape = {lens[b], 1, e}, .data = seq};
        want[b] = malloc(lens[b] * e * sizeof *want[b]);
        char msg[512];
        cr_assert_eq(clmha_reference_forward(&in.desc, &in.params, &ra, want[b], lens[b] * e,
                                             NULL, 0, msg, sizeof msg),
                     CLMHA_SUCCESS, "%s", msg);
        free(seq);
    }
    clmha_kv_cache *cache;
    cr_assert_eq(clmha_kv_cache_create(&cache, layer, n, t), CLMHA_SUCCESS);
    double err = 0.0;
    for (size_t t0 = 0; t0 < t; t0 += step) {
        size_t t1 = t0 + step;
        size_t add[3];
        for (size_t b = 0; b < n; ++b)
            add[b] = lens[b] > t0 ? (lens[b] - t0 < step ? lens[b] - t0 : step) : 0;
        float *q = slice(in.query, n, t, e, false, t0, t1);
        float *out = alloc_floats(n * step * e);
        clmha_forward_args a = {.struct_size = sizeof a, .is_causal = true, .kv_cache = cache,
                                .kv_append = add,
                                .query = {.ndim = 3, .shape = {step, n, e}, .data = q}};
        clmha_status st = clmha_layer_forward_host(layer, &a, out, n * step * e, NULL, 0);
        cr_assert_eq(st, CLMHA_SUCCESS, "tokens %zu..%zu: %s", t0, t1,
                     clmha_context_last_error(ctx));
        for (size_t b = 0; b < n; ++b)
            for (size_t i = 0; i < add[b]; ++i)
                for (size_t k = 0; k < e; ++k) {
                    double d = fabs((double)out[(i * n + b) * e + k] - want[b][(t0 + i) * e + k]);
                    if (!(d <= err)) err = d;
                }
        free(q);
        free(out);
    }
    size_t got[3];
    clmha_kv_cache_lengths(cache, got, n);
    for (size_t b = 0; b < n; ++b) cr_expect_eq(got[b], lens[b], "sequence %zu", b);
    for (size_t b = 0; b < n; ++b) free(want[b]);
    clmha_kv_cache_release(cache);
    clmha_layer_release(layer);
    instance_free(&in);
    clmha_context_release(ctx);
    return err;
}

Test(kv_cache, ragged_batch, .timeout = 300) {
    double err = ragged(self_case(16, 9));
    fprintf(stderr, "kv_cache ragged batch: max abs err %.3g\n", err);
    cr_expect(err <= TOL, "max abs err %g", err);
}

// Speculative decoding: 6 tokens, then 3 wrong tokens appended and rolled back (truncate to
// 6), then the real tokens 6..10: the outputs after the rollback equal the one-shot forward.
Test(kv_cache, truncate_then_reappend, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    const size_t t = 10, e = 16, n = 2;
    rcase c = self_case(17, t);
    instance in;
    instance_make(&in, &c);
    double *want = reference_output(&in);
    clmha_layer *layer = instance_layer(ctx, &in);
    clmha_kv_cache *cache;
    cr_assert_eq(clmha_kv_cache_create(&cache, layer, n, t), CLMHA_SUCCESS);
    float *junk = alloc_floats(3 * n * e);
    for (size_t i = 0; i < 3 * n * e; ++i) junk[i] = (float)((i * 37 % 11) - 5) * 0.3f;
    struct {
        size_t t0, t1;
        bool junk;
    } steps[] = {{0, 6, false}, {6, 9, true}, {6, 7, false}, {7, 10, false}};
    double err = 0.0;
    for (size_t k = 0; k < 4; ++k) {
        size_t t0 = steps[k].t0, t1 = steps[k].t1, cnt = t1 - t0;
        if (k == 2) {
            size_t keep[2] = {6, 6};
            cr_assert_eq(clmha_kv_cache_truncate(cache, keep, n), CLMHA_SUCCESS);
        }
        float *q = steps[k].junk ? junk : slice(in.query, n, t, e, false, t0, t1);
        float *out = alloc_floats(n * cnt * e);
        clmha_forward_args a = {.struct_size = sizeof a, .is_causal = true, .kv_cache = cache,
                                .query = {.ndim = 3, .shape = {cnt, n, e}, .data = q}};
        cr_assert_eq(clmha_layer_forward_host(layer, &a, out, n * cnt * e, NULL, 0),
                     CLMHA_SUCCESS, "step %zu: %s", k, clmha_context_last_error(ctx));
        if (!steps[k].junk)
            for (size_t b = 0; b < n; ++b) {
                double x = chunk_err(out, want, n, t, e, false, t0, t1, b);
                if (!(x <= err)) err = x;
            }
        if (!steps[k].junk) free(q);
        free(out);
    }
    fprintf(stderr, "kv_cache truncate and re-append: max abs err %.3g\n", err);
    cr_expect(err <= TOL, "max abs err %g", err);
    free(junk);
    free(want);
    clmha_kv_cache_release(cache);
    clmha_layer_release(layer);
    instance_free(&in);
    clmha_context_release(ctx);
}

// ---- Sliding windows ------------------------------------------------------------------------

// With a cache, query token t of a sequence is at position t (the cached length + its row), as
// it is in the one-shot forward of the whole sequence (top-left): fed token by token or in
// chunks, a windowed layer gives the rows of its one-shot windowed forward.
static void check_window(rcase c, int64_t left, int64_t right, size_t chunk, size_t parts,
                         const char *what) {
    char name[160];
    snprintf(name, sizeof name, "%s, window (%lld, %lld)%s", what, (long long)left,
             (long long)right, c.is_causal ? ", causal" : "");
    c.window = true, c.win_left = left, c.win_right = right;
    check_self(&c, chunk, parts, name);
}

Test(kv_cache, sliding_window, .timeout = 300) {
    // 13 tokens, 4 heads of 4, 2 sequences: one key (0, 0), 4 keys (3, 0), 6 (5, -1, causal),
    // a window wider than the cache (100, -1: the causal rows), a right bound that is_causal
    // cuts (2, 4); without is_causal (3, 0) is the same window; token by token, in chunks and
    // in one call, with the ranges of the core's choice, 3 (some empty) and 16.
    rcase c = self_case(21, 13);
    const int64_t windows[][2] = {{0, 0}, {3, 0}, {5, -1}, {100, -1}, {2, 4}};
    for (size_t w = 0; w < sizeof windows / sizeof windows[0]; ++w) {
        check_window(c, windows[w][0], windows[w][1], 1, 0, "causal self-attention");
        check_window(c, windows[w][0], windows[w][1], 4, 3, "causal self-attention");
        check_window(c, windows[w][0], windows[w][1], 13, 16, "causal self-attention");
    }
    c.is_causal = false;
    check_window(c, 3, 0, 1, 0, "self-attention");
    check_window(c, 3, 0, 5, 3, "self-attention");
    // Without is_causal a right bound sees the tokens after a query only when they come in the
    // same call: in one call, the one-shot forward's rows.
    check_window(c, 2, 3, 13, 3, "self-attention, one call");
    check_window(c, -1, 1, 13, 0, "self-attention, one call");
    c.is_causal = true;
    c.add_bias_kv = c.add_zero_attn = true;  // never windowed
    check_window(c, 1, 0, 2, 3, "add_bias_kv and add_zero_attn");
    c.add_bias_kv = c.add_zero_attn = false;
    c.batch_first = true;
    check_window(c, 4, 0, 3, 2, "batch_first");
}

// Soft-capping and ALiBi through the decode core: ALiBi's positions are bottom-right (new token
// t of a sequence at position t, as in the one-shot forward), the appended keys soft-capped
// without ALiBi's term; token by token, in chunks and in one call, several ranges a row, a long
// cache split in 7, grouped-query attention, windows.
Test(kv_cache, score_variants, .timeout = 300) {
    rcase c = self_case(23, 13);
    c.softcap = 0.8;
    check_self(&c, 1, 0, "softcap 0.8");
    check_self(&c, 4, 3, "softcap 0.8");
    c.softcap = 0.0, c.alibi = true;
    check_self(&c, 1, 0, "alibi");
    check_self(&c, 5, 16, "alibi");
    c.alibi_random = true, c.softcap = 2.0;
    check_self(&c, 3, 2, "softcap 2, alibi (given slopes)");
    c.add_bias_kv = c.add_zero_attn = true;
    check_self(&c, 2, 3, "softcap 2, alibi (given slopes), add_bias_kv and add_zero_attn");
    c.add_bias_kv = c.add_zero_attn = false;
    c.is_causal = false;
    check_self(&c, 13, 3, "softcap 2, alibi (given slopes), not causal, one call");
    c.is_causal = true;
    check_window(c, 3, 0, 4, 0, "softcap 2, alibi (given slopes)");
    c.window = false, c.sinks = true;  // the sink in decode_combine's merge
    check_self(&c, 1, 0, "softcap 2, alibi (given slopes), sinks");
    check_self(&c, 4, 3, "softcap 2, alibi (given slopes), sinks");
    c.softcap = 0.0, c.alibi = c.alibi_random = false;
    check_self(&c, 2, 16, "sinks, more ranges than keys");
    rcase g = self_case(24, 200);
    g.e = 64, g.h = 8, g.n = 2, g.kv_heads = 2;
    g.softcap = 1.5, g.alibi = true;
    check_self(&g, 1, 7, "long cache, GQA 4, softcap 1.5, alibi");
    check_self(&g, 70, 0, "long cache, GQA 4, softcap 1.5, alibi");
    g.sinks = true;
    check_self(&g, 1, 7, "long cache, GQA 4, softcap 1.5, alibi, sinks");
}

// User functions through the decode core (rcase::user): ALiBi and soft-capping as
// clmha_score_mod and windows as clmha_mask_mod at the bottom-right positions, token by token,
// in chunks, split-K over a long cache with grouped-query attention, and with a block of keys
// the mask forbids whole (skipped).
Test(kv_cache, user_functions, .timeout = 300) {
    rcase c = self_case(25, 13);
    c.user = RC_USER_SCORE, c.softcap = 0.8, c.alibi = true;
    check_self(&c, 1, 0, "user softcap 0.8, alibi");
    check_self(&c, 4, 3, "user softcap 0.8, alibi");
    c.user = RC_USER_SCORE | RC_USER_MASK;
    check_window(c, 3, 0, 4, 0, "user softcap, alibi and window");
    c.user = RC_USER_MASK, c.softcap = 0.0, c.alibi = false;
    check_window(c, 2, 1, 1, 3, "user window");
    rcase g = self_case(26, 200);
    g.e = 64, g.h = 8, g.n = 2, g.kv_heads = 2;
    g.user = RC_USER_SCORE | RC_USER_MASK, g.alibi = true, g.alibi_random = true;
    check_window(g, 40, 0, 1, 7, "long cache, GQA 4, user alibi and window");
    check_window(g, 20, 0, 70, 0, "long cache, GQA 4, user alibi and window");
    g.user = RC_USER_HOST, g.alibi = false;  // no built-in equivalent: the host forms
    check_self(&g, 1, 7, "long cache, GQA 4, user functions (host forms)");
    check_self(&g, 70, 0, "long cache, GQA 4, user functions (host forms)");
}

Test(kv_cache, sliding_window_split_k, .timeout = 300) {
    // 300 tokens, 8 heads of 8, token by token or in chunks of 60 to 150: windows narrower
    // than one range of keys (a range is at least a block of 16 keys: (3, 0), (10, 0)), wider
    // than one (100, 0: over 7 ranges, ranges of 16 keys), wider than the cache (1000, -1), and
    // (50, -1); the windows' starts move through the key blocks.
    rcase c = self_case(22, 300);
    c.e = 64, c.h = 8, c.n = 1;
    check_window(c, 100, 0, 1, 7, "long cache");
    check_window(c, 3, 0, 60, 7, "long cache");
    check_window(c, 10, 0, 100, 0, "long cache");
    check_window(c, 100, 0, 60, 7, "long cache");
    check_window(c, 100, 0, 100, 0, "long cache");
    check_window(c, 1000, -1, 100, 5, "long cache");
    check_window(c, 50, -1, 60, 2, "long cache");
    // Grouped-query attention: 8 query heads on 2 key/value heads, 2 sequences.
    c.kv_heads = 2, c.n = 2;
    check_window(c, 37, 0, 100, 7, "4 query heads per key/value head");
    check_window(c, 37, 0, 150, 0, "4 query heads per key/value head");
    c.e = 56, c.kv_heads = 1;  // D 7, G 8
    check_window(c, 20, 0, 100, 3, "8 query heads per key/value head, heads of 7");
}

Test(kv_cache, sliding_window_ragged_batch, .timeout = 300) {
    // Three sequences of 5, 9 and 2 tokens, in calls of up to 3 (kv_append): each sequence's
    // rows are its own one-shot windowed forward's.
    const int64_t windows[][2] = {{0, 0}, {2, 0}, {4, -1}};
    for (size_t w = 0; w < 3; ++w) {
        rcase c = self_case(23, 9);
        c.window = true, c.win_left = windows[w][0], c.win_right = windows[w][1];
        double err = ragged(c);
        fprintf(stderr, "kv_cache ragged batch, window (%lld, %lld): max abs err %.3g\n",
                (long long)windows[w][0], (long long)windows[w][1], err);
        cr_expect(err <= TOL, "window (%lld, %lld): max abs err %g", (long long)windows[w][0],
                  (long long)windows[w][1], err);
    }
}

// clmha_kv_cache_options::dtype: a layer's cache takes 0 or its layer's dtype; a cache for
// attention as a function takes any clmha_dtype (float64 on a device with double precision).
Test(kv_cache, options_dtype) {
    clmha_context *ctx = context_or_skip();
    rcase c = self_case(45, 4);
    instance in;
    instance_make(&in, &c);
    clmha_layer *layer = instance_layer(ctx, &in);
    clmha_kv_cache *cache = NULL;
    clmha_kv_cache_options o = {.struct_size = sizeof o, .capacity = 4,
                                .dtype = CLMHA_DTYPE_F64};
    cr_expect_eq(clmha_kv_cache_create_with(&cache, layer, 2, &o), CLMHA_INVALID_ARGUMENT);
    cr_expect_null(cache);
    cr_expect(strstr(clmha_context_last_error(ctx), "dtype") != NULL, "%s",
              clmha_context_last_error(ctx));
    o.dtype = CLMHA_DTYPE_F32;
    cr_expect_eq(clmha_kv_cache_create_with(&cache, layer, 2, &o), CLMHA_SUCCESS);
    clmha_kv_cache_release(cache);
    cache = NULL;
    o.dtype = (clmha_dtype)9;
    cr_expect_eq(clmha_kv_cache_create_for_with(&cache, ctx, 2, 2, 4, &o),
                 CLMHA_INVALID_ARGUMENT);
    cr_expect_null(cache);
    o.dtype = CLMHA_DTYPE_F64;
    cr_expect_eq(clmha_kv_cache_create_for_with(&cache, ctx, 2, 2, 4, &o),
                 has_fp64(ctx) ? CLMHA_SUCCESS : CLMHA_UNSUPPORTED);
    clmha_kv_cache_release(cache);
    clmha_layer_release(layer);
    instance_free(&in);
    clmha_context_release(ctx);
}

// float64 layers: the cache holds doubles and the decode core computes in float64; each case
// fed as check_self() does, on doubles, within the float64 forward's contract (1e-12 absolute
// on unit-scale outputs) of the reference; the narrower caches (their elements as a float32
// layer's, read into doubles) within their kinds' contracts (test_kv_dtypes.c, relative to
// the largest output), contiguous and in pages of 8 and 32.
#define F64_TOL 1e-12

static double check_f64(rcase c, size_t chunk, size_t parts, clmha_kv_dtype kind, size_t page,
                        const char *what) {
    clmha_context *ctx = fp64_context_or_skip();
    instance in;
    instance_make(&in, &c);
    in.desc.dtype = CLMHA_DTYPE_F64;
    double *want = reference_output(&in), big = 0.0;
    for (size_t i = 0; i < in.output_count; ++i) big = fmax(big, fabs(want[i]));
    feed_kind = kind, feed_page_size = page;
    clmha__test_set_decode_parts(parts);
    double err = feed_self(ctx, &in, chunk) / (kind == CLMHA_KV_FLOAT32 ? 1.0 : big);
    clmha__test_set_decode_parts(0);
    feed_kind = CLMHA_KV_FLOAT32, feed_page_size = 0;
    fprintf(stderr, "kv_cache float64 %s: kv_dtype %d, pages of %zu, chunk %zu, parts %zu: max "
                    "%s err %.3g\n",
            what, (int)kind, page, chunk, parts, kind == CLMHA_KV_FLOAT32 ? "abs" : "rel", err);
    free(want);
    instance_free(&in);
    clmha_context_release(ctx);
    return err;
}

Test(kv_cache, float64_layers, .timeout = 300) {
    rcase c = self_case(41, 13);
    const size_t runs[][2] = {{1, 0}, {4, 3}, {13, 16}};
    for (size_t r = 0; r < 3; ++r)
        cr_expect(check_f64(c, runs[r][0], runs[r][1], CLMHA_KV_FLOAT32, 0, "causal") <= F64_TOL);
    c.batch_first = true, c.add_bias_kv = c.add_zero_attn = true;
    cr_expect(check_f64(c, 2, 3, CLMHA_KV_FLOAT32, 8, "batch_first, bias_kv, zero_attn") <=
              F64_TOL);
    c = self_case(42, 70);
    c.e = 56, c.h = 8, c.kv_heads = 2;  // D 7, GQA 4
    cr_expect(check_f64(c, 1, 5, CLMHA_KV_FLOAT32, 32, "GQA 4, heads of 7") <= F64_TOL);
    c.window = true, c.win_left = 5, c.win_right = 0;
    cr_expect(check_f64(c, 9, 0, CLMHA_KV_FLOAT32, 0, "GQA 4, window (5, 0)") <= F64_TOL);
    c = self_case(43, 200);
    c.e = 64, c.h = 8, c.n = 2, c.kv_heads = 2, c.softcap = 1.5, c.alibi = true;
    c.sinks = true;
    cr_expect(check_f64(c, 1, 7, CLMHA_KV_FLOAT32, 8, "long, softcap, alibi, sinks") <= F64_TOL);
    cr_expect(check_f64(c, 70, 0, CLMHA_KV_FLOAT32, 0, "long, softcap, alibi, sinks") <=
              F64_TOL);
    c.softcap = 0.0, c.sinks = false, c.user = RC_USER_SCORE | RC_USER_MASK;
    c.window = true, c.win_left = 40, c.win_right = 0;
    cr_expect(check_f64(c, 30, 3, CLMHA_KV_FLOAT32, 0, "long, user alibi and window") <=
              F64_TOL);
    // The narrower caches: float16, bfloat16, int8, int4 (D 16: groups of 16).
    static const struct {
        clmha_kv_dtype kind;
        double rel;
    } narrow[] = {{CLMHA_KV_FLOAT16, 1e-3}, {CLMHA_KV_BFLOAT16, 5e-3}, {CLMHA_KV_INT8, 1e-2},
                  {CLMHA_KV_INT4, 2e-1}};
    c = self_case(44, 40);
    c.e = 64, c.h = 4;
    for (size_t k = 0; k < sizeof narrow / sizeof narrow[0]; ++k)
        for (size_t page = 0; page <= 8; page += 8)
            cr_expect(check_f64(c, 5, 3, narrow[k].kind, page, "narrow cache") <= narrow[k].rel,
                      "kv_dtype %d, pages of %zu", (int)narrow[k].kind, page);
}

// A call that cannot run leaves the cache as it was and enqueues nothing.
static void expect_refused(clmha_layer *layer, clmha_forward_args *a, clmha_status want,
                           const char *needle, clmha_kv_cache *cache, const size_t *lens_before) {
    clmha_context *ctx = clmha_layer_context(layer);
    size_t out_count = a->query.shape[0] * a->query.shape[1] * a->query.shape[2];
    float *out = alloc_floats(out_count ? out_count : 1);
    float *w = alloc_floats(64);
    clmha_status st = clmha_layer_forward_host(layer, a, out, out_count, a->need_weights ? w : NULL,
                                               a->need_weights ? 64 : 0);
    const char *msg = clmha_context_last_error(ctx);
    cr_expect_eq(st, want, "status %d, want %d: %s", (int)st, (int)want, msg);
    cr_expect(strstr(msg, needle), "message \"%s\" lacks \"%s\"", msg, needle);
    size_t lens[2];
    clmha_kv_cache_lengths(cache, lens, 2);
    cr_expect(lens[0] == lens_before[0] && lens[1] == lens_before[1],
              "lengths changed to %zu %zu by a refused call", lens[0], lens[1]);
    free(out);
    free(w);
}

Test(kv_cache, errors, .timeout = 300) {
    clmha_context *ctx = context_or_skip();
    rcase c = self_case(18, 4);
    instance in;
    instance_make(&in, &c);
    clmha_layer *layer = instance_layer(ctx, &in), *other = instance_layer(ctx, &in);
    const size_t n = 2, e = 16;
    clmha_kv_cache *cache = NULL;
    // Creation.
    cr_expect_eq(clmha_kv_cache_create(NULL, layer, n, 4), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_kv_cache_create(&cache, NULL, n, 4), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_kv_cache_create(&cache, layer, 0, 4), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_kv_cache_create(&cache, layer, n, 0), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_kv_cache_create(&cache, layer, n, (size_t)1 << 32),
                 CLMHA_INVALID_ARGUMENT);
    cr_expect(strstr(clmha_context_last_error(ctx), "fewer than 2^32"), "%s",
              clmha_context_last_error(ctx));
    // 2^32 - 1 tokens is fewer than 2^32: not refused as a capacity (but far too large here).
    cr_expect_eq(clmha_kv_cache_create(&cache, layer, n, ((size_t)1 << 32) - 1),
                 CLMHA_OUT_OF_MEMORY, "%s", clmha_context_last_error(ctx));
    cr_expect_eq(clmha_kv_cache_create(&cache, layer, SIZE_MAX / 2, 1000), CLMHA_SIZE_OVERFLOW);
    cr_expect_eq(clmha_kv_cache_create(&cache, layer, 1u << 20, 1u << 20), CLMHA_OUT_OF_MEMORY,
                 "a cache past the largest allocation: %s", clmha_context_last_error(ctx));
    cr_expect_null(cache);
    cr_assert_eq(clmha_kv_cache_create(&cache, layer, n, 4), CLMHA_SUCCESS);
    size_t batch = 0, cap = 0;
    cr_expect_eq(clmha_kv_cache_size(cache, &batch, &cap), CLMHA_SUCCESS);
    cr_expect(batch == n && cap == 4);
    cr_expect_eq(clmha_kv_cache_size(NULL, &batch, &cap), CLMHA_INVALID_ARGUMENT);

    // Three tokens in: then appending two more passes the capacity of 4.
    float q[3 * 2 * 16];
    for (size_t i = 0; i < sizeof q / sizeof q[0]; ++i) q[i] = (float)(i % 7) * 0.1f - 0.3f;
    float out[3 * 2 * 16];
    clmha_forward_args a = {.struct_size = sizeof a, .is_causal = true, .kv_cache = cache,
                            .query = {.ndim = 3, .shape = {3, n, e}, .data = q}};
    cr_assert_eq(clmha_layer_forward_host(layer, &a, out, 3 * n * e, NULL, 0), CLMHA_SUCCESS,
                 "%s", clmha_context_last_error(ctx));
    size_t three[2] = {3, 3};
    a.query.shape[0] = 2;
    expect_refused(layer, &a, CLMHA_SHAPE_MISMATCH, "capacity exceeded", cache, three);
    size_t add[2] = {1, 3};  // 3 of 2 new tokens
    a.kv_append = add;
    expect_refused(layer, &a, CLMHA_SHAPE_MISMATCH, "kv_append[1] is 3", cache, three);
    add[1] = 0;  // one more token for sequence 0 only: fits
    cr_expect_eq(clmha_layer_forward_host(layer, &a, out, 2 * n * e, NULL, 0), CLMHA_SUCCESS,
                 "%s", clmha_context_last_error(ctx));
    size_t lens[2];
    clmha_kv_cache_lengths(cache, lens, n);
    cr_expect(lens[0] == 4 && lens[1] == 3, "lengths %zu %zu", lens[0], lens[1]);
    size_t now[2] = {4, 3};
    a.kv_append = NULL;
    a.query.shape[0] = 1;
    // Options the decode core does not take.
    a.need_weights = true;
    expect_refused(layer, &a, CLMHA_UNSUPPORTED, "need_weights", cache, now);
    a.need_weights = false;
    unsigned char kpm[2] = {0, 0};
    a.key_padding_mask =
        (clmha_mask){.kind = CLMHA_MASK_BOOL_IGNORE, .tensor = {.ndim = 2, .shape = {n, 1},
                                                                .data = kpm}};
    expect_refused(layer, &a, CLMHA_UNSUPPORTED, "key_padding_mask", cache, now);
    a.key_padding_mask = (clmha_mask){0};
    a.impl = CLMHA_IMPL_UNFUSED;
    expect_refused(layer, &a, CLMHA_UNSUPPORTED, "impl", cache, now);
    a.impl = CLMHA_IMPL_AUTO;
    a.kv_attend_only = true;
    a.key = a.query;
    expect_refused(layer, &a, CLMHA_INVALID_ARGUMENT, "must be absent", cache, now);
    a.key = (clmha_tensor){0};
    a.kv_attend_only = false;
    // Batch and layer.
    a.query.shape[1] = 1;
    expect_refused(layer, &a, CLMHA_SHAPE_MISMATCH, "holds 2 sequences", cache, now);
    a.query.shape[1] = n;
    expect_refused(other, &a, CLMHA_INVALID_ARGUMENT, "another layer", cache, now);
    // kv_append or kv_attend_only without a cache.
    a.kv_cache = NULL;
    a.kv_attend_only = true;
    expect_refused(layer, &a, CLMHA_INVALID_ARGUMENT, "kv_cache is NULL", cache, now);
    a.kv_attend_only = false;
    a.kv_append = add;
    expect_refused(layer, &a, CLMHA_INVALID_ARGUMENT, "kv_append is set", cache, now);
    a.kv_append = NULL;
    a.kv_cache = cache;
    // Truncate and the other calls.
    size_t grow[2] = {4, 4};
    cr_expect_eq(clmha_kv_cache_truncate(cache, grow, n), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_kv_cache_truncate(cache, grow, 3), CLMHA_SHAPE_MISMATCH);
    cr_expect_eq(clmha_kv_cache_truncate(cache, NULL, n), CLMHA_INVALID_ARGUMENT);
    cr_expect_eq(clmha_kv_cache_lengths(cache, lens, 1), CLMHA_SHAPE_MISMATCH);
    cr_expect_eq(clmha_kv_cache_lengths(NULL, lens, n), CLMHA_INVALID_ARGUMENT);
    clmha_kv_cache_lengths(cache, lens, n);
    cr_expect(lens[0] == 4 && lens[1] == 3, "lengths changed: %zu %zu", lens[0], lens[1]);
    cr_expect_eq(clmha_kv_cache_reset(cache), CLMHA_SUCCESS);
    cr_expect_eq(clmha_kv_cache_reset(NULL), CLMHA_INVALID_ARGUMENT);
    clmha_kv_cache_lengths(cache, lens, n);
    cr_expect(lens[0] == 0 && lens[1] == 0, "reset left %zu %zu", lens[0], lens[1]);
    clmha_kv_cache_release(NULL);
    clmha_kv_cache_release(cache);
    clmha_layer_release(other);
    clmha_layer_release(layer);
    instance_free(&in);
    clmha_context_release(ctx);
}

// ---- PyTorch golden cases -----------------------------------------------------------------------

// Every golden case (tests/golden, PyTorch float64) that a cache can reproduce, fed @p chunk
// query rows at a time: causal self-attention cases (the key is the query) append each
// chunk's own tokens; cases without is_causal append the whole key/value with the first chunk
// and attend only afterwards. Cases with masks or dropout are skipped (the decode core takes
// neither), and so are causal cases with a separate key (top-left alignment with L != S), and
// windowed or ALiBi cases other than causal self-attention (a query row's position is the
// cached length + i: with the whole key cached first it would not be the one-shot call's i;
// in causal self-attention token t sits at position t in both). Soft-capping and sinks feed as
// they are.
static void golden_feed(clmha_context *ctx, const char *name, size_t chunk, size_t *fed,
                        double *worst) {
    golden_case gc;
    golden_load_case(name, &gc);
    golden_call call;
    golden_call_of(&gc, &call);
    const clmha_forward_args *g = &call.args;
    // Causal self-attention: each chunk appends its own tokens. Else the whole key/value (the
    // query itself in self-attention) goes in with the first chunk.
    bool self = g->key.ndim == 0 && g->is_causal;
    if (g->key_padding_mask.kind || g->attn_mask.kind || (g->training && gc.dropout > 0) ||
        (g->is_causal && g->key.ndim) || ((call.desc.window || call.desc.alibi) && !self)) {
        golden_free(&gc);
        return;
    }
    const golden_tensor *want = golden_find(&gc, "output");
    bool unbatched = g->query.ndim == 2, bf = gc.batch_first && !unbatched;
    size_t e = gc.embed_dim, l = unbatched ? g->query.shape[0] : g->query.shape[bf ? 1 : 0];
    size_t n = unbatched ? 1 : g->query.shape[bf ? 0 : 1];
    clmha_layer *layer = golden_layer_create(ctx, &gc, &call.desc);
    clmha_kv_cache *cache;
    const clmha_tensor *key = g->key.ndim ? &g->key : &g->query;
    size_t s = unbatched ? key->shape[0] : key->shape[bf ? 1 : 0];
    cr_assert_eq(clmha_kv_cache_create(&cache, layer, n, s), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(ctx));
    double err = 0.0;
    for (size_t t0 = 0; t0 < l; t0 += chunk) {
        size_t t1 = t0 + chunk < l ? t0 + chunk : l, c = t1 - t0;
        float *q = slice(g->query.data, n, l, e, bf, t0, t1);
        float *out = alloc_floats(n * c * e);
        clmha_forward_args a = *g;
        a.need_weights = false;
        a.kv_cache = cache;
        a.query.data = q;
        a.query.shape[unbatched ? 0 : bf ? 1 : 0] = c;
        if (!self && t0 == 0 && !g->key.ndim) a.key = g->query;
        if (!self && t0 > 0) {
            a.key = a.value = (clmha_tensor){0};
            a.kv_attend_only = true;
        }
        clmha_status st = clmha_layer_forward_host(layer, &a, out, n * c * e, NULL, 0);
        cr_assert_eq(st, CLMHA_SUCCESS, "%s, rows %zu..%zu: %s", name, t0, t1,
                     clmha_context_last_error(ctx));
        for (size_t b = 0; b < n; ++b) {
            double x = chunk_err(out, want->f64, n, l, e, bf, t0, t1, b);
            if (!(x <= err)) err = x;
        }
        free(q);
        free(out);
    }
    fprintf(stderr, "kv_cache golden %s (%s), chunk %zu: max abs err %.3g\n", name,
            self ? "causal self-attention" : "key/value cached once", chunk, err);
    cr_expect(err <= TOL, "%s, chunk %zu: max abs err %g", name, chunk, err);
    if (!(err <= *worst)) *worst = err;
    ++*fed;
    clmha_kv_cache_release(cache);
    clmha_layer_release(layer);
    golden_free(&gc);
}

Test(kv_cache, pytorch_golden_cases, .timeout = 600) {
    clmha_context *ctx = context_or_skip();
    size_t fed = 0;
    double worst = 0.0;
    for (size_t i = 0; i < golden_num_cases; ++i) {
        golden_feed(ctx, golden_case_names[i], 1, &fed, &worst);
        golden_feed(ctx, golden_case_names[i], 2, &fed, &worst);
    }
    fprintf(stderr, "kv_cache golden: %zu feeds, worst max abs err %.3g\n", fed, worst);
    cr_expect(fed >= 20, "only %zu golden feeds ran", fed);
    clmha_context_release(ctx);
}
