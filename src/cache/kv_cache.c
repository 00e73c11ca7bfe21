// The KV cache object (include/clmha.h, "Incremental decoding") and the plan of one call's
// append (kv_cache.h). The keys and values themselves are written and read by the decode core
// (src/cores/decode.c, cl/cores/decode.cl).
#include "cache/kv_cache.h"

#include "base/checked.h"
#include "base/half.h"
#include "base/struct_in.h"
#include "context/context.h"
#include "device/held.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Each buffer's elements: pages · kv_heads · page_size · D, checked for overflow and, at the
// bytes an element of @p kv_dtype takes (@p rs, the layer's, for float elements), the key and
// the value buffer against the device's largest allocation and, together, its global memory.
static clmha_status cache_floats(const clmha_context *ctx, size_t pages, size_t heads,
                                 size_t page_size, size_t d, size_t rs, clmha_kv_dtype kv_dtype,
                                 size_t *floats) {
    size_t x, bytes;
    *floats = 0;
    if (!clmha__mul3(pages, heads, page_size, &x) || !clmha__mul(x, d, floats) ||
        !clmha__mul(*floats, rs, &bytes))
        return clmha__fail(ctx, CLMHA_SIZE_OVERFLOW,
                           "a KV cache of %zu pages of %zu tokens, %zu heads of %zu floats "
                           "overflows size_t",
                           pages, page_size, heads, d);
    bytes = kv_dtype == CLMHA_KV_INT8                                    ? *floats
            : kv_dtype == CLMHA_KV_INT4                                  ? (*floats + 1) / 2
            : kv_dtype == CLMHA_KV_FLOAT16 || kv_dtype == CLMHA_KV_BFLOAT16 ? 2 * *floats
                                                                         : bytes;
    if (bytes > clmha__max_alloc(ctx))
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY,
                           "a KV cache of %zu pages of %zu tokens needs two buffers of %zu "
                           "bytes; the device's largest allocation is %llu bytes",
                           pages, page_size, bytes, (unsigned long long)clmha__max_alloc(ctx));
    if (2.0 * (double)bytes > (double)clmha__global_mem(ctx))
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY,
                           "a KV cache of %zu pages of %zu tokens needs two buffers of %zu "
                           "bytes, more together than the device's global memory (%llu bytes)",
                           pages, page_size, bytes, (unsigned long long)clmha__global_mem(ctx));
    return CLMHA_SUCCESS;
}

// The options of a new cache checked, into page size and pages (contiguous: the capacity rounded
// up to the decode kernels' key blocks of 16, one page per sequence).
static clmha_status check_options(clmha_context *ctx, size_t batch,
                                  const clmha_kv_cache_options *o, size_t *page_size,
                                  size_t *pages) {
    if (!batch)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "a KV cache needs a batch of at least 1");
    if ((unsigned)o->kv_dtype > CLMHA_KV_INT4)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "kv_dtype %d: CLMHA_KV_FLOAT32 (0), CLMHA_KV_INT8 (1), "
                           "CLMHA_KV_FLOAT16 (2), CLMHA_KV_BFLOAT16 (3) or CLMHA_KV_INT4 (4)",
                           (int)o->kv_dtype);
    if (!o->page_size) {
        if (!o->capacity || o->num_pages)
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                               o->num_pages ? "num_pages is for a paged cache: set page_size too"
                                            : "a KV cache needs a capacity of at least 1");
        if (o->capacity > UINT32_MAX)  // the lengths the kernels read are 32-bit
            return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                               "capacity %zu: a KV cache holds fewer than 2^32 tokens per "
                               "sequence", o->capacity);
        *page_size = (o->capacity + 15) / 16 * 16;
        *pages = batch;
        return CLMHA_SUCCESS;
    }
    if (o->page_size < 8 || (o->page_size & (o->page_size - 1)) || o->page_size > (1u << 30))
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "page_size %zu: a page holds a power of two of tokens from 8 to 2^30",
                           o->page_size);
    if (o->capacity)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "capacity %zu with page_size: a paged cache's capacity is its pool "
                           "(num_pages * page_size); leave capacity 0", o->capacity);
    if (!o->num_pages || o->num_pages > UINT32_MAX / o->page_size)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "num_pages %zu: a paged cache needs at least one page, and fewer than "
                           "2^32 tokens in all", o->num_pages);
    *page_size = o->page_size;
    *pages = o->num_pages;
    return CLMHA_SUCCESS;
}

