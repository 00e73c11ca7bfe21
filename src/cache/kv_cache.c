// The KV cache object (include/clmha.h, "Incremental decoding") and the plan of one call's
// append (kv_cache.h). The keys and values themselves are written and read by the decode core
// (src/cores/decode.c, cl/cores/decode.cl).
#include "cache/kv_cache.h"

#include "base/checked.h"
#include "context/context.h"
#include "device/held.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Each buffer's floats: batch · kv_heads · stride · D, checked for overflow and against the
// device's largest allocation (@p stride: the capacity rounded up to the decode core's key
// blocks).
static clmha_status cache_floats(const clmha_context *ctx, size_t batch, size_t heads,
                                 size_t capacity, size_t stride, size_t d, size_t *floats) {
    size_t x, bytes;
    *floats = 0;
    if (!clmha__mul3(batch, heads, stride, &x) || !clmha__mul(x, d, floats) ||
        !clmha__mul(*floats, sizeof(float), &bytes))
        return clmha__fail(ctx, CLMHA_SIZE_OVERFLOW,
                           "a KV cache of batch %zu, capacity %zu, %zu heads of %zu floats "
                           "overflows size_t",
                           batch, capacity, heads, d);
    if (bytes > clmha__max_alloc(ctx))
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY,
                           "a KV cache of batch %zu, capacity %zu needs two buffers of %zu bytes; "
                           "the device's largest allocation is %llu bytes",
                           batch, capacity, bytes, (unsigned long long)clmha__max_alloc(ctx));
    return CLMHA_SUCCESS;
}

// A new cache of @p kv_heads heads of @p head_dim floats on @p ctx, for @p layer (NULL: for
// attention as a function).
static clmha_status cache_make(clmha_kv_cache **out, clmha_context *ctx,
                               const clmha_layer *layer, size_t batch, size_t kv_heads,
                               size_t head_dim, size_t capacity) {
    if (!batch || !capacity)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "a KV cache needs a batch and a capacity of at least 1 (batch %zu, "
                           "capacity %zu)",
                           batch, capacity);
    if (capacity > UINT32_MAX - 1)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "capacity %zu: a KV cache holds fewer than 2^32 tokens per sequence",
                           capacity);
    // The decode kernels read the keys in blocks of 16 positions (cl/cores/decode.cl), the last
    // one whole.
    size_t floats = 0, stride = (capacity + 15) / 16 * 16;
    clmha_status st = cache_floats(ctx, batch, kv_heads, capacity, stride, head_dim, &floats);
    if (st) return st;
    clmha_kv_cache *c = calloc(1, sizeof *c);
    size_t *len = calloc(batch, sizeof *len);
    if (!c || !len) {
        free(c);
        free(len);
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    }
    *c = (clmha_kv_cache){.ctx = ctx, .layer = layer, .batch = batch, .capacity = capacity,
                          .kv_heads = kv_heads, .head_dim = head_dim, .stride = stride,
                          .len = len};
    clmha_context_retain(ctx);
    cl_int err;
    c->k = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE, floats * sizeof(float), NULL, &err);
    clmha__held_new(CLMHA__HELD_MEM, c->k);
    if (err == CL_SUCCESS) {
        c->v = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE, floats * sizeof(float), NULL, &err);
        clmha__held_new(CLMHA__HELD_MEM, c->v);
    }
    const char *what = "clCreateBuffer(KV cache)";
    if (err != CL_SUCCESS) {
        st = clmha__cl_fail(ctx, err, what);
        clmha_kv_cache_release(c);
        return st;
    }
    clmha__count(ctx, 0, 2);
    *out = c;
    return CLMHA_SUCCESS;
}

clmha_status clmha_kv_cache_create(clmha_kv_cache **out, clmha_layer *layer, size_t batch,
                                   size_t capacity) {
    if (out) *out = NULL;
    if (!out || !layer)
        return clmha__fail(layer ? layer->ctx : NULL, CLMHA_INVALID_ARGUMENT,
                           "%s is NULL", out ? "layer" : "out");
    if (layer->desc.dtype == CLMHA_DTYPE_F64)
        return clmha__fail(layer->ctx, CLMHA_UNSUPPORTED,
                           "a float64 layer (CLMHA_DTYPE_F64) has no KV cache yet");
    return cache_make(out, layer->ctx, layer, batch, layer->kvh, layer->d, capacity);
}

clmha_status clmha_kv_cache_create_for(clmha_kv_cache **out, clmha_context *ctx, size_t batch,
                                       size_t kv_heads, size_t head_dim, size_t capacity) {
    if (out) *out = NULL;
    if (!out || !ctx)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "%s is NULL", out ? "ctx" : "out");
    if (!kv_heads || !head_dim)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "a KV cache needs key/value heads and a head dimension of at least 1 "
                           "(kv_heads %zu, head_dim %zu)",
                           kv_heads, head_dim);
    return cache_make(out, ctx, NULL, batch, kv_heads, head_dim, capacity);
}

void clmha_kv_cache_release(clmha_kv_cache *cache) {
    if (!cache) return;
    clmha__release_mem(cache->k);
    clmha__release_mem(cache->v);
    free(cache->len);
    clmha_context *ctx = cache->ctx;
    free(cache);
    clmha_context_release(ctx);
}

