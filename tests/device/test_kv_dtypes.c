// KV caches that store their keys and values narrower than float32
// (clmha_kv_cache_options::kv_dtype): float16 and bfloat16 (rounded to nearest even on
// append), int8 (one scale per token and key/value head) and int4 (one scale per group of 32
// dimensions, or of 16 where D is 48), quantised on append and dequantised by the decode core.
//   - accuracy against the float32 cache on unit-scale data (inputs ~ N(0, 1), weights
//     ~ U(-1/sqrt(E), 1/sqrt(E))): max |narrow - float32| / max |float32| over every output row
//     of a prefill and decode steps, within the kind's contract (docs/accuracy.md states them),
//     for MHA, GQA, a window, D 48 and 64, and bfloat16 and float16 layers (a driver lane
//     takes its share of them: CLMHA_TEST_CASE_STRIDE, tests/support/support.h);
//   - a paged cache of each kind (pages of 8 and of 32) bit-identical to a contiguous one of
//     the same kind;
//   - a 200-token greedy generation of a small random model (token embeddings E 64, one
//     causal attention layer, logits = output · embeddingsᵀ) with each cache: the tokens
//     generated, compared with the float32 cache's (reported; a least first-difference per
//     kind is asserted, below what was measured);
//   - refusals: an unknown kv_dtype, int4 with an odd head_dim.
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clmha.h"
#include "random_case.h"
#include "support.h"

// Each kind's contract (max error relative to max |float32 output|, on a float32 layer; a
// 16-bit layer's outputs, each rounded to its dtype, may differ by one more unit in the last
// place: 2^-7 of the largest for bfloat16, 2^-10 for float16) and the least token at which
// its greedy generation may first differ from float32's; the measured figures (the lines
// printed to stderr) are in docs/accuracy.md.
static const struct kind {
    const char *name;
    clmha_kv_dtype dt;
    double rel;
    size_t first;
} kinds[] = {{"f16", CLMHA_KV_FLOAT16, 1e-3, 64},
             {"bf16", CLMHA_KV_BFLOAT16, 5e-3, 32},
             {"int8", CLMHA_KV_INT8, 1e-2, 16},
             {"int4", CLMHA_KV_INT4, 2e-1, 2}};
#define KINDS (sizeof kinds / sizeof kinds[0])

enum { N = 2 };

static clmha_kv_cache *cache_of(clmha_layer *layer, clmha_kv_dtype dt, size_t page_size) {
    clmha_kv_cache *c = NULL;
    clmha_kv_cache_options o = {.struct_size = sizeof o, .kv_dtype = dt,
                                .capacity = page_size ? 0 : 512, .page_size = page_size,
                                .num_pages = page_size ? N * 512 / page_size : 0};
    cr_assert_eq(clmha_kv_cache_create_with(&c, layer, N, &o), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(clmha_layer_context(layer)));
    return c;
}

// A prefill of @p prefill tokens then @p steps single-token steps (causal self-attention,
// rows from @p seed) through @p cache; every output row into @p out ((prefill + steps), N, E).
static void decode(clmha_layer *layer, clmha_kv_cache *cache, size_t e, size_t prefill,
                   size_t steps, uint64_t seed, float *out) {
    prng r = {seed};
    size_t total = prefill + steps;
    float *x = normal_floats(&r, total * N * e);
    for (size_t t0 = 0; t0 < total; t0 += t0 ? 1 : prefill) {
        size_t rows = t0 ? 1 : prefill;
        clmha_forward_args a = {.struct_size = sizeof a, .is_causal = true, .kv_cache = cache,
                                .query = {.ndim = 3, .shape = {rows, N, e},
                                          .data = x + t0 * N * e}};
        cr_assert_eq(clmha_layer_forward_host(layer, &a, out + t0 * N * e, rows * N * e, NULL,
                                              0),
                     CLMHA_SUCCESS, "%s", clmha_context_last_error(clmha_layer_context(layer)));
    }
    free(x);
}

static double rel_err(const float *got, const float *want, size_t count) {
    double err = 0, scale = 0;
    for (size_t i = 0; i < count; ++i) {
        err = fmax(err, fabs((double)got[i] - want[i]));
        scale = fmax(scale, fabs((double)want[i]));
    }
    return err / scale;
}