// A paged cache's bookkeeping: an empty table, no page held, every page free.
static bool pages_make(clmha_kv_cache *c) {
    size_t entries;
    if (!clmha__mul(c->batch, c->num_pages, &entries)) return false;
    c->table = calloc(entries ? entries : 1, sizeof *c->table);
    c->refs = calloc(c->num_pages, sizeof *c->refs);
    c->free_pages = malloc(c->num_pages * sizeof *c->free_pages);
    if (!c->table || !c->refs || !c->free_pages) return false;
    for (size_t p = 0; p < c->num_pages; ++p)  // taken from the end: page 0 first
        c->free_pages[p] = (cl_uint)(c->num_pages - 1 - p);
    c->free_count = c->num_pages;
    return true;
}

// An int4 cache's dimensions per scale: 32 where they divide D, else the largest power of two
// that does (D 48: 16); 0 for an odd D, which int4 refuses (two dimensions a byte).
static size_t int4_group(size_t d) {
    size_t g = 32;
    while (g > 1 && d % g) g /= 2;
    return g > 1 ? g : 0;
}

// The cache's element bytes and scales from its kv_dtype.
static void set_elements(clmha_kv_cache *c) {
    size_t d = c->head_dim;
    switch (c->kv_dtype) {
    case CLMHA_KV_INT8: c->row_bytes = d, c->groups = 1, c->group = d; break;
    case CLMHA_KV_FLOAT16:
    case CLMHA_KV_BFLOAT16: c->row_bytes = 2 * d; break;
    case CLMHA_KV_INT4:
        c->group = int4_group(d), c->row_bytes = d / 2, c->groups = d / c->group;
        break;
    default: c->row_bytes = c->rs * d; break;
    }
}

// A new cache of @p kv_heads heads of @p head_dim elements on @p ctx, for @p layer (NULL: for
// attention as a function, in float32), as @p o says (checked).
static clmha_status cache_make(clmha_kv_cache **out, clmha_context *ctx,
                               const clmha_layer *layer, size_t batch, size_t kv_heads,
                               size_t head_dim, const clmha_kv_cache_options *o) {
    size_t page_size = 0, pages = 0, floats = 0;
    size_t rs = layer ? layer->rs : o->dtype == CLMHA_DTYPE_F64 ? sizeof(double) : sizeof(float);
    clmha_status st;
    if ((st = check_options(ctx, batch, o, &page_size, &pages)) ||
        (st = cache_floats(ctx, pages, kv_heads, page_size, head_dim, rs, o->kv_dtype,
                           &floats)))
        return st;
    if (o->kv_dtype == CLMHA_KV_INT4 && !int4_group(head_dim))
        return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                           "an int4 KV cache needs an even head_dim (two dimensions a byte), "
                           "not %zu", head_dim);
    clmha_kv_cache *c = calloc(1, sizeof *c);
    size_t *len = calloc(batch, sizeof *len);
    if (!c || !len) {
        free(c);
        free(len);
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    }
    bool paged = o->page_size != 0;
    *c = (clmha_kv_cache){.ctx = ctx, .layer = layer, .batch = batch,
                          .capacity = paged ? pages * page_size : o->capacity,
                          .kv_heads = kv_heads, .head_dim = head_dim, .paged = paged,
                          .page_size = page_size, .num_pages = pages,
                          .kv_dtype = o->kv_dtype, .rs = rs, .len = len};
    set_elements(c);
    clmha_context_retain(ctx);
    if (paged && !pages_make(c)) {
        clmha_kv_cache_release(c);
        return clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory (page table)");
    }
    cl_int err = CL_SUCCESS;
    // The elements (floats / D rows), and a quantised cache's float scales (groups a row).
    size_t rows = floats / head_dim, scales = rows * c->groups * sizeof(float);
    size_t bytes[4] = {rows * c->row_bytes, rows * c->row_bytes, scales, scales};
    cl_mem *bufs[4] = {&c->k, &c->v, &c->ks, &c->vs};
    for (int i = 0; i < 4 && err == CL_SUCCESS; ++i) {
        if (!bytes[i]) continue;
        *bufs[i] = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_WRITE, bytes[i], NULL, &err);
        clmha__held_new(CLMHA__HELD_MEM, *bufs[i]);
    }
    if (err != CL_SUCCESS) {
        st = clmha__cl_fail(ctx, err, "clCreateBuffer(KV cache)");
        clmha_kv_cache_release(c);
        return st;
    }
    clmha__count(ctx, 0, c->groups ? 4 : 2);
    *out = c;
    return CLMHA_SUCCESS;
}

