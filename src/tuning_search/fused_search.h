// The fused attention kernel's tiles (phase D of clmha_context_tune()): candidates timed on a
// real layer's fused stage, each checked against the double-precision reference. Part of the
// tuner (top layer): it builds layers and calls the fused core's tile helpers
// (clmha__fused_tiles_for, clmha__layer_set_fused_tiles, clmha__fused_default_vw).
#ifndef CLMHA_TUNING_SEARCH_FUSED_SEARCH_H
#define CLMHA_TUNING_SEARCH_FUSED_SEARCH_H

#include "context/context.h"

#include "tuning_store/params.h"

#include <stdint.h>

// What the fused-tile phase measured.
typedef struct clmha__fused_result {
    bool searched;                // the phase ran and its default passed the check
    bool improved;                // a candidate beat the default
    size_t best[CLMHA__FUSED_PARAMS];
    double default_ms, best_ms;   // medians of the fused stage (one profiled forward each)
    double flops;                 // 4·N·L·S·E of the shape
    size_t tried, rejected;
} clmha__fused_result;

// D. The fused attention kernel's tiles on @p shape (self-attention, random parameters and
// inputs drawn from @p rng) until @p deadline (now_s() seconds) or @p max_tried candidates (0:
// no limit). Never fails: *res says what was measured (searched false when the default tiles
// could not be timed).
CLMHA__HIDDEN void clmha__tune_fused(clmha_context *ctx, uint64_t *rng,
                                     const clmha_tune_shape *shape, double deadline,
                                     size_t max_tried, clmha__fused_result *res);

#endif