Test(kv_dtypes, accuracy_against_float32) {
    clmha_context *ctx = context_or_skip();
    static const struct {
        const char *name;
        size_t e, h, kvh;
        bool window;
        clmha_dtype dtype;
    } cases[] = {{"mha", 64, 2, 0, false, CLMHA_DTYPE_F32},
                 {"gqa", 128, 8, 2, false, CLMHA_DTYPE_F32},
                 {"window", 64, 4, 0, true, CLMHA_DTYPE_F32},
                 {"d64", 128, 2, 0, false, CLMHA_DTYPE_F32},
                 {"d48", 96, 2, 0, false, CLMHA_DTYPE_F32},
                 {"bf16", 64, 2, 1, false, CLMHA_DTYPE_BF16},
                 {"f16", 128, 2, 0, false, CLMHA_DTYPE_F16}};
    double worst[KINDS] = {0};
    size_t count_cases = sizeof cases / sizeof cases[0];
    case_stride stride = case_stride_get("kv_dtypes", count_cases);  // the driver lanes' share
    for (size_t i = 0; i < count_cases; ++i) {
        if (!case_stride_keeps(stride, i)) continue;
        rcase c = rcase_base(500 + i);
        c.e = cases[i].e, c.h = cases[i].h, c.kv_heads = cases[i].kvh, c.self_attn = true;
        if (cases[i].window) c.window = true, c.win_left = 50, c.win_right = 0;
        instance in;
        instance_make(&in, &c);
        in.desc.dtype = cases[i].dtype;
        clmha_layer *layer = instance_layer(ctx, &in);
        if (!layer) {  // a float16 layer where the device cannot run one
            cr_log_warn("%s: layer not made here (%s)", cases[i].name,
                        clmha_context_last_error(ctx));
            instance_free(&in);
            continue;
        }
        size_t prefill = 200, steps = 24, count = (prefill + steps) * N * c.e;
        float *f = alloc_floats(count), *q = alloc_floats(count), *qp = alloc_floats(count);
        clmha_kv_cache *cf = cache_of(layer, CLMHA_KV_FLOAT32, 0);
        decode(layer, cf, c.e, prefill, steps, 7 + i, f);
        for (size_t k = 0; k < KINDS; ++k) {
            clmha_kv_cache *ci = cache_of(layer, kinds[k].dt, 0);
            // Paged: pages of 8 (key blocks read from two pages) or of 32, in turns.
            size_t ps = (k + i) % 2 ? 8 : 32;
            clmha_kv_cache *cp = cache_of(layer, kinds[k].dt, ps);
            decode(layer, ci, c.e, prefill, steps, 7 + i, q);
            decode(layer, cp, c.e, prefill, steps, 7 + i, qp);
            double err = rel_err(q, f, count);
            if (cases[i].dtype == CLMHA_DTYPE_F32) worst[k] = fmax(worst[k], err);
            double ulp = cases[i].dtype == CLMHA_DTYPE_BF16  ? ldexp(1, -7)
                         : cases[i].dtype == CLMHA_DTYPE_F16 ? ldexp(1, -10)
                                                             : 0;
            cr_expect_leq(err, kinds[k].rel + ulp, "%s: %s against float32: %.3g",
                          cases[i].name, kinds[k].name, err);
            cr_expect(memcmp(q, qp, count * sizeof *q) == 0,
                      "%s: the paged %s cache (pages of %zu) differs", cases[i].name,
                      kinds[k].name, ps);
            fprintf(stderr, "kv_dtypes %-6s (E %zu, H %zu, KVH %zu, D %zu) %-4s: max |%s - f32| "
                    "/ max |f32| = %.2e over %zu rows; paged (%zu) bit-identical\n",
                    cases[i].name, c.e, c.h, cases[i].kvh ? cases[i].kvh : c.h, c.e / c.h,
                    kinds[k].name, kinds[k].name, err, (prefill + steps) * N, ps);
            clmha_kv_cache_release(ci), clmha_kv_cache_release(cp);
        }
        clmha_kv_cache_release(cf);
        clmha_layer_release(layer);
        free(f), free(q), free(qp);
        instance_free(&in);
    }
    for (size_t k = 0; k < KINDS; ++k)
        fprintf(stderr, "kv_dtypes %s: worst on float32 layers %.2e (contract %.1e)\n",
                kinds[k].name, worst[k],
                kinds[k].rel);
    clmha_context_release(ctx);
}