clmha_status clmha_kv_cache_create_with(clmha_kv_cache **out, clmha_layer *layer, size_t batch,
                                        const clmha_kv_cache_options *options) {
    if (out) *out = NULL;
    if (!out || !layer || !options)
        return clmha__fail(layer ? layer->ctx : NULL, CLMHA_INVALID_ARGUMENT, "%s is NULL",
                           !out ? "out" : !layer ? "layer" : "options");
    clmha_kv_cache_options o;
    char msg[256];
    clmha_status st = CLMHA__STRUCT_IN(clmha_kv_cache_options, &o, options, "options", msg,
                                       sizeof msg);
    if (st) return clmha__fail(layer->ctx, st, "%s", msg);
    if (o.dtype && o.dtype != layer->desc.dtype)
        return clmha__fail(layer->ctx, CLMHA_INVALID_ARGUMENT,
                           "options.dtype %s: a layer's cache takes the layer's dtype (%s; or "
                           "leave it 0)",
                           clmha__dtype_name(o.dtype), clmha__dtype_name(layer->desc.dtype));
    return cache_make(out, layer->ctx, layer, batch, layer->kvh, layer->d, &o);
}

clmha_status clmha_kv_cache_create(clmha_kv_cache **out, clmha_layer *layer, size_t batch,
                                   size_t capacity) {
    clmha_kv_cache_options o = {.struct_size = sizeof o, .capacity = capacity};
    return clmha_kv_cache_create_with(out, layer, batch, &o);
}

clmha_status clmha_kv_cache_create_for_with(clmha_kv_cache **out, clmha_context *ctx,
                                            size_t batch, size_t kv_heads, size_t head_dim,
                                            const clmha_kv_cache_options *options) {
    if (out) *out = NULL;
    if (!out || !ctx || !options)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "%s is NULL",
                           !out ? "out" : !ctx ? "ctx" : "options");
    if (!kv_heads || !head_dim)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "a KV cache needs key/value heads and a head dimension of at least 1 "
                           "(kv_heads %zu, head_dim %zu)",
                           kv_heads, head_dim);
    clmha_kv_cache_options o;
    char msg[256];
    clmha_status st = CLMHA__STRUCT_IN(clmha_kv_cache_options, &o, options, "options", msg,
                                       sizeof msg);
    if (st) return clmha__fail(ctx, st, "%s", msg);
    if ((unsigned)o.dtype > CLMHA_DTYPE_BF16)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT, "options.dtype %d is no clmha_dtype",
                           (int)o.dtype);
    if (o.dtype == CLMHA_DTYPE_F64 && !ctx->info.fp64)
        return clmha__fail(ctx, CLMHA_UNSUPPORTED,
                           "a float64 cache (options.dtype CLMHA_DTYPE_F64) needs a device with "
                           "double precision (cl_khr_fp64); %s has none",
                           ctx->info.device_name);
    return cache_make(out, ctx, NULL, batch, kv_heads, head_dim, &o);
}

clmha_status clmha_kv_cache_create_for(clmha_kv_cache **out, clmha_context *ctx, size_t batch,
                                       size_t kv_heads, size_t head_dim, size_t capacity) {
    clmha_kv_cache_options o = {.struct_size = sizeof o, .capacity = capacity};
    return clmha_kv_cache_create_for_with(out, ctx, batch, kv_heads, head_dim, &o);
}

void clmha_kv_cache_release(clmha_kv_cache *cache) {
    if (!cache) return;
    clmha__release_mem(cache->k);
    clmha__release_mem(cache->v);
    clmha__release_mem(cache->ks);
    clmha__release_mem(cache->vs);
    free(cache->len);
    free(cache->table);
    free(cache->refs);
    free(cache->free_pages);
    clmha_context *ctx = cache->ctx;
    free(cache);
    clmha_context_release(ctx);
}

// The pages of a paged cache's sequence @p n from its page @p keep on, given back (a page no
// sequence holds any more goes to the free list).
static void pages_drop(clmha_kv_cache *c, size_t n, size_t keep) {
    size_t held = (c->len[n] + c->page_size - 1) / c->page_size;
    for (size_t i = keep; i < held; ++i) {
        cl_uint p = c->table[n * c->num_pages + i];
        if (--c->refs[p] == 0) c->free_pages[c->free_count++] = p;
    }
}

