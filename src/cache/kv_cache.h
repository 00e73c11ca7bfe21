// The KV cache of incremental decoding (clmha_kv_cache in include/clmha.h): the device buffers
// of the cached keys and values, head-split, and the host-side lengths of its sequences. A
// forward call with a cache plans its append here (clmha__kv_plan(): new lengths, capacity
// check, the lengths buffer the kernels read), the decode core (src/cores/decode.c) appends
// and attends, and the forward pass commits the new lengths once everything is enqueued.
#ifndef CLMHA_CACHE_KV_CACHE_H
#define CLMHA_CACHE_KV_CACHE_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"

struct clmha_kv_cache {
    clmha_context *ctx;        // retained
    const clmha_layer *layer;  // the layer it was made for (identity only: not retained), or
                               // NULL: made for attention as a function
                               // (clmha_kv_cache_create_for())
    size_t batch, capacity;    // N; tokens per sequence (paged: the pool's tokens)
    size_t kv_heads, head_dim; // heads of the cached keys and values, and their dimension
    // The storage: pages of page_size positions, page p holding (kv_heads, page_size, D) elements
    // of keys from k + p * kv_heads * page_size * D (v likewise): v row by row, k in transposed
    // blocks of 16 positions (cl/cores/decode.cl). A contiguous cache is one page per sequence,
    // page n for sequence n, of page_size = the capacity rounded up to 16.
    bool paged;
    size_t page_size, num_pages;
    // The elements: float32 (doubles in a float64 layer's cache: rs 8), float16, bfloat16, or
    // quantised (int8, int4) with `groups` float scales per (position, KV head) in ks (keys)
    // and vs (values): int8 one, int4 one per `group` dimensions (cl/cores/decode.cl has the
    // layouts).
    clmha_kv_dtype kv_dtype;
    size_t rs;                 // the bytes of a CLMHA_KV_FLOAT32 element: the layer's rs
    size_t row_bytes;          // bytes of one position's row of D elements (int4: D / 2)
    size_t groups, group;      // quantised: scales per row and dimensions per scale; else 0
    cl_mem k, v, ks, vs;
    bool keys_zeroed;          // k was zeroed (by the decode core's first call: a key block's
                               // positions past a sequence's length are read, their scores
                               // dropped, so they must never be uninitialised memory)
    size_t *len;               // batch lengths (host bookkeeping)
    // Paged: table[n * num_pages + i] is sequence n's page i (it holds ceil(len[n] / page_size)
    // of them), refs[p] the sequences that hold page p, free_pages[0 .. free_count) the pages
    // none holds. Contiguous: NULL (sequence n's page is page n).
    cl_uint *table, *refs, *free_pages;
    size_t free_count;
};

// One call's use of a cache: every sequence's length before and after it, and a buffer of
// those pairs (cl_uint old, new per sequence) that the decode kernels read, followed for a
// paged cache by the call's page table (pages_ld entries per sequence); for a paged cache, the
// pages the call takes (tentatively: the cache changes only on commit) and the copies on write
// it needs first.
typedef struct clmha__kv_plan {
    clmha_kv_cache *cache;
    size_t *old_len, *new_len;  // batch entries each (one allocation)
    size_t max_new;             // the longest sequence after the call
    cl_mem lens;                // (batch, 2) cl_uint, then (batch, pages_ld) pages (paged)
    size_t pages_ld;
    cl_uint *rows;              // paged: the table rows after the call (batch * pages_ld)
    size_t taken;               // paged: pages taken from the free list
    cl_uint *copies;            // paged: num_copies (source, destination) pages to copy
    size_t num_copies;
} clmha__kv_plan;

// Plans appending @p appended[n] tokens (NULL: @p s of every sequence; each at most @p s) to
// sequence n of @p cache for a call of @p layer with batch @p n_batch: checks the cache's
// layer (@p function: a bare layer of attention as a function, which takes a cache made for it
// with its key/value heads and head dimension), batch and capacity and makes the lengths
// buffer. Nothing changes in the cache.
CLMHA__HIDDEN clmha_status clmha__kv_plan_make(clmha_kv_cache *cache, const clmha_layer *layer,
                                               bool function, size_t n_batch, size_t s,
                                               const size_t *appended, clmha__kv_plan *plan);

// The cache takes the planned lengths (after the call was enqueued).
CLMHA__HIDDEN void clmha__kv_plan_commit(clmha__kv_plan *plan);

// Frees what the plan holds (the buffer stays alive while enqueued work uses it).
CLMHA__HIDDEN void clmha__kv_plan_release(clmha__kv_plan *plan);

#endif