// Greedy generation: token t's embedding through the layer (and the cache), logits the output
// against every embedding, the next token their argmax.
static void generate(clmha_layer *layer, clmha_kv_cache *cache, const float *emb, size_t vocab,
                     size_t e, size_t steps, int *tokens) {
    float *y = alloc_floats(e);
    int tok = 1;
    for (size_t t = 0; t < steps; ++t) {
        clmha_forward_args a = {.struct_size = sizeof a, .is_causal = true, .kv_cache = cache,
                                .query = {.ndim = 2, .shape = {1, e}, .data = emb + tok * e}};
        cr_assert_eq(clmha_layer_forward_host(layer, &a, y, e, NULL, 0), CLMHA_SUCCESS);
        double best = -INFINITY;
        for (size_t v = 0; v < vocab; ++v) {
            double s = 0;
            for (size_t c = 0; c < e; ++c) s += (double)y[c] * emb[v * e + c];
            if (s > best) best = s, tok = (int)v;
        }
        tokens[t] = tok;
    }
    free(y);
}

Test(kv_dtypes, greedy_generation) {
    clmha_context *ctx = context_or_skip();
    enum { STEPS = 200, VOCAB = 64 };
    rcase c = rcase_base(99);
    c.e = 64, c.h = 4, c.self_attn = true;
    instance in;
    instance_make(&in, &c);
    clmha_layer *layer = instance_layer(ctx, &in);
    prng r = {1234};
    float *emb = normal_floats(&r, VOCAB * c.e);
    int tf[STEPS], ti[STEPS];
    clmha_kv_cache *cf = NULL;
    clmha_kv_cache_options o = {.struct_size = sizeof o, .capacity = STEPS};
    cr_assert_eq(clmha_kv_cache_create_with(&cf, layer, 1, &o), CLMHA_SUCCESS);
    generate(layer, cf, emb, VOCAB, c.e, STEPS, tf);
    size_t distinct = 0;
    bool seen[VOCAB] = {false};
    for (size_t t = 0; t < STEPS; ++t) distinct += !seen[tf[t]], seen[tf[t]] = true;
    for (size_t k = 0; k < KINDS; ++k) {
        clmha_kv_cache *ci = NULL;
        o.kv_dtype = kinds[k].dt;
        cr_assert_eq(clmha_kv_cache_create_with(&ci, layer, 1, &o), CLMHA_SUCCESS);
        generate(layer, ci, emb, VOCAB, c.e, STEPS, ti);
        size_t same = 0, first = STEPS;
        for (size_t t = 0; t < STEPS; ++t) {
            same += tf[t] == ti[t];
            if (tf[t] != ti[t] && first == STEPS) first = t;
        }
        fprintf(stderr, "kv_dtypes %s greedy generation (vocab %d, E %zu, H %zu, %d tokens, "
                "%zu distinct in the float32 run): %zu of %d tokens identical, first difference "
                "at %zu (%d: none)\n", kinds[k].name, VOCAB, c.e, c.h, STEPS, distinct, same,
                STEPS, first, STEPS);
        cr_expect_geq(first, kinds[k].first, "the %s cache's generation departs at token %zu",
                      kinds[k].name, first);
        clmha_kv_cache_release(ci);
    }
    clmha_kv_cache_release(cf);
    clmha_layer_release(layer);
    free(emb);
    instance_free(&in);
    clmha_context_release(ctx);
}

Test(kv_dtypes, refusals) {
    clmha_context *ctx = context_or_skip();
    rcase c = rcase_base(3);
    c.e = 6, c.h = 2;  // D 3: int4 keeps two dimensions a byte
    instance in;
    instance_make(&in, &c);
    clmha_layer *layer = instance_layer(ctx, &in);
    clmha_kv_cache *cache = NULL;
    clmha_kv_cache_options o = {.struct_size = sizeof o, .capacity = 8,
                                .kv_dtype = (clmha_kv_dtype)7};
    cr_expect_eq(clmha_kv_cache_create_with(&cache, layer, 2, &o), CLMHA_INVALID_ARGUMENT);
    cr_expect_null(cache);
    fprintf(stderr, "kv_dtypes refuses: %s\n", clmha_context_last_error(ctx));
    o.kv_dtype = CLMHA_KV_INT4;
    cr_expect_eq(clmha_kv_cache_create_with(&cache, layer, 2, &o), CLMHA_UNSUPPORTED);
    cr_expect_null(cache);
    fprintf(stderr, "kv_dtypes refuses: %s\n", clmha_context_last_error(ctx));
    o.kv_dtype = CLMHA_KV_FLOAT16;  // an odd D is fine for the 16-bit kinds
    cr_expect_eq(clmha_kv_cache_create_with(&cache, layer, 2, &o), CLMHA_SUCCESS);
    clmha_kv_cache_release(cache);
    clmha_layer_release(layer);
    instance_free(&in);
    clmha_context_release(ctx);
}