clmha_status clmha_kv_cache_reset(clmha_kv_cache *cache) {
    if (!cache) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "cache is NULL");
    for (size_t n = 0; cache->paged && n < cache->batch; ++n) pages_drop(cache, n, 0);
    memset(cache->len, 0, cache->batch * sizeof *cache->len);
    return CLMHA_SUCCESS;
}

clmha_status clmha_kv_cache_fork(clmha_kv_cache *cache, size_t src, size_t dst) {
    if (!cache) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "cache is NULL");
    if (src >= cache->batch || dst >= cache->batch)
        return clmha__fail(cache->ctx, CLMHA_INVALID_ARGUMENT,
                           "fork: sequences %zu and %zu of a cache of %zu", src, dst,
                           cache->batch);
    if (!cache->paged)
        return clmha__fail(cache->ctx, CLMHA_UNSUPPORTED,
                           "fork shares pages: make the cache paged (clmha_kv_cache_create_with(),"
                           " page_size)");
    if (src == dst) return CLMHA_SUCCESS;
    pages_drop(cache, dst, 0);
    size_t held = (cache->len[src] + cache->page_size - 1) / cache->page_size;
    for (size_t i = 0; i < held; ++i) {
        cl_uint p = cache->table[src * cache->num_pages + i];
        cache->table[dst * cache->num_pages + i] = p;
        ++cache->refs[p];
    }
    cache->len[dst] = cache->len[src];
    return CLMHA_SUCCESS;
}

