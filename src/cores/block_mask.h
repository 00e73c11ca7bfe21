// The block masks of a layer's clmha_mask_mod (block_mask.c; kernel cl/cores/block_mask.cl):
// per plane and tile of query rows by keys, whether the function forbids the whole tile, allows
// all of it, or some of it, so that the fused cores skip the first and call the function per
// key only in the last (FlexAttention's block mask). A core keeps one in its state, evaluated
// on the first call of a shape and tile and kept while the shape, the tile and the layer's
// parameters stay (clmha_layer::mod_version); an attention function's call, whose p may have
// changed in place, evaluates it every call.
#ifndef CLMHA_CORES_BLOCK_MASK_H
#define CLMHA_CORES_BLOCK_MASK_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"

typedef struct clmha__block_mask {
    cl_kernel kernel;  // mod_block_mask, built on first use
    size_t wg;         // its work-group
    cl_mem buf;        // the bytes, grown on demand
    size_t cap;
    // What buf holds (valid: something).
    bool valid;
    size_t planes, heads, l, s, s_padded, rows, keys, q_pos, k_pos;
    unsigned long version;
    unsigned long evaluations;  // counts the evaluations (a reader's copy is stale when it moved)
} clmha__block_mask;

// The block mask of the call @p d of layer @p l (with clmha_mask_mod) for tiles of @p rows
// query rows by @p keys keys, into *@p out (owned by @p bm), evaluated when @p bm does not
// already hold it.
CLMHA__HIDDEN clmha_status clmha__block_mask_get(clmha_layer *l, clmha__block_mask *bm,
                                                 const clmha__dims *d, size_t rows, size_t keys,
                                                 cl_mem *out);

// Releases what @p bm holds (not @p bm itself).
CLMHA__HIDDEN void clmha__block_mask_release(clmha__block_mask *bm);

#endif
