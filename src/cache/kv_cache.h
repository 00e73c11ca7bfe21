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
    size_t batch, capacity;    // N, tokens per sequence
    size_t kv_heads, head_dim; // heads of the cached keys and values, and their floats
    size_t stride;             // positions per (sequence, head): capacity rounded up to 16
    cl_mem k, v;               // (batch, kv_heads, stride, D) floats each: v row by row, k in
                               // transposed blocks of 16 positions (cl/cores/decode.cl)
    bool keys_zeroed;          // k was zeroed (by the decode core's first call: a key block's
                               // positions past a sequence's length are read, their scores
                               // dropped, so they must never be uninitialised memory)
    size_t *len;               // batch lengths (host bookkeeping)
};

// One call's use of a cache: every sequence's length before and after it, and a buffer of
// those pairs (cl_uint old, new per sequence) that the decode kernels read.
typedef struct clmha__kv_plan {
    clmha_kv_cache *cache;
    size_t *old_len, *new_len;  // batch entries each (one allocation)
    size_t max_new;             // the longest sequence after the call
    cl_mem lens;                // (batch, 2) cl_uint, made by clmha__kv_plan()
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
