// The decode core's split of the keys (phase E of clmha_context_tune()): how many work-items per
// compute unit and how few keys per range the split aims at, timed on one decode step of a real
// layer at two cache lengths, each candidate's output checked against the double-precision
// reference. Part of the tuner (top layer): it builds layers and KV caches and sets the decode
// core's split on its own layer (clmha__decode_set_split).
#ifndef CLMHA_TUNING_SEARCH_DECODE_SEARCH_H
#define CLMHA_TUNING_SEARCH_DECODE_SEARCH_H

#include "context/context.h"

#include "tuning_store/params.h"

#include <stdint.h>

// The cache lengths a decode step is timed at (keys; one query row per sequence, N = 1).
#define CLMHA__DECODE_TUNE_SHORT 512
#define CLMHA__DECODE_TUNE_LONG 8192

// What the decode-split phase measured.
typedef struct clmha__decode_result {
    bool searched;                  // the phase ran and the default split passed the check
    bool improved;                  // a candidate beat the default by 3% or more
    size_t best[CLMHA__DECODE_PARAMS];
    double default_ms, best_ms;     // decode stage of one step, both cache lengths together
                                    // (medians of profiled calls)
    size_t tried, rejected;
} clmha__decode_result;

// E. The decode split on a layer of @p shape's embed_dim and num_heads (random parameters and
// inputs drawn from @p rng), until @p deadline (now_s() seconds) or @p max_tried candidates (0:
// no limit). Never fails: *res says what was measured (searched false when the default split
// could not be timed).
CLMHA__HIDDEN void clmha__tune_decode(clmha_context *ctx, uint64_t *rng,
                                      const clmha_tune_shape *shape, double deadline,
                                      size_t max_tried, clmha__decode_result *res);

#endif