clmha_status clmha_kv_cache_pages(const clmha_kv_cache *cache, size_t *page_size,
                                  size_t *num_pages, size_t *free_pages) {
    if (!cache) return clmha__fail(NULL, CLMHA_INVALID_ARGUMENT, "cache is NULL");
    if (page_size) *page_size = cache->paged ? cache->page_size : 0;
    if (num_pages) *num_pages = cache->num_pages;
    if (free_pages) *free_pages = cache->paged ? cache->free_count : 0;
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
    for (size_t n = 0; cache->paged && n < count; ++n)
        pages_drop(cache, n, (lengths[n] + cache->page_size - 1) / cache->page_size);
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

// A paged cache's pages for @p plan's lengths: each sequence's table row after the call (the
// pages it holds, a copy for a shared, partly filled last page it appends into, fresh pages
// for the rest) in plan->rows, taken from the free list tentatively (the cache is unchanged).
// CLMHA_OUT_OF_MEMORY when the pool has too few free pages.
static clmha_status plan_pages(clmha_kv_cache *c, clmha__kv_plan *plan) {
    size_t p = c->page_size, ld = 1, wanted = 0;
    for (size_t n = 0; n < c->batch; ++n) {
        size_t need = (plan->new_len[n] + p - 1) / p;
        ld = need > ld ? need : ld;
    }
    plan->pages_ld = ld;
    plan->rows = calloc(c->batch * ld, sizeof *plan->rows);
    plan->copies = malloc(2 * c->batch * sizeof *plan->copies);
    if (!plan->rows || !plan->copies)
        return clmha__fail(c->ctx, CLMHA_OUT_OF_MEMORY, "out of host memory (page table)");
    for (size_t n = 0; n < c->batch; ++n) {
        size_t need = (plan->new_len[n] + p - 1) / p, have = (plan->old_len[n] + p - 1) / p;
        cl_uint *row = plan->rows + n * ld;
        memcpy(row, c->table + n * c->num_pages, have * sizeof *row);
        if (have && plan->new_len[n] > plan->old_len[n] && plan->old_len[n] % p) {
            // Copy on write: the last page is partly filled and another sequence still holds
            // it (its holders less those this call already copies it away from).
            size_t holders = c->refs[row[have - 1]];
            for (size_t j = 0; j < plan->num_copies; ++j)
                holders -= plan->copies[2 * j] == row[have - 1];
            if (holders > 1) {
                cl_uint fresh = ++wanted <= c->free_count
                                    ? c->free_pages[c->free_count - 1 - plan->taken++]
                                    : 0;
                plan->copies[2 * plan->num_copies] = row[have - 1];
                plan->copies[2 * plan->num_copies++ + 1] = fresh;
                row[have - 1] = fresh;
            }
        }
        for (size_t i = have; i < need; ++i)
            row[i] = ++wanted <= c->free_count ? c->free_pages[c->free_count - 1 - plan->taken++]
                                               : 0;
    }
    if (wanted > c->free_count)
        return clmha__fail(c->ctx, CLMHA_OUT_OF_MEMORY,
                           "the KV cache's pool is exhausted: the call needs %zu more pages of %zu "
                           "tokens and %zu of %zu are free (truncate or reset sequences, or make "
                           "a larger pool); nothing changed",
                           wanted, p, c->free_count, c->num_pages);
    return CLMHA_SUCCESS;
}

// Whether @p cache, given to a call of attention as a function on the bare layer @p layer,
// is one made for such calls, with their key/value heads, head dimension, context and
// precision.
static clmha_status function_cache_fits(const clmha_kv_cache *cache, const clmha_layer *layer) {
    clmha_context *ctx = layer->ctx;
    if (cache->layer)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "kv_cache was made for a layer (clmha_kv_cache_create()): attention "
                           "as a function takes one of clmha_kv_cache_create_for()");
    if (cache->ctx != ctx || cache->kv_heads != layer->kvh || cache->head_dim != layer->d)
        return clmha__fail(ctx, CLMHA_SHAPE_MISMATCH,
                           "kv_cache holds %zu key/value heads of %zu floats%s; the call's key "
                           "and value have %zu of %zu",
                           cache->kv_heads, cache->head_dim,
                           cache->ctx != ctx ? " on another context" : "", layer->kvh, layer->d);
    if (cache->rs != layer->rs)
        return clmha__fail(ctx, CLMHA_INVALID_ARGUMENT,
                           "kv_cache was made for %s calls (clmha_kv_cache_options::dtype); "
                           "this call is %s",
                           cache->rs == 8 ? "float64" : "float32 and 16-bit",
                           layer->rs == 8 ? "float64" : "float32 or 16-bit");
    return CLMHA_SUCCESS;
}

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
    clmha_status st;
    if (function && (st = function_cache_fits(cache, layer))) return st;
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
    st = CLMHA_SUCCESS;
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
    plan->pages_ld = 1;
    if (!st && cache->paged) st = plan_pages(cache, plan);
    // The lengths, then a paged cache's table: one buffer (made at once, copied from the host:
    // nothing waits), which the kernels read as lens and lens + 2N.
    size_t words = 2 * n_batch + (cache->paged ? n_batch * plan->pages_ld : 0);
    cl_uint *all = st ? NULL : malloc(words * sizeof *all);
    if (!st && !all) st = clmha__fail(ctx, CLMHA_OUT_OF_MEMORY, "out of host memory");
    if (!st) {
        memcpy(all, pairs, 2 * n_batch * sizeof *pairs);
        if (cache->paged)
            memcpy(all + 2 * n_batch, plan->rows, n_batch * plan->pages_ld * sizeof *all);
        cl_int err;
        plan->lens = clCreateBuffer(ctx->cl_ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR,
                                    words * sizeof *all, all, &err);
        clmha__held_new(CLMHA__HELD_MEM, plan->lens);
        if (err != CL_SUCCESS) st = clmha__cl_fail(ctx, err, "clCreateBuffer(KV cache lengths)");
    }
    free(all);
    free(pairs);
    if (st) clmha__kv_plan_release(plan);
    return st;
}

void clmha__kv_plan_commit(clmha__kv_plan *plan) {
    clmha_kv_cache *c = plan->cache;
    if (c->paged) {  // the pages taken now held once, the copied ones once less
        for (size_t j = 0; j < plan->taken; ++j) c->refs[c->free_pages[c->free_count - 1 - j]] = 1;
        c->free_count -= plan->taken;
        for (size_t j = 0; j < plan->num_copies; ++j) --c->refs[plan->copies[2 * j]];
        for (size_t n = 0; n < c->batch; ++n) {
            size_t need = (plan->new_len[n] + c->page_size - 1) / c->page_size;
            memcpy(c->table + n * c->num_pages, plan->rows + n * plan->pages_ld,
                   need * sizeof *c->table);
        }
    }
    memcpy(c->len, plan->new_len, c->batch * sizeof *plan->new_len);
}

void clmha__kv_plan_release(clmha__kv_plan *plan) {
    clmha__release_mem(plan->lens);
    free(plan->old_len);
    free(plan->rows);
    free(plan->copies);
    *plan = (clmha__kv_plan){0};
}
