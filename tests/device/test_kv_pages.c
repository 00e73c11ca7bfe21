// Paged KV caches (clmha_kv_cache_create_with(), page_size): the same calls through a paged
// cache and a contiguous one give bit-identical outputs (the decode core reads the pages in
// place through a page table, with the same arithmetic); clmha_kv_cache_fork() shares a prompt's
// pages and copies a shared, partly filled page only when a sequence appends into it (the free
// pages say how many were taken); a pool that runs out refuses the call and changes nothing,
// and truncating gives pages back; the options' refusals. Layers: float32 with grouped-query
// attention, a sliding window, bfloat16.
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clmha.h"
#include "random_case.h"
#include "support.h"

enum { N = 3, MAX_CHUNK = 24 };

typedef struct fixture {
    clmha_context *ctx;
    instance in;
    clmha_layer *layer;
    size_t e;
} fixture;

static void fixture_make(fixture *f, clmha_dtype dtype, bool window, uint64_t seed) {
    f->ctx = context_or_skip();
    rcase c = rcase_base(seed);
    c.e = 32, c.h = 4, c.kv_heads = 2, c.n = N, c.l = c.s = MAX_CHUNK, c.self_attn = true;
    c.need_weights = false, c.is_causal = true;
    if (window) c.window = true, c.win_left = 9, c.win_right = 0;
    instance_make(&f->in, &c);
    f->in.desc.dtype = dtype;
    f->layer = instance_layer(f->ctx, &f->in);
    f->e = c.e;
}

static void fixture_free(fixture *f) {
    clmha_layer_release(f->layer);
    instance_free(&f->in);
    clmha_context_release(f->ctx);
}

static clmha_kv_cache *paged(fixture *f, size_t page_size, size_t pages) {
    clmha_kv_cache *cache = NULL;
    clmha_kv_cache_options o = {.struct_size = sizeof o, .page_size = page_size,
                                .num_pages = pages};
    cr_assert_eq(clmha_kv_cache_create_with(&cache, f->layer, N, &o), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(f->ctx));
    return cache;
}

static clmha_kv_cache *contiguous(fixture *f, size_t capacity) {
    clmha_kv_cache *cache = NULL;
    cr_assert_eq(clmha_kv_cache_create(&cache, f->layer, N, capacity), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(f->ctx));
    return cache;
}

// One causal self-attention call of @p rows query rows per sequence (rows drawn from @p seed),
// sequence n appending counts[n] of them; the output (rows, N, E) into @p out. Returns the
// status.
static clmha_status step(fixture *f, clmha_kv_cache *cache, size_t rows, const size_t *counts,
                         uint64_t seed, float *out) {
    prng r = {seed};
    float *q = normal_floats(&r, rows * N * f->e);
    clmha_forward_args a = {.struct_size = sizeof a, .is_causal = true, .kv_cache = cache,
                            .kv_append = counts,
                            .query = {.ndim = 3, .shape = {rows, N, f->e}, .data = q}};
    clmha_status st = clmha_layer_forward_host(f->layer, &a, out, rows * N * f->e, NULL, 0);
    free(q);
    return st;
}

// Runs the same calls through @p a and @p b: chunks of 1 … MAX_CHUNK rows with ragged counts;
// asserts every output bit-identical. Returns the calls made.
static size_t same_calls(fixture *f, clmha_kv_cache *a, clmha_kv_cache *b, size_t calls,
                         uint64_t seed) {
    float *oa = alloc_floats(MAX_CHUNK * N * f->e), *ob = alloc_floats(MAX_CHUNK * N * f->e);
    prng r = {seed};
    for (size_t c = 0; c < calls; ++c) {
        size_t rows = prng_range(&r, 1, MAX_CHUNK), counts[N];
        for (size_t n = 0; n < N; ++n) counts[n] = prng_range(&r, 0, rows);
        cr_assert_eq(step(f, a, rows, counts, seed + c, oa), CLMHA_SUCCESS, "call %zu: %s", c,
                     clmha_context_last_error(f->ctx));
        cr_assert_eq(step(f, b, rows, counts, seed + c, ob), CLMHA_SUCCESS, "call %zu: %s", c,
                     clmha_context_last_error(f->ctx));
        cr_assert(memcmp(oa, ob, rows * N * f->e * sizeof *oa) == 0,
                  "call %zu (%zu rows): the outputs differ (max |diff| %.3g)", c, rows,
                  max_abs_diff(oa, ob, rows * N * f->e));
    }
    size_t la[N], lb[N];
    clmha_kv_cache_lengths(a, la, N), clmha_kv_cache_lengths(b, lb, N);
    cr_assert(memcmp(la, lb, sizeof la) == 0);
    free(oa), free(ob);
    return calls;
}

