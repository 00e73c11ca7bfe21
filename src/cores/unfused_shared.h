// What the unfused core's forward (src/cores/unfused.c) and its backward pass
// (src/cores/unfused_backward.c) both run: the scores' GEMM and the masked softmax over rows of
// the scores, with the masked_softmax kernel the core builds with the layer. A file of its own
// so that the arrows run one way: unfused.c calls unfused_backward.c, and both call this file.
#ifndef CLMHA_CORES_UNFUSED_SHARED_H
#define CLMHA_CORES_UNFUSED_SHARED_H

#include <stdbool.h>
#include <stddef.h>

#include "clmha.h"

#include "base/defs.h"
#include "layer/layer.h"
#include "layer/shape.h"

// The masked_softmax kernel (cl/cores/unfused.cl) and its work-group (its -DWG), within the
// kernel's limit: the unfused core builds it with the layer.
typedef struct clmha__unfused_softmax {
    cl_kernel kernel;
    size_t wg;
} clmha__unfused_softmax;

// A chunk of the scores: rows [first, first + rows) of (N*H*L, S'), held by layer->scores from
// its start (clmha__scores_chunks()).
typedef struct clmha__unfused_chunk {
    size_t first, rows;
} clmha__unfused_chunk;

// Whether chunk @p c holds every row of the call of @p d.
static inline bool clmha__unfused_chunk_is_all(const clmha_layer *l, const clmha__dims *d,
                                               clmha__unfused_chunk c) {
    return c.first == 0 && c.rows == d->n * l->h * d->l;
}

// Largest power of two <= min(@p cap, @p limit) (a work-group within a kernel's limit).
CLMHA__HIDDEN size_t clmha__unfused_pow2_below(size_t cap, size_t limit);

// Scores = Q · Kᵀ · scale (Q in @p qt, K in @p kt, @p group query heads per key/value plane;
// @p scale 0: 1/√D) for the rows of @p c into layer->scores: all of them (N*H, L, S') in one
// strided batched GEMM; a chunk in one plain GEMM per plane it touches (CLBlast 1.5.3's batched
// GEMM ignores buffer offsets, its plain GEMM honours them).
CLMHA__HIDDEN clmha_status clmha__unfused_scores(clmha_layer *layer, const clmha__dims *d,
                                                 clmha__unfused_chunk c, cl_mem qt, cl_mem kt,
                                                 size_t group, double scale);

// Masks, softmax and dropout (unless @p no_dropout: the backward pass's probabilities) in place
// on the scores of @p c, one work-group of @p sm's kernel per row; each row's log-sum-exp into
// @p lse (N*H*L floats, the global row's place; NULL: none).
CLMHA__HIDDEN clmha_status clmha__unfused_masked_softmax(clmha_layer *layer,
                                                         const clmha__unfused_softmax *sm,
                                                         const clmha_forward_args *args,
                                                         const clmha__dims *d,
                                                         clmha__unfused_chunk c, bool no_dropout,
                                                         cl_mem lse);

// Recomputes the probabilities of a call for its backward pass: scores = Q·Kᵀ·scale (@p scale
// 0: 1/√D) from @p q (N*H, L, D) and @p k (N*H, S', D), both at offset 0, then masks and
// softmax without dropout (@p sm), into layer->scores, all rows at once (the caller has
// reserved them: clmha__layer_reserve(), one chunk).
CLMHA__HIDDEN clmha_status clmha__unfused_probabilities(clmha_layer *layer,
                                                        const clmha__unfused_softmax *sm,
                                                        const clmha_forward_args *args,
                                                        const clmha__dims *dims, cl_mem q,
                                                        cl_mem k, double scale);

#endif