clmha_status clmha_kv_cache_reset(clmha_kv_cache *cache) {
    if (!cache) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "cache is NULL");
    memset(cache->len, 0, cache->batch * sizeof *cache->len);
    return CLMHA_SUCCESS;
}

static clmha_status check_count(const clmha_kv_cache *cache, const void *lengths, size_t count) {
    if (!cache) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "cache is NULL");
    if (!lengths) return clmha__fail(cache->ctx, CLMHA_INVALID_ARGUMENT, "lengths is NULL");
    if (count != cache->batch)
        return clmha__fail(cache->ctx, CLMHA_SHAPE_MISMATCH,
                           "count is %zu but the cache holds %zu sequences", count, cache->batch);
    return CLMHA_SUCCESS;
}

clmha_status clmha_kv_cache_truncate(clmha_kv_cache *cache, const size_t *lengths, size_t count) {
    clmha_status st = check_count(cache, lengths, count);
    if (st) return st;
    for (size_t n = 0; n < count; ++n)
        if (lengths[n] > cache->len[n])
            return clmha__fail(cache->ctx, CLMHA_INVALID_ARGUMENT,
                               "truncate: sequence %zu holds %zu tokens, cannot grow to %zu",
                               n, cache->len[n], lengths[n]);
    memcpy(cache->len, lengths, count * sizeof *lengths);
    return CLMHA_SUCCESS;
}

clmha_status clmha_kv_cache_lengths(const clmha_kv_cache *cache, size_t *lengths, size_t count) {
    clmha_status st = check_count(cache, lengths, count);
    if (st) return st;
    memcpy(lengths, cache->len, count * sizeof *lengths);
    return CLMHA_SUCCESS;
}

clmha_status clmha_kv_cache_size(const clmha_kv_cache *cache, size_t *batch, size_t *capacity) {
    if (!cache) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "cache is NULL");
    if (batch) *batch = cache->batch;
    if (capacity) *capacity = cache->capacity;
    return CLMHA_SUCCESS;
}

// ---- one call's plan ----------------------------------------------------------------------------

clmha_status clmha__kv_plan_make(clmha_kv_cache *cache, const clmha_layer *layer, bool function,
                                 size_t n_batch, size_t s, const size_t *appended,
                                 clmha__kv_plan *plan) {
    *plan = (clmha__kv_plan){.cache = cache};
    clmha_context *ctx = layer->ctx;
    if (!function && cache->layer != layer)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           cache->layer ? "kv_cache was made for another layer "
                                          "(clmha_kv_cache_create())"
                                        : "kv_cache was made for attention as a function "
                                          "(clmha_kv_cache_create_for()), not for a layer");
    if (function && cache->layer)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "kv_cache was made for a layer (clmha_kv_cache_create()): attention "
                           "as a function takes one of clmha_kv_cache_create_for()");
    if (function && (cache->ctx != ctx || cache->kv_heads != layer->kvh ||
                     cache->head_dim != layer->d))
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                           "kv_cache holds %zu key/value heads of %zu floats%s; the call's key "
                           "and value have %zu of %zu",
                           cache->kv_heads, cache->head_dim,
                           cache->ctx != ctx ? " on another context" : "", layer->kvh, layer->d);
    if (n_batch != cache->batch)
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                           "the call's batch is %zu but kv_cache holds %zu sequences", n_batch,
                           cache->batch);
    size_t *lens = malloc(2 * n_batch * sizeof *lens);
    cl_uint *pairs = malloc(2 * n_batch * sizeof *pairs);
    if (!lens || !pairs) {
        free(lens);
        free(pairs);
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    }
    plan->old_len = lens;
    plan->new_len = lens + n_batch;
    clmha_status st = CLMHA_SUCCESS;
    for (size_t n = 0; n < n_batch && !st; ++n) {
        size_t add = appended ? appended[n] : s;
        size_t old = cache->len[n];
        if (add > s)
            st = clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                             "kv_append[%zu] is %zu but the call has %zu new key/value tokens", n,
                             add, s);
        else if (add > cache->capacity - old)
            st = clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                             "kv_cache capacity exceeded: sequence %zu holds %zu of %zu tokens "
                             "and the call appends %zu (make a larger cache, or truncate)",
                             n, old, cache->capacity, add);
        plan->old_len[n] = old;
        plan->new_len[n] = old + add;
        pairs[2 * n] = (cl_uint)old;
        pairs[2 * n + 1] = (cl_uint)(old + add);
        if (old + add > plan->max_new) plan->max_new = old + add;
    }
    if (!st) {
        cl_int err;
        plan->lens = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR,
                                    2 * n_batch * sizeof *pairs, pairs, &err);
        clmha__held_new(CLMHA__HELD_MEM, plan->lens);
        if (err != CL_SUCCESS) st = clmha__cl_fail(ctx, err, "clCreateBuffer(KV cache lengths)");
    }
    free(pairs);
    if (st) clmha__kv_plan_release(plan);
    return st;
}

void clmha__kv_plan_commit(clmha__kv_plan *plan) {
    memcpy(plan->cache->len, plan->new_len, plan->cache->batch * sizeof *plan->new_len);
}

void clmha__kv_plan_release(clmha__kv_plan *plan) {
    clmha__release_mem(plan->lens);
    free(plan->old_len);
    *plan = (clmha__kv_plan){0};
}