Test(kv_pages, bit_identical_to_contiguous) {
    static const struct {
        clmha_dtype dtype;
        bool window;
        size_t page_size;
    } cases[] = {{CLMHA_DTYPE_F32, false, 16}, {CLMHA_DTYPE_F32, true, 32},
                 {CLMHA_DTYPE_BF16, false, 64}, {CLMHA_DTYPE_F32, false, 8},
                 {CLMHA_DTYPE_F32, true, 8}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; ++i) {
        fixture f;
        fixture_make(&f, cases[i].dtype, cases[i].window, 40 + i);
        clmha_kv_cache *a = contiguous(&f, 200);
        clmha_kv_cache *b = paged(&f, cases[i].page_size, 1024 / cases[i].page_size);
        size_t calls = same_calls(&f, a, b, 12, 100 * i);
        size_t lens[N], pages, free_pages, ps;
        clmha_kv_cache_lengths(b, lens, N);
        clmha_kv_cache_pages(b, &ps, &pages, &free_pages);
        size_t held = 0;
        for (size_t n = 0; n < N; ++n) held += (lens[n] + ps - 1) / ps;
        cr_expect_eq(pages - free_pages, held, "pages held %zu, the lengths need %zu",
                     pages - free_pages, held);
        fprintf(stderr, "kv_pages dtype %d window %d page %zu: %zu calls bit-identical; "
                "lengths %zu %zu %zu in %zu pages\n", (int)cases[i].dtype, cases[i].window,
                ps, calls, lens[0], lens[1], lens[2], held);
        clmha_kv_cache_release(a), clmha_kv_cache_release(b);
        fixture_free(&f);
    }
}

// A prompt in sequence 0, forked to 1 and 2; then steps that append different tokens to each.
// Against a contiguous cache where every sequence got the prompt itself.
Test(kv_pages, fork_and_copy_on_write) {
    fixture f;
    fixture_make(&f, CLMHA_DTYPE_F32, false, 77);
    size_t ps = 16, pool = 48, prompt = 21;  // two pages, the second partly filled
    clmha_kv_cache *a = contiguous(&f, 200), *b = paged(&f, ps, pool);
    float *oa = alloc_floats(MAX_CHUNK * N * f.e), *ob = alloc_floats(MAX_CHUNK * N * f.e);
    // The prompt: the same rows for every sequence (step() draws (rows, N, E) from one seed;
    // the contiguous cache appends it to all three, the paged one to sequence 0 only).
    prng r = {5};
    float *p1 = normal_floats(&r, prompt * f.e), *q = alloc_floats(prompt * N * f.e);
    for (size_t t = 0; t < prompt; ++t)
        for (size_t n = 0; n < N; ++n) memcpy(q + (t * N + n) * f.e, p1 + t * f.e, f.e * 4);
    const size_t all[N] = {prompt, prompt, prompt}, first[N] = {prompt, 0, 0};
    clmha_forward_args args = {.struct_size = sizeof args, .is_causal = true,
                               .query = {.ndim = 3, .shape = {prompt, N, f.e}, .data = q}};
    float *ya = alloc_floats(prompt * N * f.e), *yb = alloc_floats(prompt * N * f.e);
    args.kv_cache = a, args.kv_append = all;
    cr_assert_eq(clmha_layer_forward_host(f.layer, &args, ya, prompt * N * f.e, NULL, 0),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(f.ctx));
    args.kv_cache = b, args.kv_append = first;
    cr_assert_eq(clmha_layer_forward_host(f.layer, &args, yb, prompt * N * f.e, NULL, 0),
                 CLMHA_SUCCESS, "%s", clmha_context_last_error(f.ctx));
    size_t free0, free1, free2;
    clmha_kv_cache_pages(b, NULL, NULL, &free0);
    cr_assert_eq(clmha_kv_cache_fork(b, 0, 1), CLMHA_SUCCESS);
    cr_assert_eq(clmha_kv_cache_fork(b, 0, 2), CLMHA_SUCCESS);
    clmha_kv_cache_pages(b, NULL, NULL, &free1);
    cr_expect_eq(free0, pool - 2, "the prompt holds 2 pages; %zu free", free0);
    cr_expect_eq(free1, free0, "fork takes no page (%zu free, %zu before)", free1, free0);
    // One token each: sequences 0 and 1 copy the shared second page, 2 then holds it alone.
    const size_t one[N] = {1, 1, 1};
    cr_assert_eq(step(&f, a, 1, one, 9, oa), CLMHA_SUCCESS);
    cr_assert_eq(step(&f, b, 1, one, 9, ob), CLMHA_SUCCESS);
    cr_assert(memcmp(oa, ob, N * f.e * sizeof *oa) == 0, "the first step differs");
    clmha_kv_cache_pages(b, NULL, NULL, &free2);
    cr_expect_eq(free2, free1 - 2, "two copies on write: %zu free, %zu before", free2, free1);
    size_t calls = same_calls(&f, a, b, 6, 900);
    fprintf(stderr, "kv_pages fork: prompt %zu in 2 pages shared by 3 sequences; 2 copies on "
            "write; %zu more calls bit-identical\n", prompt, calls);
    // A fork onto a sequence with pages gives them back; fork of a contiguous cache: refused.
    size_t before, after, lens[N];
    clmha_kv_cache_pages(b, NULL, NULL, &before);
    clmha_kv_cache_lengths(b, lens, N);
    cr_assert_eq(clmha_kv_cache_fork(b, 2, 1), CLMHA_SUCCESS);
    clmha_kv_cache_pages(b, NULL, NULL, &after);
    size_t own = (lens[1] + ps - 1) / ps;
    cr_expect_geq(after, before, "forking onto sequence 1 freed no page (%zu, %zu)", after,
                  before);
    cr_expect_leq(after, before + own);
    cr_expect_eq(clmha_kv_cache_fork(a, 0, 1), CLMHA_UNSUPPORTED);
    cr_expect_eq(clmha_kv_cache_fork(b, 0, N), CLMHA_INVALID_ARGUMENT);
    free(p1), free(q), free(ya), free(yb), free(oa), free(ob);
    clmha_kv_cache_release(a), clmha_kv_cache_release(b);
    fixture_free(&f);
}

Test(kv_pages, exhausted_pool_changes_nothing) {
    fixture f;
    fixture_make(&f, CLMHA_DTYPE_F32, false, 91);
    clmha_kv_cache *b = paged(&f, 16, 4), *a = contiguous(&f, 64);
    float *oa = alloc_floats(MAX_CHUNK * N * f.e), *ob = alloc_floats(MAX_CHUNK * N * f.e);
    const size_t fill[N] = {20, 20, 0}, more[N] = {0, 13, 0}, again[N] = {0, 0, 24};
    cr_assert_eq(step(&f, b, 20, fill, 1, ob), CLMHA_SUCCESS);  // 2 + 2 pages: the pool
    cr_assert_eq(step(&f, a, 20, fill, 1, oa), CLMHA_SUCCESS);
    size_t lens[N], lens2[N], free0, free1;
    clmha_kv_cache_lengths(b, lens, N);
    clmha_kv_cache_pages(b, NULL, NULL, &free0);
    cr_assert_eq(free0, 0);
    clmha_status st = step(&f, b, 13, more, 2, ob);  // sequence 1 needs a page: none is free
    cr_expect_eq(st, CLMHA_OUT_OF_MEMORY, "got %s", clmha_status_string(st));
    fprintf(stderr, "kv_pages exhausted: %s\n", clmha_context_last_error(f.ctx));
    clmha_kv_cache_lengths(b, lens2, N);
    clmha_kv_cache_pages(b, NULL, NULL, &free1);
    cr_expect(memcmp(lens, lens2, sizeof lens) == 0 && free1 == free0, "the refusal changed "
              "the cache");
    // Sequence 0 truncated to 10 tokens gives a page back: the call runs, as on a contiguous
    // cache truncated alike.
    const size_t cut[N] = {10, 20, 0};
    cr_assert_eq(clmha_kv_cache_truncate(b, cut, N), CLMHA_SUCCESS);
    cr_assert_eq(clmha_kv_cache_truncate(a, cut, N), CLMHA_SUCCESS);
    clmha_kv_cache_pages(b, NULL, NULL, &free1);
    cr_expect_eq(free1, 1, "truncating to 10 tokens freed %zu pages", free1);
    cr_assert_eq(step(&f, b, 13, more, 2, ob), CLMHA_SUCCESS, "%s",
                 clmha_context_last_error(f.ctx));
    cr_assert_eq(step(&f, a, 13, more, 2, oa), CLMHA_SUCCESS);
    cr_expect(memcmp(oa, ob, 13 * N * f.e * sizeof *oa) == 0, "after the truncation");
    cr_expect_eq(step(&f, b, 24, again, 3, ob), CLMHA_OUT_OF_MEMORY);  // 2 more pages: no
    cr_assert_eq(clmha_kv_cache_reset(b), CLMHA_SUCCESS);
    clmha_kv_cache_pages(b, NULL, NULL, &free1);
    cr_expect_eq(free1, 4, "reset gave %zu pages back", free1);
    free(oa), free(ob);
    clmha_kv_cache_release(a), clmha_kv_cache_release(b);
    fixture_free(&f);
}

Test(kv_pages, option_refusals) {
    fixture f;
    fixture_make(&f, CLMHA_DTYPE_F32, false, 3);
    static const struct {
        size_t capacity, page_size, num_pages;
    } bad[] = {{0, 4, 4}, {0, 24, 4}, {64, 16, 4}, {0, 16, 0}, {0, 0, 4}, {0, 0, 0}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) {
        clmha_kv_cache *c = (clmha_kv_cache *)1;
        clmha_kv_cache_options o = {.struct_size = sizeof o, .capacity = bad[i].capacity,
                                    .page_size = bad[i].page_size,
                                    .num_pages = bad[i].num_pages};
        cr_expect_eq(clmha_kv_cache_create_with(&c, f.layer, N, &o), CLMHA_INVALID_ARGUMENT,
                     "case %zu", i);
        cr_expect_null(c);
        fprintf(stderr, "kv_pages refuses: %s\n", clmha_context_last_error(f.ctx));
    }
    fixture_free(&f);
}
